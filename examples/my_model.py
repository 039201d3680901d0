"""Your own model on the ``remat`` command line: three factories for ``--module``.

Every ``remat`` command takes ``--module FILE.py:FACTORY`` (or ``package.module:FACTORY``);
the factory is called with no arguments (see docs/cli.md, "Your own model"). This file
needs nothing but torch. From the repository root::

    remat plan --module examples/my_model.py:build --budget 70% --batch 2 --seq 128
    remat profile --module examples/my_model.py:build_with_batch
    remat compare --module examples/my_model.py:build_training --batch 2 --seq 64
    remat simulate --module examples/my_model.py:build_training --seq 512 --batch 1,8

``build`` returns the model alone: it has ``config.vocab_size``, so remat makes random
token batches (``input_ids`` and ``labels``) for it and trains on the loss the model
returns. ``build_with_batch`` returns ``(model, batch)``: one fixed batch.
``build_training`` returns an object with ``model``, ``make_batch(batch_size, seq_len)``
and ``loss_fn(output, batch)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F


@dataclass(frozen=True)
class TinyLMConfig:
    """Sizes of :class:`TinyLM`, under the field names Hugging Face configs use.

    Args:
        vocab_size: tokens in the vocabulary. Default: 256.
        hidden_size: model width. Default: 64.
        num_attention_heads: attention heads. Default: 4.
        num_hidden_layers: blocks. Default: 2.
        max_seq_len: positions in the learned position table. Default: 512.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_hidden_layers: int = 2
    max_seq_len: int = 512


class Attention(nn.Module):
    """Causal multi-head self-attention (fused: ``scaled_dot_product_attention``)."""

    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape  # (B, T, C)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(x).split(c, dim=-1))  # (B, heads, T, C / heads)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-norm transformer block: attention, then a 4x MLP, each with a residual."""

    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        width = config.hidden_size
        self.norm1 = nn.LayerNorm(width)
        self.attn = Attention(config)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """A small causal language model: logits, or the next-token loss when given labels."""

    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.pos = nn.Embedding(config.max_seq_len, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size)
        self.head = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids) + self.pos(positions)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))  # (B, T, vocab)
        if labels is None:
            return logits
        return next_token_loss(logits, labels)


def next_token_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Cross-entropy of each position's logits against the next token."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


def token_batch(batch_size: int, seq_len: int, *, vocab_size: int = 256) -> dict[str, Tensor]:
    """Random token ids and their labels (a copy; the loss shifts them)."""
    ids = torch.randint(0, vocab_size, (batch_size, seq_len))  # (B, T)
    return {"input_ids": ids, "labels": ids.clone()}


def build() -> nn.Module:
    """(a) The model alone: remat makes token batches from ``config.vocab_size``."""
    return TinyLM(TinyLMConfig())


def build_with_batch() -> tuple[nn.Module, dict[str, Tensor]]:
    """(b) The model and one fixed batch (2 sequences of 64 tokens)."""
    return TinyLM(TinyLMConfig()), token_batch(2, 64)


def build_training() -> Any:
    """(c) The model, ``make_batch(batch_size, seq_len)`` and ``loss_fn(output, batch)``."""
    config = TinyLMConfig()

    def make_batch(batch_size: int, seq_len: int) -> dict[str, Tensor]:
        return {"input_ids": token_batch(batch_size, seq_len)["input_ids"]}

    def loss_fn(output: Tensor, batch: dict[str, Tensor]) -> Tensor:
        return next_token_loss(output, batch["input_ids"])

    return SimpleNamespace(model=TinyLM(config), make_batch=make_batch, loss_fn=loss_fn)
