"""Plans for steps fake tensors cannot run: measured on a real copy (NOTE [ Planning on a
real copy ] in planning/context.py), fitting on the CPU allocator with exact gradients."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import remat
from remat.errors import RematError, RematWarning
from remat.measure.fake import fake_failure

D, VOCAB = 16, 32


class WhereMoE(nn.Module):
    """litgpt's ``LLaMAMoE`` dispatch: a top-k router, each expert's tokens picked with
    ``torch.where(mask)`` (a ``nonzero``: its output shape depends on the routing)."""

    def __init__(self, experts: int = 3, k: int = 2) -> None:
        super().__init__()
        self.k = k
        self.norm = nn.LayerNorm(D)
        self.gate = nn.Linear(D, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(D, 2 * D), nn.SiLU(), nn.Linear(2 * D, D))
            for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.norm(x).view(-1, c)
        probs, index = torch.topk(self.gate(h), self.k)
        probs = probs.softmax(dim=1)
        masks = (index.unsqueeze(-1) == torch.arange(len(self.experts))).permute(2, 0, 1)
        y = torch.zeros_like(h)
        for mask, expert in zip(masks, self.experts, strict=True):
            token, slot = torch.where(mask)
            y[token] += probs[token, slot, None] * expert(h[token])
        return x + y.view(b, t, c)


class ItemBlock(nn.Module):
    """A block that reads a value into Python (``.item()``, as JetMoE's ``.tolist()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = float(x.abs().max().item()) + 1.0
        return x + torch.tanh(self.fc(x)) / scale


class CastingBlock(nn.Module):
    """A router that converts its own weights in forward (Switch Transformers'
    ``self.classifier = self.classifier.to(self.dtype)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, D)
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.router = self.router.to(torch.float64)
        gate = torch.sigmoid(self.router(x.to(torch.float64))).to(x.dtype)
        return x + gate * self.fc(x)


class LM(nn.Module):
    def __init__(self, make: type[nn.Module], layers: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(make() for _ in range(layers))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())


def _lm(make: type[nn.Module], layers: int = 3) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return LM(make, layers).train(), torch.randint(0, VOCAB, (4, 32))


@pytest.fixture(scope="module")
def moe_plan() -> tuple[nn.Module, torch.Tensor, remat.Plan, list[str]]:
    model, ids = _lm(WhereMoE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = remat.plan(model, ids, budget="activations:70%")
    said = [str(w.message) for w in caught if issubclass(w.category, RematWarning)]
    return model, ids, plan, said


def test_where_dispatch_plans_on_a_real_copy(moe_plan) -> None:
    model, _, plan, said = moe_plan
    fallback = [s for s in said if "measuring on a real copy" in s]
    assert len(fallback) == 1 and "aten.nonzero" in fallback[0]
    assert not [s for s in said if "blocks found hold" in s]  # its layers hold the activations
    assert plan.decisions  # something is checkpointed
    assert plan.measured_peak_bytes <= plan.budget_bytes
    # the allocator's peak, first step after apply included (NOTE [ Fits on the allocator ])
    assert plan.allocator_peak_bytes is not None
    assert plan.allocator_peak_bytes <= plan.budget_bytes
    assert not any(getattr(m, "_remat_strategy", None) for m in model.modules())


def test_where_dispatch_plan_keeps_gradients_exact(moe_plan) -> None:
    model, ids, plan, _ = moe_plan
    report = remat.validate(model, ids, plan)
    assert report.max_rel_error <= 1e-6


@pytest.mark.parametrize("make", [WhereMoE, ItemBlock, CastingBlock])
def test_simulated_profile_says_why_fake_tensors_cannot_run(make: type[nn.Module]) -> None:
    model, ids = _lm(make, layers=2)
    with pytest.raises(RematError, match="simulate=False") as raised:
        remat.profile(model, ids, simulate=True)
    assert fake_failure(raised.value) is not None


def test_item_block_plans_with_exact_gradients() -> None:
    model, ids = _lm(ItemBlock, layers=2)
    with pytest.warns(RematWarning, match="real copy"):
        plan = remat.plan(model, ids, budget="activations:99%")
    assert plan.decisions
    assert plan.allocator_peak_bytes is not None
    assert plan.allocator_peak_bytes <= plan.budget_bytes
    assert remat.validate(model, ids, plan).max_rel_error <= 1e-6


def test_casting_block_plans_or_says_why() -> None:
    # Its first call converts the router: fake parameters cannot follow (a real copy is
    # measured), and a checkpointed first step that recomputes the conversion cannot
    # either: that is a remat error with its fix, never PyTorch's CheckpointError.
    model, ids = _lm(CastingBlock, layers=2)
    with pytest.warns(RematWarning, match="real copy"), \
            pytest.raises(RematError, match="run one training step before planning"):
        remat.plan(model, ids, budget="activations:99%")
    # Nothing to checkpoint: it plans, on a real copy (a small CPU model's stand-in, NOTE
    # [ A real copy standing in for the fake one ], or the fallback, which warns).
    model, ids = _lm(CastingBlock, layers=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*real copy", RematWarning)
        plan = remat.plan(model, ids, budget="100%")
    assert plan.measured_peak_bytes <= plan.budget_bytes


def test_meta_model_that_fake_tensors_cannot_run_is_refused() -> None:
    with torch.device("meta"):
        model = LM(ItemBlock, 2).train()
    ids = torch.randint(0, VOCAB, (2, 8))
    with pytest.raises(RematError, match="meta device") as raised:
        remat.plan(model, ids, budget="80%", simulate=True)
    assert "fix:" in str(raised.value)


def test_other_errors_are_not_fake_failures() -> None:
    assert fake_failure(ValueError("bad batch")) is None
    chained = RuntimeError("outer")
    chained.__cause__ = RuntimeError("Cannot swap t1 because it has weakref associated with it")
    assert fake_failure(chained) is not None
