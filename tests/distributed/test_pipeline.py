"""Pipeline schedules (what each rank holds in flight) and bytes per pipeline rank."""

from __future__ import annotations

import json
import types
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from typer.testing import CliRunner

from remat.cli import app
from remat.distributed.pipeline import chunk_blocks, pipeline_rank_bytes
from remat.distributed.pipeline_fsdp import FsdpChunk, fsdp_rank_bytes, plain_rank_bytes
from remat.distributed.schedule import Action, held_microbatches, schedule_actions
from remat.distributed.tensor_parallel import tp_rank_bytes
from remat.models import build_model
from remat.models.llama import rotary_cos_sin


@pytest.fixture(scope="module")
def schedules() -> types.ModuleType:
    """PyTorch's schedules, imported by the tests that compare with them (an import of
    seconds that the suite's other workers need not pay at collection)."""
    return pytest.importorskip("torch.distributed.pipelining.schedules")


def _torch_actions(schedules: types.ModuleType, order: list[Any]) -> list[tuple[int, str]]:
    kinds = {schedules._ComputationType.FORWARD: "F",
             schedules._ComputationType.FULL_BACKWARD: "B"}
    return [(a.stage_index, kinds[a.computation_type]) for a in order
            if a is not None and a.computation_type in kinds]


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 3, 2), (2, 6, 3),
                                           (3, 6, 2), (4, 16, 4)])
def test_interleaved_lists_are_pytorchs(schedules: types.ModuleType, p: int, m: int,
                                       v: int) -> None:
    cls = schedules.ScheduleInterleaved1F1B
    if not hasattr(cls, "_calculate_single_rank_operations"):
        pytest.skip("this torch has no per-rank interleaved order to compare with")
    fake = types.SimpleNamespace(n_local_stages=v, microbatches_per_round=m // max(1, m // p),
                                 pp_group_size=p, _n_microbatches=m)
    ours = schedule_actions("interleaved-1f1b", stages=p, microbatches=m, virtual_stages=v)
    for rank in range(p):
        theirs = cls._calculate_single_rank_operations(fake, rank)
        assert [(a.chunk, a.kind) for a in ours[rank]] == _torch_actions(schedules, theirs)
        # and the micro-batch indices run in order per chunk
        assert [a.microbatch for a in ours[rank]] == [a.microbatch_index for a in theirs
                                                      if a is not None]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(4, 8), (2, 5), (3, 3)])
def test_single_stage_lists_have_pytorchs_order(schedules: types.ModuleType, name: str, p: int,
                                                m: int) -> None:
    cls = {"gpipe": schedules.ScheduleGPipe, "1f1b": schedules.Schedule1F1B}[name]
    if not hasattr(cls, "_get_pipeline_order"):
        pytest.skip("this torch has no pipeline_order for single-stage schedules")
    theirs = cls._get_pipeline_order(types.SimpleNamespace(_num_stages=p, _n_microbatches=m))
    ours = schedule_actions(name, stages=p, microbatches=m)
    for rank in range(p):
        # 1F1B's IR writes F-then-B pairs after p - 1 - r forwards; the runtime runs
        # p - r forwards then B-then-F pairs: the same sequence of kinds
        assert [(a.chunk, a.kind) for a in ours[rank]] == _torch_actions(schedules, theirs[rank])


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 8), m=st.integers(1, 24))
def test_held_microbatches_closed_forms(p: int, m: int) -> None:
    assert held_microbatches("1f1b", stages=p, microbatches=m) == tuple(
        min(m, p - r) for r in range(p))
    assert held_microbatches("gpipe", stages=p, microbatches=m) == (m,) * p
    for actions in schedule_actions("1f1b", stages=p, microbatches=m):
        forwards = [a.microbatch for a in actions if a.kind == "F"]
        backwards = [a.microbatch for a in actions if a.kind == "B"]
        assert forwards == backwards == list(range(m))
        assert all(actions.index(type(a)(a.chunk, "F", a.microbatch)) < i
                   for i, a in enumerate(actions) if a.kind == "B")


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 6), rounds=st.integers(1, 3), v=st.integers(1, 4))
def test_interleaved_every_chunk_forwards_before_backward(p: int, rounds: int, v: int) -> None:
    m = p * rounds
    ranks = schedule_actions("interleaved-1f1b", stages=p, microbatches=m, virtual_stages=v)
    for rank, actions in enumerate(ranks):
        assert len(actions) == 2 * m * v
        seen: set[tuple[int, int]] = set()
        for a in actions:
            assert a.chunk % p == rank
            if a.kind == "F":
                seen.add((a.chunk, a.microbatch))
            else:
                assert (a.chunk, a.microbatch) in seen
    held = held_microbatches("interleaved-1f1b", stages=p, microbatches=m, virtual_stages=v)
    assert held == tuple(sorted(held, reverse=True)) and max(held) <= m * v


def test_bad_schedules_raise() -> None:
    with pytest.raises(ValueError, match="unknown schedule"):
        held_microbatches("zigzag", stages=2, microbatches=2)
    with pytest.raises(ValueError, match="one stage per rank"):
        held_microbatches("1f1b", stages=2, microbatches=2, virtual_stages=2)
    with pytest.raises(ValueError, match="multiple of its rounds"):
        held_microbatches("interleaved-1f1b", stages=2, microbatches=5, virtual_stages=2)
    with pytest.raises(ValueError, match="more pipeline chunks than blocks"):
        chunk_blocks(3, 4)
    assert chunk_blocks(7, 3) == (range(3), range(3, 5), range(5, 7))


def _tiny() -> Any:
    return build_model("llama-tiny", n_layer=4)


def _tp_rank_step(model: Any, *, tp: int, sequence_parallel: bool, strategy: str,
                  tp_plan: dict[str, Any] | None = None) -> list[Any]:
    """The TP rank's simulated step (fp32, AdamW, batch 2 x 16): the rank figures of
    ``tp_rank_bytes`` with the same arguments, without its one-device simulation."""
    from remat.distributed.tp_step import simulate_ranks

    return simulate_ranks(model, seq_len=16, points=[(strategy, 2)], tp=tp,
                          sequence_parallel=sequence_parallel, dtype="fp32",
                          optimizer="adamw", tp_plan=tp_plan)


def test_ranks_split_the_one_device_step_exactly() -> None:
    one = tp_rank_bytes(_tiny, seq_len=16, batch_size=2, tp=1, dtype="fp32")
    ranks = pipeline_rank_bytes(_tiny, seq_len=16, batch_size=2, stages=2, microbatches=4,
                                dtype="fp32")
    assert [r.blocks for r in ranks] == [(0, 1), (2, 3)]
    assert [r.held_microbatches for r in ranks] == [2, 1]
    assert sum(r.param_bytes for r in ranks) == one.param_bytes
    assert sum(r.grad_bytes for r in ranks) == one.grad_bytes
    assert sum(r.optimizer_bytes for r in ranks) == pytest.approx(one.optimizer_bytes, abs=16)
    assert sum(r.activation_bytes for r in ranks) == one.device_activation_bytes
    for r in ranks:
        static = r.param_bytes + r.grad_bytes + r.optimizer_bytes
        assert r.peak_bytes >= static + r.held_microbatches * r.activation_bytes
    # GPipe holds all four micro-batches on both ranks
    gpipe = pipeline_rank_bytes(_tiny, seq_len=16, batch_size=2, stages=2, microbatches=4,
                                schedule="gpipe", dtype="fp32")
    assert gpipe[0].peak_bytes - ranks[0].peak_bytes == 2 * ranks[0].activation_bytes
    # FSDP over two pipeline replicas (NOTE [ FSDP under pipeline parallelism ]):
    # parameter and optimizer shards, the stage's parameters gathered from its first
    # forward and its gradients unsharded from its first backward to the step's end
    for reshard in (False, True):
        dp = pipeline_rank_bytes(_tiny, seq_len=16, batch_size=2, stages=2, microbatches=4,
                                 dp=2, dtype="fp32", reshard_after_forward=reshard)
        for plain, fsdp in zip(ranks, dp, strict=True):
            assert fsdp.param_bytes == plain.param_bytes // 2  # even dims: no padding
            assert fsdp.gathered_param_bytes == plain.param_bytes
            assert fsdp.grad_bytes == plain.grad_bytes
            assert fsdp.activation_bytes == plain.activation_bytes
            # both peak at a backward: all gathered, gradients whole, moments halved
            assert plain.peak_bytes - fsdp.peak_bytes == (
                plain.optimizer_bytes - fsdp.optimizer_bytes - fsdp.param_bytes)


def test_fsdp_replay_by_hand() -> None:
    # shards: params 5 + 20 + 20, state 90 -> 135; params and grads 90 unsharded
    chunk = FsdpChunk(saved=100, work=7, root=(10, 10), blocks=((40, 40), (40, 40)),
                      moments=180, scalars=0)
    gpipe = [Action(0, "F", 0), Action(0, "F", 1), Action(0, "B", 0), Action(0, "B", 1)]
    kept = fsdp_rank_bytes(gpipe, {0: chunk}, dp=2)
    assert (kept.param_bytes, kept.optimizer_bytes, kept.grad_bytes) == (45, 90, 90)
    assert kept.peak_bytes == 135 + 90 + 90 + 200 + 7  # the first B
    # reshard after forward: the same backward peak (every group left gathered)
    assert fsdp_rank_bytes(gpipe, {0: chunk}, dp=2, reshard_after_forward=True) == kept
    # frozen blocks (no gradients): the first B with 3 held, the root's gradient
    forwards = [Action(0, "F", i) for i in range(3)] + [Action(0, "B", i) for i in range(3)]
    small = FsdpChunk(saved=100, work=0, root=(10, 10), blocks=((40, 0), (40, 0)),
                      moments=0, scalars=0)
    assert fsdp_rank_bytes(forwards, {0: small}, dp=2).peak_bytes == 45 + 90 + 10 + 300
    # without FSDP: the whole static bytes, nothing gathered besides
    assert plain_rank_bytes(forwards, {0: small}).peak_bytes == 90 + 10 + 300


def test_full_recompute_holds_less_and_costs_recompute() -> None:
    none = pipeline_rank_bytes(_tiny, seq_len=16, batch_size=2, stages=2, microbatches=4)
    full = pipeline_rank_bytes(_tiny, seq_len=16, batch_size=2, stages=2, microbatches=4,
                               strategy="full")
    for n, f in zip(none, full, strict=True):
        assert f.activation_bytes < n.activation_bytes
        assert n.recompute_ms == 0 < f.recompute_ms


def test_cli_pipeline_table_and_errors() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["simulate", "--model", "llama-tiny", "--seq", "16", "--batch",
                                 "1", "--strategies", "none,full", "--pp", "2",
                                 "--json", "-"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert len(data["pipeline"]) == 4  # 2 strategies x 2 ranks
    assert [r["held_microbatches"] for r in data["stage_plans"]] == [2, 1]
    assert all(r["strategy"] == "none" for r in data["stage_plans"])  # everything fits
    fsdp = runner.invoke(app, ["simulate", "--model", "llama-tiny", "--seq", "16", "--batch",
                               "1", "--strategies", "none", "--pp", "2", "--dp", "2",
                               "--reshard-after-forward", "--json", "-"])
    assert fsdp.exit_code == 0, fsdp.output
    rows = json.loads(fsdp.stdout)["pipeline"]
    assert all(r["reshard_after_forward"] and r["gathered_param_bytes"] == 2 * r["param_bytes"]
               for r in rows)
    table = runner.invoke(app, ["simulate", "--model", "llama-tiny", "--seq", "16", "--batch",
                                "1", "--strategies", "full", "--pp", "2"])
    assert table.exit_code == 0 and "Plan per stage" in table.output
    bad = runner.invoke(app, ["simulate", "--model", "llama-tiny", "--pp", "2", "--dp", "2",
                              "--world-size", "2"])
    assert bad.exit_code == 2 and "--dp and --world-size both given" in bad.output
    bad = runner.invoke(app, ["simulate", "--model", "llama-tiny", "--pp", "2",
                              "--virtual-stages", "2"])
    assert bad.exit_code == 2 and "needs an interleaved schedule" in bad.output


@pytest.mark.parametrize(("strategy", "layout"), [
    ("full", {"stages": 3, "microbatches": 6, "tp": 2, "sequence_parallel": True}),
    ("ops", {"stages": 2, "microbatches": 4, "schedule": "interleaved-1f1b",
             "virtual_stages": 2, "dp": 2})])
def test_cut_stack_gives_the_whole_stacks_bytes(strategy: str, layout: dict[str, Any]) -> None:
    def seven() -> Any:
        return build_model("llama-tiny", n_layer=7)

    cut = pipeline_rank_bytes(seven, seq_len=16, batch_size=2, strategy=strategy, **layout)
    whole = pipeline_rank_bytes(seven, seq_len=16, batch_size=2, strategy=strategy,
                                exact=True, **layout)
    assert cut == whole


@pytest.mark.parametrize("sp", [False, True])
def test_one_stage_is_the_tp_rank_step(sp: bool) -> None:
    # pp = 1, one micro-batch: the rank runs tp_rank_bytes's step, byte for byte.
    # tp_rank_bytes's rank figures are simulate_ranks's (its second, one-device simulation
    # only fills device_*, which nothing here reads): the rank's step alone.
    (one,) = _tp_rank_step(_tiny, tp=2, sequence_parallel=sp, strategy="full")
    (rank,) = pipeline_rank_bytes(_tiny, seq_len=16, batch_size=2, stages=1, microbatches=1,
                                  tp=2, sequence_parallel=sp, strategy="full", dtype="fp32")
    assert (rank.param_bytes, rank.grad_bytes, rank.optimizer_bytes, rank.activation_bytes,
            rank.peak_bytes) == (one.param_bytes, one.grad_bytes, one.optimizer_bytes,
                                 one.activation_bytes, one.peak_bytes)
    # --tp 2 --dp 2 without --pp: FSDP shards of the rank's own shards (even sizes here)
    (fsdp,) = pipeline_rank_bytes(_tiny, seq_len=16, batch_size=2, stages=1, microbatches=1,
                                  tp=2, sequence_parallel=sp, dp=2, strategy="full",
                                  dtype="fp32")
    assert (fsdp.param_bytes, fsdp.activation_bytes) == (one.param_bytes // 2,
                                                         one.activation_bytes)


class _FirstStage(nn.Module):
    """Stage 0 of 2 of llama-tiny (4 blocks) as its own model: the embedding and blocks 0
    and 1, Llama's forward up to there; the loss squares the stage output, so that the
    output is saved as the next stage's first norm saves it in the whole model."""

    def __init__(self) -> None:
        super().__init__()
        model = _tiny()
        self.config = model.config
        self.tok_emb, self.drop = model.tok_emb, model.drop
        self.blocks = nn.ModuleList(model.blocks[:2])

    def forward(self, input_ids: torch.Tensor, labels: Any = None) -> torch.Tensor:
        x = self.drop(self.tok_emb(input_ids))  # (B, T, C)
        cos, sin = rotary_cos_sin(input_ids.size(1), self.config.head_dim,
                                  self.config.rope_theta, device=x.device, dtype=x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)  # (B, T, C), sequence-sharded under SP
        return x.pow(2).mean()


@pytest.mark.parametrize("sp", [False, True])
def test_stage_is_the_tp_rank_step_of_the_stage_alone(sp: bool) -> None:
    # the rank's step of the stage alone, as tp_rank_bytes simulates it (rank figures only)
    (alone,) = _tp_rank_step(_FirstStage, tp=2, sequence_parallel=sp, strategy="none")
    ranks = pipeline_rank_bytes(_tiny, seq_len=16, batch_size=2, stages=2, microbatches=2,
                                tp=2, sequence_parallel=sp, dtype="fp32")
    assert ranks[0].param_bytes == alone.param_bytes
    # The stage alone computes its RoPE tables (cos, sin: 2 x T x head_dim fp32) and its
    # loss (one fp32 scalar); the whole model's step computes the tables once, outside
    # every block, and counts them with the loss on the last stage.
    config = _tiny().config
    own = 2 * 16 * config.head_dim * 4 + 4
    assert ranks[0].activation_bytes + own == alone.activation_bytes


def test_a_user_tp_plan_reaches_the_pipeline_ranks() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}
    (one,) = _tp_rank_step(_tiny, tp=2, sequence_parallel=False, strategy="full",
                           tp_plan=plan)
    (rank,) = pipeline_rank_bytes(_tiny, seq_len=16, batch_size=2, stages=1, microbatches=1,
                                  tp=2, strategy="full", dtype="fp32", tp_plan=plan)
    assert (rank.param_bytes, rank.activation_bytes, rank.peak_bytes) == (
        one.param_bytes, one.activation_bytes, one.peak_bytes)
