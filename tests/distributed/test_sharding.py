"""Per-rank peak arithmetic for FSDP and DDP."""

from __future__ import annotations

import pytest

from remat.distributed.sharding import shard_peak

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


def test_fsdp_layout_pads_shards_and_names_each_groups_last_gradient() -> None:
    from remat.distributed.sharding import fsdp_layout
    from remat.models import build_model

    model = build_model("llama-tiny", n_layer=2)  # d_model 64, d_ff 176, vocab 256
    layout = fsdp_layout(model, 3)
    block = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    assert layout.block_param_bytes == layout.block_grad_bytes == (block, block)
    # The last registered parameter of a block is the MLP's down projection (64 x 176):
    # FSDP2's reduce-scatter loop still holds its gradient (NOTE [ FSDP2 per phase ], 4.).
    assert layout.block_last_grad_bytes == (64 * 176 * 4,) * 2
    assert layout.root_param_bytes == 2 * 256 * 64 * 4 + 64 * 4  # embedding, head, norm
    assert layout.root_last_grad_bytes == 256 * 64 * 4  # lm_head
    # Dim 0 padded to a multiple of 3 per parameter: gate/up (176 rows) keep 59 rows,
    # down (64 rows) 22, the norms (64) 22, q/o (64) 22, k/v (32) 11.
    per_block = (2 * 59 * 64 + 22 * 176 + 2 * 22 + 2 * 22 * 64 + 2 * 11 * 64) * 4
    root = (2 * 86 * 64 + 22) * 4  # embedding and head: 256 rows -> 86
    assert layout.block_shard_grad_bytes == (per_block, per_block)
    assert layout.shard_param_bytes == 2 * per_block + root
