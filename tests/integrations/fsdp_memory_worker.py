"""Per-rank peaks of one FSDP2 training step on gloo CPU ranks (spawned by
test_fsdp2_memory.py and benchmarks/fsdp_memory.py): the tracker's and the CPU allocator's.

Each rank builds the same tiny models (llama-tiny and gpt-tiny, 2 layers), shards each with
``apply_fsdp`` per strategy and profiles one step
with AdamW (``remat.measure.profile_step(..., allocator=True)``: the tracker's peak, and the
allocator's peak of one more untracked step plus the bytes alive at its start).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

MODELS = ("llama-tiny", "gpt-tiny")
N_LAYER = 2
BATCH, SEQ = 2, 16
STRATEGIES = ("none", "full")
#: the cases each rank measures, ``"model:strategy"``
CASES = tuple(f"{m}:{s}" for m in MODELS for s in STRATEGIES)


def build(model: str = MODELS[0]) -> Any:
    from remat.models import build_model

    torch.manual_seed(0)
    return build_model(model, n_layer=N_LAYER)


def batch(rank: int = 0, model: str = MODELS[0]) -> dict[str, torch.Tensor]:
    from remat.models import make_batch

    out: dict[str, torch.Tensor] = make_batch(model, BATCH, SEQ, seed=rank)
    return out


def worker(rank: int, world: int, store_path: str, out_path: str) -> None:
    """One rank: profile a step per case; rank 0 writes ``{case: [per rank]}``."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    from remat.integrations.fsdp2 import apply_fsdp
    from remat.measure.profile import profile_step
    from remat.measure.step import Step

    mesh = init_device_mesh("cpu", (world,))
    mine: dict[str, dict[str, Any]] = {}
    for case in CASES:
        name, strategy = case.split(":")
        model = apply_fsdp(build(name), strategy, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        prof = profile_step(Step(model, batch(rank, name), optimizer=opt), timing=False,
                            allocator=True)
        mine[case] = {"tracker": prof.peak_bytes, "allocator": prof.allocator_peak_bytes,
                          "phase": prof.peak_phase, "param_bytes": prof.param_bytes,
                          "grad_bytes": prof.grad_bytes,
                          "optimizer_bytes": prof.optimizer_bytes,
                          "breakdown": {c.value: b for c, b in prof.cost.breakdown.items()}}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        Path(out_path).write_text(json.dumps(
            {c: [g[c] for g in gathered] for c in CASES}))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip finalization, which gloo's threads can abort (test_fsdp2.py)


def measure(world: int, tmp: Path) -> dict[str, list[dict[str, Any]]]:
    """Spawn ``world`` gloo ranks and return each case's per-rank measurements."""
    from tests.ranks import run_ranks

    out = tmp / f"fsdp_memory_{world}.json"
    run_ranks(worker, (world, str(tmp / f"store_{world}"), str(out)), world)
    result: dict[str, list[dict[str, Any]]] = json.loads(out.read_text())
    return result
