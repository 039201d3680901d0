"""MemoryTracker: exact bytes on a toy model, accounted by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from remat.measure import MemoryTracker, OpRecord, run_step
from remat.measure.fake import fake_copy

F32 = 4
B, D = 8, 64
ACT = B * D * F32  # one (8, 64) float32 activation: 2048 bytes
W = D * D * F32  # one (64, 64) float32 weight: 16384 bytes


def tracked_step(model, x, blocks):
    tracker = MemoryTracker(blocks=blocks)
    tracker.register_model(model)
    tracker.register([x], "batch")

    def on_phase(phase: str) -> None:
        if phase != "end":
            tracker.set_phase(phase)

    with tracker:
        run_step(model, x, on_phase=on_phase)
    return tracker


def test_activation_bytes_by_hand(toy, toy_blocks):
    model = toy(n=2)
    x = torch.randn(B, D)
    tracker = tracked_step(model, x, toy_blocks(model))
    # Forward, per block: h = x @ W.T (mm saves its input and W; x is the batch, W a param),
    # r = relu(h) (threshold_backward needs the *result* r, not h). h is saved by nobody
    # and is freed as soon as relu returns. Block 1's mm saves r0, already counted.
    # Loss: r1.float().mean() -> `.float()` of float32 is r1 itself; mean saves nothing
    # but shapes; the scalar loss (4 B) is alive when backward starts.
    saved = {"blocks.0": ACT, "blocks.1": ACT}  # r0, r1
    assert tracker.block_saved_bytes == saved
    assert tracker.activation_bytes == ACT + ACT + F32 == 4100


def test_peak_by_hand(toy, toy_blocks):
    model = toy(n=2)
    x = torch.randn(B, D)
    tracker = tracked_step(model, x, toy_blocks(model))
    # The peak is reached in backward, when block 0's weight gradient (mm, 16384 B) is
    # created: params (2 W) + batch + loss (4) + the ones_like seed of loss.backward() (4)
    # + blocks.1.fc.weight.grad (W, accumulated) + grad of block 0's pre-activation (ACT)
    # + the new weight gradient (W).
    expected = 2 * W + ACT + F32 + F32 + W + ACT + W
    assert tracker.peak_bytes == expected == 69640
    assert tracker.peak_phase == "backward"
    # After the step: params, batch and both gradients (now kind "grads"); the loss went
    # with run_step's return value.
    assert tracker.current_breakdown == {"params": 2 * W, "batch": ACT, "grads": 2 * W}


def test_backward_ops_are_seen_and_attributed(toy, toy_blocks):
    model = toy(n=2)
    tracker = tracked_step(model, torch.randn(B, D), toy_blocks(model))
    phases = {op.phase for op in tracker.ops}
    assert phases == {"forward", "backward"}
    mms = [op for op in tracker.ops if op.name == "aten.mm"]
    # 2 forward mm, then per block one weight-grad mm and (block 1 only: block 0's input
    # is the batch, which needs no gradient) one input-grad mm.
    assert [(op.phase, op.block) for op in mms] == [
        ("forward", "blocks.0"), ("forward", "blocks.1"),
        ("backward", "blocks.1"), ("backward", "blocks.1"), ("backward", "blocks.0"),
    ]
    assert all(op.flops == 2 * B * D * D for op in mms)
    views = [op for op in tracker.ops if op.name in ("aten.t", "aten.detach", "aten.expand")]
    assert views and all(op.read_bytes == op.write_bytes == 0 for op in views)


def test_views_share_one_storage():
    x = torch.randn(16, 16)
    tracker = MemoryTracker()
    with tracker:
        y = x * 2  # new storage, 1024 B
        views = [y.t(), y.view(256), y[:4], y.detach()]
        assert tracker.current_bytes == 1024 + 1024  # x discovered as "other", y once
        del y
        assert tracker.current_bytes == 2048  # the views keep y's storage alive
        del views
        assert tracker.current_bytes == 1024
    assert tracker.peak_bytes == 2048
    assert tracker.peak_breakdown == {"other": 1024, "forward": 1024}


def test_torch_tensor_is_created_not_preexisting():
    tracker = MemoryTracker()
    with tracker:
        t = torch.tensor([1.0, 2.0, 3.0])  # allocated outside dispatch, then lift_fresh
        u = t + 1
    assert tracker.current_breakdown == {"forward": 24}
    del t, u


def test_tracker_under_fake_mode_matches_real(toy, toy_blocks):
    model = toy(n=3)
    x = torch.randn(B, D)
    real = tracked_step(model, x, toy_blocks(model))
    mode = FakeTensorMode()
    fmodel = fake_copy(model, mode)
    with mode:
        fx = torch.empty(B, D)
        fake = tracked_step(fmodel, fx, toy_blocks(fmodel))
    assert (fake.peak_bytes, fake.activation_bytes) == (real.peak_bytes, real.activation_bytes)
    assert fake.block_saved_bytes == real.block_saved_bytes
    assert [(o.name, o.phase, o.flops) for o in fake.ops] == [
        (o.name, o.phase, o.flops) for o in real.ops
    ]


def test_device_filter_ignores_other_devices():
    tracker = MemoryTracker(device="meta")
    with tracker:
        a = torch.ones(100)  # cpu: not counted
        b = torch.ones(100, device="meta")  # 400 B counted
    assert tracker.current_bytes == 400
    del a, b


def test_bad_kind_and_phase_raise():
    tracker = MemoryTracker()
    with pytest.raises(ValueError,
                       match=r"(?s)^MemoryTracker.register: unknown kind.*fix: pass one of"):
        tracker.register([torch.ones(1)], "activations")
    with pytest.raises(ValueError, match="recompute is detected"):
        tracker.set_phase("recompute")
    with pytest.raises(ValueError, match=r"(?s)^OpRecord: unknown phase.*fix: pass one of"):
        OpRecord("aten.mm", "sideways", 0, 0, 0)
    with pytest.raises(ValueError, match="flops must be >= 0"):
        OpRecord("aten.mm", "forward", -1, 0, 0)


@pytest.mark.parametrize("strategy", ["none", "full"])
@pytest.mark.parametrize("simulate", [False, True])
def test_phase_peaks_hold_the_step_peak_and_the_optimizers_moment(strategy: str,
                                                                   simulate: bool) -> None:
    from remat import apply, profile
    from remat.models import build_model, make_batch

    model = apply(build_model("gpt-tiny"), strategy)
    optimizer = torch.optim.AdamW(model.parameters())
    prof = profile(model, make_batch("gpt-tiny", 2), optimizer=optimizer, timing=False,
                   simulate=simulate)
    phases = dict(prof.phase_peaks)
    assert set(phases) >= {"forward", "backward", "optimizer"}
    assert ("recompute" in phases) == (strategy == "full")
    top = max(phases, key=lambda p: (phases[p].peak_bytes, -phases[p].order))
    assert (top, phases[top].peak_bytes) == (prof.peak_phase, prof.peak_bytes)
    assert dict(phases[top].breakdown) == dict(prof.peak_breakdown)
    for phase, peak in phases.items():
        assert sum(peak.breakdown.values()) == peak.peak_bytes, phase
    # Adam's moment: parameters, gradients and its two states, plus its temporaries.
    opt = phases["optimizer"].breakdown
    assert opt["optimizer_state"] == prof.optimizer_bytes > 0
    assert opt["gradients"] == prof.grad_bytes


def test_an_op_on_dtensors_is_priced_by_its_shards() -> None:
    # a column-parallel linear of 2 ranks: rank 0's matmul is (4, 8) @ (8, 3), its
    # output 4 x 3 fp32, though the tracker meets the op with the global (8, 6) weight
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from remat.distributed.tp_step import fake_mesh

    with fake_mesh(2) as mesh:
        linear = parallelize_module(nn.Linear(8, 6, bias=False), mesh, ColwiseParallel())
        tracker = MemoryTracker()
        with tracker:
            linear(torch.ones(4, 8))
    (mm,) = [op for op in tracker.ops if op.name in ("aten.mm", "aten.t", "aten.addmm")
             and op.flops]
    assert mm.flops == 2 * 4 * 8 * 3
    assert mm.write_bytes == 4 * 3 * 4
