"""GPU check of the caching-allocator model: predicted vs measured reserved bytes.

For a few small models and strategies, on a CUDA machine, each case runs in a process of
its own (the allocator reads ``PYTORCH_CUDA_ALLOC_CONF`` once, when CUDA starts, NOTE
[ Allocator settings as torch 2.13 reads them ]; a fresh process also starts without the
cuBLAS workspaces an earlier case left in the cache) and records, with the default
settings and with ``expandable_segments:True``:

1. measured: ``torch.cuda.max_memory_reserved()`` / ``max_memory_allocated()`` over the
   model's creation and its first training step (AdamW), then over its second step, the
   peaks reset before it (the steady step);
2. predicted: a fake copy of the same model, optimizer and batch on ``cuda`` runs one
   tracked step (no GPU memory), and its allocation log is replayed through the model of
   the allocator (``remat.measure.reserved.reserved_of_step``) with the same settings.

It prints one markdown table, measured next to predicted. What the tracker cannot see (a
kernel's workspace, cuBLAS's workspaces, which the allocator also serves) shows as
measured above predicted.

``--dry-run`` runs on CPU, in this process, and prints the predictions only (a fake step
on CPU); the tests run it on a tiny model so the script cannot rot.

Usage::

    .venv/bin/python benchmarks/gpu_reserved.py                      # CUDA, all cases
    .venv/bin/python benchmarks/gpu_reserved.py --models gpt-small --batch 4 --json out.json
    .venv/bin/python benchmarks/gpu_reserved.py --dry-run            # CPU, predictions only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import remat
from remat.core.allocator_replay import StepReserved
from remat.measure.fake import fake_batch, fake_copy_with_map, fake_optimizer
from remat.measure.reserved import reserved_of_step
from remat.measure.step import Step, run_step
from remat.measure.tracked_step import tracked_step
from remat.models import build_model, make_batch
from remat.units import markdown_table, mib

MODELS = ("gpt-small", "llama-small")
STRATEGIES = ("none", "full")
SETTINGS = ("", "expandable_segments:True")
_SCRIPT = Path(__file__).resolve()


def _setup(model_name: str, strategy: str, batch_size: int,
           device: torch.device) -> tuple[torch.nn.Module, Any, torch.optim.Optimizer]:
    """The model (seed 0, the strategy applied), its batch and an AdamW, on ``device``."""
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(model_name)
    if strategy != "none":
        remat.apply(model, strategy)
    batch = make_batch(model, batch_size, device=device)
    return model, batch, torch.optim.AdamW(model.parameters(), lr=1e-4)


def predict(model: torch.nn.Module, batch: Any, optimizer: torch.optim.Optimizer,
            settings: str, device: str | None) -> StepReserved:
    """The allocator model's first and steady step for a fake copy's tracked step."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fmodel, replaced = fake_copy_with_map(model, mode, device=device)
    foptimizer = fake_optimizer(optimizer, replaced)
    step = Step(fmodel, fake_batch(batch, mode, device=device), optimizer=foptimizer)
    with mode:
        tracked = tracked_step(step, step.blocks_found(required=False))
    return reserved_of_step(tracked.tracker, settings)


def _prediction_fields(p: StepReserved) -> dict[str, int | None]:
    return {"predicted_first_reserved": p.first_step_reserved_bytes,
            "predicted_first_allocated": p.first_step_allocated_bytes,
            "predicted_steady_reserved": p.steady_reserved_bytes,
            "predicted_steady_allocated": p.steady_allocated_bytes,
            "tracker_peak": p.peak_requested_bytes}


def run_case(model_name: str, strategy: str, settings: str, batch_size: int) -> dict[str, Any]:
    """One case on CUDA, in this process (started with ``settings`` in the environment)."""
    device = torch.device("cuda")
    model, batch, optimizer = _setup(model_name, strategy, batch_size, device)
    row: dict[str, Any] = {"model": model_name, "strategy": strategy, "settings": settings}
    row.update(_prediction_fields(predict(model, batch, optimizer, settings, "cuda")))
    for name in ("first", "steady"):
        torch.cuda.synchronize()
        run_step(model, batch, optimizer=optimizer)
        torch.cuda.synchronize()
        row[f"measured_{name}_reserved"] = int(torch.cuda.max_memory_reserved())
        row[f"measured_{name}_allocated"] = int(torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
    return row


def dry_case(model_name: str, strategy: str, settings: str, batch_size: int) -> dict[str, Any]:
    """One case's prediction on CPU (no measurement)."""
    model, batch, optimizer = _setup(model_name, strategy, batch_size, torch.device("cpu"))
    row: dict[str, Any] = {"model": model_name, "strategy": strategy, "settings": settings}
    row.update(_prediction_fields(predict(model, batch, optimizer, settings, None)))
    return row


def _in_subprocess(model_name: str, strategy: str, settings: str,
                   batch_size: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    env["PYTORCH_CUDA_ALLOC_CONF"] = settings
    out = subprocess.run(
        [sys.executable, str(_SCRIPT), "--case", model_name, strategy, str(batch_size)],
        env=env, capture_output=True, text=True, timeout=600, check=False)
    if out.returncode != 0:
        raise SystemExit(f"case {model_name}/{strategy}/{settings!r} failed:\n{out.stderr}")
    row: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return row


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{mib(value):.1f}"


def _error(measured: int | None, predicted: int | None) -> str:
    if not measured or predicted is None:
        return "-"
    return f"{100.0 * (predicted - measured) / measured:+.1f}%"


def render(result: dict[str, Any]) -> str:
    """The rows as a markdown table (MiB), with the command that made them."""
    dry = result["dry_run"]
    headers = ["model", "strategy", "settings", "step", "tracker peak"]
    headers += ["predicted reserved", "predicted allocated"]
    if not dry:
        headers += ["measured reserved", "measured allocated", "reserved error"]
    rows = []
    for r in result["rows"]:
        for step in ("first", "steady"):
            cells = [r["model"], r["strategy"], r["settings"] or "(default)", step,
                     _mib(r["tracker_peak"]), _mib(r[f"predicted_{step}_reserved"]),
                     _mib(r[f"predicted_{step}_allocated"])]
            if not dry:
                cells += [_mib(r[f"measured_{step}_reserved"]),
                          _mib(r[f"measured_{step}_allocated"]),
                          _error(r[f"measured_{step}_reserved"], r[f"predicted_{step}_reserved"])]
            rows.append(cells)
    device = "CPU, predictions only (dry run)" if dry else result["device"]
    return (f"Command: `python benchmarks/gpu_reserved.py {' '.join(result['argv'])}`  \n"
            f"Device: {device}; torch {torch.__version__}; batch {result['batch']}; MiB\n\n"
            + markdown_table(headers, rows))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the cases (in subprocesses on CUDA, here with ``--dry-run``) and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS),
                        help="PYTORCH_CUDA_ALLOC_CONF values ('' for the defaults)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--case", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.case is not None:  # a subprocess: one case, its row as JSON on stdout
        model_name, strategy, batch = args.case
        settings = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        print(json.dumps(run_case(model_name, strategy, settings, int(batch))))
        return {}
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_reserved.py: no CUDA device; pass --dry-run")
    rows = []
    for model_name in args.models:
        for strategy in args.strategies:
            for settings in args.settings:
                case = dry_case if args.dry_run else _in_subprocess
                rows.append(case(model_name, strategy, settings, args.batch))
    result = {"dry_run": args.dry_run, "batch": args.batch, "rows": rows,
              "argv": list(argv) if argv is not None else sys.argv[1:],
              "device": "cpu" if args.dry_run else torch.cuda.get_device_name()}
    print(render(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
