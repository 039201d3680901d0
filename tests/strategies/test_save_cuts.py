"""Save sets as minimum cuts (NOTE [ Save sets as minimum cuts ])."""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from remat.core.op_record import OpRecord
from remat.devices import get_device
from remat.measure.flops import op_flops, op_traffic
from remat.recompute import is_recomputing
from remat.strategies.dead_ops import supported
from remat.strategies.op_graph import block_graphs
from remat.strategies.regions import install_checkpoint, uninstall
from remat.strategies.save_cuts import (
    CutGraph,
    _first_step,
    _hull_sets,
    cut_graph,
    cut_save_sets,
    with_cut_sets,
)

H100 = get_device("h100-80gb")


@st.composite
def graphs(draw: Any) -> CutGraph:
    """Random op graphs: each call reads earlier ones; keepable calls have bytes."""
    n = draw(st.integers(min_value=1, max_value=7))
    out_bytes = tuple(draw(st.integers(min_value=0, max_value=64)) for _ in range(n))
    cost_ms = tuple(float(draw(st.integers(min_value=0, max_value=20))) for _ in range(n))
    reads = tuple(tuple(sorted(draw(st.sets(st.integers(0, o - 1), max_size=3))) if o else ())
                  for o in range(n))
    needed = frozenset(draw(st.sets(st.integers(0, n - 1), min_size=1)))
    keepable = frozenset(o for o in draw(st.sets(st.integers(0, n - 1))) if out_bytes[o] > 0)
    return CutGraph(tuple(("aten.op", o) for o in range(n)), out_bytes, cost_ms, reads,
                    needed, keepable)


def _every_kept_set(cut: CutGraph) -> list[tuple[frozenset[int], int, float]]:
    keepable = sorted(cut.keepable)
    sets = (frozenset(c) for k in range(len(keepable) + 1)
            for c in itertools.combinations(keepable, k))
    return [(kept, *cut.price(kept)) for kept in sets]


@settings(max_examples=150, deadline=None)
@given(cut=graphs(), lam=st.sampled_from([0.01, 0.1, 0.3, 1.0, 3.0, 10.0]))
def test_the_cut_finds_the_cheapest_kept_set(cut: CutGraph, lam: float) -> None:
    best = min(lam * nbytes + ms for _, nbytes, ms in _every_kept_set(cut))
    kept, nbytes, ms = cut.solve(lam)
    assert kept <= cut.keepable
    assert cut.price(kept) == pytest.approx((nbytes, ms))
    scale = 1.0 + sum(cut.cost_ms) + lam * sum(cut.out_bytes)
    assert lam * nbytes + ms == pytest.approx(best, abs=1e-6 * scale)


def _lower_hull(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """Vertices of the lower-left convex hull (bytes up, ms down), collinear ones dropped."""
    best: dict[int, float] = {}
    for nbytes, ms in points:
        best[nbytes] = min(ms, best.get(nbytes, ms))
    hull: list[tuple[int, float]] = []
    for b, c in sorted(best.items()):
        if hull and c >= hull[-1][1] - 1e-9:
            continue  # more bytes for no less recompute
        while len(hull) >= 2:
            (b1, c1), (b2, c2) = hull[-2], hull[-1]
            if (c2 - c1) * (b - b1) >= (c - c1) * (b2 - b1) - 1e-9:
                hull.pop()  # the middle point is not below the chord
            else:
                break
        hull.append((b, c))
    return hull


@settings(max_examples=150, deadline=None)
@given(cut=graphs())
def test_the_sweep_finds_every_vertex_of_the_hull(cut: CutGraph) -> None:
    want = _lower_hull([(b, c) for _, b, c in _every_kept_set(cut)])
    got = {(b, round(c, 6)) for _, b, c in cut.hull()}
    assert {(b, round(c, 6)) for b, c in want} <= got
    assert len(got) <= len(want) + 2  # the two ends may be collinear with a vertex


def test_a_collinear_cheap_end_offers_its_smallest_drop() -> None:
    """Item 5 of the NOTE: three outputs that each cost 0.1 ms per byte to redo put the
    whole hull on one line from keeping all to keeping none; the drop of the smallest is
    offered as well, so a plan needing 10 bytes frees 10, not 60."""
    cut = CutGraph(tuple(("aten.op", o) for o in range(3)), (10, 20, 30), (1.0, 2.0, 3.0),
                   ((), (), ()), frozenset(range(3)), frozenset(range(3)))
    assert [nbytes for _, nbytes, _ in cut.hull()] == [60, 0]  # no vertex between
    step = _first_step(cut, cut.hull())
    assert step == (frozenset({1, 2}), 50, 1.0)
    assert frozenset({"aten.op#1", "aten.op#2"}) in _hull_sets(cut, max_sets=6)


@settings(max_examples=150, deadline=None)
@given(cut=graphs())
def test_the_first_step_lies_on_the_first_edge_one_drop_from_the_top(cut: CutGraph) -> None:
    hull = cut.hull()
    step = _first_step(cut, hull)
    if step is None:
        return
    (top, top_bytes, top_ms), (_, next_bytes, next_ms) = hull[0], hull[1]
    kept, nbytes, ms = step
    assert len(top - kept) == 1 and kept < top
    assert cut.price(kept) == pytest.approx((nbytes, ms))
    assert next_bytes < nbytes < top_bytes and ms > top_ms
    slope = (next_ms - top_ms) / (top_bytes - next_bytes)
    assert ms - top_ms == pytest.approx(slope * (top_bytes - nbytes), rel=1e-6, abs=1e-9)
    offered = _hull_sets(cut, max_sets=6)
    assert frozenset(f"aten.op#{o}" for o in kept) in offered


# -- on a real region -----------------------------------------------------------------------

class Rotary(nn.Module):
    """Llama-style attention: projections viewed into heads, rotary q and k, SDPA."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.v, self.o = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)

    @staticmethod
    def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        shape = (b, s, self.heads, d // self.heads)
        q, k, v = (proj(x).view(shape).transpose(1, 2) for proj in (self.q, self.k, self.v))
        angles = torch.arange(s, dtype=x.dtype)[:, None] * torch.linspace(0, 1, d // self.heads)
        cos, sin = angles.cos(), angles.sin()
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, d))


class _Ops(TorchDispatchMode):
    """Each aten call as an OpRecord; ``recompute=True`` keeps only calls that recompute."""

    def __init__(self, recompute: bool = False) -> None:
        super().__init__()
        self.recompute = recompute
        self.ops: list[OpRecord] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.recompute and not is_recomputing():
            return out
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
        keys = {t.untyped_storage().data_ptr() for t in ins}
        aliases = bool(outs) and all(t.untyped_storage().data_ptr() in keys for t in outs)
        read, write, dtype_bytes = op_traffic(func, ins, outs, aliases_only=aliases)
        self.ops.append(OpRecord(str(func.overloadpacket), "forward",
                                 op_flops(func.overloadpacket, args, kwargs, out),
                                 read, write, None, dtype_bytes))
        return out


def _grads(module: nn.Module, x: Tensor) -> list[Tensor]:
    loss = module(x).square().sum()
    return list(torch.autograd.grad(loss, [x, *module.parameters()]))


@pytest.mark.skipif(not supported(), reason="SAC without storage by call index")
def test_each_cut_save_set_recomputes_what_the_model_says_with_exact_gradients() -> None:
    torch.manual_seed(0)
    module, x = Rotary(), torch.randn(2, 16, 32, requires_grad=True)
    reference = _grads(module, x)
    graph = block_graphs(module, (x,), {}, {})[""]
    with _Ops() as forward:
        module(x)
    install_checkpoint(module)
    try:
        with _Ops(recompute=True) as full:
            _grads(module, x)
    finally:
        uninstall(module)
    cut = cut_graph(graph, forward.ops, H100, full.ops)
    assert cut is not None
    sets = cut_save_sets(graph, forward.ops, H100, recomputed=full.ops, max_sets=100)
    assert len(sets) >= 3
    by_entry = {f"{name}#{index}": o for o, (name, index) in enumerate(cut.names)}
    computing = {op.name for op in forward.ops if op.write_bytes > 0}
    for save in sets:
        kept = frozenset(by_entry[e] for e in save)
        predicted = Counter(cut.names[o][0] for o in cut.recomputed(kept)
                            if cut.names[o][0] in computing)
        install_checkpoint(module, label="ops", save_ops=save)
        try:
            with _Ops(recompute=True) as ran:
                grads = _grads(module, x)
        finally:
            uninstall(module)
        assert Counter(op.name for op in ran.ops if op.name in computing) == predicted, save
        for got, want in zip(grads, reference, strict=True):
            assert torch.equal(got, want)
    # The rotary outputs kept without their projections: the q and k matmuls are dead
    # (their views no longer keep them live), only v's runs again.
    rotary = [s for s in sets if not any(e.startswith("aten.mm") for e in s)]
    assert rotary
    kept = frozenset(by_entry[e] for e in rotary[0])
    assert [cut.names[o][0] for o in cut.recomputed(kept)].count("aten.mm") == 1


@pytest.mark.skipif(not supported(), reason="SAC without storage by call index")
def test_offered_sets_are_the_chain_and_the_cuts_less_the_beaten() -> None:
    torch.manual_seed(0)
    module, x = Rotary(), torch.randn(2, 16, 32, requires_grad=True)
    graph = block_graphs(module, (x,), {}, {})[""]
    with _Ops() as forward:
        module(x)
    cut = cut_graph(graph, forward.ops, H100)
    assert cut is not None
    by_entry = {f"{name}#{index}": o for o, (name, index) in enumerate(cut.names)}
    # With the rotary outputs cached the q projection is dead: caching it too costs
    # bytes and saves nothing.
    wasteful = frozenset({"aten.add#0", "aten.add#1", "aten.mm#0"})
    chain = [wasteful, frozenset({"aten.mm#0", "aten.mm#1", "aten.mm#2"})]
    offered = with_cut_sets(graph, forward.ops, H100, chain)
    cuts = cut_save_sets(graph, forward.ops, H100)
    assert frozenset({"aten.add#0", "aten.add#1"}) in cuts and wasteful not in offered
    assert set(offered) <= set(chain) | set(cuts) and set(cuts) <= set(offered)
    prices = [cut.price(frozenset(by_entry[e] for e in s)) for s in offered]
    for a in prices:  # none beats another
        assert not any(b != a and b[0] <= a[0] and b[1] <= a[1] for b in prices)
    assert with_cut_sets(None, forward.ops, H100, chain) == chain
