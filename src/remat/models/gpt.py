"""A GPT-2 style decoder: LayerNorm, causal SDPA attention, GELU MLP, dropout.

Follows nanoGPT (Karpathy) and the GPT-2 paper: pre-norm blocks, learned position
embeddings, LM head tied to the token embedding by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from remat.errors import message
from remat.models.common import (
    LMOutput,
    check_dropout,
    check_positive,
    check_seq_len,
    init_weights,
    next_token_loss,
    scale_residual_projections,
)


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT model.

    Args:
        vocab_size: number of token ids.
        n_layer: number of transformer blocks.
        n_head: attention heads; must divide ``d_model``.
        d_model: hidden size. The MLP is ``4 * d_model`` wide (GPT-2).
        max_seq_len: longest sequence (size of the position embedding).
        dropout: dropout probability on embeddings, attention and residual branches.
            Default: 0.0.
        bias: whether Linear and LayerNorm layers have biases. Default: True (GPT-2).
        tie_weights: share the LM head weight with the token embedding. Default: True.
    """

    vocab_size: int
    n_layer: int
    n_head: int
    d_model: int
    max_seq_len: int
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True

    def __post_init__(self) -> None:
        check_positive("GPTConfig", vocab_size=self.vocab_size, n_layer=self.n_layer,
                       n_head=self.n_head, d_model=self.d_model, max_seq_len=self.max_seq_len)
        check_dropout("GPTConfig", self.dropout)
        if self.d_model % self.n_head != 0:
            raise ValueError(message(
                "GPTConfig", f"d_model={self.d_model} is not divisible by n_head={self.n_head}",
                fix="pick n_head dividing d_model"))

    @property
    def head_dim(self) -> int:
        """Size of one attention head (``d_model // n_head``)."""
        return self.d_model // self.n_head


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.head_dim  # widths from heads: a TP rank's are its own
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape  # (B, T, C)
        hs, C = self.head_dim, self.n_head * self.head_dim
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        out: Tensor = self.resid_dropout(self.proj(y))  # (B, T, C)
        return out


class GPTMLP(nn.Module):
    """Linear -> GELU -> Linear -> Dropout, 4x wide."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model, bias=config.bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * config.d_model, config.d_model, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.fc(x))  # (B, T, 4C)
        out: Tensor = self.dropout(self.proj(h))  # (B, T, C)
        return out


class GPTBlock(nn.Module):
    """Pre-norm block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = GPTMLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))  # (B, T, C)
        return x


class GPT(nn.Module):
    """GPT-2 style language model.

    Blocks live in ``self.blocks`` (an ``nn.ModuleList`` of :class:`GPTBlock`), each called as
    ``block(x)``.

    Args:
        config: the model shape, see :class:`GPTConfig`.

    Example::

        >>> model = GPT(GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=64,
        ...                       max_seq_len=32))
        >>> ids = torch.randint(0, 256, (2, 16))
        >>> model(ids, labels=ids).loss.shape
        torch.Size([])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        blocks = [GPTBlock(config) for _ in range(config.n_layer)]
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(config.d_model, bias=config.bias)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        init_weights(self)
        scale_residual_projections(
            [p for b in blocks for p in (b.attn.proj, b.mlp.proj)],
            config.n_layer,
        )
        if config.tie_weights:
            self.lm_head.weight = self.tok_emb.weight

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> LMOutput:
        """Logits for ``input_ids`` ``(B, T)``; with ``labels``, also the next-token loss."""
        T = input_ids.size(1)
        check_seq_len("GPT.forward", T, self.config.max_seq_len)
        pos = torch.arange(T, device=input_ids.device)  # (T,)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        loss = None if labels is None else next_token_loss(logits, labels)
        return LMOutput(logits=logits, loss=loss)
