"""Kernel scratch: the formula and the probes of remat/measure/scratch.py against the CPU
allocator (NOTE [ Kernel scratch measured by probes ])."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from remat.measure import profile, scratch
from remat.measure.allocator import allocator_peak
from remat.measure.profile import allocator_step_peak
from remat.measure.step import Step, clear_grads, run_step

CONV = torch.ops.aten.convolution.default


def _conv_call(channels: int = 8) -> tuple[object, ...]:
    x = torch.randn(2, channels, 16, 16)
    w = torch.randn(2 * channels, channels, 3, 3)
    return (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)


@pytest.fixture(autouse=True)
def _empty_cache() -> Iterator[None]:
    scratch.clear_probes()
    yield
    scratch.clear_probes()


class _Net(nn.Module):
    """A ResNet-style CNN: conv-BN-ReLU stem, one residual block, pooling, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.MaxPool2d(2))
        self.block = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.GroupNorm(4, 16),
                                   nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        h = torch.relu(h + self.block(h))
        return self.head(nn.functional.adaptive_avg_pool2d(h, 1).flatten(1))  # type: ignore[no-any-return]


def _vit() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    model = transformers.ViTForImageClassification(transformers.ViTConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        image_size=16, patch_size=4, num_labels=10))
    return model, {"pixel_values": torch.randn(2, 3, 16, 16), "labels": torch.tensor([1, 2])}


def _cnn() -> tuple[nn.Module, torch.Tensor]:
    return _Net(), torch.randn(4, 3, 16, 16)


def _gap(model: nn.Module, batch: object) -> tuple[int, int]:
    prof = profile(model, batch, timing=False)
    static = prof.param_bytes + prof.buffer_bytes + prof.batch_bytes
    clear_grads(model)
    run_step(model, batch)  # warm-up, as the tracked step had
    return prof.peak_bytes, allocator_step_peak(Step(model, batch), static)


@pytest.mark.parametrize("build", [_cnn, _vit], ids=["cnn", "vit"])
def test_profile_matches_the_allocator_within_a_thousandth(build: object) -> None:
    torch.manual_seed(0)
    model, batch = build()  # type: ignore[operator]
    model.train()
    tracked, allocated = _gap(model, batch)
    assert abs(tracked - allocated) <= allocated // 1000, (tracked, allocated)


def test_without_probes_the_cnn_reads_low(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the probes add: the same CNN without them misses its convolution scratch."""
    monkeypatch.setattr(scratch, "MAX_PROBES", 0)
    torch.manual_seed(0)
    model, batch = _cnn()
    tracked, allocated = _gap(model, batch)
    assert allocated - tracked > allocated // 1000, (tracked, allocated)


def test_a_probe_is_the_allocator_peak_above_the_outputs() -> None:
    call = _conv_call()
    kept: list[torch.Tensor] = []
    truth = allocator_peak(lambda: kept.append(CONV(*call)))
    out = kept[0]
    probed = scratch.probe_scratch(CONV, call, {}, out)
    assert probed == truth.peak_bytes - out.nbytes > 0


def test_probes_are_cached_by_call_key() -> None:
    call = _conv_call()
    out = CONV(*call)
    assert scratch.probe_scratch(CONV, call, {}, out, probe=False) == 0  # cache only: empty
    first = scratch.probe_scratch(CONV, call, {}, out)
    assert scratch._probes[0] == 1
    same_layout = (torch.randn(2, 8, 16, 16), *call[1:])
    assert scratch.probe_scratch(CONV, same_layout, {}, out) == first
    assert scratch._probes[0] == 1  # read from the cache
    scratch.probe_scratch(CONV, _conv_call(4), {}, CONV(*_conv_call(4)))
    assert scratch._probes[0] == 2  # another shape: probed


def test_a_call_that_allocated_nothing_reads_no_probe_but_keeps_its_formula() -> None:
    call = _conv_call()
    out = CONV(*call)
    probed = scratch.scratch_bytes(CONV, call, {}, out, probe=True)
    assert probed > 0 and scratch._probes[0] == 1
    assert scratch.scratch_bytes(CONV, call, {}, out, allocated=False) == 0
    assert scratch.scratch_bytes(CONV, call, {}, out, tensors=[*call[:2], out]) == probed
    softmax = torch.ops.aten._safe_softmax.default
    x = torch.randn(2, 8)
    formula = scratch.scratch_bytes(softmax, (x, -1), {}, softmax(x, -1))
    assert formula == 22  # 16 bools + 2 row flags + a 4-byte 0-dim tensor
    assert scratch.scratch_bytes(softmax, (x, -1), {}, softmax(x, -1), allocated=False) == 22


def test_fake_tensors_never_probe_nor_read_the_cache() -> None:
    call = _conv_call()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in call)
        fake_out = CONV(*fake)
        assert scratch.probe_scratch(CONV, fake, {}, fake_out) == 0
    assert scratch._probes[0] == 0
    real = scratch.probe_scratch(CONV, call, {}, CONV(*call))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in call)
        assert scratch.probe_scratch(CONV, fake, {}, CONV(*fake)) == 0 < real
    assert scratch._probes[0] == 1


def test_a_simulated_profile_does_not_depend_on_what_ran_before() -> None:
    torch.manual_seed(0)
    model, batch = _cnn()
    before = profile(model, batch, timing=False, simulate=True).peak_bytes
    real = profile(model, batch, timing=False).peak_bytes  # probes the convolutions
    after = profile(model, batch, timing=False, simulate=True).peak_bytes
    assert before == after < real  # the simulation leaves out the probed scratch


def test_the_quick_fake_check_answers_as_is_fake() -> None:
    """Scratch is counted only on real tensors: the check that skips ``is_fake`` for a plain
    tensor or parameter must answer as it does, functional wrappers of fakes included."""
    from torch._subclasses.fake_tensor import is_fake

    mode = FakeTensorMode()
    with mode:
        fake_param = nn.Parameter(torch.empty(3))
    fake = mode.from_tensor(torch.ones(2))
    cases = [torch.ones(2), nn.Parameter(torch.ones(2)), fake, fake_param,
             torch._to_functional_tensor(fake), torch._to_functional_tensor(torch.ones(2))]
    assert [scratch._fake(t) for t in cases] == [is_fake(t) for t in cases] \
        == [False, False, True, True, True, False]
