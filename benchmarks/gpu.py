"""GPU check of the planner's predictions: peaks, step times, tokens/s, offload overlap.

One command on a CUDA machine records, for a ~1B model (``llama-1b``, bfloat16, AdamW):

1. predicted vs ``torch.cuda.max_memory_allocated`` peaks of ``none``, ``full`` and the
   plan (predictions: a simulated profile for the manual strategies, the peak model's
   for the plan);
2. predicted vs measured step times: the roofline of each strategy's simulated step on the
   device's spec (cost.py NOTE [ Step-time model ]) for every row, and for the plan also
   the planner's own figure (on CUDA it times the plan's step itself);
3. tokens/s of ``none`` / ``full`` / plan at a fixed memory cap (``--cap-gib``; a
   strategy whose measured peak is over the cap is reported as not fitting);
4. the ``offload`` strategy (every block): the host link measured with pinned copies of
   1 GiB each way, the bytes it moves (simulated ``none`` minus ``offload`` activation
   bytes), its step time against the planner's model (NOTE [ Offload copies in the step
   time ] in planning/candidates.py: ``none`` plus the copies out beyond the forward's
   roofline, plus the copies back), and the overlap: the
   share of the copies (``2 x moved bytes / measured link``) hidden behind compute,
   ``1 - (offload_ms - none_ms) / copy_ms``, clipped to [0, 1];
5. the ``full_offload`` strategy (every block checkpointed, its input on the host): a row
   of the table like ``none`` and ``full``, and its overlap against ``full``: the bytes it
   moves (simulated ``full`` minus ``full_offload`` activation bytes), the copies' time
   at the measured link, ``1 - (full_offload_ms - full_ms) / copy_ms`` and the step time
   the planner's model predicts (``full`` plus the copies out beyond the forward's
   roofline and back beyond the recompute's and backward's).

``--hf cohere`` runs the same on a Hugging Face decoder the planner was not tuned on
(benchmarks/planner.py's held-out families), built from its config class at about 1.06B
parameters (``HELD_OUT``; random weights, sdpa attention), sequences of ``--seq`` tokens
(default 2048). The planning time (``plan_s``: the two simulated steps and ``remat.plan``)
is recorded with every run.

``--dry-run`` runs the same path on CPU with ``llama-tiny`` (float32, batch 2, bytes
from the tracker, offload skipped, ``full_offload`` running as ``full``); the tests run
it so the script cannot rot.

Usage::

    .venv/bin/python benchmarks/gpu.py                           # CUDA, llama-1b
    .venv/bin/python benchmarks/gpu.py --cap-gib 40 --batch 4 --seq 2048 --json out.json
    .venv/bin/python benchmarks/gpu.py --hf cohere --json hf.json  # CUDA, held-out 1B decoder
    .venv/bin/python benchmarks/gpu.py --dry-run                 # CPU, tiny model
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import remat
from remat.devices import get_device
from remat.errors import RematWarning
from remat.measure import roofline_ms
from remat.measure.timing import time_step
from remat.models import build_model, make_batch
from remat.planning.candidates import offload_exposed_ms
from remat.planning.recompute_cost import step_ms
from remat.report.plan import plan_text
from remat.strategies import preserved_strategy
from remat.units import format_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS, replace_section  # noqa: E402 (benchmarks/ is on sys.path)

#: Hugging Face decoders of families the planner's tests and tuning never use, as config
#: overrides: (about 1.06B parameters for the GPU, a tiny one for the dry run).
_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
HELD_OUT: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "cohere": (dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                    num_attention_heads=16, num_key_value_heads=4, vocab_size=32000, **_IDS),
               dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=128, **_IDS)),
}


def _hf_model(name: str, dtype: torch.dtype, device: torch.device,
              dry_run: bool) -> torch.nn.Module:
    from remat.simulate.hf import hf_model_from_name

    if name not in HELD_OUT:
        raise SystemExit(f"benchmarks/gpu.py: --hf {name}: not a held-out family here\n"
                         f"known: {', '.join(sorted(HELD_OUT))}")
    return hf_model_from_name(name, dtype=dtype, device=device,
                              **HELD_OUT[name][1 if dry_run else 0])


def _token_batch(model: torch.nn.Module, batch_size: int, seq: int,
                 device: torch.device) -> dict[str, torch.Tensor]:
    """Random token ids (a fixed seed) with next-token labels, for a Hugging Face model."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch_size, seq), generator=g)
    return {"input_ids": ids.to(device), "labels": ids.clone().to(device)}


@dataclass
class Row:
    """One strategy on the device."""

    strategy: str
    predicted_peak_bytes: int
    measured_peak_bytes: int
    predicted_step_ms: float | None
    roofline_step_ms: float
    measured_step_ms: float
    tokens_per_s: float
    fits: bool


def _peak_and_ms(model: torch.nn.Module, batch: Any, optimizer: torch.optim.Optimizer,
                 device: torch.device, repeats: int) -> tuple[int, float]:
    """Measured peak (CUDA allocator, else the tracker) and the median step time."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        times = time_step(model, batch, optimizer=optimizer, repeats=repeats)
        peak = int(torch.cuda.max_memory_allocated())
    else:
        times = time_step(model, batch, optimizer=optimizer, repeats=repeats)
        peak = remat.profile(model, batch, optimizer=optimizer, timing=False).peak_bytes
    return peak, times.step_ms


def _simulated(model: torch.nn.Module, batch: Any, optimizer: torch.optim.Optimizer,
               strategy: Any) -> Any:
    """The simulated profile of a step with ``strategy`` applied (the model restored)."""
    with preserved_strategy(model), warnings.catch_warnings():
        warnings.simplefilter("ignore", RematWarning)  # full_offload on the CPU
        remat.apply(model, strategy)
        return remat.profile(model, batch, optimizer=optimizer, simulate=True)


def _host_link_bytes_per_s(device: torch.device, nbytes: int = 2**30,
                           repeats: int = 5) -> dict[str, float]:
    """Median pinned-copy bandwidth each way, bytes/s (CUDA events around each copy)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out: dict[str, float] = {}
    for name, dst, what in (("d2h", host, src), ("h2d", src, host)):
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(what, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        out[name] = nbytes / (sorted(times[1:])[repeats // 2] / 1e3)
    return out


def run(*, preset: str, batch_size: int, seq: int | None, cap_bytes: int | None,
        dry_run: bool, repeats: int, argv: Sequence[str] = (),
        hf: str | None = None) -> dict[str, Any]:
    """Every measurement of the module docstring; returns them as a JSON-able dict."""
    cuda = torch.cuda.is_available() and not dry_run
    if not cuda and not dry_run:
        raise SystemExit("benchmarks/gpu.py: no CUDA device; pass --dry-run for the CPU path")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    if hf is not None:
        model = _hf_model(hf, dtype, device, dry_run)
        preset = f"{hf} (Hugging Face, {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B)"
        batch = _token_batch(model, batch_size, seq or (32 if dry_run else 2048), device)
    else:
        with device:
            model = build_model(preset).to(dtype)
        batch = make_batch(model, batch_size, seq) if seq else make_batch(model, batch_size)
        batch = {k: v.to(device) for k, v in batch.items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = batch_size * int(next(iter(batch.values())).shape[-1]) \
        if isinstance(batch, dict) else batch_size

    started = time.perf_counter()  # plan_s: the two simulated steps and remat.plan
    sims = {name: _simulated(model, batch, optimizer, name) for name in ("none", "full")}
    none_prof = sims["none"]
    if cap_bytes is None:  # half-way between full and none
        cap_bytes = (sims["full"].peak_bytes + none_prof.peak_bytes) // 2
    plan = remat.plan(model, batch, optimizer=optimizer, budget=cap_bytes)
    plan_s = time.perf_counter() - started

    spec = get_device(plan.cost_device) if cuda else get_device("h100-80gb")
    rows: list[Row] = []
    for name in ("none", "full", "full_offload", "plan"):
        strategy: Any = plan if name == "plan" else name
        sim = sims.get(name) or _simulated(model, batch, optimizer, strategy)
        predicted = plan.predicted_peak_bytes if name == "plan" else sim.peak_bytes
        with preserved_strategy(model), warnings.catch_warnings():
            warnings.simplefilter("ignore", RematWarning)  # full_offload on the CPU
            remat.apply(model, strategy)
            peak, ms = _peak_and_ms(model, batch, optimizer, device, repeats)
        rows.append(Row(name, predicted, peak,
                        plan.predicted_step_ms if name == "plan" else None,
                        step_ms(sim.ops, spec), ms, tokens / (ms / 1e3), peak <= cap_bytes))

    offload: dict[str, Any] = {"skipped": "no CUDA (dry run)"}
    full_offload: dict[str, Any] = {"skipped": "no CUDA (dry run)"}
    if cuda:
        link = _host_link_bytes_per_s(device)
        offload_prof = _simulated(model, batch, optimizer, "offload")
        moved = none_prof.activation_bytes - offload_prof.activation_bytes
        with preserved_strategy(model):
            remat.apply(model, "offload")
            offload_peak, offload_ms = _peak_and_ms(model, batch, optimizer, device, repeats)
        none_ms = rows[0].measured_step_ms
        forward_ms = roofline_ms(none_prof.ops, spec, phases=("forward",))
        measured_link = min(link.values())
        copy_ms = 2 * moved / measured_link * 1e3
        overlap = 1.0 - (offload_ms - none_ms) / copy_ms if copy_ms > 0 else None
        offload = {
            "predicted_peak_bytes": offload_prof.peak_bytes,
            "measured_peak_bytes": offload_peak, "moved_bytes": moved,
            "link_d2h_gb_per_s": link["d2h"] / 1e9,
            "link_h2d_gb_per_s": link["h2d"] / 1e9,
            "spec_link_gb_per_s": spec.host_link_bytes_per_s / 1e9,
            "none_step_ms": none_ms, "offload_step_ms": offload_ms,
            "predicted_offload_step_ms": none_ms + offload_exposed_ms(moved, forward_ms, spec),
            "copy_ms": copy_ms,
            "overlap": None if overlap is None else min(1.0, max(0.0, overlap)),
        }
        full_offload = _full_offload_overlap(rows, sims["full"], _simulated(
            model, batch, optimizer, "full_offload"), measured_link, spec)
    return {
        "command": "python benchmarks/gpu.py " + shlex.join(argv),
        "date": f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if cuda else "cpu (dry run)",
        "preset": preset, "batch_size": batch_size, "tokens_per_step": tokens,
        "cap_bytes": cap_bytes, "plan_s": plan_s, "plan": plan_text(plan),
        "rows": [asdict(r) for r in rows], "offload": offload, "full_offload": full_offload,
    }


def _full_offload_overlap(rows: Sequence[Row], full_prof: Any, ours_prof: Any,
                          link_bytes_per_s: float, spec: Any) -> dict[str, Any]:
    """Item 5 of the module docstring: ``full_offload``'s copies against ``full``'s step."""
    by_name = {r.strategy: r for r in rows}
    full_ms, ours_ms = by_name["full"].measured_step_ms, by_name["full_offload"].measured_step_ms
    moved = full_prof.activation_bytes - ours_prof.activation_bytes
    copy_ms = 2 * moved / link_bytes_per_s * 1e3
    overlap = 1.0 - (ours_ms - full_ms) / copy_ms if copy_ms > 0 else None
    forward_ms = roofline_ms(full_prof.ops, spec, phases=("forward",))
    back_ms = roofline_ms(full_prof.ops, spec, phases=("recompute", "backward"))
    blocks = max(len(full_prof.blocks), 1)  # each block: its share of copies and kernels
    predicted = full_ms + blocks * offload_exposed_ms(
        moved // blocks, forward_ms / blocks, spec, backward_ms=back_ms / blocks)
    return {"moved_bytes": moved, "copy_ms": copy_ms, "full_step_ms": full_ms,
            "full_offload_step_ms": ours_ms, "predicted_full_offload_step_ms": predicted,
            "overlap": None if overlap is None else min(1.0, max(0.0, overlap))}


def render(result: dict[str, Any]) -> str:
    """A markdown table of ``run``'s result."""
    lines = [f"{result['preset']} on {result['device']}, batch {result['batch_size']}, "
             f"cap {format_bytes(result['cap_bytes'])}, planned in {result['plan_s']:.1f} s",
             "", *([f"Command: `{result['command']}` (torch {result['torch']}, "
                    f"{result['date']})", ""] if "command" in result else []),
             "| Strategy | Predicted peak | Measured peak | Planner's step | Roofline step "
             "| Measured step | Tokens/s | Fits |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        pred_ms = "-" if r["predicted_step_ms"] is None else f"{r['predicted_step_ms']:.1f} ms"
        lines.append(f"| {r['strategy']} | {format_bytes(r['predicted_peak_bytes'])} | "
                     f"{format_bytes(r['measured_peak_bytes'])} | {pred_ms} | "
                     f"{r['roofline_step_ms']:.1f} ms | "
                     f"{r['measured_step_ms']:.1f} ms | {r['tokens_per_s']:.0f} | "
                     f"{'yes' if r['fits'] else 'no'} |")
    off = result["offload"]
    if "measured_peak_bytes" in off:  # runs before the offload row have only the JSON
        ms = off["offload_step_ms"]
        lines.append(f"| offload (every block) | {format_bytes(off['predicted_peak_bytes'])} | "
                     f"{format_bytes(off['measured_peak_bytes'])} | "
                     f"{off['predicted_offload_step_ms']:.1f} ms | - | {ms:.1f} ms | "
                     f"{result['tokens_per_step'] / (ms / 1e3):.0f} | "
                     f"{'yes' if off['measured_peak_bytes'] <= result['cap_bytes'] else 'no'} |")
    lines += ["", "The plan:", "", "```", result["plan"], "```", "",
              f"offload: `{json.dumps(off)}`"]
    if "full_offload" in result:
        lines.append(f"full_offload: `{json.dumps(result['full_offload'])}`")
    return "\n".join(lines)


def write_section(paths: Sequence[str]) -> None:
    """Render the results saved with ``--json`` into RESULTS.md's ``gpu`` section."""
    body = "\n\n".join(f"### `{p}`\n\n" + render(json.loads(Path(p).read_text()))
                         for p in paths)
    body = (f"## On a GPU: predicted vs measured\n\nRendered by `.venv/bin/python "
            f"benchmarks/gpu.py --render {' '.join(paths)}` from the JSON each run wrote "
            f"on the GPU machine.\n\n" + body)
    RESULTS.write_text(replace_section(RESULTS.read_text() if RESULTS.exists() else "",
                                       "gpu", body))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, llama-tiny, no offload")
    parser.add_argument("--preset", default=None, help="default: llama-1b (dry run: llama-tiny)")
    parser.add_argument("--hf", default=None, choices=sorted(HELD_OUT),
                        help="a held-out Hugging Face decoder (about 1.06B; dry run: tiny) "
                             "instead of --preset")
    parser.add_argument("--batch", type=int, default=None, help="default: 4 (dry run: 2)")
    parser.add_argument("--seq", type=int, default=None, help="default: the preset's")
    parser.add_argument("--cap-gib", type=float, default=None,
                        help="memory cap; default: half-way between full and none")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the result here")
    parser.add_argument("--render", nargs="+", default=None, metavar="JSON",
                        help="run nothing: write these saved results into RESULTS.md")
    args = parser.parse_args(argv)
    if args.render:
        write_section(args.render)
        return {}
    preset = args.preset or ("llama-tiny" if args.dry_run else "llama-1b")
    batch = args.batch or (2 if args.dry_run else 4)
    cap = None if args.cap_gib is None else int(args.cap_gib * 2**30)
    result = run(preset=preset, batch_size=batch, seq=args.seq, cap_bytes=cap,
                 dry_run=args.dry_run, repeats=args.repeats, argv=list(argv or []),
                 hf=args.hf)
    print(render(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
