"""Simulated vs real compiled steps: how close ``remat.profile(compiled, simulate=True)`` is.

For each model and compiler ``activation_memory_budget`` (1.0, 0.75, 0.5, 0.25, 0.0), the
model is compiled with inductor at that budget (each budget its own backend:
:func:`remat.compiled.install.compile_with_budget`, whole model; with
``--blocks MODELS`` also :func:`~remat.compiled.install.compile_blocks_with_budget`,
every block at that budget), then

* simulated: :func:`remat.compiled.simulate.simulate_compiled` on fake tensors
  (inductor's own generated wrapper replayed with no-op kernels; nothing allocated),
  run *before* the model's first real step, so nothing real was compiled yet;
* real: :func:`remat.compiled.measure.measure_compiled` (allocator peak of a real
  compiled step plus the bytes alive at its start);

and the relative error of the simulated peak is reported, with the activation bytes
(alive when backward starts) and FLOPs of both. Models as in benchmarks/compile.py
(gpt-small, llama-small: batch 8, seq 128; hf-llama: 6 layers, d 256, seq 256, batch 4),
dropout off, CPU, float32, no optimizer.

Writes the ``compile-sim`` section of ``benchmarks/RESULTS_compile.md``.

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/compile_sim.py --blocks gpt-small,llama-small
    PYTHONPATH=src .venv/bin/python benchmarks/compile_sim.py --models gpt-small --budgets 1,0
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
from torch import nn

from remat.compiled.install import compile_blocks_with_budget, compile_with_budget
from remat.compiled.measure import measure_compiled
from remat.compiled.replay import CompiledSimulationError
from remat.compiled.simulate import simulate_compiled

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import replace_section, run_header  # noqa: E402
from compile import BUDGETS, OUT, MiB, _models  # noqa: E402

SECTION = "compile-sim"


@dataclass
class Row:
    model: str
    how: str
    budget: float
    real_peak: int
    sim_peak: int
    real_act: int
    sim_act: int
    real_flops: int
    sim_flops: int
    sim_s: float
    new_graphs: int
    refused: str = ""  # the simulation's refusal (CompiledSimulationError), if it refused

    @property
    def error(self) -> float:
        return self.sim_peak / self.real_peak - 1


def bench(name: str, build: Callable[[], tuple[nn.Module, Any]], budgets: tuple[float, ...],
          blocks: bool, log: Callable[[str], None]) -> list[Row]:
    model, batch = build()
    rows = []
    ways: list[tuple[str, Callable[[nn.Module, float], nn.Module]]] = [
        ("whole", lambda m, b: compile_with_budget(m, b))]
    if blocks:
        ways.append(("blocks", lambda m, b: compile_blocks_with_budget(m, b)))
    for how, compile_at in ways:
        for budget in budgets:
            compiled = compile_at(copy.deepcopy(model), budget)
            t0 = time.time()
            try:
                sim = simulate_compiled(compiled, batch)
            except CompiledSimulationError as exc:  # refused: recorded, not an error row
                real = measure_compiled(compiled, batch, timing=False)
                rows.append(Row(name, how, budget, real.peak_bytes, 0, 0, 0, 0, 0, 0.0,
                                real.new_graphs, refused=str(exc).split(": ", 1)[-1]))
                log(f"{name} {how} {budget:g}: refused ({rows[-1].refused})")
                continue
            sim_s = time.time() - t0
            real = measure_compiled(compiled, batch, timing=False)
            row = Row(name, how, budget, real.peak_bytes, sim.peak_bytes,
                      real.profile.activation_bytes, sim.profile.activation_bytes,
                      real.profile.flops, sim.profile.flops, sim_s,
                      real.new_graphs)
            rows.append(row)
            log(f"{name} {how} {budget:g}: real {row.real_peak / MiB:.2f} MiB, simulated "
                f"{row.sim_peak / MiB:.2f} MiB ({100 * row.error:+.2f}%), {sim_s:.1f} s")
    torch._dynamo.reset()
    return rows


def markdown(rows: list[Row]) -> str:
    lines = ["| model | compiled | budget | real peak | simulated peak | error | difference | "
             "real activations | simulated activations | FLOPs equal | simulation time |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|:-:|--:|"]
    for r in rows:
        if r.refused:
            lines.append(f"| {r.model} | {r.how} | {r.budget:g} | {r.real_peak / MiB:.2f} MiB | "
                         f"refused: {r.refused} | | | | | | |")
            continue
        lines.append(
            f"| {r.model} | {r.how} | {r.budget:g} | {r.real_peak / MiB:.2f} MiB | "
            f"{r.sim_peak / MiB:.2f} MiB | {100 * r.error:+.2f}% | "
            f"{r.sim_peak - r.real_peak:+,d} B | {r.real_act / MiB:.2f} MiB | "
            f"{r.sim_act / MiB:.2f} MiB | {'yes' if r.real_flops == r.sim_flops else 'no'} | "
            f"{r.sim_s:.1f} s |")
    rows = [r for r in rows if not r.refused]
    if not rows:
        return "\n".join(lines) + "\n"
    worst = max(rows, key=lambda r: abs(r.error))
    lines.append("")
    lines.append(f"Largest |error|: {100 * abs(worst.error):.2f}% ({worst.model}, "
                 f"{worst.how}, budget {worst.budget:g}); mean |error| "
                 f"{100 * sum(abs(r.error) for r in rows) / len(rows):.2f}% over {len(rows)} "
                 "configurations.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="gpt-small,llama-small,hf-llama",
                        help="comma-separated: gpt-small, llama-small, hf-llama, hf-gpt2, "
                             "hf-qwen2 (default: the first three)")
    parser.add_argument("--budgets", default=",".join(f"{b:g}" for b in BUDGETS),
                        help="comma-separated compiler budgets (default: 1,0.75,0.5,0.25,0)")
    parser.add_argument("--blocks", default="",
                        help="comma-separated models to also compile per block "
                             "(compile_blocks_with_budget); default: none")
    parser.add_argument("--out", type=Path, default=OUT, help="markdown file to write")
    parser.add_argument("--section", default=SECTION,
                        help=f"the section of --out to replace (default {SECTION})")
    parser.add_argument("--title", default="Simulated compiled steps vs real ones",
                        help="the section's heading")
    args = parser.parse_args(argv)
    torch._dynamo.config.recompile_limit = 64  # many compiles of the same classes' code
    budgets = tuple(float(b) for b in args.budgets.split(","))
    wanted = [m.strip() for m in args.models.split(",") if m.strip()]
    known = {name.split(" ")[0]: (name, build) for name, build in _models(False)}
    unknown = sorted(set(wanted) - set(known))
    if unknown:
        parser.error(f"--models: unknown {unknown}; known: {sorted(known)}")
    start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - start:6.0f} s] {msg}", flush=True)

    rows: list[Row] = []
    for key in wanted:
        name, build = known[key]
        blocks = key in {m.strip() for m in args.blocks.split(",")}
        rows.extend(bench(name, build, budgets, blocks, log))
    table = markdown(rows)
    print(table)
    body = (run_header(args.title, "compile_sim.py", sys.argv[1:] if argv is None else argv,
                       start)
            + "Real peak: a real compiled step's allocator high-water mark plus parameters and "
            "batch (`measure_compiled`, as in the table above). Simulated peak: "
            "`remat.profile(compiled, batch, simulate=True)` on fake tensors, before the model "
            "ran: dynamo capture, AOTAutograd partition at the same budget, inductor's "
            "generated wrapper replayed with no-op kernels (NOTE [ Simulating compiled code ] "
            "in src/remat/compiled/simulate.py). Error: simulated / real - 1. "
            "Activations: bytes alive when backward starts. FLOPs equal: the simulated "
            "profile's FLOPs (partitioned graphs + eager code) equal the real profile's.\n\n"
            + table)
    args.out.write_text(replace_section(args.out.read_text() if args.out.exists() else "",
                                        args.section, body))
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
