"""A real copy standing in for the fake one (NOTE [ A real copy standing in for the fake
one ] in planning/context.py): the same measurements, the user's RNG untouched, and only
where a real copy is cheaper."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import remat
from remat.models import build_model, make_batch
from remat.planning import context as planning_context
from remat.planning.context import prepare
from remat.planning.copy_cost import fake_seconds, real_seconds
from tiny_nets import D, net


class _ScaledBlock(torch.nn.Module):
    """A residual MLP block that scales by a constant made in its forward with
    ``torch.tensor`` (as T5's relative position buckets are): an ``aten.lift_fresh``, which
    a fake mode answers with a fake copy and a real tensor with itself."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(D, 4 * D), torch.nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(0.5)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x))) * scale


def _model(which: str) -> tuple[torch.nn.Module, Any]:
    if which == "tensor-constant":
        model = net()
        model.blocks = torch.nn.ModuleList([_ScaledBlock(), _ScaledBlock()])
        return model, torch.randn(2, 16, D, generator=torch.Generator().manual_seed(0))
    if which == "llama-tiny":
        torch.manual_seed(0)
        model = build_model("llama-tiny")
        return model, make_batch(model, 2)
    from generated_models import generated_model

    drawn = generated_model(int(which.removeprefix("generated-")))
    return drawn.model, drawn.batch


# llama-tiny: remat's own decoder (SDPA kept by ops save sets: a random op under SAC);
# seed 1: a Qwen2 with attention dropout; seed 2: an OLMoE (data-dependent routing);
# tensor-constant: a forward that makes a tensor of Python data (NOTE [ Bytes moved ]).
@pytest.mark.parametrize("which", ["llama-tiny", "generated-1", "generated-2",
                                   "tensor-constant"])
def test_a_stand_in_measures_what_the_fake_copy_measures(which: str) -> None:
    model, batch = _model(which)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fake = prepare(model, batch, stand_in=False)
        rng = torch.get_rng_state()
        real = prepare(model, batch)
    assert fake.setup is not None and not fake.setup.real
    assert real.setup is not None and real.setup.stand_in and real.setup.real
    assert torch.equal(torch.get_rng_state(), rng)  # the user's generator did not move
    # Every candidate of every block, the windows and the calibration: byte for byte.
    assert real.peak_model == fake.peak_model
    assert real.builtin == fake.builtin
    assert (real.no_checkpoint_peak_bytes, real.static_bytes) == \
        (fake.no_checkpoint_peak_bytes, fake.static_bytes)


def test_a_model_over_the_copy_limit_or_simulated_is_measured_on_fake_tensors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Which copy is measured on is decided from the model's size and the flag, never its
    # architecture: tiny_nets' two MLP blocks (a few ops a step, so each fake prepare costs
    # a fraction of a decoder's) are what a real copy would stand in for, as checked first.
    # 256 tokens: the activations are most of the step, so "activations:80%" is plannable.
    model = net()
    batch = torch.randn(2, 256, D, generator=torch.Generator().manual_seed(0))
    default = prepare(model, batch)
    assert default.setup is not None and default.setup.stand_in and default.setup.real
    monkeypatch.setattr(planning_context, "STAND_IN_MAX_BYTES", 0)
    ctx = prepare(model, batch)
    assert ctx.setup is not None and not ctx.setup.real
    monkeypatch.undo()

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("simulate=True planned on a real copy")

    monkeypatch.setattr(planning_context, "stand_in_setup", refused)
    plan = remat.plan(model, batch, budget="activations:80%", simulate=True)
    assert plan.budget_bytes > 0


def test_a_real_copy_is_priced_by_its_work_not_the_clock() -> None:
    # 100 small ops: real arithmetic is cheaper than faking them; 1e12 FLOPs is not.
    assert real_seconds(100, 10**8, threads=1) < fake_seconds(100)
    assert real_seconds(100, 10**12, threads=1) > fake_seconds(100)
    assert real_seconds(100, 10**12, threads=4) < real_seconds(100, 10**12, threads=1)
