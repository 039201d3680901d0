"""Each pitfall gives one clear warning naming the module and the fix."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from torch import nn

from remat.errors import RematWarning
from remat.models import build_model, make_batch
from remat.strategies import apply


class BNBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bn(self.lin(x)).relu()


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(BNBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def _warnings_of(fn: object) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()  # type: ignore[operator]
    return [str(w.message) for w in caught if issubclass(w.category, RematWarning)]


def test_clean_model_gives_no_warning() -> None:
    model = build_model("gpt-tiny")
    assert _warnings_of(lambda: apply(model, "full")) == []


def test_use_cache_is_turned_off_with_one_warning() -> None:
    model = build_model("gpt-tiny")
    model.config = types.SimpleNamespace(use_cache=True)  # what a HF model carries
    messages = _warnings_of(lambda: apply(model, "full"))
    assert len(messages) == 1
    assert "use_cache" in messages[0] and "set use_cache=False" in messages[0]
    assert model.config.use_cache is False


def test_hf_gradient_checkpointing_is_disabled() -> None:
    model = build_model("gpt-tiny")
    state = {"on": True}
    model.__dict__["is_gradient_checkpointing"] = True

    def disable() -> None:
        state["on"] = False
        model.__dict__["is_gradient_checkpointing"] = False

    model.__dict__["gradient_checkpointing_disable"] = disable
    messages = _warnings_of(lambda: apply(model, "full"))
    assert len(messages) == 1 and "gradient_checkpointing_disable()" in messages[0]
    assert state["on"] is False


def test_batchnorm_warning_names_modules_and_stats_update_once() -> None:
    torch.manual_seed(0)
    model = BNNet()
    reference = BNNet()
    reference.load_state_dict(model.state_dict())
    messages = _warnings_of(lambda: apply(model, "full"))
    assert len(messages) == 1
    assert "'layers.0.bn'" in messages[0] and "running statistics" in messages[0]
    x = torch.randn(4, 8)
    model(x).backward()
    reference(x).backward()
    for name, buf in reference.named_buffers():
        torch.testing.assert_close(model.get_buffer(name), buf, rtol=0, atol=0, msg=name)
    assert int(model.layers[0].bn.num_batches_tracked) == 1


def test_hooks_inside_a_region_warn_but_hooks_on_the_block_do_not() -> None:
    model = build_model("llama-tiny")
    model.blocks[0].register_forward_hook(lambda *a: None)
    assert _warnings_of(lambda: apply(model, "full")) == []
    model.blocks[1].mlp.register_forward_hook(lambda *a: None)
    messages = _warnings_of(lambda: apply(model, "full"))
    assert len(messages) == 1
    assert "'blocks.1.mlp'" in messages[0] and "fire again" in messages[0]


def test_eval_mode_and_no_grad_warn() -> None:
    model = build_model("gpt-tiny").eval()
    messages = _warnings_of(lambda: apply(model, "full"))
    assert len(messages) == 1 and "model.train()" in messages[0]
    model.train()
    with torch.no_grad():
        messages = _warnings_of(lambda: apply(model, "full"))
    assert len(messages) == 1 and "torch.no_grad()" in messages[0]


def test_frozen_model_warns() -> None:
    model = build_model("gpt-tiny").requires_grad_(False)
    messages = _warnings_of(lambda: apply(model, "sqrt"))
    assert len(messages) == 1 and "requires_grad=True" in messages[0]


def test_offload_on_cpu_is_a_noop_with_one_notice() -> None:
    model = build_model("gpt-tiny")
    messages = _warnings_of(lambda: apply(model, "offload"))
    assert len(messages) == 1 and "no-op" in messages[0]
    model(**make_batch(model, 2)).loss.backward()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offload moves tensors to host")
def test_offload_on_cuda_keeps_gradients() -> None:
    from remat.validation import validate

    model = build_model("gpt-tiny").cuda()
    assert validate(model, make_batch(model, 2), "offload").passed
