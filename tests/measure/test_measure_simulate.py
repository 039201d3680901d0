"""simulate=True: fake copies, and bytes equal to the real run's, exactly."""

from __future__ import annotations

import functools
import types

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from remat.measure import Profile, fake_copy, profile, profile_simulated
from remat.models import build_model, make_batch
from remat.strategies import apply

B, D = 8, 64


def assert_same_bytes(real: Profile, sim: Profile) -> None:
    assert sim.simulated and not real.simulated
    for key in ("peak_bytes", "activation_bytes", "param_bytes", "buffer_bytes", "grad_bytes",
                "optimizer_bytes", "batch_bytes", "flops", "forward_flops", "backward_flops",
                "recompute_flops"):
        assert getattr(sim, key) == getattr(real, key), key
    assert sim.peak_phase == real.peak_phase
    assert dict(sim.peak_breakdown) == dict(real.peak_breakdown)
    assert sim.blocks == real.blocks  # names, saved bytes, FLOPs (no times: timing=False)
    assert [(o.name, o.phase, o.block, o.alloc_bytes, o.read_bytes, o.write_bytes)
            for o in sim.ops] == [
        (o.name, o.phase, o.block, o.alloc_bytes, o.read_bytes, o.write_bytes)
        for o in real.ops
    ]


def test_simulate_equals_real_toy(toy):
    model = toy(n=3, checkpointed=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(B, D)
    real = profile(model, x, optimizer=opt, timing=False)
    sim = profile(model, x, optimizer=opt, simulate=True)
    assert_same_bytes(real, sim)
    assert sim.forward_ms is sim.backward_ms is sim.step_ms is None
    assert sim.recompute_flops > 0


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("strategy", ["none", "full"])
def test_simulate_equals_real_built_in(preset, strategy):
    torch.manual_seed(0)
    model = build_model(preset, dropout=0.1)
    apply(model, strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = make_batch(model, 2)
    real = profile(model, batch, optimizer=opt, timing=False)
    sim = profile(model, batch, optimizer=opt, simulate=True)
    assert_same_bytes(real, sim)
    assert (real.recompute_flops > 0) == (strategy == "full")


def test_meta_model_simulates_like_the_real_one():
    torch.manual_seed(0)
    real_model = build_model("llama-tiny")
    with torch.device("meta"):
        meta_model = build_model("llama-tiny")
    apply(meta_model, "full")
    apply(real_model, "full")
    batch = make_batch("llama-tiny", 2)
    sim = profile(meta_model, batch, simulate=True)
    real = profile(real_model, batch, timing=False)
    assert_same_bytes(real, sim)
    assert sim.device == "cpu"
    assert all(p.device.type == "meta" for p in meta_model.parameters())  # untouched


def test_fake_copy_structure():
    torch.manual_seed(0)
    model = build_model("gpt-tiny")  # tied embedding / LM head
    model.blocks[0].attn.requires_grad_(False)
    mode = FakeTensorMode()
    fake, original = fake_copy(model, mode), model
    assert fake is not original
    named = dict(fake.named_parameters())
    assert named.keys() == dict(original.named_parameters()).keys()
    for name, p in original.named_parameters():
        q = named[name]
        assert isinstance(q, nn.Parameter) and isinstance(q, FakeTensor), name
        assert (q.shape, q.dtype, q.requires_grad, q.device) == (
            p.shape, p.dtype, p.requires_grad, p.device), name
    assert sum(1 for _ in fake.parameters()) == sum(1 for _ in original.parameters())
    for (name, b), (_, c) in zip(original.named_buffers(), fake.named_buffers(), strict=True):
        assert isinstance(c, FakeTensor) and c.shape == b.shape, name
    assert fake.training == original.training


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)


def scaled_forward(module: Scaled, x: torch.Tensor, *, scale: float = 2.0) -> torch.Tensor:
    return module.fc(x) * scale


@pytest.mark.parametrize("kind", ["method", "partial"])
def test_instance_forward_survives_fake_copy(kind):
    with torch.device("meta"):
        model = nn.Sequential(Scaled(), Scaled())
    for m in model:
        if kind == "method":
            m.forward = types.MethodType(scaled_forward, m)
        else:
            m.forward = functools.partial(scaled_forward, m, scale=3.0)
    mode = FakeTensorMode()
    fake = fake_copy(model, mode)
    for m, f in zip(model, fake, strict=True):
        bound_to = f.forward.__self__ if kind == "method" else f.forward.args[0]
        assert bound_to is f and bound_to is not m
    # The overrides run on the fake parameters (the meta ones would fail on fake CPU input).
    prof = profile_simulated(model, torch.empty(B, D, device="meta"))
    assert prof.forward_flops == 2 * (2 * B * D * D)
    assert prof.ops_in("forward")[-2].name == "aten.mul"


def test_fake_device_argument():
    with torch.device("meta"):
        model = nn.Linear(D, D)
    mode = FakeTensorMode()
    fake = fake_copy(model, mode, device="cpu")
    assert fake.weight.device == torch.device("cpu")
    with mode:
        y = fake(torch.empty(B, D))
    assert y.shape == (B, D) and isinstance(y, FakeTensor)


def test_simulated_optimizer_keeps_class_and_hyperparameters(toy):
    model = toy(n=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    prof = profile(model, torch.randn(B, D), optimizer=opt, simulate=True)
    assert prof.optimizer_bytes == prof.param_bytes  # one momentum buffer per parameter
    assert not opt.state  # the real optimizer was not stepped


@pytest.mark.parametrize("strategy", ["attn", "ops"])
def test_simulate_equals_real_other_strategies(strategy):
    torch.manual_seed(0)
    model = build_model("gpt-tiny")
    apply(model, strategy)
    batch = make_batch(model, 2, 16)
    assert_same_bytes(profile(model, batch, timing=False), profile(model, batch, simulate=True))


def test_cuda_fake_device_needs_a_cuda_build():
    if torch.backends.cuda.is_built():
        pytest.skip("this PyTorch build supports fake CUDA tensors")
    with torch.device("meta"):
        model = nn.Linear(D, D)
    with pytest.raises(ValueError, match="needs a CUDA-enabled PyTorch build"):
        profile_simulated(model, torch.empty(B, D, device="meta"), device="cuda")


@pytest.mark.parametrize("strategy", ["none", "full", "ops"])
def test_simulated_steps_share_a_warm_up_and_equal_separate_profiles(strategy: str) -> None:
    from remat.measure.profile import simulated_steps
    from remat.measure.step import Step

    with torch.device("meta"):
        model = build_model("gpt-tiny")
    apply(model, strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [make_batch("gpt-tiny", b) for b in (3, 1, 2)]
    shared = simulated_steps(Step(model, batches[0], optimizer=opt), batches)
    for batch, got in zip(batches, shared, strict=True):
        alone = profile_simulated(model, batch, optimizer=opt)
        for key in ("peak_bytes", "activation_bytes", "optimizer_bytes", "flops",
                    "recompute_flops"):
            assert getattr(got, key) == getattr(alone, key), key
        assert dict(got.peak_breakdown) == dict(alone.peak_breakdown)
        assert {p: m.peak_bytes for p, m in got.phase_peaks.items()} == {
            p: m.peak_bytes for p, m in alone.phase_peaks.items()}
    with pytest.raises(ValueError, match="at least one batch"):
        simulated_steps(Step(model, batches[0]), [])
