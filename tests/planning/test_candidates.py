"""Candidates per kind of block, and the peak model checked against measured steps."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from torch import nn

from remat.core.op_record import OpRecord
from remat.devices import get_device
from remat.measure import profile
from remat.measure.step import Step
from remat.planning import PlanContext, plan, prepare
from remat.planning.candidates import Candidate
from remat.planning.loop import measure_decisions
from remat.strategies.builtin import Full, NoCheckpoint, SelectiveOps
from remat.strategies.builtin.ops import save_set_chain

from .conftest import Prepared

H100 = get_device("h100-80gb")


def op(name: str, flops: int, read: int, write: int) -> OpRecord:
    return OpRecord(name, "forward", flops, read, write)


def test_save_set_chain_keeps_attention_longest_then_matmuls_then_pointwise() -> None:
    ops = [
        op("aten.native_layer_norm", 0, 4096, 4096),
        op("aten.mm", 2 * 64**3, 8192, 4096),
        op("aten._scaled_dot_product_flash_attention", 10**9, 12288, 4096),
        op("aten.gelu", 0, 16384, 16384),
        op("aten.mul", 0, 8192, 4096),
        op("aten.bernoulli_", 0, 4096, 4096),  # in place: never in a save set
        op("aten.ones", 0, 0, 4096),  # a factory: free to redo
        op("aten.view", 0, 0, 0),  # a view: moves nothing
    ]
    chain = save_set_chain(ops, H100)
    assert chain[0] == {"aten._scaled_dot_product_flash_attention"}
    assert chain[1] == chain[0] | {"aten.mm"}
    for smaller, larger in zip(chain, chain[1:], strict=False):
        assert smaller < larger
    names = set().union(*chain)
    assert not names & {"aten.bernoulli_", "aten.ones", "aten.view"}
    assert len(chain[-1]) == 4  # of 5 savable names, at least one is always recomputed
    assert chain[2] == chain[1] | {"aten.mul"}  # reads 2 bytes per byte written: dearest
    assert save_set_chain(ops, H100, max_light_ops=1)[-1] == chain[2]


def test_save_set_chain_adds_repeated_matmuls_call_by_call() -> None:
    ops = [  # three matmuls writing the same bytes; inner dimensions 64, 1024, 256
        op("aten.mm", 2 * 64 * 64 * 64, 8192, 16384),
        op("aten.mm", 2 * 64 * 1024 * 64, 8192, 16384),
        op("aten.mm", 2 * 64 * 256 * 64, 8192, 16384),
        op("aten.gelu", 0, 16384, 16384),
    ]
    chain = save_set_chain(ops, H100)
    # Dearest to recompute per byte first; every call kept is spelled by the op's name.
    assert chain == [{"aten.mm#1"}, {"aten.mm#1", "aten.mm#2"}, {"aten.mm"}]


def test_candidates_of_a_transformer_block(gpt_tiny: Prepared) -> None:
    tables = gpt_tiny.context.peak_model.tables
    assert len({id(t) for t in tables}) == 1  # identical blocks share one measurement
    table = tables[0]
    none, labels = table[0], [c.label() for c in table]
    assert none.is_none and none.recompute_ms == 0.0 and none.recompute_flops == 0
    assert "full" in labels
    full = table[labels.index("full")]
    assert full.saved_bytes < none.saved_bytes and full.recompute_flops > 0
    assert full.recompute_ms > 0
    # Some candidates decide on the attention and MLP sub-layers separately.
    assert any("attn=" in label or "mlp=" in label for label in labels)
    for c in table[1:]:  # every kept candidate is better than another in some number
        assert not any(o.dominates(c) and o != c for o in table if not c.dominates(o))


def test_peak_model_predicts_measured_peaks_exactly(tiny: Prepared) -> None:
    ctx = tiny.context
    pm = ctx.peak_model
    assert pm.predict([0] * pm.num_blocks) == ctx.no_checkpoint_peak_bytes == tiny.none_peak
    rng = random.Random(0)
    for _ in range(3):
        choice = [rng.randrange(len(t)) for t in pm.tables]
        measured = measure_decisions(Step(tiny.model, tiny.batch), ctx.decisions(choice),
                                     simulate=True)
        assert measured.peak_bytes == pm.predict(choice), [
            pm.tables[i][c].label() for i, c in enumerate(choice)]


class Widen(nn.Module):
    """Residual MLP block that may change the width: LayerNorm, Linear, GELU, Linear."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_in)
        self.up = nn.Linear(d_in, 4 * d_out)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * d_out, d_out)
        self.skip = nn.Linear(d_in, d_out, bias=False) if d_in != d_out else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.skip(x) + self.down(self.act(self.up(self.norm(x))))
        return out


class Pyramid(nn.Module):
    """Blocks of three different shapes: the planner measures one of each kind."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Widen(16, 16), Widen(16, 16), Widen(16, 32),
                                     Widen(32, 32), Widen(32, 32)])
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        loss: torch.Tensor = self.head(x).square().mean()
        return loss


def test_a_model_with_blocks_of_different_shapes() -> None:
    torch.manual_seed(0)
    model = Pyramid()
    x = torch.randn(64, 16)
    ctx = prepare(model, x)
    tables = ctx.peak_model.tables
    # layers.0 gets the raw input (no grad), unlike layers.1: they are measured apart.
    assert tables[3] is tables[4] and len({id(t) for t in tables}) == 4
    none_peak = profile(model, x, timing=False).peak_bytes
    assert ctx.no_checkpoint_peak_bytes == none_peak
    result = plan(model, x, budget="80%", context=ctx)
    assert result.measured_peak_bytes is not None
    assert result.measured_peak_bytes <= result.budget_bytes == int(0.8 * none_peak)
    assert result.predicted_peak_bytes == result.measured_peak_bytes
    assert all(d.name in ("full", "ops") for d in result.decisions.values())
    assert result.decision("layers.0") in (NoCheckpoint(), *result.decisions.values())


def test_save_set_chain_leaves_out_calls_the_recompute_never_runs() -> None:
    # An MLP: gate, up, activation, product, down. Fully checkpointed, the recompute stops
    # before the down projection (its input is the last tensor backward needs).
    gate = op("aten.mm", 2 * 512 * 128 * 344, 4 * (512 * 128 + 128 * 344), 4 * 512 * 344)
    down = op("aten.mm", 2 * 512 * 344 * 128, 4 * (512 * 344 + 344 * 128), 4 * 512 * 128)
    silu = op("aten.silu", 0, 4 * 512 * 344, 4 * 512 * 344)
    mul = op("aten.mul", 0, 8 * 512 * 344, 4 * 512 * 344)
    forward = [gate, gate, silu, mul, down]
    recomputed = [gate, gate, silu, mul]
    # Without the recompute, the down projection (dearest per byte) is kept first ...
    assert save_set_chain(forward, H100)[0] == {"aten.mm#2"}
    chain = save_set_chain(forward, H100, recomputed=recomputed)
    # ... with it, never: keeping its output saves no time. The gate and up projections
    # are named call by call (not "aten.mm", which would keep the down projection too).
    assert chain == [{"aten.mm#0"}, {"aten.mm#0", "aten.mm#1"},
                     {"aten.mm#0", "aten.mm#1", "aten.mul"}]
    assert all("aten.mm#2" not in s and "aten.mm" not in s for s in chain)
    # Nothing recomputed at all: nothing worth keeping.
    assert save_set_chain(forward, H100, recomputed=[]) == []


def test_candidate_validation_and_labels() -> None:
    none = Candidate((), 100, 110, 150, 0, 0.0)
    full = Candidate((("", Full()),), 10, 90, 150, 9, 2.0)
    assert none.is_none and none.label() == "none"
    assert full.label() == "full" and full.decisions_for("b.0") == {"b.0": Full()}
    pair = Candidate((("attn", Full()),
                      ("mlp", SelectiveOps(frozenset({"aten.mm"})))), 1, 1, 1, 1, 0.1)
    assert pair.label() == "attn=full; mlp=ops[aten.mm]"
    assert set(pair.decisions_for("b.1")) == {"b.1.attn", "b.1.mlp"}
    assert full.dominates(full) and not none.dominates(full)
    with pytest.raises(ValueError, match="saved_bytes must be >= 0"):
        Candidate((), -1, 0, 0, 0, 0.0)


@pytest.fixture(scope="module")
def moe() -> tuple[nn.Module, dict[str, torch.Tensor], PlanContext]:
    """A two-block Qwen2-MoE decoder (tests/generated_models.py; d 16, two experts, a
    gated shared expert, no dropout), prepared once."""
    from generated_models import generated_model

    drawn = generated_model(2387)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return drawn.model, drawn.batch, prepare(drawn.model, drawn.batch)


def test_a_moe_block_offers_dropping_only_its_cheapest_outputs(
        moe: tuple[nn.Module, dict[str, torch.Tensor], PlanContext]) -> None:
    # The MoE sub-layer's cheapest save sets recompute only router ops (topk, sort, their
    # indices) whose inputs stay cached: the hull's cheap end (NOTE [ Candidate
    # decisions ], item 3). Its last ops (the weighted sum of the experts' outputs, read
    # only by the block's residual add after the last pack) are not recomputed by them
    # (NOTE [ Dead ops in recompute ], item 6); every save set of the MoE recomputed them.
    model, batch, context = moe
    table = context.peak_model.tables[0]
    none, full = table[0], next(c for c in table if c.label() == "full")
    freeing = [c for c in table if c.label().startswith("mlp=")
               and c.saved_bytes < none.saved_bytes]
    cheap = min(freeing, key=lambda c: c.recompute_ms)
    assert cheap.recompute_ms < 0.1 * full.recompute_ms
    # Chosen where it is cheapest: a budget it meets in one block.
    pm = context.peak_model
    choice = [0] * pm.num_blocks
    choice[0] = table.index(cheap)
    budget = pm.predict(choice)
    assert budget < context.no_checkpoint_peak_bytes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = plan(model, batch, budget=budget, context=context, simulate=True)
    assert result.recompute_ms <= cheap.recompute_ms * (1 + 1e-9)
