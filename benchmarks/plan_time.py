"""Time ``remat.plan`` end to end on issue #11's timing model, with a per-phase breakdown.

The model is ``gpt-tiny`` with ``n_layer`` layers, d_model 128, seq 128, batch 4 (float32,
CPU). Each layer count is planned once untimed (imports, dynamo set-up and other
first-call costs stay out), then ``--repeats`` times per budget; the script prints the
median wall and CPU (``time.process_time``) seconds of each, and the median seconds spent
in each phase of NOTE [ How a plan is made ] (src/remat/planning/planner.py), read off the
planner's progress reports:

- ``fake copy``: the fake model, batch and optimizer;
- ``block inputs``: the forward that captures each block's arguments;
- ``candidates``: every candidate of every kind of block run on its own;
- ``windows``: one tracked whole step without checkpointing (the peak model's calibration);
- ``closed loop``: solving, and measuring the chosen plan with a whole step;
- ``allocator step``: the real steps that read the allocator's peak of a fitting choice
  (NOTE [ Fits on the allocator ] in src/remat/planning/loop.py).

``--hf-llama`` times a 32-layer Hugging Face Llama instead (d_model 128, 4 heads, 2 KV
heads, MLP 344, vocab 1024, seq 128, batch 4, float32, CPU; ``--layers`` sets its depth), and
beside each plan one real training step of the same model (``remat.measure.time_step``: the
median of 3 after a warm-up). Plan and step alternate, so a busy machine slows both alike; it
prints the median of the per-repeat ratios ``plan seconds / step seconds``, wall and CPU.

``--throughput`` also times ``plan_throughput(...)`` on ``gpt-small`` (budget 60% of
the batch-8 peak), once (it takes a minute).

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/plan_time.py                  # 32 layers, 50%
    PYTHONPATH=src .venv/bin/python benchmarks/plan_time.py --layers 16,32 --budgets 25,50,75
    PYTHONPATH=src .venv/bin/python benchmarks/plan_time.py --hf-llama       # plan / step
    PYTHONPATH=src .venv/bin/python benchmarks/plan_time.py --throughput
    PYTHONPATH=src .venv/bin/python benchmarks/plan_time.py --families --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections import defaultdict

import torch
from torch import nn

from remat.measure.step import clear_grads, run_step
from remat.models import build_model, make_batch
from remat.planning import plan, plan_throughput
from remat.progress import reporting

PHASES = ("fake copy", "block inputs", "candidates", "windows", "closed loop", "allocator step")


def _phase(step: str) -> str:
    """The phase a progress report's ``step`` belongs to (see the module docstring)."""
    if step == "closed loop, allocator step":
        return "allocator step"
    if step.startswith("closed loop"):
        return "closed loop"
    if step.startswith("memory windows"):
        return "windows"
    if step in ("fake copy", "block inputs"):
        return step
    return "candidates"


class PhaseClock:
    """Wall and CPU seconds per phase, from the timestamps of the planner's progress
    reports."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu_seconds: dict[str, float] = defaultdict(float)
        self._phase: str | None = None
        self._since = self._cpu_since = 0.0

    def __call__(self, step: str, done: int, total: int) -> None:
        self._switch(_phase(step))

    def _switch(self, phase: str | None) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        if self._phase is not None:
            self.seconds[self._phase] += now - self._since
            self.cpu_seconds[self._phase] += cpu - self._cpu_since
        self._phase, self._since, self._cpu_since = phase, now, cpu

    def stop(self) -> None:
        """Charge the time since the last report to its phase."""
        self._switch(None)


def hf_llama(n_layer: int) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The ``--hf-llama`` model (random weights, from a config) and its batch of 4 x 128."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=1024, hidden_size=128, num_hidden_layers=n_layer,
                            num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=344, max_position_embeddings=128)
    model = tf.LlamaForCausalLM(config)
    model.config.use_cache = False
    model.train()
    ids = torch.randint(0, 1024, (4, 128), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids.clone()}


def gpt_tiny(n_layer: int) -> tuple[nn.Module, torch.Tensor]:
    """The default model: ``gpt-tiny`` with d_model 128, seq 128, and its batch of 4."""
    torch.manual_seed(0)
    model = build_model("gpt-tiny", n_layer=n_layer, d_model=128, max_seq_len=128)
    return model, make_batch(model, 4)


def time_real_step(model: nn.Module, batch: object) -> tuple[float, float]:
    """Wall s and CPU s of one real training step (forward, loss, backward): medians of 3
    runs after a warm-up."""
    walls, cpus = [], []
    for i in range(4):
        clear_grads(model)
        started, cpu = time.perf_counter(), time.process_time()
        run_step(model, batch)
        if i:
            walls.append(time.perf_counter() - started)
            cpus.append(time.process_time() - cpu)
    clear_grads(model)
    return statistics.median(walls), statistics.median(cpus)


def time_plan(model: nn.Module, batch: object, budget_percent: int | str
              ) -> tuple[float, float, dict[str, float], bool, dict[str, float]]:
    """Wall s, CPU s, wall s per phase of one ``plan`` at ``budget_percent``% of the
    no-checkpoint peak, whether the plan's measured peak fits its budget, and CPU s per
    phase."""
    clock = PhaseClock()
    started, cpu = time.perf_counter(), time.process_time()
    with reporting(clock):
        result = plan(model, batch, budget=budget_percent if isinstance(budget_percent, str)
                      else f"{budget_percent}%")
    clock.stop()
    wall_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu
    return (wall_s, cpu_s, dict(clock.seconds), result.measured_peak_bytes <= result.budget_bytes,
            dict(clock.cpu_seconds))


def time_throughput() -> tuple[float, float, int]:
    """Wall s, CPU s and the batch size picked by the throughput search on ``gpt-small``."""
    torch.manual_seed(0)
    model = build_model("gpt-small")
    started, cpu = time.perf_counter(), time.process_time()
    result = plan_throughput(model, lambda n: make_batch(model, n), budget="60%")
    return time.perf_counter() - started, time.process_time() - cpu, int(result.batch_size or 0)


def time_families(repeats: int) -> None:
    """Median wall s of ``repeats`` plans of each of issue #31's five decoders at budgets
    25/50/75% of the way from ``full``'s peak to ``none``'s (after one untimed plan)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from planner import FAMILY_RUNS, family_model, hf_batch

    from remat.compare.frontier import frontier

    print("| model | 25% | 50% | 75% |\n|---|---:|---:|---:|")
    for name, batch_size in FAMILY_RUNS[:5]:
        model, batch = family_model(name), hf_batch(batch_size)
        manual = frontier(model, batch, budget_bytes=1)
        full, none = manual.point("full").peak_bytes, manual.point("none").peak_bytes
        time_plan(model, batch, str(none))  # first-call costs
        cells = []
        for percent in (25, 50, 75):
            budget = str(int(full + percent / 100 * (none - full)))
            runs = [time_plan(model, batch, budget)[0] for _ in range(repeats)]
            cells.append(f"{statistics.median(runs):.2f} s")
        print(f"| {name} | {' | '.join(cells)} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="32", help="layer counts, comma-separated")
    parser.add_argument("--budgets", default="50",
                        help="budgets, percent of the no-checkpoint peak, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="timed plans per case")
    parser.add_argument("--hf-llama", action="store_true",
                        help="plan a Hugging Face Llama (d 128, seq 128, batch 4) and time "
                             "one real step beside each plan")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads (a busy machine makes 2-thread real steps erratic)")
    parser.add_argument("--throughput", action="store_true",
                        help="also time the throughput search on gpt-small")
    parser.add_argument("--families", action="store_true",
                        help="time issue #31's five 6-layer decoders (benchmarks/planner.py) "
                             "at 25/50/75%% of the way from full to none instead")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of "
          f"{args.repeats}", flush=True)
    if args.families:
        time_families(args.repeats)
        return
    name = "HF Llama" if args.hf_llama else "gpt-tiny"
    for n_layer in (int(n) for n in args.layers.split(",") if n.strip()):
        model, batch = (hf_llama if args.hf_llama else gpt_tiny)(n_layer)
        time_plan(model, batch, 75)  # first-call costs
        for budget in (int(b) for b in args.budgets.split(",") if b.strip()):
            runs, steps = [], []
            for _ in range(args.repeats):
                if args.hf_llama:
                    steps.append(time_real_step(model, batch))
                runs.append(time_plan(model, batch, budget))
            wall = statistics.median(r[0] for r in runs)
            cpu = statistics.median(r[1] for r in runs)
            phases = ", ".join(f"{p} {statistics.median(r[2].get(p, 0.0) for r in runs):.2f}/"
                               f"{statistics.median(r[4].get(p, 0.0) for r in runs):.2f}"
                               for p in PHASES)
            fits = all(r[3] for r in runs)
            print(f"plan, {name}, {n_layer} layers, budget {budget}%: {wall:.2f} s wall, "
                  f"{cpu:.2f} s CPU (runs: {', '.join(f'{r[0]:.2f}' for r in runs)} s wall); "
                  f"phases, s wall/CPU: {phases}; fits: {fits}", flush=True)
            if steps:
                ratio = statistics.median(r[0] / s[0] for r, s in zip(runs, steps, strict=True))
                cpu_ratio = statistics.median(r[1] / s[1] for r, s in zip(runs, steps, strict=True))
                print(f"  one real step: {statistics.median(s[0] for s in steps):.3f} s wall, "
                      f"{statistics.median(s[1] for s in steps):.3f} s CPU; plan / step: "
                      f"{ratio:.1f}x wall, {cpu_ratio:.1f}x CPU", flush=True)
    if args.throughput:
        wall_s, cpu_s, batch_size = time_throughput()
        print(f"throughput search, gpt-small: {wall_s:.1f} s wall, {cpu_s:.1f} s CPU, "
              f"batch {batch_size}", flush=True)


if __name__ == "__main__":
    main()
