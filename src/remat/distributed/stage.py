"""Pipeline parallelism (``torch.distributed.pipelining``): each stage planned for the
micro-batches its schedule holds at once.

Example::

    >>> from remat.distributed.stage import LlamaStage, plan_stage
    >>> stage = LlamaStage(build_model("llama-tiny", n_layer=4), stage_index=rank, stages=2)
    >>> plan = plan_stage(stage, micro_batch, budget="60%", schedule="1f1b",
    ...                   stage_index=rank, stages=2, microbatches=4,
    ...                   loss_fn=lambda logits, _: next_token_loss(logits, labels))
    >>> remat.apply(stage, plan)
    >>> pipe = PipelineStage(stage, rank, 2, device)      # then Schedule1F1B(pipe, 4, ...)

A stage holds a slice of the model's blocks (the first also the embedding, the last
the norm and the LM head), split torchtitan style: a copy of the model with the other
stages' layers deleted. Under a schedule the stage holds several micro-batches' saved
activations at its worst moment (``remat.distributed.schedule.held_microbatches``: GPipe
all ``m``, 1F1B ``min(m, p - s)`` at stage ``s``), so :func:`plan_stage` plans it with
that many in flight (NOTE [ Micro-batches in flight ] in remat/planning/in_flight.py):
one budget per stage, the card it runs on. Under an interleaved schedule a rank's
chunks share its card: :func:`remat.distributed.pipeline_rank.plan_rank` plans them
together for the rank's one budget.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import Tensor, nn

from remat.core.budget import Budget, BudgetLike
from remat.distributed.stage_loss import StageLoss
from remat.errors import message
from remat.measure.step import LossFn
from remat.models.common import check_seq_len
from remat.models.llama import Llama, rotary_cos_sin
from remat.planning.plans import Plan

__all__ = ["LlamaStage", "plan_stage", "stage_in_flight", "stage_loss"]


class LlamaStage(nn.Module):
    """One pipeline stage of remat's :class:`~remat.models.llama.Llama`: a slice of its blocks.

    The model is deep-copied and the layers of other stages deleted (torchtitan's
    manual split), so the stage's parameters are the model's own values and an
    un-split model gives the reference gradients. Blocks are split as evenly as
    possible, earlier stages taking the remainder. The first stage takes token ids
    ``(B, T)``; later ones the hidden state ``(B, T, C)``; the last returns logits
    ``(B, T, V)``, the others the hidden state.

    Args:
        model: the whole model (not modified).
        stage_index: this stage, ``0 .. stages - 1``.
        stages: how many stages the model is split into.

    Example:
        >>> LlamaStage(build_model("llama-tiny", n_layer=4), stage_index=1, stages=2).blocks
        ModuleList of the model's blocks 2 and 3
    """

    def __init__(self, model: Llama, *, stage_index: int, stages: int) -> None:
        super().__init__()
        n = len(model.blocks)
        if not 0 <= stage_index < stages <= n:
            raise ValueError(message(
                "LlamaStage", "stage_index must be in 0 .. stages - 1, and stages <= blocks",
                {"stage_index": stage_index, "stages": stages, "blocks": n},
                fix="split into at most as many stages as the model has blocks"))
        sizes = [n // stages + (1 if s < n % stages else 0) for s in range(stages)]
        start = sum(sizes[:stage_index])
        whole = copy.deepcopy(model)
        self.config = whole.config
        self.is_first, self.is_last = stage_index == 0, stage_index == stages - 1
        self.first_block = start
        self.tok_emb = whole.tok_emb if self.is_first else None
        self.blocks = nn.ModuleList(whole.blocks[start:start + sizes[stage_index]])
        self.norm = whole.norm if self.is_last else None
        self.lm_head = whole.lm_head if self.is_last else None

    def forward(self, x: Tensor) -> Tensor:
        """Token ids or hidden state in; hidden state or (last stage) logits out."""
        if self.tok_emb is not None:
            check_seq_len("LlamaStage.forward", x.size(1), self.config.max_seq_len)
            x = self.tok_emb(x)  # (B, T, C)
        cos, sin = rotary_cos_sin(x.size(1), self.config.head_dim, self.config.rope_theta,
                                  device=x.device, dtype=x.dtype)  # 2 x (T, hs)
        for block in self.blocks:
            x = block(x, cos, sin)  # (B, T, C)
        if self.norm is not None and self.lm_head is not None:
            x = self.lm_head(self.norm(x))  # (B, T, V)
        return x


def stage_in_flight(schedule: str, *, stage_index: int, stages: int, microbatches: int,
                    virtual_stages: int = 1) -> int:
    """How many micro-batches stage ``stage_index`` holds at its worst moment.

    ``remat.distributed.schedule.held_microbatches`` per pipeline rank, read at the rank
    that runs the stage (``stage_index % stages``: the interleaved schedule's looped
    placement, stage ``i`` on rank ``i mod p``).

    Args:
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved-1f1b"``.
        stage_index: the stage, ``0 .. stages * virtual_stages - 1``.
        stages: pipeline ranks ``p``.
        microbatches: micro-batches per step ``m``.
        virtual_stages: stages per rank (interleaved 1F1B). Default: 1.

    Example:
        >>> stage_in_flight("1f1b", stage_index=0, stages=2, microbatches=4)
        2
    """
    from remat.distributed.schedule import held_microbatches

    if not 0 <= stage_index < stages * virtual_stages:
        raise ValueError(message(
            "remat.distributed.stage.plan_stage", "stage_index out of range",
            {"stage_index": stage_index, "stages x virtual_stages": stages * virtual_stages},
            fix="pass a stage index from 0 to stages * virtual_stages - 1"))
    held = held_microbatches(schedule, stages=stages, microbatches=microbatches,
                             virtual_stages=virtual_stages)
    return int(held[stage_index % stages])


def plan_stage(stage: nn.Module, micro_batch: Any, *, budget: BudgetLike | Budget,
               schedule: str, stage_index: int, stages: int, microbatches: int,
               virtual_stages: int = 1, loss_fn: LossFn | None = None,
               **plan_kwargs: Any) -> Plan:
    """``remat.plan`` for one pipeline stage with the micro-batches its schedule holds.

    More micro-batches shrink the pipeline bubble but, at the first stages of 1F1B and
    at every stage of GPipe, multiply the saved activations a stage holds; the plan
    checkpoints so that those ``k`` copies fit the stage's budget (``k`` from
    :func:`stage_in_flight`; NOTE [ Micro-batches in flight ]).

    Args:
        stage: the stage's module (train mode), e.g. :class:`LlamaStage`.
        micro_batch: one micro-batch of the stage's input (token ids for the first stage,
            a hidden state for later ones).
        budget: the stage's peak on its device: bytes, ``"12GiB"``, ``"60%"``.
        schedule, stage_index, stages, microbatches, virtual_stages: the pipeline (see
            :func:`stage_in_flight`).
        loss_fn: the last stage's ``loss_fn(output, micro_batch) -> scalar`` (the
            schedule's loss on that micro-batch's targets); ignored for other stages,
            whose backward starts from the next stage's gradient. Default: ``None``
            (the last stage's output mean).
        **plan_kwargs: passed on to :func:`remat.plan` (``optimizer``, ``blocks``,
            ``simulate``, ``device``, ``cost``).

    Returns:
        The stage's plan, its ``measured_peak_bytes`` that of the stage's step with
        ``k`` micro-batches in flight.

    Example:
        >>> plan = plan_stage(stage, hidden, budget="2GiB", schedule="gpipe",
        ...                   stage_index=1, stages=2, microbatches=4)
    """
    from remat.planning.planner import plan

    k = stage_in_flight(schedule, stage_index=stage_index, stages=stages,
                        microbatches=microbatches, virtual_stages=virtual_stages)
    loss = stage_loss(schedule, stage_index=stage_index, chunks=stages * virtual_stages,
                      in_flight=k, microbatches=microbatches, loss_fn=loss_fn)
    return plan(stage, micro_batch, budget=budget, loss_fn=loss,
                microbatches_in_flight=k, **plan_kwargs)


def stage_loss(schedule: str, *, stage_index: int, chunks: int, in_flight: int,
               microbatches: int, loss_fn: LossFn | None = None) -> StageLoss:
    """The :class:`~remat.distributed.stage_loss.StageLoss` a stage's planned step runs with.

    Args:
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved-1f1b"``.
        stage_index: the stage, ``0 .. chunks - 1``.
        chunks: stages of the whole pipeline (ranks x virtual stages).
        in_flight: micro-batches the stage holds at once.
        microbatches: micro-batches per step.
        loss_fn: the last stage's loss. Default: ``None`` (its output's mean).

    Example:
        >>> stage_loss("1f1b", stage_index=1, chunks=2, in_flight=1, microbatches=4).accumulating
        True
    """
    # A backward runs before the k-th forward when the stage holds fewer than all m.
    accumulating = in_flight < microbatches
    # 1F1B sends input gradients asynchronously (StageLoss); the first stage has none.
    sends = schedule != "gpipe" and stage_index > 0
    if stage_index == chunks - 1:
        return StageLoss(_mean_loss if loss_fn is None else loss_fn, accumulating, sends)
    return StageLoss(accumulating=accumulating, sends_input_grad=sends)


def _mean_loss(output: Any, batch: Any) -> Tensor:
    out = output if isinstance(output, Tensor) else output[0]
    return out.float().mean()
