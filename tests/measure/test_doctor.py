"""``remat.doctor`` on CPU jobs that leak in each of the seeds' ways, and on healthy ones.

Each leaking job is tiny; the bytes are exact: a kept loss is 4 B, a kept graph holds what
the step's forward saved, a growing list holds one (4, 64) float32 tensor per forward.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import remat
from generated_models import generated_model
from remat.core.cost import Category
from remat.core.doctor import Cause
from tiny_nets import D, Net

BATCH = 4
ROW_BYTES = BATCH * D * 4  # one (4, 64) float32 tensor


class Remember(nn.Module):
    """A block that appends its output to a list on every forward (state that grows)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        self.seen.append(y.detach())
        return torch.relu(y)


class Growing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Remember(), Remember()])
        self.out = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x).mean()


@pytest.fixture
def job() -> tuple[Net, torch.Tensor, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    return model, torch.randn(BATCH, D), torch.optim.AdamW(model.parameters())


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_healthy_job_is_healthy_and_its_steady_peak_is_the_profiles(job) -> None:
    model, x, opt = job
    before = [p.detach().clone() for p in model.parameters()]
    report = remat.doctor(model, x, optimizer=opt)
    assert report.healthy and report.findings == ()
    state = 2 * _param_bytes(model) + 4 * len(before)  # AdamW: two moments, a float32 step
    first, *steady = report.steps
    assert first.growth == {"optimizer state": state}
    assert all(s.growth == {} and s.held_bytes == {} for s in steady)
    assert {s.peak_bytes for s in steady} == {
        remat.profile(model, x, optimizer=opt, timing=False).peak_bytes}
    assert steady[0].peak_breakdown[Category.OPTIMIZER_STATE] == state
    assert first.peak_breakdown[Category.OPTIMIZER_STATE] == state  # made in step 1
    assert set(steady[0].peak_blocks) <= {"blocks.0", "blocks.1"}
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not opt.state and all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("seed", [3, 11])
def test_generated_hf_decoders_are_healthy(seed: int) -> None:
    drawn = generated_model(seed, seq=16)
    opt = torch.optim.AdamW(drawn.model.parameters())
    report = remat.doctor(drawn.model, drawn.batch, optimizer=opt, steps=3)
    assert report.healthy, (drawn.label, report.findings)
    assert report.steps[1].peak_bytes == report.steps[2].peak_bytes, drawn.label


def _no_zero_grad(model: nn.Module, batch: torch.Tensor, optimizer: torch.optim.Optimizer
                  ) -> None:
    model(batch).backward()
    optimizer.step()


@pytest.mark.parametrize("how", ["emulated", "step_fn"])
def test_gradients_never_cleared(job, how: str) -> None:
    model, x, opt = job
    report = (remat.doctor(model, x, optimizer=opt, zero_grad=False) if how == "emulated"
              else remat.doctor(model, x, optimizer=opt, step_fn=_no_zero_grad))
    assert not report.healthy
    (finding,) = report.findings
    grads = _param_bytes(model)
    assert finding.cause is Cause.GRADIENTS_KEPT and finding.size_bytes == grads
    assert finding.step == 2 and "never cleared" in finding.detail
    assert [s.held_bytes for s in report.steps[1:]] == [{"gradients": grads}] * 3
    assert report.steps[0].held_bytes == {}


def test_gradients_zeroed_but_kept(job) -> None:
    model, x, opt = job

    def step(model: nn.Module, batch: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        model(batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    (finding,) = remat.doctor(model, x, optimizer=opt, step_fn=step).findings
    assert finding.cause is Cause.GRADIENTS_KEPT and "set_to_none=False" in finding.detail


def test_zero_grad_before_the_forward_is_healthy(job) -> None:
    model, x, opt = job

    def step(model: nn.Module, batch: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad()  # the gradients are alive between steps, freed before the peak
        model(batch).backward()
        optimizer.step()

    report = remat.doctor(model, x, optimizer=opt, step_fn=step)
    assert report.healthy and report.findings == ()


def _keeping_losses(losses: list[torch.Tensor]) -> Callable[..., None]:
    """A training step that appends each step's loss tensor (not ``loss.item()``) to
    ``losses``: a user's list keeping one graph output per step alive."""
    def step(model: nn.Module, batch: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        loss = model(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss)
    return step


def test_loss_kept_in_a_list(job) -> None:
    model, x, opt = job
    losses: list[torch.Tensor] = []
    report = remat.doctor(model, x, optimizer=opt, step_fn=_keeping_losses(losses))
    (finding,) = report.findings
    assert finding.cause is Cause.OUTPUTS_KEPT
    assert finding.holder == "losses in test_loss_kept_in_a_list() (list)"
    assert (finding.growth_bytes, finding.size_bytes, finding.step) == (4, 16, 1)
    assert [s.growth_bytes for s in report.steps[1:]] == [4, 4, 4]


def test_a_dead_weak_proxy_in_the_process_is_no_holder(job) -> None:
    # gc.get_objects() lists weakref proxies; isinstance on a dead one raises ReferenceError
    # (left by whatever ran earlier in the process: the suite's order decides)
    import weakref

    class Gone:
        pass

    gone = Gone()
    dead = weakref.proxy(gone)
    del gone
    model, x, opt = job
    losses: list[torch.Tensor] = []
    report = remat.doctor(model, x, optimizer=opt, step_fn=_keeping_losses(losses))
    assert [f.holder for f in report.findings] == [
        "losses in test_a_dead_weak_proxy_in_the_process_is_no_holder() (list)"]
    assert type(dead) in weakref.ProxyTypes


def test_graph_kept_alive_holds_what_the_forward_saved(job) -> None:
    model, x, _ = job
    kept = []

    def step(model: nn.Module, batch: torch.Tensor) -> None:
        model(batch).backward()
        model.zero_grad()
        kept.append(model(batch))  # an output whose graph is never backpropagated

    report = remat.doctor(model, x, step_fn=step)
    grows = {f.holder: f.growth_bytes for f in report.findings}
    assert {f.cause for f in report.findings} == {Cause.OUTPUTS_KEPT}
    saved = remat.profile(model, x, timing=False).activation_bytes  # the loss included
    assert grows == {"kept in test_graph_kept_alive_holds_what_the_forward_saved() (list)": 4,
                     "graph of kept in test_graph_kept_alive_holds_what_the_forward_saved() "
                     "(list)": saved - 4}


def test_module_state_grows_every_forward() -> None:
    torch.manual_seed(0)
    report = remat.doctor(Growing(), torch.randn(BATCH, D))
    assert not report.healthy
    found = {f.holder: (f.cause, f.growth_bytes, f.size_bytes) for f in report.findings}
    assert found == {f"blocks.{i}.seen": (Cause.STATE_GROWS, ROW_BYTES, 4 * ROW_BYTES)
                     for i in (0, 1)}
    assert report.steps[-1].held_bytes == {"blocks.0.seen": 3 * ROW_BYTES,
                                           "blocks.1.seen": 3 * ROW_BYTES}


def test_module_state_grows_in_recomputation_too() -> None:
    torch.manual_seed(0)
    model = Growing()
    remat.apply(model, "full")
    report = remat.doctor(model, torch.randn(BATCH, D))
    found = {f.holder: (f.cause, f.growth_bytes) for f in report.findings}
    assert found == {f"blocks.{i}.seen": (Cause.RECOMPUTE_GROWS, 2 * ROW_BYTES) for i in (0, 1)}
    assert "is_recomputing" in report.findings[0].fix


def test_bad_arguments(job) -> None:
    model, x, _ = job
    with pytest.raises(ValueError, match=r"^remat.doctor: nothing to examine"):
        remat.doctor()
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        remat.doctor(model, x, steps=0)
    with pytest.raises(ValueError, match="step_fn is your own"):
        remat.doctor(model, x, step_fn=_no_zero_grad, loss_fn=lambda out, b: out)
    with pytest.raises(TypeError, match="step_fn must be callable"):
        remat.doctor(model, x, step_fn=3)
    model.eval()
    with pytest.raises(ValueError, match="eval mode"):
        remat.doctor(model, x)


def test_reserved_bytes_growing_while_allocated_bytes_do_not_is_fragmentation() -> None:
    from remat.core.doctor import DoctorStep
    from remat.measure.doctor import _fragmentation

    mib = 1 << 20

    def row(step: int, reserved: int, expandable: int) -> DoctorStep:
        return DoctorStep(step, 0, 10 * mib, 0, "backward", reserved_bytes=reserved * mib,
                          allocated_bytes=10 * mib, expandable_reserved_bytes=expandable * mib)

    (finding,) = _fragmentation((row(1, 20, 12), row(2, 40, 12), row(3, 60, 12), row(4, 80, 12)))
    assert finding.cause is Cause.FRAGMENTATION and finding.severity == "error"
    assert (finding.size_bytes, finding.growth_bytes) == (40 * mib, 20 * mib)
    assert "expandable_segments:True" in finding.fix
    (advice,) = _fragmentation((row(1, 1024, 300), row(2, 1024, 300), row(3, 1024, 300)))
    assert advice.severity == "advice" and advice.size_bytes == 724 * mib
    assert _fragmentation((row(1, 20, 20), row(2, 20, 20), row(3, 20, 20))) == []
