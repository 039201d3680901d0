"""Tensor (and sequence) parallelism on 2, 4 and 8 gloo CPU ranks with remat: gradients match
one process, and each rank's measured bytes equal remat.distributed.tensor_parallel's.

One set of gloo ranks runs every distributed case (NOTE [ Forked ranks ]); rank 0 writes
the numbers to a JSON file that the tests below read.
"""

from __future__ import annotations

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

from remat.distributed.pipeline import pipeline_rank_bytes
from remat.distributed.tensor_parallel import (
    TPRankBytes,
    rank_param_bytes,
    tp_rank_bytes,
    tp_roles,
)
from remat.errors import RematError
from remat.integrations.tp import apply_tp, tp_plan
from remat.models import build_model, make_batch

TP = 2
# Two ranks sum partial products of the row-parallel linears in another order than one
# process: float32 rounding, ~1e-7 relative; never more than this.
RTOL = 1e-5
PARITY = [  # (case, sequence parallel, strategy, order)
    ("tp:none", False, "none", "tp_first"), ("tp:full", False, "full", "tp_first"),
    ("tp:attn", False, "attn", "tp_first"), ("tp:ops", False, "ops", "tp_first"),
    ("tp:plan", False, "plan", "tp_first"), ("tp-remat-first:full", False, "full", "remat_first"),
    ("sp:full", True, "full", "tp_first"), ("sp:ops", True, "ops", "tp_first"),
]


#: t = 4 and 8 need heads divisible by t (llama-tiny has 4 query and 2 key/value heads):
#: the same model with as many as each degree needs.
WIDE: dict[int, dict[str, int]] = {4: {"n_kv_head": 4}, 8: {"n_head": 8, "n_kv_head": 8}}


def user_plan() -> dict[str, Any]:
    """A plan unlike remat's own (attention left whole, the MLP and the head sharded) in
    torchtitan's form: block-relative entries plus a root one (NOTE [ A user's TP plan ]).
    Module-level: the CLI loads it as ``tests/integrations/test_tp.py:user_plan``."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}


def _model(**overrides: Any) -> Any:
    torch.manual_seed(0)
    return build_model("llama-tiny", n_layer=2, **overrides)


def _batch() -> dict[str, torch.Tensor]:
    batch: dict[str, torch.Tensor] = make_batch("llama-tiny", 2, 16, seed=100)
    return batch


def _rank_sim(t: int, sp: bool, **heads: int) -> TPRankBytes:
    """``tp_rank_bytes`` of ``full`` (fp32, SGD) for ``_model(**heads)`` at TP degree ``t``:
    simulated once per module, as several tests (and every rank at t = 4) compare with it."""
    return _cached_rank_sim(t, bool(sp), tuple(sorted(heads.items())))


@functools.cache
def _cached_rank_sim(t: int, sp: bool, heads: tuple[tuple[str, int], ...]) -> TPRankBytes:
    return tp_rank_bytes(functools.partial(_model, **dict(heads)), seq_len=16, batch_size=2,
                         tp=t, sequence_parallel=sp, strategy="full", dtype="fp32",
                         optimizer="sgd")


@functools.cache
def _reference(factory: Any = None) -> tuple[float, dict[str, torch.Tensor]]:
    model = (factory or _model)()
    loss = model(**_batch()).loss
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                         if p.grad is not None}


def _opt() -> nn.Module:
    """A GPT-3-style block (Hugging Face OPT: q/k/v, out_proj, fc1/fc2 on the block), no
    dropout (ranks draw their own masks)."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    return OPTForCausalLM(OPTConfig(  # type: ignore[no-any-return]
        vocab_size=256, hidden_size=64, num_hidden_layers=2, ffn_dim=256, num_attention_heads=4,
        word_embed_proj_dim=64, max_position_embeddings=16, dropout=0.0, tie_word_embeddings=False,
        activation_function="gelu", attn_implementation="eager", use_cache=False))


def _parity(model: nn.Module, factory: Any = None) -> dict[str, Any]:
    ref_loss, ref_grads = _reference(factory)
    loss = model(**_batch()).loss
    loss.backward()
    worst = 0.0
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        ref = ref_grads[name]
        # floor: OPT's k_proj bias has an exact gradient of 0 (softmax is shift-invariant
        # per query); both sides are float noise of ~1e-11 there
        worst = max(worst, float((grad - ref).abs().max() / max(ref.abs().max(), 1e-5)))
    return {"loss": loss.item(), "ref_loss": ref_loss, "grad_rel_error": worst}


def _fused_parity(factory: Any, mesh: Any) -> tuple[dict[str, Any], nn.Module, Any]:
    """``factory``'s model (a fused QKV) under remat's layout with ``full`` on top against
    one process; the fused weights' gradients put back in the model's order
    (``natural_order``). Returns the result, the parallelized model and its batch."""
    import remat
    from remat.distributed.tp_fused import linear_shape
    from remat.distributed.tp_layout import fused_of
    from remat.integrations.tp import natural_order
    from remat.simulate.sim_setup import default_batch

    torch.manual_seed(0)
    ref = factory()
    batch = default_batch(ref, 2, 16)
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    torch.manual_seed(0)
    model = factory()
    fused = fused_of(model, tp_roles(model), api="test")
    out_dims = {n: s[2] for n, m in model.named_modules() if (s := linear_shape(m))}
    remat.apply(apply_tp(model, mesh), "full")
    loss = model(**batch).loss
    loss.backward()
    refs = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        owner = name.rpartition(".")[0]
        if owner in fused:
            dim = out_dims[owner] if grad.dim() == 2 else 0
            grad = natural_order(grad, dim, fused[owner][0], TP)
        want = refs[name].grad
        assert want is not None
        worst = max(worst, float((grad - want).abs().max() / max(want.abs().max(), 1e-5)))
    return ({"loss": loss.item(), "ref_loss": ref_loss.item(), "grad_rel_error": worst},
            model, batch)


def _bytes(model: nn.Module, batch: Any = None) -> dict[str, int]:
    """The rank's tracked step (fp32, SGD with momentum) and the CPU allocator's peak."""
    from tests.measure.allocator_util import allocator_step_peak

    from remat.distributed.sharded import is_dtensor
    from remat.measure.profile import allocator_step_peak as allocator_peak_of_step
    from remat.measure.step import clear_grads, run_step
    from remat.measure.tracked_step import tracked_step
    from remat.simulate.precision import make_optimizer

    # foreach as the simulation picks it: without SP the norms stay plain tensors, and
    # foreach ops refuse to mix them with DTensors in one list.
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer("sgd", params, foreach=all(is_dtensor(p) for p in params))
    assert opt is not None
    batch = _batch() if batch is None else batch
    run_step(model, batch, optimizer=opt)  # optimizer state, as WarmFake's warm-up
    clear_grads(model)
    from remat.measure.step import Step

    # gloo's worker thread drops its references to a collective's tensors just after the
    # main thread's wait returns, so now and then a buffer outlives its last use by a few
    # ops (one step in six, seen: +40960 B of activations, +3776 or +12288 B of peak at
    # t = 2 and 4). That only adds bytes: the lowest of five tracked steps, per figure, is
    # the step's own (all five noisy: ~1e-4 per rank and configuration).
    steps = []
    for _ in range(5):
        steps.append(tracked_step(Step(model, batch, optimizer=opt), []))
        clear_grads(model)
    tracked = min(steps, key=lambda t: t.tracker.peak_bytes)
    static = sum(tracked.static.values())
    # The allocator also sees gloo's staging buffers, whose lifetimes follow its worker
    # thread's timing (one step read 20% above the tracker where most read a few %): the
    # lowest of three steps, like the tracker's. The first after a plain warm-up step (the
    # helper's); each later one right after the one before, itself a whole step that leaves
    # the model as a warm-up does (optimizer state kept, gradients cleared around it).
    alloc = allocator_step_peak(model, batch, optimizer=opt,
                                baseline_bytes=static).absolute_peak_bytes
    for _ in range(2):
        alloc = min(alloc, allocator_peak_of_step(Step(model, batch, optimizer=opt), static))
    tracker = tracked.tracker
    return {"peak": tracker.peak_bytes,
            "activations": min(t.tracker.activation_bytes for t in steps),
            "params": tracked.static.get("params", 0),
            "optimizer": tracked.static.get("optimizer_state", 0),
            "allocator_peak": alloc}


def _mesh(rank: int, store_path: str, world: int) -> Any:
    """Join the ``world`` gloo ranks (one thread each: they share the machine's cores)
    and return their one-dimensional CPU mesh."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _worker(rank: int, store_path: str, out_path: str) -> None:
    import remat

    mesh = _mesh(rank, store_path, TP)
    results: dict[str, Any] = {}
    for name, sp, strategy, order in PARITY:
        model = _model()
        if order == "remat_first":
            remat.apply(model, strategy)
        apply_tp(model, mesh, sequence_parallel=sp)
        if strategy == "plan":
            strategy = remat.plan(model, _batch(), budget=10**9)
        if order == "tp_first":
            remat.apply(model, strategy)
        results[name] = _parity(model)
    for sp in (False, True):  # OPT's layout, with full recompute on top
        model = remat.apply(apply_tp(_opt(), mesh, sequence_parallel=sp), "full")
        results[f"opt:sp={sp}"] = _parity(model, _opt)
    for sp in (False, True):
        model = apply_tp(_model(), mesh, sequence_parallel=sp)
        remat.apply(model, "full")
        results[f"t={TP}:sp={sp}"] = _bytes(model)
    results["user-plan:full"] = _parity(remat.apply(apply_tp(_model(), mesh,
                                                             tp_plan=user_plan()), "full"))
    results["user-plan:bytes"] = _bytes(remat.apply(apply_tp(_model(), mesh,
                                                             tp_plan=user_plan()), "full"))
    from tests.distributed.test_tp_fused import falcon_grouped, gpt2

    results["fused:gpt2"], model, batch = _fused_parity(gpt2, mesh)
    results["fused:gpt2:bytes"] = _bytes(model, batch)
    # groups of heads, and a parallel block adding in place to a rowwise output
    results["fused:falcon"] = _fused_parity(falcon_grouped, mesh)[0]
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see tests/integrations/test_fsdp2.py: gloo threads at finalization


def _bytes_worker(rank: int, store_path: str, out_path: str, world: int) -> None:
    """One of ``world`` ranks: the measured bytes of ``full`` with and without SP at TP
    degree ``world`` and, on 8 ranks, at 4 too (two TP groups of 4 on a 2 x 4 mesh: one
    spawn for both degrees); every rank writes its own file."""
    from torch.distributed.device_mesh import init_device_mesh

    import remat

    meshes = {world: _mesh(rank, store_path, world)}
    if world == 8:
        meshes[4] = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))["tp"]
    results: dict[str, Any] = {}
    for t, mesh in meshes.items():
        for sp in (False, True):
            model = apply_tp(_model(**WIDE.get(t, {})), mesh, sequence_parallel=sp)
            remat.apply(model, "full")
            results[f"t={t}:sp={sp}"] = _bytes(model)
    Path(f"{out_path}.{rank}").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(fn: Any, world: int, tmp: Path, *extra: Any) -> None:
    run_ranks(fn, (str(tmp / "store"), str(tmp / "results.json"), *extra), world)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # The Hugging Face models the ranks build, imported here once (seconds: transformers'
    # modeling code) rather than by each forked rank (NOTE [ Forked ranks ]).
    import transformers

    for name in ("OPTForCausalLM", "GPT2LMHeadModel", "FalconForCausalLM"):
        getattr(transformers, name)  # a lazy module: the attribute imports the model
    # A simulation in this process first, as a user may run one before training: the
    # forked ranks inherit DTensor's caches, and their gradients must still equal one
    # process's (NOTE [ One tensor-parallel rank, simulated ], process-group state).
    _rank_sim(TP, False)
    tmp = tmp_path_factory.mktemp("tp")
    _spawn(_worker, TP, tmp)
    return json.loads((tmp / "results.json").read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each of 4 ranks' measured bytes at TP degree 4 (``_bytes_worker``). The suite
    spawns at most 4 ranks (8 processes on the test machine's 2 cores take longer than
    the rest of this module); ``python -m tests.integrations.test_tp`` measures 8 too
    and prints the docs' table."""
    tmp = tmp_path_factory.mktemp("tp4")
    _spawn(_bytes_worker, 4, tmp, 4)
    return [json.loads((tmp / f"results.json.{r}").read_text()) for r in range(4)]


@pytest.mark.parametrize("case", [c[0] for c in PARITY] + ["opt:sp=False", "opt:sp=True",
                                                            "user-plan:full", "fused:gpt2",
                                                            "fused:falcon"])
def test_tp_gradients_match_one_process(results: dict[str, Any], case: str) -> None:
    result = results[case]
    assert result["loss"] == pytest.approx(result["ref_loss"], rel=RTOL)
    assert result["grad_rel_error"] <= RTOL, result


@pytest.mark.parametrize("sp", [False, True])
def test_measured_rank_bytes_match_the_simulation(results: dict[str, Any], sp: bool) -> None:
    _check_rank_bytes(results[f"t={TP}:sp={sp}"], TP, sp, {})


def test_a_user_plan_simulates_the_bytes_gloo_ranks_measure(results: dict[str, Any]) -> None:
    measured = results["user-plan:bytes"]
    sim = tp_rank_bytes(_model, seq_len=16, batch_size=2, tp=TP, strategy="full",
                        dtype="fp32", optimizer="sgd", tp_plan=user_plan())
    model = _model()
    # Exact: the MLP's and the head's weights split in two, the rest whole.
    split = sum(p.numel() * 4 for n, p in model.named_parameters()
                if ".mlp." in n or n.startswith("lm_head"))
    whole = sum(p.numel() * 4 for p in model.parameters()) - split
    assert measured["params"] == sim.param_bytes == whole + split // TP
    assert (measured["optimizer"], measured["activations"], measured["peak"]) == (
        sim.optimizer_bytes, sim.activation_bytes, sim.peak_bytes)
    assert sim.peak_bytes < sim.device_peak_bytes


def test_gpt2_fused_qkv_simulates_the_bytes_gloo_ranks_measure(results: dict[str, Any]) -> None:
    from tests.distributed.test_tp_fused import gpt2

    from remat.distributed.tp_step import simulate_ranks

    measured = results["fused:gpt2:bytes"]
    (sim,) = simulate_ranks(gpt2, seq_len=16, points=[("full", 2)], tp=TP,
                            sequence_parallel=False, dtype="fp32", optimizer="sgd")
    model = gpt2()
    # Exact: every weight split in two (c_attn by heads of q, k and v) but the norms',
    # the position embedding and the rowwise Conv1Ds' biases.
    whole = sum(p.numel() * 4 for n, p in model.named_parameters()
                if ".ln_" in n or "ln_f" in n or "wpe" in n or n.endswith("c_proj.bias"))
    split = sum(p.numel() * 4 for p in model.parameters()) - whole
    assert measured["params"] == sim.param_bytes == whole + split // TP
    assert (measured["optimizer"], measured["activations"], measured["peak"]) == (
        sim.optimizer_bytes, sim.activation_bytes, sim.peak_bytes)
    assert measured["peak"] == pytest.approx(measured["allocator_peak"], rel=0.15)


def test_a_user_plan_key_no_block_holds_is_refused() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel

    with pytest.raises(RematError, match="'mlp.fc_in' names no module") as info:
        tp_rank_bytes(_model, seq_len=16, batch_size=2, tp=TP, dtype="fp32",
                      optimizer="sgd", tp_plan={"mlp.fc_in": ColwiseParallel()})
    assert "blocks.0" in str(info.value) and "mlp.gate_proj" in str(info.value)
    with pytest.raises(RematError, match="sequence_parallel with tp_plan"):
        tp_rank_bytes(_model, seq_len=16, batch_size=2, tp=TP, sequence_parallel=True,
                      tp_plan=user_plan())


@pytest.mark.parametrize("sp", [False, True])
def test_measured_rank_bytes_match_the_simulation_at_t4(
        wide: list[dict[str, Any]], sp: bool) -> None:
    # Every rank holds the same shards and runs the same ops: each is checked on its own
    # against the simulation of rank 0 (one simulation per sp, _rank_sim).
    for measured in (r[f"t=4:sp={sp}"] for r in wide):
        _check_rank_bytes(measured, 4, sp, WIDE[4])


def test_t1_is_the_single_device_profile() -> None:
    import remat
    from remat.simulate.precision import make_optimizer

    sim = tp_rank_bytes(_model, seq_len=16, batch_size=2, tp=1, strategy="full",
                        dtype="fp32", optimizer="sgd")
    model = _model()
    remat.apply(model, "full")
    opt = make_optimizer("sgd", [p for p in model.parameters() if p.requires_grad])
    prof = remat.profile(model, _batch(), optimizer=opt, timing=False)
    assert (sim.peak_bytes, sim.activation_bytes) == (prof.peak_bytes, prof.activation_bytes)
    assert (sim.param_bytes, sim.grad_bytes, sim.optimizer_bytes) == (
        prof.param_bytes, prof.grad_bytes, prof.optimizer_bytes)


def _check_rank_bytes(measured: dict[str, int], t: int, sp: bool,
                      overrides: dict[str, Any]) -> None:
    sim = _rank_sim(t, sp, **overrides)
    model = _model(**overrides)
    # Exact: norms whole, every other weight split t ways (the head's and embedding's by
    # rows).
    assert sim.param_bytes == measured["params"]
    norms = sum(p.numel() * 4 for n, p in model.named_parameters() if "norm" in n)
    assert measured["params"] == norms + (sum(p.numel() * 4 for p in model.parameters())
                                          - norms) // t
    # SGD's momentum clones the gradient, and DTensor returns the vocabulary-parallel
    # embedding's gradient whole: that weight's momentum is whole, the rest split.
    emb = model.tok_emb.weight.numel() * 4
    assert sim.optimizer_bytes == measured["optimizer"] == sim.grad_bytes
    assert sim.grad_bytes == sim.param_bytes + emb - emb // t
    # Activations and peak: the rank's own step under a fake process group is the step
    # gloo runs (NOTE [ One tensor-parallel rank, simulated ]), byte for byte.
    assert (measured["activations"], measured["peak"]) == (sim.activation_bytes,
                                                           sim.peak_bytes)
    # The tracker against the CPU allocator on the rank: gloo's staging buffers are
    # allocated outside the dispatcher (both peaks move by a few % between runs).
    assert measured["peak"] == pytest.approx(measured["allocator_peak"], rel=0.15)


def test_sequence_parallel_saves_activations() -> None:
    # _model is llama-tiny (2 layers, its preset): the simulations the gloo ranks' bytes
    # are checked against
    sims = [_rank_sim(TP, sp) for sp in (False, True)]
    assert sims[1].activation_bytes < sims[0].activation_bytes


# ---- single-process pieces -----------------------------------------------------------------

def test_a_collective_wrapper_counts_the_tensor_it_wraps() -> None:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    from remat.measure.ledger import storage_of

    inner = torch.ones(2, 16, 64)
    wrapped = AsyncCollectiveTensor(inner)
    # the wrapper's own storage is a placeholder of the full size; the bytes are inner's
    assert storage_of(wrapped) is not None and storage_of(inner) is not None
    assert storage_of(wrapped)._cdata == storage_of(inner)._cdata  # type: ignore[union-attr]


def test_plan_follows_torchtitan_for_llama_and_shards_gpt_fused_qkv_by_heads() -> None:
    plan = tp_plan(build_model("llama-tiny"), sequence_parallel=True)
    kinds = {name: type(style).__name__ for name, style in plan.items()}
    assert kinds["blocks.0.attn.q_proj"] == kinds["blocks.1.mlp.up_proj"] == "ColwiseParallel"
    assert kinds["blocks.0.attn.o_proj"] == kinds["blocks.0.mlp.down_proj"] == "RowwiseParallel"
    assert kinds["blocks.0.attn_norm"] == kinds["norm"] == "SequenceParallel"
    assert kinds["blocks.0.attn"] == "PrepareModuleInput"
    assert kinds["tok_emb"] == "RowwiseParallel" and kinds["lm_head"] == "ColwiseParallel"
    assert "blocks.0.attn_norm" not in tp_plan(build_model("llama-tiny"))
    gpt = tp_plan(build_model("gpt-tiny", tie_weights=False))
    assert type(gpt["blocks.0.mlp.fc"]).__name__ == "ColwiseParallel"
    # the fused qkv: q, k and v (64 wide each) split by heads, not one column shard
    assert gpt["blocks.0.attn.qkv"].sections == (64, 64, 64)
    assert type(gpt["blocks.0.attn.proj"]).__name__ == "RowwiseProjection"
    with pytest.raises(RematError, match="tied to the head: True"):
        tp_plan(build_model("gpt-tiny"), sequence_parallel=True)
    with pytest.raises(RematError, match="sequence parallelism with a fused QKV"):
        tp_plan(build_model("gpt-tiny", tie_weights=False), sequence_parallel=True)


def test_plan_finds_hugging_face_llama_names() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    roles = tp_roles(transformers.LlamaForCausalLM(config))
    assert roles["model.layers.1.self_attn.k_proj"] == "colwise"
    assert roles["model.layers.0.mlp.down_proj"] == "rowwise"
    assert roles["model.embed_tokens"] == "embedding" and roles["lm_head"] == "head"


def test_rank_param_bytes_rounds_up_uneven_shards() -> None:
    model = build_model("llama-tiny")
    roles = tp_roles(model)
    assert rank_param_bytes(model, roles, 1) == sum(p.numel() * 4 for p in model.parameters())
    # d_ff = 176 over 3 ranks: rank 0 keeps 59 rows of gate/up and 59 columns of down.
    mlp = model.blocks[0].mlp
    rank0 = rank_param_bytes(mlp, {"gate_proj": "colwise", "up_proj": "colwise",
                                   "down_proj": "rowwise"}, 3)
    assert rank0 == 3 * 59 * 64 * 4


def test_simulated_bytes_shrink_with_tp_and_t8_runs() -> None:
    wide = functools.partial(_model, **WIDE[4])
    by_t = {t: tp_rank_bytes(wide, seq_len=16, batch_size=2, tp=t, strategy="none",
                             dtype="fp32", optimizer="adamw") for t in (1, 2, 4)}
    assert by_t[1].activation_bytes == by_t[1].device_activation_bytes
    assert by_t[1].peak_bytes == by_t[1].device_peak_bytes
    assert by_t[4].device_peak_bytes == by_t[1].peak_bytes
    assert by_t[4].peak_bytes < by_t[2].peak_bytes < by_t[1].peak_bytes
    # AdamW: two moments in the parameter's layout, step counters whole.
    counters = by_t[1].optimizer_bytes - 2 * by_t[1].param_bytes
    assert 0 < counters < 200
    assert by_t[2].optimizer_bytes == 2 * by_t[2].param_bytes + counters
    t8 = tp_rank_bytes(functools.partial(_model, **WIDE[8]), seq_len=16, batch_size=2, tp=8,
                       sequence_parallel=True, strategy="full", dtype="fp32", optimizer="sgd")
    model = _model(**WIDE[8])
    assert t8.param_bytes == rank_param_bytes(model, tp_roles(model), 8)


def test_a_head_count_the_degree_does_not_divide_is_refused() -> None:
    # llama-tiny's 2 key/value heads cannot be split 4 ways: apply_tp refuses, and so does
    # the simulation of the rank (it parallelizes with apply_tp's layout).
    with pytest.raises(RematError, match="n_kv_head=2 is not divisible by the TP degree 4"):
        tp_rank_bytes("llama-tiny", seq_len=16, batch_size=2, tp=4)


def test_a_module_is_simulated_on_a_copy_and_a_layout_that_fails_is_refused() -> None:
    model = _model()
    got = tp_rank_bytes(model, seq_len=16, batch_size=2, tp=2, strategy="full", dtype="fp32",
                        optimizer="sgd")
    assert got == _rank_sim(2, False)  # the same call with the factory
    assert all(type(p) is nn.Parameter and p.device.type == "cpu" for p in model.parameters())
    assert model.blocks[0].attn.n_head == 4  # not divided by the layout
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    with pytest.raises(RematError, match="fails on a rank"):
        tp_rank_bytes(lambda: transformers.LlamaForCausalLM(config), seq_len=16,
                      batch_size=2, tp=2, sequence_parallel=True, dtype="fp32")


def test_simulation_leaves_an_initialized_process_group_alone(tmp_path: Path) -> None:
    # A one-rank gloo group in this process: the rank is simulated in a subprocess, the
    # group survives, and the figures are those of a process without one.
    want = tp_rank_bytes("llama-tiny", seq_len=16, batch_size=2, tp=2, strategy="full",
                         dtype="fp32", optimizer="sgd")
    pipeline = {"seq_len": 16, "batch_size": 2, "stages": 2, "microbatches": 2, "tp": 2,
                "sequence_parallel": True, "dtype": "fp32", "optimizer": "sgd"}
    want_ranks = pipeline_rank_bytes("llama-tiny", **pipeline)
    store = dist.FileStore(str(tmp_path / "store"), 1)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        got = tp_rank_bytes("llama-tiny", seq_len=16, batch_size=2, tp=2, strategy="full",
                            dtype="fp32", optimizer="sgd")
        got_ranks = pipeline_rank_bytes("llama-tiny", **pipeline)  # the same subprocess way
        assert dist.is_initialized() and dist.group.WORLD is group
        assert dist.get_backend() == "gloo" and dist.get_world_size() == 1
        with pytest.raises(RematError, match="cannot be sent to the subprocess"):
            tp_rank_bytes(lambda: build_model("llama-tiny"), seq_len=16, batch_size=2, tp=2)
    finally:
        dist.destroy_process_group()
    assert got == want
    assert got_ranks == want_ranks


if __name__ == "__main__":  # the docs table: python -m tests.integrations.test_tp
    import tempfile

    print("| t | SP | parameters, B | activations, B: measured / simulated "
          "| peak, B: measured / simulated | ranks equal |")
    measured: dict[int, list[dict[str, Any]]] = {}
    for world in (2, 8):  # the 8 ranks measure t = 4 too (_bytes_worker)
        out = Path(tempfile.mkdtemp())
        _spawn(_bytes_worker, world, out, world)
        ranks = [json.loads((out / f"results.json.{r}").read_text()) for r in range(world)]
        for t in {2: (2,), 8: (4, 8)}[world]:
            measured[t] = [{k.split(":", 1)[1]: v for k, v in r.items()
                            if k.startswith(f"t={t}:")} for r in ranks]
    for t in sorted(measured):
        ranks = measured[t]
        for sp in (False, True):
            sim = tp_rank_bytes(functools.partial(_model, **WIDE.get(t, {})), seq_len=16,
                                batch_size=2, tp=t, sequence_parallel=sp, strategy="full",
                                dtype="fp32", optimizer="sgd")
            m = ranks[0][f"sp={sp}"]
            keys = ("params", "optimizer", "activations", "peak")  # the allocator's varies
            same = all(all(r[f"sp={sp}"][k] == m[k] for k in keys) for r in ranks)
            print(f"| {t} | {'yes' if sp else 'no'} | {m['params']} | {m['activations']} / "
                  f"{sim.activation_bytes} | {m['peak']} / {sim.peak_bytes} | "
                  f"{'yes' if same else 'no'} |")
