"""Per-rank peaks of one FSDP2 training step on gloo CPU ranks (spawned by
test_fsdp2_memory.py and benchmarks/fsdp_memory.py): the tracker's and the CPU allocator's.

Each rank builds the same tiny model, shards it with ``apply_fsdp`` and profiles one step
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

MODEL = "llama-tiny"
N_LAYER = 2
BATCH, SEQ = 2, 16
STRATEGIES = ("none", "full")


def build() -> Any:
    from remat.models import build_model

    torch.manual_seed(0)
    return build_model(MODEL, n_layer=N_LAYER)


def batch(rank: int = 0) -> dict[str, torch.Tensor]:
    from remat.models import make_batch

    out: dict[str, torch.Tensor] = make_batch(MODEL, BATCH, SEQ, seed=rank)
    return out


def worker(rank: int, world: int, store_path: str, out_path: str) -> None:
    """One rank: profile a step per strategy; rank 0 writes ``{strategy: [per rank]}``."""
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
    for strategy in STRATEGIES:
        model = apply_fsdp(build(), strategy, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        prof = profile_step(Step(model, batch(rank), optimizer=opt), timing=False,
                            allocator=True)
        mine[strategy] = {"tracker": prof.peak_bytes, "allocator": prof.allocator_peak_bytes,
                          "phase": prof.peak_phase, "param_bytes": prof.param_bytes,
                          "grad_bytes": prof.grad_bytes,
                          "optimizer_bytes": prof.optimizer_bytes,
                          "breakdown": {c.value: b for c, b in prof.cost.breakdown.items()}}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        Path(out_path).write_text(json.dumps(
            {s: [g[s] for g in gathered] for s in STRATEGIES}))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip finalization, which gloo's threads can abort (test_fsdp2.py)


def measure(world: int, tmp: Path) -> dict[str, list[dict[str, Any]]]:
    """Spawn ``world`` gloo ranks and return each strategy's per-rank measurements."""
    from torch.multiprocessing.spawn import spawn

    out = tmp / f"fsdp_memory_{world}.json"
    root = str(Path(__file__).resolve().parents[2])
    sys.path.insert(0, root)
    try:
        spawn(worker, args=(world, str(tmp / f"store_{world}"), str(out)), nprocs=world,
              join=True)
    finally:
        sys.path.remove(root)
    result: dict[str, list[dict[str, Any]]] = json.loads(out.read_text())
    return result
