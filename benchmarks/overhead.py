"""remat's applied strategies cost no more than hand-written torch.utils.checkpoint.

For each model, five variants train side by side in one run, interleaved
(A B C D E A B ...) so machine noise hits them alike:

- ``none``: the plain model;
- ``hand-written``: every block replaced by a wrapper module whose forward is
  ``torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False, **kwargs)``;
- ``remat full``: ``remat.apply(model, "full")``;
- ``hand-written SAC``: the same wrapper with ``context_fn`` from
  ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` and a policy that saves
  the outputs of the compute-heavy ops (``remat.strategies.sac.COMPUTE_HEAVY_OPS``) and
  recomputes the rest: what users write for selective checkpointing;
- ``remat ops``: ``remat.apply(model, "ops")``, which saves the same ops.

It reports median step times, the ratio of each remat variant to its hand-written
counterpart, and the exact peak bytes of each (``remat.profile``), which must be equal
within each pair. Writes the section between ``<!-- overhead:start -->`` and
``<!-- overhead:end -->`` in benchmarks/RESULTS.md.

Usage::

    .venv/bin/python benchmarks/overhead.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import remat
from remat.models import build_model, make_batch
from remat.strategies.sac import COMPUTE_HEAVY_OPS
from remat.units import format_bytes

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from _results import RESULTS, replace_section  # noqa: E402


def _save_heavy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """A hand-written SAC policy: keep matmul and attention outputs, recompute the rest."""
    if str(op.overloadpacket) in COMPUTE_HEAVY_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class HandWritten(nn.Module):
    """What users write by hand: a wrapper calling torch.utils.checkpoint (with a SAC
    ``context_fn`` when ``selective``)."""

    def __init__(self, block: nn.Module, *, selective: bool = False) -> None:
        super().__init__()
        self.block = block
        self.selective = selective

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.selective:
            return checkpoint(self.block, *args, use_reentrant=False,
                              context_fn=lambda: create_selective_checkpoint_contexts(
                                  _save_heavy), **kwargs)
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


# Each remat variant and the hand-written variant it is compared with.
PAIRS = {"none": "hand-written", "hand-written": "hand-written", "remat full": "hand-written",
         "hand-written SAC": "hand-written SAC", "remat ops": "hand-written SAC"}


def _variants(preset: str) -> dict[str, nn.Module]:
    torch.manual_seed(0)
    plain = build_model(preset)
    models = {"none": plain}
    for name in ("hand-written", "remat full", "hand-written SAC", "remat ops"):
        model = build_model(preset)
        model.load_state_dict(plain.state_dict())
        if name.startswith("hand-written"):
            for i, block in enumerate(model.blocks):
                model.blocks[i] = HandWritten(block, selective=name.endswith("SAC"))
        else:
            remat.apply(model, name.split()[1])
        models[name] = model
    return models


def _step(model: nn.Module, batch: dict[str, torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()

    return run


def measure(preset: str, batch_size: int, repeats: int) -> list[dict[str, Any]]:
    models = _variants(preset)
    batch = make_batch(models["none"], batch_size)
    steps = {name: _step(m, batch) for name, m in models.items()}
    for run in steps.values():  # warm-up
        run()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, run in steps.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) * 1e3)
    rows = []
    for name, model in models.items():
        prof = remat.profile(model, batch, timing=False,
                             blocks=(lambda n, m: isinstance(m, HandWritten))
                             if name.startswith("hand-written") else None)
        rows.append({"variant": name, "step_ms": statistics.median(times[name]),
                     "peak_bytes": prof.peak_bytes, "activation_bytes": prof.activation_bytes})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    lines = [
        f"Machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU. "
        f"Date: {dt.date.today().isoformat()}. Median of {args.repeats} interleaved steps.",
        "",
        "Command: `.venv/bin/python benchmarks/overhead.py"
        + (f" --repeats {args.repeats}`" if args.repeats != 15 else "`"),
        "",
        "Each remat variant's step is compared with its hand-written counterpart (`remat "
        "full` with `hand-written`, `remat ops` with `hand-written SAC`); `none` with "
        "`hand-written`.",
        "",
        "| model | variant | step ms | vs hand-written | peak | activations |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for preset, batch_size in (("gpt-small", 8), ("llama-small", 8)):
        rows = measure(preset, batch_size, args.repeats)
        by_name = {r["variant"]: r for r in rows}
        for r in rows:
            ratio = r["step_ms"] / by_name[PAIRS[r["variant"]]]["step_ms"]
            lines.append(
                f"| {preset} (batch {batch_size}) | {r['variant']} | {r['step_ms']:.1f} | "
                f"{ratio:.3f} | {format_bytes(r['peak_bytes'])} | "
                f"{format_bytes(r['activation_bytes'])} |"
            )
            print(preset, r["variant"], f"{r['step_ms']:.1f} ms", f"ratio {ratio:.3f}",
                  r["peak_bytes"], r["activation_bytes"])
    body = "## Overhead: remat vs hand-written checkpoint\n\n" + "\n".join(lines) + "\n"
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    RESULTS.write_text(replace_section(text, "overhead", body))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
