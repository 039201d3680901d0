"""Saved storages: the terms of activation_bytes, each named by the op that made it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remat.core.results import SavedStorage
from remat.measure import MemoryTracker, profile_simulated
from remat.measure.outside import cpu_rng_state_bytes
from remat.measure.saved import saved_storages
from remat.models import build_model, make_batch
from remat.strategies import apply


def test_tracker_names_each_saved_storage_by_hand() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    units = [(n, m) for n, m in model.named_modules() if n]
    tracker = MemoryTracker(blocks=units, record_saved=True)
    tracker.register_model(model)
    tracker.register([x], "batch")
    with tracker:
        loss = model(x).sum()
        tracker.set_phase("backward")
        loss.backward()
    # addmm's (3, 8) output is freed once relu returns (relu's backward needs its result);
    # the second addmm saves relu's output, already counted; the scalar loss is alive.
    assert tracker.saved_storages == (
        SavedStorage("aten.relu", (3, 8), "float32", 3 * 8 * 4, "1"),
        SavedStorage("aten.sum", (), "float32", 4, None),
    )
    assert tracker.activation_bytes == 3 * 8 * 4 + 4
    plain = MemoryTracker()
    with plain:
        loss = model(x).sum()
        plain.set_phase("backward")
    assert plain.saved_storages == () and plain.activation_bytes == tracker.activation_bytes


def test_saved_storages_sum_to_activation_bytes_with_the_rng_states() -> None:
    with torch.device("meta"):
        model = build_model("gpt-tiny")
    apply(model, "full")
    batch = make_batch("gpt-tiny", 2)
    saved = saved_storages(model, batch)
    assert sum(s.nbytes for s in saved) == profile_simulated(model, batch).activation_bytes
    states = [s for s in saved if s.op == "torch.get_rng_state"]
    assert [s.unit for s in states] == ["blocks.0", "blocks.1"]
    assert {s.nbytes for s in states} == {cpu_rng_state_bytes()}
    # each checkpointed block keeps its input: the previous block's (2, 32, 64) fp32 sum
    outputs = [s for s in saved if s.op == "aten.add" and s.unit in ("blocks.0", "blocks.1")]
    assert [(s.shape, s.nbytes) for s in outputs] == [((2, 32, 64), 2 * 32 * 64 * 4)] * 2


def test_saved_storages_refuses_an_unknown_unit() -> None:
    with torch.device("meta"):
        model = build_model("gpt-tiny")
    with pytest.raises(ValueError, match="'blocks.9' is no module"):
        saved_storages(model, make_batch("gpt-tiny", 2), units=["blocks.0", "blocks.9"])
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        SavedStorage("aten.mm", (1,), "float32", -1)
