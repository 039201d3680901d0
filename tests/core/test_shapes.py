"""The shape envelope and its buckets (NOTE [ Shape envelope ], NOTE [ Shape buckets ])."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from remat.core.shapes import ShapeEnvelope, bucket_size, check_on_new_shape

HF = {"input_ids": (8, 512), "attention_mask": (8, 512), "labels": (8, 512)}


def test_a_batch_is_inside_when_no_input_is_larger_in_any_dimension() -> None:
    env = ShapeEnvelope.of(HF)
    assert env.covers(HF)
    assert env.covers({"input_ids": (8, 100), "labels": (2, 512)})  # fewer inputs, smaller
    assert not env.covers({**HF, "input_ids": (8, 513)})
    assert not env.covers({**HF, "position_ids": (8, 512)})  # an input it never saw
    assert not env.covers({**HF, "attention_mask": (8, 1, 512, 512)})  # other dimensions
    assert env.outside({**HF, "input_ids": (9, 1024), "position_ids": (8, 512)}) == [
        "input_ids (9, 1024) > (8, 512)",
        "position_ids (8, 512): not an input of the plan's batch"]
    assert env.outside(HF) == []


def test_several_batches_are_a_union_of_boxes_not_their_largest_dimensions() -> None:
    env = ShapeEnvelope.of({"x": (8, 512)}, {"x": (16, 256)}, {"x": (4, 128)})
    assert len(env.shapes) == 2  # (4, 128) lies inside (8, 512): dropped
    assert env.covers({"x": (16, 200)}) and env.covers({"x": (8, 400)})
    assert not env.covers({"x": (16, 512)})  # never proven
    assert env.label() == "x (8, 512) or x (16, 256)"
    assert env.union(ShapeEnvelope.of({"x": (16, 512)})).shapes == ((("x", (16, 512)),),)


def test_the_envelope_round_trips_through_its_dict() -> None:
    env = ShapeEnvelope.of(HF, {"input_ids": (16, 128), "labels": (16, 128)})
    data = env.to_dict()
    assert data["shapes"][0] == {"attention_mask": [8, 512], "input_ids": [8, 512],
                                 "labels": [8, 512]}
    assert ShapeEnvelope.from_dict(data) == env


@pytest.mark.parametrize("data", [None, {"shapes": 3}, {"shapes": [{"x": ["a"]}]},
                                  {"shapes": []}])
def test_a_malformed_envelope_is_refused(data: object) -> None:
    with pytest.raises(ValueError, match=r"^ShapeEnvelope"):
        ShapeEnvelope.from_dict(data)


def test_buckets_round_up_only_the_dimensions_that_grew() -> None:
    env = ShapeEnvelope.of({"pixels": (8, 3, 224, 224), "labels": (8,)})
    assert env.bucket({"pixels": (12, 3, 300, 224), "labels": (12,)}) == (
        ("labels", (16,)), ("pixels", (16, 3, 320, 224)))
    assert [bucket_size(n) for n in (0, 1, 3, 12, 64, 65, 300, 1000, 4097)] == [
        0, 1, 4, 16, 64, 128, 320, 1024, 4160]


@given(st.integers(1, 100_000))
def test_a_bucket_holds_its_size_and_overshoots_by_less_than_both_rules(size: int) -> None:
    bucket = bucket_size(size)
    assert size <= bucket < max(2 * size, size + 64)
    assert bucket & (bucket - 1) == 0 or bucket % 64 == 0
    assert bucket_size(bucket) == bucket


def test_on_new_shape_values() -> None:
    assert check_on_new_shape("replan", api="remat.apply") == "replan"
    with pytest.raises(ValueError, match=r"^remat.apply: unknown on_new_shape 'raise'"):
        check_on_new_shape("raise", api="remat.apply")
