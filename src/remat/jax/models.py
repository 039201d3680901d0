"""A Flax NNX GPT (the JAX twin of ``remat.models`` GPT presets), for demos and tests.

Pre-norm GPT-2 blocks (nanoGPT layout): LayerNorm, causal self-attention, LayerNorm,
GELU MLP 4x wide; learned position embeddings; LM head tied to the token embedding.
The model returns its next-token cross-entropy loss, so the default ``loss_fn`` of
:func:`remat.jax.profile` works on it.

Activations are tagged with :func:`jax.ad_checkpoint.checkpoint_name` so that the
``save_only_these_names`` policies have something to save (see :data:`TAGGED_NAMES`).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from remat.errors import current_call, message

#: Names the preset tags with ``checkpoint_name``, in forward order within a block.
TAGGED_NAMES: tuple[str, ...] = ("qkv", "attn_probs", "attn_out", "mlp_up", "mlp_act")


@dataclass(frozen=True)
class GPTConfig:
    """Shape of an NNX GPT.

    Args:
        vocab_size: number of token ids.
        n_layer: number of blocks.
        n_head: attention heads; must divide ``d_model``.
        d_model: hidden size (the MLP is ``4 * d_model`` wide).
        max_seq_len: longest sequence.

    Example:
        >>> GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=64, max_seq_len=32).n_layer
        2
    """

    vocab_size: int
    n_layer: int
    n_head: int
    d_model: int
    max_seq_len: int

    def __post_init__(self) -> None:
        for key in ("vocab_size", "n_layer", "n_head", "d_model", "max_seq_len"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(message("GPTConfig", f"{key} must be an int >= 1",
                                         {key: repr(value)}, fix=f"pass {key} as an int >= 1"))
        if self.d_model % self.n_head:
            raise ValueError(message("GPTConfig", "d_model is not divisible by n_head",
                                     {"d_model": self.d_model, "n_head": self.n_head},
                                     fix="pick n_head dividing d_model"))


#: Built-in configurations; the same shapes as the PyTorch presets of the same name.
PRESETS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=64, max_seq_len=32),
    "gpt-small": GPTConfig(vocab_size=4096, n_layer=6, n_head=8, d_model=256,
                           max_seq_len=128),
}


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention with a fused QKV projection."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs) -> None:
        self.n_head = cfg.n_head
        self.qkv = nnx.Linear(cfg.d_model, 3 * cfg.d_model, rngs=rngs)
        self.proj = nnx.Linear(cfg.d_model, cfg.d_model, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        h = self.n_head
        qkv = checkpoint_name(self.qkv(x), "qkv")  # (B, T, 3D)
        q, k, v = jnp.split(qkv.reshape(b, t, 3, h, d // h), 3, axis=2)  # (B, T, 1, H, hs)
        q, k, v = (a[:, :, 0].transpose(0, 2, 1, 3) for a in (q, k, v))  # (B, H, T, hs)
        scores = q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(d // h)  # (B, H, T, T)
        mask = jnp.tril(jnp.ones((t, t), dtype=bool))
        probs = checkpoint_name(jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1),
                                "attn_probs")
        out = (probs @ v).transpose(0, 2, 1, 3).reshape(b, t, d)  # (B, T, D)
        return self.proj(checkpoint_name(out, "attn_out"))


class MLP(nnx.Module):
    """GELU MLP, ``4 * d_model`` wide."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(cfg.d_model, 4 * cfg.d_model, rngs=rngs)
        self.down = nnx.Linear(4 * cfg.d_model, cfg.d_model, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = checkpoint_name(self.up(x), "mlp_up")  # (B, T, 4D)
        return self.down(checkpoint_name(jax.nn.gelu(h), "mlp_act"))


class GPTBlock(nnx.Module):
    """A pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs) -> None:
        self.ln1 = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.attn = CausalSelfAttention(cfg, rngs=rngs)
        self.ln2 = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nnx.Module):
    """GPT-2 style decoder returning its next-token loss: ``model(input_ids, labels)``."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs) -> None:
        self.config = cfg
        self.wte = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
        self.wpe = nnx.Embed(cfg.max_seq_len, cfg.d_model, rngs=rngs)
        self.blocks = nnx.List([GPTBlock(cfg, rngs=rngs) for _ in range(cfg.n_layer)])
        self.ln_f = nnx.LayerNorm(cfg.d_model, rngs=rngs)

    def __call__(self, input_ids: jax.Array, labels: jax.Array) -> jax.Array:
        t = input_ids.shape[1]
        x = self.wte(input_ids) + self.wpe(jnp.arange(t))[None]  # (B, T, D)
        for block in self.blocks:
            x = block(x)
        logits = self.wte.attend(self.ln_f(x))[:, :-1]  # (B, T-1, V), tied head
        logp = jax.nn.log_softmax(logits, axis=-1)
        target = labels[:, 1:]
        return -jnp.take_along_axis(logp, target[..., None], axis=-1).mean()


def _config(source: GPT | GPTConfig | str) -> GPTConfig:
    if isinstance(source, GPT):
        return source.config
    if isinstance(source, GPTConfig):
        return source
    if source not in PRESETS:
        raise ValueError(message(current_call("remat.jax.build_model"),
                                 f"unknown preset {source!r}", {"presets": ", ".join(PRESETS)},
                                 fix="pass one of the presets or a GPTConfig"))
    return PRESETS[source]


def build_model(preset: str | GPTConfig = "gpt-small", *, seed: int = 0) -> GPT:
    """A freshly initialised NNX GPT.

    Args:
        preset: a key of :data:`PRESETS` or a :class:`GPTConfig`. Default: ``"gpt-small"``.
        seed: parameter initialisation seed. Default: 0.

    Example:
        >>> build_model("gpt-tiny").config.n_layer
        2
    """
    return GPT(_config(preset), rngs=nnx.Rngs(seed))


def make_batch(source: GPT | GPTConfig | str, batch_size: int, seq_len: int | None = None,
               *, seed: int = 0) -> dict[str, jax.Array]:
    """A batch of random token ids with next-token labels, ``model(**batch)`` ready.

    Args:
        source: a built-in model, its config, or a preset name.
        batch_size: sequences, >= 1.
        seq_len: tokens per sequence, 2..max_seq_len. Default: ``max_seq_len``.
        seed: PRNG seed. Default: 0.

    Returns:
        ``{"input_ids": int32 (B, T), "labels": int32 (B, T)}``.

    Example:
        >>> make_batch("gpt-tiny", 2, 16)["input_ids"].shape
        (2, 16)
    """
    cfg = _config(source)
    seq = cfg.max_seq_len if seq_len is None else seq_len
    if batch_size < 1 or not 2 <= seq <= cfg.max_seq_len:
        raise ValueError(message(current_call("remat.jax.make_batch"),
                                 "batch_size or seq_len out of range",
                                 {"batch_size": batch_size, "seq_len": seq,
                                  "max_seq_len": cfg.max_seq_len},
                                 fix=f"pass batch_size >= 1 and 2 <= seq_len <= {cfg.max_seq_len}"))
    ids = jax.random.randint(jax.random.key(seed), (batch_size, seq), 0, cfg.vocab_size,
                             dtype=jnp.int32)
    return {"input_ids": ids, "labels": ids}
