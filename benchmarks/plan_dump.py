"""Dump what the planner measures and decides, to diff two versions of ``src/`` byte for byte.

For gpt-tiny (6 layers), llama-tiny, gpt-tiny with AdamW and two held-out Hugging Face
decoders (Llama, Phi; see benchmarks/planner.py): the peak model's windows (calibrated
constants), every block's candidates (bytes, FLOPs, roofline ms) and the plans at 40, 60 and
80% of the no-checkpoint peak (measured and predicted peak, recompute FLOPs, decisions).
A speed-up of the planner must leave this file unchanged.

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/plan_dump.py /tmp/after.json
    PYTHONPATH=/path/to/old/src .venv/bin/python benchmarks/plan_dump.py /tmp/before.json
    cmp /tmp/before.json /tmp/after.json
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from remat.models import build_model, make_batch
from remat.planning import plan, prepare

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner import hf_batch, hf_model  # noqa: E402


def record(model: torch.nn.Module, batch: Any,
           optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """The peak model, candidates and plans of one model and batch, as plain data."""
    ctx = prepare(model, batch, optimizer=optimizer)
    peak_model = ctx.peak_model
    out: dict[str, Any] = {
        "windows": [(w.label, w.constant_bytes, w.prefix, w.block, w.term)
                    for w in peak_model.windows],
        "tables": [[(c.label(), c.saved_bytes, c.forward_peak_bytes, c.backward_peak_bytes,
                     c.recompute_flops, c.recompute_ms, c.recompute_bytes) for c in table]
                   for table in peak_model.tables],
        "none_peak": ctx.no_checkpoint_peak_bytes,
    }
    plans: dict[str, Any] = {}
    for budget in ("40%", "60%", "80%"):
        try:
            p = plan(model, batch, budget=budget, optimizer=optimizer, context=ctx)
        except Exception as error:  # noqa: BLE001 - BudgetTooSmall is an answer too
            plans[budget] = type(error).__name__
            continue
        plans[budget] = (p.measured_peak_bytes, p.predicted_peak_bytes, p.recompute_flops,
                         sorted((k, v.label()) for k, v in p.decisions.items()))
    out["plans"] = plans
    return out


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: {sys.argv[0]} OUT.json")
    warnings.simplefilter("ignore")
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    model = build_model("gpt-tiny", n_layer=6)
    out["gpt-tiny"] = record(model, make_batch(model, 2))
    torch.manual_seed(0)
    model = build_model("llama-tiny")
    out["llama-tiny"] = record(model, make_batch(model, 2))
    torch.manual_seed(0)
    model = build_model("gpt-tiny")
    out["gpt-tiny-adamw"] = record(model, make_batch(model, 2),
                                   torch.optim.AdamW(model.parameters()))
    for name in ("hf-llama", "hf-phi"):
        out[name] = record(hf_model(name), hf_batch(2))
    Path(sys.argv[1]).write_text(json.dumps(out, indent=0, default=str))
    print(f"wrote {sys.argv[1]}")


if __name__ == "__main__":
    main()
