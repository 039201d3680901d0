"""FSDP2 and DDP on CPU (gloo, 2 processes): loss and gradients match one process without
checkpointing, in both orders (remat then fully_shard, fully_shard then remat).

One set of gloo ranks runs every distributed case (NOTE [ Forked ranks ]); rank 0 writes
the numbers to a JSON file that the tests below read.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from tests.ranks import run_ranks
from torch import nn

from remat.distributed.sharding import shard_peak
from remat.errors import RematError, StrategyError
from remat.integrations.fsdp2 import (
    apply_fsdp,
    check_segments_sharding,
    per_rank_peak,
    shard_groups,
    single_device_budget_bytes,
)
from remat.models import LlamaMLP, build_model, make_batch
from remat.strategies import applied, apply, sqrt_segments

WORLD = 2
STEPS = 3
# Two ranks sum their halves' gradients in another order than one process does: float32
# rounding, so ~1e-7 relative, never more than this.
RTOL = 1e-5
# SGD keeps those differences that small after a step (Adam's normalisation would amplify
# them where a gradient is ~0); lr large enough that the loss visibly falls.
LR = 1.0
FSDP_CASES = [  # (case name, order, strategy)
    ("fsdp:full", "remat_first", "full"),
    ("fsdp:sqrt", "remat_first", "sqrt"),
    ("fsdp:ops", "remat_first", "ops"),
    ("fsdp:none", "remat_first", "none"),
    ("fsdp-after:attn", "shard_first", "attn"),
    ("fsdp-after:every:2", "shard_first", "every:2"),
    ("fsdp-after:ops", "shard_first", "ops"),
]
DDP_CASES = [("ddp:full", "full"), ("ddp:sqrt", "sqrt"), ("ddp:mlp", "mlp")]


def _model() -> Any:
    torch.manual_seed(0)
    return build_model("llama-tiny", n_layer=4)  # no dropout: ranks see different halves


def _batch(step: int) -> dict[str, torch.Tensor]:
    batch: dict[str, torch.Tensor] = make_batch("llama-tiny", 4, 16, seed=100)
    return batch  # the same batch every step: the loss must fall


@functools.cache
def _reference() -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """One process, no checkpointing, the whole batch: losses and grads per step."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(STEPS):
        loss = model(**_batch(step)).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: _grad(p).detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads


def _grad(p: nn.Parameter) -> Any:
    assert p.grad is not None, "a parameter got no gradient"
    return p.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


class _CountCalls:
    """Counts LlamaMLP.forward calls, to prove recomputation ran (patched in the worker)."""

    calls = 0

    @classmethod
    def install(cls) -> None:
        original = LlamaMLP.forward

        def forward(self: LlamaMLP, *args: Any, **kwargs: Any) -> Any:
            cls.calls += 1
            return original(self, *args, **kwargs)

        LlamaMLP.forward = forward  # type: ignore[method-assign]


def _train(model: nn.Module, rank: int) -> dict[str, Any]:
    """STEPS steps on this rank's half of each batch; returns losses, errors, MLP calls."""
    ref_losses, ref_grads = _reference()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, errors = [], []
    _CountCalls.calls = 0
    for step in range(STEPS):
        local = {k: v.chunk(WORLD)[rank] for k, v in _batch(step).items()}
        loss = model(**local).loss
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / WORLD)
        worst = 0.0
        for name, p in model.named_parameters():
            name = name.removeprefix("module.")  # DDP
            grad = _grad(p)
            if hasattr(grad, "full_tensor"):
                grad = grad.full_tensor()  # FSDP2: DTensor shard -> whole gradient
            worst = max(worst, _rel(grad, ref_grads[step][name]))
        errors.append(worst)
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "ref_losses": ref_losses, "grad_rel_errors": errors,
            "mlp_calls": _CountCalls.calls}


def _worker(rank: int, store_path: str, out_path: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)  # two ranks share the test machine's cores
    store = dist.FileStore(store_path, WORLD)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _CountCalls.install()
    mesh = init_device_mesh("cpu", (WORLD,))
    results: dict[str, Any] = {}
    for name, order, strategy in FSDP_CASES:
        model = _model()
        if order == "remat_first":
            apply_fsdp(model, strategy, mesh=mesh)
        else:
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            apply(model, strategy)
        results[name] = _train(model, rank)
        results[name]["param_names_kept"] = [n for n, _ in model.named_parameters()] == [
            n for n, _ in _model().named_parameters()]
    # sqrt after per-block fully_shard: segments span FSDP groups -> clear error.
    model = _model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    segments = [[model.blocks[i] for i in seg] for seg in sqrt_segments(len(model.blocks))]
    try:
        check_segments_sharding(segments)
        results["sqrt_after_shard_error"] = ""
    except RematError as exc:
        results["sqrt_after_shard_error"] = str(exc)
    try:
        apply_fsdp(model, "full", mesh=mesh)
        results["apply_fsdp_twice_error"] = ""
    except RematError as exc:
        results["apply_fsdp_twice_error"] = str(exc)
    for name, strategy in DDP_CASES:
        model = apply(_model(), strategy)
        ddp = nn.parallel.DistributedDataParallel(model)
        results[name] = _train(ddp, rank)
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.barrier()  # leave together (gloo may abort a rank whose peer is still talking)
    dist.destroy_process_group()
    # Skip interpreter finalization, which gloo's worker threads can abort now and then
    # (see examples/train_fsdp.py); the results are written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn_all(tmp: Path) -> dict[str, Any]:
    out = tmp / "results.json"
    run_ranks(_worker, (str(tmp / "store"), str(out)), WORLD)  # NOTE [ Forked ranks ]
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def test_fsdp2_and_ddp_on_two_ranks_match_one_process(tmp_path: Path) -> None:
    """One test for all the ranks' cases, so pytest-xdist starts the ranks once."""
    results = _spawn_all(tmp_path)
    # Loss and gradients at every step match one process without checkpointing.
    for case in [c[0] for c in FSDP_CASES] + [c[0] for c in DDP_CASES]:
        result = results[case]
        for loss, ref in zip(result["losses"], result["ref_losses"], strict=True):
            assert loss == pytest.approx(ref, rel=RTOL), (case, result)
        assert max(result["grad_rel_errors"]) <= RTOL, (case, result)
        assert result["losses"][-1] < result["losses"][0], (case, result)  # it trains
    # Recomputation ran: 4 blocks x STEPS forwards, and each checkpointed MLP once more.
    forward_only = 4 * STEPS
    assert results["fsdp:none"]["mlp_calls"] == forward_only
    for case in ("fsdp:full", "fsdp:sqrt", "fsdp:ops", "fsdp-after:every:2", "fsdp-after:ops",
                 "ddp:full", "ddp:sqrt", "ddp:mlp"):
        extra = forward_only // 2 if case.endswith("every:2") else forward_only
        assert results[case]["mlp_calls"] == forward_only + extra, case
    assert results["fsdp:full"]["param_names_kept"]
    # sqrt over blocks sharded one by one, and apply_fsdp on a sharded model: clear errors.
    message = results["sqrt_after_shard_error"]
    assert "sqrt segment 0 spans 2 blocks" in message
    assert "apply_fsdp(model, 'sqrt')" in message and "'full'" in message
    assert "fully_shard already ran on" in results["apply_fsdp_twice_error"]


# ---- single-process pieces -----------------------------------------------------------------

def test_shard_groups_follow_sqrt_segments() -> None:
    model: Any = build_model("llama-tiny", n_layer=5)
    assert [len(g) for g in shard_groups(model)] == [1] * 5
    apply(model, "sqrt")  # ceil(sqrt(5)) = 3 -> [0, 1, 2], [3, 4]
    groups = shard_groups(model)
    index = {id(b): i for i, b in enumerate(model.blocks)}
    assert [[index[id(m)] for m in g] for g in groups] == [[0, 1, 2], [3, 4]]


class _Bytes:
    def __init__(self, peak: int, params: int, grads: int, optim: int) -> None:
        self.peak_bytes, self.param_bytes = peak, params
        self.grad_bytes, self.optimizer_bytes = grads, optim


def test_per_rank_peak_counts_sharded_states_and_the_largest_group() -> None:
    model: Any = build_model("llama-tiny", n_layer=4)
    params = sum(p.numel() * 4 for p in model.parameters())
    block = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    root = params - 4 * block
    prof = _Bytes(peak=10 * params, params=params, grads=params, optim=2 * params)
    rank = per_rank_peak(prof, model, world_size=4)
    expected = shard_peak(peak_bytes=10 * params, param_bytes=params, grad_bytes=params,
                          optimizer_bytes=2 * params, sharding="fsdp", world_size=4,
                          block_param_bytes=block, block_grad_bytes=block,
                          root_param_bytes=root, root_grad_bytes=root)
    assert rank == expected
    # 4P fixed (P + G + 2P Adam) -> 4P/4 sharded, + one block's and the root's P and G.
    assert rank.peak_bytes == 6 * params + params + 2 * block + 2 * root
    apply(model, "sqrt")  # segments of 2 blocks: twice the gathered bytes
    assert per_rank_peak(prof, model, world_size=4).unsharded_bytes == 4 * block + 2 * root
    ddp = per_rank_peak(prof, model, world_size=4, sharding="ddp")
    assert ddp.peak_bytes == 11 * params  # + gradient buckets


def test_single_device_budget_adds_what_sharding_saves() -> None:
    model = build_model("llama-tiny", n_layer=4)
    params = sum(p.numel() * 4 for p in model.parameters())
    prof = _Bytes(peak=10 * params, params=params, grads=params, optim=2 * params)
    saved = prof.peak_bytes - per_rank_peak(prof, model, world_size=4).peak_bytes
    assert saved > 0
    assert single_device_budget_bytes(1000, prof, model, world_size=4) == 1000 + saved
    with pytest.raises(ValueError, match="budget_bytes must be an int > 0"):
        single_device_budget_bytes(0, prof, model, world_size=4)


def test_apply_fsdp_needs_a_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    with pytest.raises(RematError, match="torch.distributed is not initialized"):
        apply_fsdp(copy.deepcopy(build_model("llama-tiny")), "full")


def test_apply_fsdp_refuses_to_compile_sqrt_before_touching_the_model() -> None:
    model = build_model("llama-tiny")
    with pytest.raises(StrategyError, match="compile=True cannot compile 'sqrt'"):
        apply_fsdp(model, "sqrt", compile=True)
    assert applied(model) is None
