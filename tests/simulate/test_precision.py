"""Training precisions and optimizers for simulation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remat.simulate.precision import PRECISIONS, get_precision, make_optimizer, optimizer_factory


def test_precisions() -> None:
    assert set(PRECISIONS) == {"bf16", "amp-bf16", "amp-fp16", "fp32"}
    bf16 = get_precision("bf16")
    assert (bf16.param_dtype, bf16.autocast_dtype) == (torch.bfloat16, None)
    amp = get_precision("AMP_BF16")
    assert (amp.param_dtype, amp.autocast_dtype) == (torch.float32, torch.bfloat16)
    assert amp.activation_bytes_per_element == 2
    assert get_precision("fp32").activation_bytes_per_element == 4
    assert get_precision(amp) is amp
    with pytest.raises(ValueError, match="unknown precision 'int8'"):
        get_precision("int8")


@pytest.mark.parametrize(("name", "states"), [("adamw", 2), ("adam", 2), ("sgd", 1)])
def test_optimizer_state_bytes(name: str, states: int) -> None:
    model = nn.Linear(8, 4, bias=False).to(torch.bfloat16)
    opt = make_optimizer(name, model.parameters())
    assert opt is not None and opt.defaults["foreach"] is True
    model(torch.randn(2, 8, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    tensors = [v for v in opt.state[model.weight].values()
               if isinstance(v, torch.Tensor) and v.numel() > 1]
    # States are created like the parameters: bf16 params give bf16 moments.
    assert len(tensors) == states and all(t.dtype == torch.bfloat16 for t in tensors)
    assert sum(t.nbytes for t in tensors) == states * 8 * 4 * 2


def test_none_and_unknown_optimizers() -> None:
    assert make_optimizer("none", []) is None
    assert optimizer_factory("none") is None
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        optimizer_factory("lion")
    factory = optimizer_factory("AdamW")
    assert factory is not None
    assert isinstance(factory(nn.Linear(2, 2).parameters()), torch.optim.AdamW)
