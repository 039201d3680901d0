"""remat.validate: reports, tolerance, and leaving the model as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remat.core.parity import ParityReport
from remat.errors import ParityError
from remat.models import build_model, make_batch
from remat.strategies import applied, apply
from remat.validation import relative_error, validate


def test_relative_error() -> None:
    ref = torch.tensor([1.0, -4.0, 2.0])
    assert relative_error(ref, ref) == 0.0
    assert relative_error(ref + torch.tensor([0.0, 0.4, 0.0]), ref) == pytest.approx(0.1)
    assert relative_error(torch.zeros(2), torch.zeros(2)) == 0.0


def test_report_fields_and_model_left_unchanged() -> None:
    torch.manual_seed(0)
    model = apply(build_model("gpt-tiny", dropout=0.1), "every:2")
    before = applied(model)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    report = validate(model, make_batch(model, 2), "ops")
    assert report.passed and report.strategy == "ops"
    assert set(report.per_param_rel_error) == {n for n, _ in model.named_parameters()}
    assert report.loss == report.loss_ref
    assert applied(model) == before
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n])


class Drifting(nn.Module):
    """A block whose forward depends on how often it ran: recompute differs from forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x) * (1.0 + 0.5 * (self.calls % 2))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Drifting() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x).tanh()
        return x.square().sum()


def test_failure_is_reported_and_raised() -> None:
    torch.manual_seed(0)
    report = validate(Net(), torch.randn(3, 4), "full")
    assert not report.passed
    assert report.worst_param.startswith("layers.")
    with pytest.raises(ParityError, match="changes gradients"):
        report.raise_if_failed()


def test_report_validates_rtol() -> None:
    with pytest.raises(ValueError, match="rtol must be > 0"):
        ParityReport("full", 1.0, 1.0, 0.0, 0.0, "", {}, rtol=0.0)


def test_validate_leaves_hf_checkpointing_and_kv_cache_as_it_found_them() -> None:
    """validate used to turn HF checkpointing off for good (next run: OOM)."""
    import warnings

    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.gradient_checkpointing_enable()
        model.config.use_cache = True
        ids = torch.randint(0, 64, (2, 8))
        report = validate(model, {"input_ids": ids, "labels": ids}, "full")
        assert report.passed
        # transformers renamed is_gradient_checkpointing (5.17 has only that name)
        name = ("is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing")
                else "is_gradient_checkpointing")
        assert getattr(model, name) is True
    assert model.config.use_cache is True
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
