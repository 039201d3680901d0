"""Pieces shared by the built-in models: the output type, the loss and weight init."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor, nn

from remat.errors import message


@dataclass(frozen=True)
class LMOutput:
    """What the built-in language models return.

    Attributes:
        logits: ``(batch, seq, vocab)`` next-token logits, in the model's dtype.
        loss: scalar float32 next-token cross entropy, or None when no labels were given.
    """

    logits: Tensor
    loss: Tensor | None = None


def next_token_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross entropy of ``logits[:, :-1]`` against ``labels[:, 1:]``, in float32.

    Labels equal to -100 are ignored (the Hugging Face convention).
    """
    vocab_size = logits.size(-1)
    shifted = logits[:, :-1].float().reshape(-1, vocab_size)  # (B*(T-1), V)
    targets = labels[:, 1:].reshape(-1)  # (B*(T-1),)
    return F.cross_entropy(shifted, targets, ignore_index=-100)


def init_weights(module: nn.Module, *, std: float = 0.02) -> None:
    """GPT-2 style init: Linear/Embedding weights ~ N(0, std), biases zero.

    Norm layers keep their own defaults (weight one, bias zero). Deterministic under
    ``torch.manual_seed`` because it draws from the global generator in module order.
    """
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=std)


def scale_residual_projections(projections: list[nn.Linear], n_layer: int,
                               *, std: float = 0.02) -> None:
    """Re-init residual output projections with std / sqrt(2 * n_layer).

    See GPT-2 paper, section 2.3 ("scale the weights of residual layers at initialization by
    a factor of 1/sqrt(N) where N is the number of residual layers"); nanoGPT does the same.
    """
    scaled_std = std / math.sqrt(2 * n_layer)
    for proj in projections:
        nn.init.normal_(proj.weight, mean=0.0, std=scaled_std)


def check_positive(api: str, **values: int) -> None:
    """Raise ValueError naming every field that is not a positive integer."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(message(api, f"{name} must be a positive integer",
                                     {"found": repr(value)}, fix=f"pass {name} >= 1"))


def check_dropout(api: str, dropout: float) -> None:
    """Raise ValueError unless 0 <= dropout < 1."""
    if not 0.0 <= dropout < 1.0:
        raise ValueError(message(api, "dropout must be in [0, 1)", {"found": repr(dropout)},
                                 fix="pass 0 <= dropout < 1"))


def check_seq_len(api: str, seq_len: int, max_seq_len: int) -> None:
    """Raise ValueError when a sequence is longer than the model supports."""
    if seq_len > max_seq_len:
        raise ValueError(message(
            api, f"sequence length {seq_len} exceeds max_seq_len={max_seq_len}",
            fix=f"pass shorter inputs or build the model with max_seq_len={seq_len}"))


