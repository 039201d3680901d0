"""The plan file envelope both frameworks' plans share (NOTE [ Plan file envelope ])."""

from __future__ import annotations

import pytest

from remat.core.plan_file import envelope, load_json, read_envelope

READ = {"framework": "torch", "versions": (1, 2), "api": "remat.Plan.from_json",
        "make": "remat.plan(...)"}


def test_the_envelope_reads_back_its_version() -> None:
    assert envelope("jax", 1) == {"format": "remat.plan", "version": 1, "framework": "jax"}
    assert read_envelope(envelope("torch", 1), **READ) == 1  # type: ignore[arg-type]
    legacy = {"format": "remat.plan", "version": 2}  # no framework: written for PyTorch
    assert read_envelope(legacy, **READ) == 2  # type: ignore[arg-type]


@pytest.mark.parametrize(("data", "first_line", "fix"), [
    ([1, 2], "remat.Plan.from_json: not a remat plan", "write plans with plan.to_json()"),
    ({"format": "other"}, "remat.Plan.from_json: not a remat plan",
     "write plans with plan.to_json()"),
    (envelope("jax", 1), "remat.Plan.from_json: this is a 'jax' plan, not a 'torch' one",
     "load it with remat.jax.Plan.from_json(...)"),
    (envelope("torch", 3), "remat.Plan.from_json: plan format version 3 is not supported",
     "re-create the plan with remat.plan(...)"),
    ({**envelope("torch", 2), "version": "2"},
     "remat.Plan.from_json: plan format version '2' is not supported", "this remat reads"),
])
def test_each_wrong_envelope_names_the_reader_and_the_fix(data: object, first_line: str,
                                                          fix: str) -> None:
    with pytest.raises(ValueError) as info:
        read_envelope(data, **READ)  # type: ignore[arg-type]
    lines = str(info.value).splitlines()
    assert lines[0] == first_line and fix in "\n".join(lines[1:])


def test_bad_json_names_the_reader() -> None:
    with pytest.raises(ValueError, match=r"^remat.jax.Plan.from_json: not valid JSON\n"):
        load_json("{", api="remat.jax.Plan.from_json")
