"""Per-rank peak arithmetic for FSDP and DDP."""

from __future__ import annotations

import pytest

from remat.simulate.sharding import shard_peak

GIB = 1024**3


def test_none_is_the_single_device_peak() -> None:
    out = shard_peak(peak_bytes=100, param_bytes=40, grad_bytes=20, optimizer_bytes=20)
    assert (out.peak_bytes, out.rest_bytes, out.unsharded_bytes) == (100, 20, 0)


def test_fsdp_divides_states_and_adds_the_gathered_block() -> None:
    # Llama-7B-like, bf16 + AdamW(bf16): P = G = 13 GiB, O = 26 GiB, activations 10 GiB.
    out = shard_peak(peak_bytes=62 * GIB, param_bytes=13 * GIB, grad_bytes=13 * GIB,
                     optimizer_bytes=26 * GIB, sharding="fsdp", world_size=8,
                     block_param_bytes=GIB // 2, block_grad_bytes=GIB // 2,
                     root_param_bytes=GIB // 4, root_grad_bytes=GIB // 4)
    # 10 + 13/8 + 13/8 + 26/8 + 0.5 + 0.5 + 0.25 + 0.25 GiB
    assert out.peak_bytes == 10 * GIB + 52 * GIB // 8 + int(1.5 * GIB)
    assert (out.param_bytes, out.grad_bytes, out.optimizer_bytes) == (
        13 * GIB // 8, 13 * GIB // 8, 26 * GIB // 8)
    assert out.unsharded_bytes == int(1.5 * GIB)
    assert out.rest_bytes == 10 * GIB


def test_fsdp_rounds_shards_up_and_counts_prefetch() -> None:
    out = shard_peak(peak_bytes=10, param_bytes=3, grad_bytes=3, optimizer_bytes=3,
                     sharding="fsdp", world_size=2, block_param_bytes=1, block_grad_bytes=1,
                     prefetch_blocks=1)
    assert out.peak_bytes == 1 + 2 + 2 + 2 + (2 * 1 + 1)


def test_ddp_keeps_states_whole_and_adds_buckets() -> None:
    kw = dict(peak_bytes=100, param_bytes=40, grad_bytes=20, optimizer_bytes=20,
              sharding="ddp", world_size=8)
    assert shard_peak(**kw).peak_bytes == 120  # type: ignore[arg-type]
    assert shard_peak(**kw, gradient_as_bucket_view=True).peak_bytes == 100  # type: ignore[arg-type]


def test_bad_inputs() -> None:
    with pytest.raises(ValueError,
                       match=r"(?s)exceeds peak_bytes\n.*peak_bytes: 10\n  fix: pass the parts"):
        shard_peak(peak_bytes=10, param_bytes=8, grad_bytes=8, optimizer_bytes=0)
    with pytest.raises(ValueError, match="world_size=2 needs sharding"):
        shard_peak(peak_bytes=10, param_bytes=1, grad_bytes=1, optimizer_bytes=1, world_size=2)
    with pytest.raises(ValueError, match="unknown sharding 'zero'"):
        shard_peak(peak_bytes=10, param_bytes=1, grad_bytes=1, optimizer_bytes=1,
                   sharding="zero")
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        shard_peak(peak_bytes=10, param_bytes=1, grad_bytes=1, optimizer_bytes=1,
                   sharding="fsdp", world_size=0)
