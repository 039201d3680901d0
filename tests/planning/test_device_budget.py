"""``budget="device"``: the card's capacity less what lives outside the allocator, on the
predicted reserved peak with the workspaces (NOTE [ Fits on the card ] in card_fit.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

import remat
from remat.card_fit import card_budget
from remat.devices import DeviceSpec
from remat.models import build_model, make_batch
from remat.planning import prepare

MIB = 2**20


def _step() -> tuple[torch.nn.Module, torch.Tensor, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = build_model("gpt-tiny", max_seq_len=128)
    return model, make_batch(model, 16, 128), torch.optim.AdamW(model.parameters())


def _card(tensor_mib: int) -> DeviceSpec:
    """A card whose allocator can reserve ``tensor_mib`` MiB besides the default outside
    terms and workspaces (the estimates for an unknown card, no environment)."""
    probe = card_budget(DeviceSpec("probe", 2**40, 1e14, 1e13, 1e12, 1e10), env={})
    overhead = probe.outside_bytes + probe.workspace_bytes
    return DeviceSpec("test-card", overhead + tensor_mib * MIB, 1e14, 1e13, 1e12, 1e10)


@pytest.fixture(autouse=True)
def _no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The card's estimates read no variable of this machine."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUBLAS_WORKSPACE_CONFIG",
                 "CUDA_MODULE_LOADING", "NCCL_BUFFSIZE"):
        monkeypatch.delenv(name, raising=False)


def test_a_device_plan_keeps_its_reserved_peak_on_the_card() -> None:
    model, batch, optimizer = _step()
    card = _card(44)  # `none` reserves 56 MiB here, `full` 30 MiB (simulated)
    # one measurement for both plans below (what simulate=True prepares: fake copies only)
    context = prepare(model, batch, optimizer=optimizer, stand_in=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = remat.plan(model, batch, optimizer=optimizer, budget="device", device=card,
                          simulate=True, context=context)
    limit = card_budget(card).limit_bytes
    assert plan.budget_bytes == limit
    assert plan.reserved_peak_bytes is not None and plan.reserved_peak_bytes <= limit
    assert plan.decisions  # `none` would be over: something is checkpointed
    # The same figure from the applied plan's own simulated step
    remat.apply(model, plan)
    prof = remat.profile(model, batch, optimizer=optimizer, simulate=True)
    remat.remove(model)
    workspaces = card_budget(card).workspace_bytes
    assert prof.reserved().reserved_bytes + workspaces == plan.reserved_peak_bytes
    # On allocated bytes alone the same card's tensor bytes admit a cheaper, unfitting plan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        on_bytes = remat.plan(model, batch, optimizer=optimizer,
                              budget=card_budget(card).tensor_bytes, simulate=True,
                              context=context)
    assert on_bytes.recompute_ms <= plan.recompute_ms


def test_a_device_budget_needs_a_card() -> None:
    model, batch, optimizer = _step()
    with pytest.raises(ValueError, match="budget='device' needs a card to plan for"):
        remat.plan(model, batch, optimizer=optimizer, budget="device", simulate=True)


def test_the_throughput_search_plans_every_size_for_the_card() -> None:
    torch.manual_seed(0)
    model = build_model("gpt-tiny", max_seq_len=128, n_layer=2)
    optimizer = torch.optim.AdamW(model.parameters())
    # one sequence of 128 tokens fits with checkpointing (`none` is over), two do not: the
    # search plans the two sizes it starts with (1 fits, 2 over), a full prepare each
    card = _card(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        best = remat.plan_throughput(
            model, lambda n: make_batch(model, n, 128), budget="device", device=card,
            optimizer=optimizer, simulate=True,
            search=remat.ThroughputSearch(batch_size=1, max_batch_size=2))
    limit = card_budget(card).limit_bytes
    assert best.budget_bytes == limit
    assert best.reserved_peak_bytes is not None and best.reserved_peak_bytes <= limit
    assert best.decisions  # the chosen size checkpoints
    assert [(row.batch_size, row.fits) for row in best.throughput] == [(1, True), (2, False)]
    assert best.batch_size == 1  # the card stopped the search at its first doubling
