"""simulate=True equals the real step byte for byte on Hugging Face architectures.

Items 1 (mixture-of-experts models simulate: ``torch._grouped_mm`` in every float dtype) and 2
(fake runs take the branches real runs take: NOTE [ Data-dependent branches under fake tensors ]).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from remat.measure import Profile, profile
from remat.measure.fake import fake_tensor
from remat.measure.fake_kernels import install_fake_kernels
from remat.measure.tracker import MemoryTracker
from remat.strategies import apply

pytest.importorskip("transformers")


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


hf_tiny = _load("hf_tiny")


def assert_same_bytes(real: Profile, sim: Profile) -> None:
    assert (sim.peak_bytes, sim.activation_bytes, sim.peak_phase) == (
        real.peak_bytes, real.activation_bytes, real.peak_phase)
    assert dict(sim.peak_breakdown) == dict(real.peak_breakdown)
    assert sim.blocks == real.blocks
    assert [(o.name, o.phase, o.block, o.alloc_bytes) for o in sim.ops] == [
        (o.name, o.phase, o.block, o.alloc_bytes) for o in real.ops]


@pytest.mark.parametrize("strategy", ["none", "full"])
@pytest.mark.parametrize("model_type", sorted(hf_tiny.ARCHITECTURES))
def test_simulated_step_equals_real_step(model_type: str, strategy: str,
                                         caplog: pytest.LogCaptureFixture) -> None:
    model, batch = hf_tiny.build_hf(model_type)
    apply(model, strategy)
    real = profile(model, batch, timing=False)
    with caplog.at_level(logging.WARNING, logger="torch._subclasses.fake_tensor"):
        sim = profile(model, batch, simulate=True)
    spam = [r for r in caplog.records if r.name.startswith("torch._subclasses")]
    assert not spam  # no "failed while attempting to run meta" log lines
    assert_same_bytes(real, sim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_grouped_mm_fake_kernel_matches_cpu_kernel(dtype: torch.dtype) -> None:
    install_fake_kernels()
    a = torch.randn(10, 8, dtype=dtype, requires_grad=True)
    b = torch.randn(3, 8, 32, dtype=dtype, requires_grad=True)
    offs = torch.tensor([3, 7, 10], dtype=torch.int32)
    real = torch._grouped_mm(a, b, offs=offs)
    mode = FakeTensorMode()
    fa, fb, f_offs = (fake_tensor(t, mode) for t in (a, b, offs))
    with mode:
        fa.requires_grad_()
        fb.requires_grad_()
        out = torch._grouped_mm(fa, fb, offs=f_offs)
        out.sum().backward()  # the backward's grouped matmuls take the zero-stride gradient
    assert (out.shape, out.stride(), out.dtype) == (real.shape, real.stride(), real.dtype)
    assert out.untyped_storage().nbytes() == real.untyped_storage().nbytes()
    assert fa.grad is not None and fa.grad.shape == a.shape
    assert fb.grad is not None and fb.grad.shape == b.shape


def test_moe_bf16_simulates() -> None:
    model, batch = hf_tiny.build_hf("qwen2_moe", dtype=torch.bfloat16)
    assert_same_bytes(profile(model, batch, timing=False), profile(model, batch, simulate=True))


def test_shadow_answers_scalar_reads_under_the_tracker() -> None:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    ids = torch.tensor([[3, 1, 4], [1, 5, 9]])
    fake_ids = fake_tensor(ids, mode)
    with mode, MemoryTracker():
        positions = torch.arange(3).expand(2, 3)
        assert bool((fake_ids[:, [-1, 0]] == 9).any())
        assert int((positions * fake_ids).sum()) == int((torch.arange(3) * ids).sum())
    with mode, pytest.raises(RuntimeError):  # without the tracker: no values, as before
        bool((fake_ids == 9).any())


def test_shadow_knows_floats_made_from_known_values_only() -> None:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    ids = fake_tensor(torch.tensor([[3, 1, 4]]), mode)  # a batch of ids: shadows are on
    weight = fake_tensor(torch.ones(2, 3), mode)  # float data from outside: never known
    with mode, MemoryTracker():
        mask = torch.ones(2, 3)  # BART's decoder mask when none is given
        assert bool(mask.bool().all()) and float(mask.sum()) == 6.0
        assert int(ids.sum()) == 8
        with pytest.raises(RuntimeError):
            bool((weight > 0).all())


def _ops_of(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> set[object]:
    """The aten overloads one real forward of ``model`` runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: set[object] = set()

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.add(func)
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Ops():
        model(**batch)
    return seen


def test_bart_default_decoder_mask_simulates_like_the_real_step() -> None:
    # BartDecoder builds torch.ones(batch, seq) (float) when no decoder mask is given, and
    # transformers skips the causal mask after checking it is all ones: the fake step must
    # read the same value, or it materializes a 4-D mask the real step never allocates.
    transformers = pytest.importorskip("transformers")
    config = transformers.BartConfig(
        encoder_layers=1, decoder_layers=1, d_model=32, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=128,
        max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(config).train()
    batch = {"input_ids": torch.randint(1, 128, (2, 16)),
             "labels": torch.randint(1, 128, (2, 8))}
    if torch.ops.aten.rand.default in _ops_of(model, batch):
        pytest.skip("this transformers' BART draws torch.rand([]) for LayerDrop in every "
                    "training forward, even at layerdrop 0 (5.17 does; 5.23 does not), and "
                    "branches on it: a random value fake tensors cannot have")
    assert_same_bytes(profile(model, batch, timing=False), profile(model, batch, simulate=True))
