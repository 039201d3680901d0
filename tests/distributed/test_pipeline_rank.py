"""The rank peak model of ``plan_rank`` on hand-counted schedules (single process, no
planning): per-action held micro-batches per chunk, and the peak rule with its sends."""

from __future__ import annotations

import pytest

from remat.distributed.pipeline_rank import (
    ChunkBytes,
    RankPlan,
    held_by_chunk,
    plan_rank,
    rank_peak_bytes,
)

# ScheduleInterleaved1F1B, p=2 ranks, v=2 chunks each, m=4 micro-batches (rounds of 2).
# Rank 0 (chunks 0, 2) warms up with (v - 1) * 2 + 2 (p - 1 - r) = 4 forwards, rank 1
# (chunks 1, 3) with 2; then F, B alternate; backwards run the chunks in reverse rounds.
# Per action, (held by the rank's first chunk, by its second): at an F before it, at a B
# with its own micro-batch.
RANK0 = [("F0.0", 0, 0), ("F0.1", 1, 0), ("F2.0", 2, 0), ("F2.1", 2, 1), ("F0.2", 2, 2),
         ("B2.0", 3, 2), ("F0.3", 3, 1), ("B2.1", 4, 1), ("F2.2", 4, 0), ("B0.0", 4, 1),
         ("F2.3", 3, 1), ("B0.1", 3, 2), ("B2.2", 2, 2), ("B2.3", 2, 1), ("B0.2", 2, 0),
         ("B0.3", 1, 0)]
RANK1 = [("F1.0", 0, 0), ("F1.1", 1, 0), ("F3.0", 2, 0), ("B3.0", 2, 1), ("F3.1", 2, 0),
         ("B3.1", 2, 1), ("F1.2", 2, 0), ("B1.0", 3, 0), ("F1.3", 2, 0), ("B1.1", 3, 0),
         ("F3.2", 2, 0), ("B3.2", 2, 1), ("F3.3", 2, 0), ("B3.3", 2, 1), ("B1.2", 2, 0),
         ("B1.3", 1, 0)]


@pytest.mark.parametrize(("rank", "expected"), [(0, RANK0), (1, RANK1)])
def test_held_by_chunk_interleaved(rank: int, expected: list[tuple[str, int, int]]) -> None:
    moments = held_by_chunk("interleaved-1f1b", rank=rank, stages=2, microbatches=4,
                            virtual_stages=2)
    first, second = rank, rank + 2
    got = [(f"{a.kind}{a.chunk}.{a.microbatch}", h[first], h[second]) for a, h in moments]
    assert got == expected
    # the rank's most chunk-micro-batches at once: 5 on rank 0, 3 on rank 1
    assert max(h[first] + h[second] for _, h in moments) == (5, 3)[rank]


def test_rank_peak_by_hand() -> None:
    # p=1, v=2, m=2: F0.0 F1.0 B1.0 F0.1 B0.0 F1.1 B1.1 B0.1
    moments = held_by_chunk("interleaved-1f1b", rank=0, stages=1, microbatches=2,
                            virtual_stages=2)
    assert [f"{a.kind}{a.chunk}.{a.microbatch}" for a, _ in moments] == \
        ["F0.0", "F1.0", "B1.0", "F0.1", "B0.0", "F1.1", "B1.1", "B0.1"]
    c0 = ChunkBytes(static_bytes=110, grad_bytes=10, held_bytes=20, forward_bytes=25,
                    backward_bytes=30, sent_output_bytes=4)
    c1 = ChunkBytes(static_bytes=240, grad_bytes=40, held_bytes=50, forward_bytes=60,
                    backward_bytes=70, sent_grad_bytes=8)
    # B1.1: static 300 + grads 50 + held (c0 1 x 20, c1 1 x 50) + sends (c1's gradient of
    # B1.0: 8; c0's output of B0.0: 4) + backward 70 = 502
    assert rank_peak_bytes(moments, {0: c0, 1: c1}, schedule="interleaved-1f1b") == 502
    # without sends and gradients the peak is F1.1's or B1.0's rule alone: 300 + 20 + 50 + 70
    bare = {0: ChunkBytes(100, 0, 20, 25, 30), 1: ChunkBytes(200, 0, 50, 60, 70)}
    assert rank_peak_bytes(moments, bare, schedule="interleaved-1f1b") == 440


def test_sends_per_schedule() -> None:
    # one chunk, m=2; F0 F1 B0 B1 (gpipe) and F0 B0 F1 B1 (1f1b, p=1)
    chunk = ChunkBytes(static_bytes=14, grad_bytes=4, held_bytes=3, forward_bytes=5,
                       backward_bytes=6, sent_grad_bytes=2)
    gpipe = held_by_chunk("gpipe", rank=0, stages=1, microbatches=2)
    # B0: 10 + 4 + 2 x 3 + 6 = 26; B1: 10 + 4 + 3 + 2 (B0's gradient, waited at the end) + 6
    assert rank_peak_bytes(gpipe, {0: chunk}, schedule="gpipe") == 26
    one = held_by_chunk("1f1b", rank=0, stages=1, microbatches=3)
    # every B after the first: 10 + 4 + 3 + 2 (one send in flight) + 6 = 25
    assert rank_peak_bytes(one, {0: chunk}, schedule="1f1b") == 25


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="one chunk and one micro-batch per virtual stage"):
        plan_rank([object()], [None], budget="75%",  # type: ignore[list-item]
                  schedule="interleaved-1f1b", rank=0, stages=2, microbatches=4,
                  virtual_stages=2)
    with pytest.raises(ValueError, match="rank must be in 0 .. stages - 1"):
        held_by_chunk("1f1b", rank=2, stages=2, microbatches=4)
    with pytest.raises(ValueError, match="bytes and recompute_ms must be >= 0"):
        ChunkBytes(-1, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="a peak within the budget"):
        RankPlan((), (), budget_bytes=10, peak_bytes=11, no_checkpoint_peak_bytes=20,
                 recompute_ms=0.0)


def test_budget_below_every_combination() -> None:
    import torch

    from remat.distributed.stage import LlamaStage
    from remat.errors import BudgetTooSmall
    from remat.models import build_model

    torch.manual_seed(0)
    model = build_model("llama-tiny", n_layer=2)
    chunks = [LlamaStage(model, stage_index=i, stages=2).train() for i in (0, 1)]
    micros = [torch.randint(0, 256, (2, 8)),
              torch.randn(2, 8, model.config.d_model, requires_grad=True)]
    with pytest.raises(BudgetTooSmall, match="no combination of the chunks' plans") as info:
        plan_rank(chunks, micros, budget=1_000, schedule="interleaved-1f1b", rank=0,
                  stages=1, microbatches=2, virtual_stages=2, levels=1)
    # the least peak still holds both chunks' parameters and gradients
    params = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    assert info.value.min_peak_bytes > 2 * params
    assert f"{info.value.min_peak_bytes:,} B" in str(info.value)
