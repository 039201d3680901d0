"""Small models shared by tests (importable: pyproject puts tests/ on pytest's path)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["D", "Block", "MethodLM", "MethodLayer", "MhaLayer", "MhaNet", "Net", "net"]

D = 64


class Block(nn.Module):
    """A pre-norm residual MLP block (LayerNorm, Linear, GELU, Linear)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 4 * D)
        self.fc2 = nn.Linear(4 * D, D)
        self.norm = nn.LayerNorm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    """Two :class:`Block` between an input projection and a head; returns a scalar loss."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(D, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x).square().mean()


def net() -> Net:
    """A :class:`Net` with seed-0 weights."""
    torch.manual_seed(0)
    return Net()


class RMSNorm(nn.Module):
    """LLaMA's RMSNorm: ``x / rms(x) * weight``."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MethodLayer(nn.Module):
    """A LLaMA-style decoder layer whose attention and SwiGLU MLP are *methods*, not
    sub-modules: RMSNorm, rotary embeddings, an additive float mask passed positionally."""

    def __init__(self, dim: int = 32, heads: int = 4, hidden: int = 64, seq: int = 16) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        half = dim // heads // 2
        freqs = 1.0 / 10000 ** (torch.arange(half) / half)
        angles = torch.outer(torch.arange(seq).float(), freqs)  # (T, hd/2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:  # (B, H, T, hd)
        a, b = x.chunk(2, dim=-1)
        cos, sin = self.cos[: x.shape[2]], self.sin[: x.shape[2]]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def _attention_forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        hd = c // self.heads
        q, k, v = (p(x).view(b, t, self.heads, hd).transpose(1, 2)  # (B, H, T, hd)
                   for p in (self.q, self.k, self.v))
        q, k = self._rotate(q), self._rotate(k)
        scores = q @ k.transpose(-2, -1) / math.sqrt(hd) + mask  # (B, H, T, T)
        y = scores.softmax(-1) @ v
        return self.o(y.transpose(1, 2).reshape(b, t, c))

    def _ffn_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self._attention_forward(self.norm1(x), mask)
        return x + self._ffn_forward(self.norm2(x))


class MethodLM(nn.Module):
    """Layers of :class:`MethodLayer` on a ``(B, T, dim)`` input; returns a scalar loss."""

    def __init__(self, layers: int = 2, dim: int = 32, seq: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList([MethodLayer(dim, seq=seq) for _ in range(layers)])
        self.head = nn.Linear(dim, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.full((t, t), -1e9).triu(1)  # additive causal mask
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(x).square().mean()


class MhaLayer(nn.Module):
    """A pre-norm layer around ``nn.MultiheadAttention`` (a child named by neither
    ``attn`` nor ``attention``: found by its class name) and an MLP."""

    def __init__(self, dim: int = 32, heads: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attention_layer = nn.MultiheadAttention(dim, heads, dropout=dropout,
                                                     batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attention_layer(h, h, h)[0]
        return x + self.mlp(self.norm2(x))


class MhaNet(nn.Module):
    """Layers of :class:`MhaLayer`; returns a scalar loss."""

    def __init__(self, layers: int = 2, dim: int = 32, dropout: float = 0.0) -> None:
        super().__init__()
        self.layers = nn.ModuleList([MhaLayer(dim, dropout=dropout) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()
