"""NOTE [ Dense hull for shallow models ]: shallow models get every hull vertex as a save set."""

from __future__ import annotations

import pytest

from remat.devices import get_device
from remat.strategies.base import BlockContext
from remat.strategies.builtin.ops import cut_sets_for
from remat.strategies.save_cuts import CutGraph, _hull_sets

#: Nine independent calls backward needs (kept or recomputed), cost per byte 9, 8, ..., 1
#: ms/MB: the hull keeps the dearest per byte first, one vertex per call.
N = 9
MB = 2**20
GRAPH = CutGraph(names=tuple(("aten.mul", i) for i in range(N)),
                 out_bytes=(MB,) * N, cost_ms=tuple(float(N - i) for i in range(N)),
                 reads=((),) * N, needed=frozenset(range(N)), keepable=frozenset(range(N)))


def _price(entries: frozenset[str]) -> tuple[int, float]:
    kept = frozenset(int(e.split("#")[1]) for e in entries)
    return GRAPH.price(kept)


def test_cut_sets_for_is_dense_only_for_shallow_models() -> None:
    assert [cut_sets_for(n) for n in (0, 1, 2, 4, 5, 32)] == [6, 12, 12, 12, 6, 6]


def test_a_shallow_model_gets_every_hull_vertex_with_its_exact_price() -> None:
    dense = _hull_sets(GRAPH, cut_sets_for(2))
    # Vertices keeping 1..8 calls (keeping all 9 recomputes nothing: not offered).
    assert [_price(s) for s in dense] == [
        (k * MB, float(sum(range(1, N - k + 1)))) for k in range(1, N)]
    assert dense[0] == frozenset({"aten.mul#0"})  # 9 ms/MB: kept first
    sparse = _hull_sets(GRAPH, cut_sets_for(32))
    assert len(sparse) == 6 and set(sparse) < set(dense)
    assert sparse[0] == dense[0] and sparse[-1] == dense[-1]  # both ends stay


def test_a_deep_model_gets_the_cheap_end_of_the_hull() -> None:
    # NOTE [ Save sets as minimum cuts ], item 4: the two vertices keeping the most (they
    # recompute only the cheapest calls per byte) are offered, then the rest spread out.
    dense = _hull_sets(GRAPH, cut_sets_for(2))
    sparse = _hull_sets(GRAPH, cut_sets_for(32))
    assert sparse[-2:] == dense[-2:]
    assert [_price(s) for s in sparse[-2:]] == [(7 * MB, 3.0), (8 * MB, 1.0)]
    assert [len(s) for s in sparse] == [1, 3, 4, 6, 7, 8]
    assert [len(s) for s in _hull_sets(GRAPH, 3)] == [1, 7, 8]
    assert [len(s) for s in _hull_sets(GRAPH, 2)] == [1, 8]  # both ends
    assert [len(s) for s in _hull_sets(GRAPH, 1)] == [1]


def test_block_context_refuses_a_negative_block_count() -> None:
    with pytest.raises(ValueError, match="model_blocks must be >= 0"):
        BlockContext(forward_ops=(), sublayers={}, cost_device=get_device("h100-80gb"),
                     runs_on="cpu", model_blocks=-1)
