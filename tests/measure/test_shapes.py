"""A batch's tensor inputs by path, as the model's call receives them, and a batch grown to a
shape bucket (remat/measure/shapes.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from remat.measure.shapes import batch_envelope, batch_shapes, call_shapes, grown_call


class Pair(nn.Module):
    def forward(self, pair: Any, mask: torch.Tensor | None = None, *rest: Any,
                **extra: Any) -> torch.Tensor:
        return torch.zeros(())


def test_nested_batches_name_each_tensor_by_its_path() -> None:
    model = Pair()
    batch = ({"a": torch.zeros(2, 3), "b": [torch.zeros(4), 7, None]}, torch.zeros(2, 5),
             torch.zeros(1, 1), "text")
    assert batch_shapes(model, batch) == {"pair.a": (2, 3), "pair.b.0": (4,),
                                          "mask": (2, 5), "args.2": (1, 1)}
    # keywords and positions name the same input; scalars and non-tensors are not inputs
    assert call_shapes((), {"pair": torch.zeros(2), "num_items_in_batch": torch.tensor(9),
                            "use_cache": False}, ("pair", "mask")) == {"pair": (2,)}
    assert batch_shapes(model, torch.zeros(3, 4)) == {"pair": (3, 4)}


def test_hf_style_batches_and_their_envelope() -> None:
    class Lm(nn.Module):
        def forward(self, input_ids: torch.Tensor, attention_mask: Any = None,
                    labels: Any = None) -> torch.Tensor:
            return torch.zeros(())

    ids = torch.zeros(2, 16, dtype=torch.long)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    env = batch_envelope(Lm(), batch, {"input_ids": ids[:, :8], "labels": ids[:, :8]})
    assert env.shapes == ((("attention_mask", (2, 16)), ("input_ids", (2, 16)),
                           ("labels", (2, 16))),)
    assert env.covers(call_shapes((ids[:1],), {"labels": ids[:1]}, ("input_ids",)))


def test_a_grown_batch_repeats_its_own_slices() -> None:
    ids = torch.arange(6).reshape(2, 3)
    grown = grown_call((ids,), {"labels": ids}, ("input_ids",),
                       (("input_ids", (4, 5)), ("labels", (4, 5))))
    assert isinstance(grown, dict) and set(grown) == {"input_ids", "labels"}
    assert grown["input_ids"].tolist() == [[0, 1, 2, 0, 1], [3, 4, 5, 3, 4],
                                           [0, 1, 2, 0, 1], [3, 4, 5, 3, 4]]
    assert grown_call((ids,), {}, ("x",)) == (ids,)  # no target: the call's own batch
    with pytest.raises(ValueError, match="keyword and unnamed positional"):
        grown_call((ids, ids), {"y": ids}, ("x",))
