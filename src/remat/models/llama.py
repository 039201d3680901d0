"""A Llama style decoder: RMSNorm, rotary embeddings, SwiGLU MLP, grouped-query attention.

Follows the Llama papers (Touvron et al. 2023; Llama 3, Dubey et al. 2024) and the Hugging Face
``modeling_llama`` layout. RoPE cos/sin are computed once per forward in :class:`Llama` and
passed to every block as extra positional arguments, ``block(x, cos, sin)``.
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
class LlamaConfig:
    """Shape of a Llama model.

    Args:
        vocab_size: number of token ids.
        n_layer: number of transformer blocks.
        n_head: query heads; must divide ``d_model``.
        n_kv_head: key/value heads (grouped-query attention); must divide ``n_head``.
        d_model: hidden size.
        d_ff: SwiGLU inner size.
        max_seq_len: longest sequence.
        rope_theta: RoPE base. Default: 10000.0 (Llama 2; Llama 3 uses 500000.0).
        norm_eps: RMSNorm epsilon. Default: 1e-5.
        dropout: dropout on attention probabilities and residual branches. Default: 0.0.
        tie_weights: share the LM head with the embedding. Default: False
            (True only for the small Llama 3.2 models).
    """

    vocab_size: int
    n_layer: int
    n_head: int
    n_kv_head: int
    d_model: int
    d_ff: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dropout: float = 0.0
    tie_weights: bool = False

    def __post_init__(self) -> None:
        check_positive("LlamaConfig", vocab_size=self.vocab_size, n_layer=self.n_layer,
                       n_head=self.n_head, n_kv_head=self.n_kv_head, d_model=self.d_model,
                       d_ff=self.d_ff, max_seq_len=self.max_seq_len)
        check_dropout("LlamaConfig", self.dropout)
        if self.d_model % self.n_head != 0:
            raise ValueError(message(
                "LlamaConfig", f"d_model={self.d_model} is not divisible by n_head={self.n_head}",
                fix="pick n_head dividing d_model"))
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(message(
                "LlamaConfig", f"n_head={self.n_head} is not divisible by "
                f"n_kv_head={self.n_kv_head}",
                {"why": "grouped-query attention needs whole groups"},
                fix="pick n_kv_head dividing n_head"))
        if self.head_dim % 2 != 0:
            raise ValueError(message(
                "LlamaConfig", f"head_dim={self.head_dim} (d_model / n_head) must be even for "
                "RoPE", fix="pick d_model and n_head with an even d_model / n_head"))
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError(message(
                "LlamaConfig", "rope_theta and norm_eps must be > 0",
                {"rope_theta": self.rope_theta, "norm_eps": self.norm_eps},
                fix="pass positive values"))

    @property
    def head_dim(self) -> int:
        """Size of one attention head (``d_model // n_head``)."""
        return self.d_model // self.n_head


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)  # (B, T, C)
        return self.weight * h.to(x.dtype)


def rotary_cos_sin(seq_len: int, head_dim: int, theta: float, *, device: torch.device,
                   dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """RoPE tables ``cos, sin`` of shape ``(seq_len, head_dim)`` (Su et al. 2021, RoFormer).

    Uses the "rotate half" layout of Hugging Face Llama: frequencies repeated twice.
    """
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    )  # (hs/2,)
    t = torch.arange(seq_len, device=device, dtype=torch.float32)  # (T,)
    freqs = torch.outer(t, inv_freq)  # (T, hs/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hs)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # 2 x (..., hs/2)
    return torch.cat((-x2, x1), dim=-1)  # (..., hs)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``(B, nh, T, hs)`` by the RoPE tables ``(T, hs)``."""
    return x * cos + _rotate_half(x) * sin  # (B, nh, T, hs)


class LlamaAttention(nn.Module):
    """Causal grouped-query attention with RoPE, no biases."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.q_proj = nn.Linear(config.d_model, config.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.d_model, config.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.d_model, config.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.n_head * self.head_dim, config.d_model, bias=False)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, _ = x.shape  # (B, T, C)
        hs = self.head_dim
        q = self.q_proj(x).view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, self.n_kv_head, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, self.n_kv_head, hs).transpose(1, 2)  # (B, nkv, T, hs)
        q = apply_rotary(q, cos, sin)  # (B, nh, T, hs)
        k = apply_rotary(k, cos, sin)  # (B, nkv, T, hs)
        # SDPA broadcasts each kv head over its n_head / n_kv_head query heads (torch >= 2.5),
        # without materialising repeated k/v on the fused CPU and CUDA kernels.
        y = F.scaled_dot_product_attention(
            q, k, v,
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.n_kv_head != self.n_head,
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_head * hs)  # (B, T, C)
        out: Tensor = self.resid_dropout(self.o_proj(y))  # (B, T, C)
        return out


class LlamaMLP(nn.Module):
    """SwiGLU MLP (Shazeer 2020): ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.down_proj = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = F.silu(self.gate_proj(x)) * self.up_proj(x)  # (B, T, d_ff)
        out: Tensor = self.dropout(self.down_proj(h))  # (B, T, C)
        return out


class LlamaBlock(nn.Module):
    """Pre-norm block: ``x + attn(attn_norm(x), cos, sin)``, then ``x + mlp(mlp_norm(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = LlamaAttention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)  # (B, T, C)
        x = x + self.mlp(self.mlp_norm(x))  # (B, T, C)
        return x


class Llama(nn.Module):
    """Llama style language model.

    Blocks live in ``self.blocks`` (an ``nn.ModuleList`` of :class:`LlamaBlock`), each called as
    ``block(x, cos, sin)``: checkpointing strategies must pass the extra arguments through.

    Args:
        config: the model shape, see :class:`LlamaConfig`.

    Example::

        >>> model = Llama(LlamaConfig(vocab_size=256, n_layer=2, n_head=4, n_kv_head=2,
        ...                           d_model=64, d_ff=176, max_seq_len=32))
        >>> ids = torch.randint(0, 256, (2, 16))
        >>> model(ids, labels=ids).logits.shape
        torch.Size([2, 16, 256])
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        blocks = [LlamaBlock(config) for _ in range(config.n_layer)]
        self.blocks = nn.ModuleList(blocks)
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        init_weights(self)
        scale_residual_projections(
            [p for b in blocks for p in (b.attn.o_proj, b.mlp.down_proj)],
            config.n_layer,
        )
        if config.tie_weights:
            self.lm_head.weight = self.tok_emb.weight

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> LMOutput:
        """Logits for ``input_ids`` ``(B, T)``; with ``labels``, also the next-token loss."""
        T = input_ids.size(1)
        check_seq_len("Llama.forward", T, self.config.max_seq_len)
        x = self.drop(self.tok_emb(input_ids))  # (B, T, C)
        cos, sin = rotary_cos_sin(T, self.config.head_dim, self.config.rope_theta,
                                  device=x.device, dtype=x.dtype)  # 2 x (T, hs)
        for block in self.blocks:
            x = block(x, cos, sin)  # (B, T, C)
        logits = self.lm_head(self.norm(x))  # (B, T, V)
        loss = None if labels is None else next_token_loss(logits, labels)
        return LMOutput(logits=logits, loss=loss)
