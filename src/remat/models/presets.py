"""Named model shapes, from test-sized to real, and :func:`build_model`."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from remat.errors import message
from remat.models.gpt import GPT, GPTConfig
from remat.models.llama import Llama, LlamaConfig

ModelConfig = GPTConfig | LlamaConfig

# The large presets ("gpt2-124m", "llama-1b", "llama-7b", "llama-70b", "llama-405b") are for
# simulation and planning: build them under `with torch.device("meta"):` unless you mean to
# allocate them.
PRESETS: dict[str, GPTConfig | LlamaConfig] = {
    "gpt-tiny": GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=64, max_seq_len=32,
                          dropout=0.1),
    "gpt-small": GPTConfig(vocab_size=4096, n_layer=6, n_head=8, d_model=256, max_seq_len=128,
                           dropout=0.1),
    # GPT-2 small (Radford et al. 2019): 124,439,808 parameters with the tied head.
    "gpt2-124m": GPTConfig(vocab_size=50257, n_layer=12, n_head=12, d_model=768,
                           max_seq_len=1024, dropout=0.1),
    "llama-tiny": LlamaConfig(vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, d_model=64,
                              d_ff=176, max_seq_len=32),
    "llama-small": LlamaConfig(vocab_size=4096, n_layer=6, n_head=8, n_kv_head=4, d_model=256,
                               d_ff=688, max_seq_len=128),
    # Llama-3.2-1B (meta-llama/Llama-3.2-1B config.json): tied embeddings, 1,235,814,400 params.
    "llama-1b": LlamaConfig(vocab_size=128256, n_layer=16, n_head=32, n_kv_head=8, d_model=2048,
                            d_ff=8192, max_seq_len=4096, rope_theta=500000.0, tie_weights=True),
    # Llama-2-7B (meta-llama/Llama-2-7b-hf config.json): 6,738,415,616 params.
    "llama-7b": LlamaConfig(vocab_size=32000, n_layer=32, n_head=32, n_kv_head=32, d_model=4096,
                            d_ff=11008, max_seq_len=4096),
    # Llama-3.1-70B (meta-llama/Llama-3.1-70B config.json): 70,553,706,496 params.
    "llama-70b": LlamaConfig(vocab_size=128256, n_layer=80, n_head=64, n_kv_head=8, d_model=8192,
                             d_ff=28672, max_seq_len=8192, rope_theta=500000.0),
    # Llama-3.1-405B (meta-llama/Llama-3.1-405B config.json): 405,853,388,800 params.
    "llama-405b": LlamaConfig(vocab_size=128256, n_layer=126, n_head=128, n_kv_head=8,
                              d_model=16384, d_ff=53248, max_seq_len=8192,
                              rope_theta=500000.0),
}


def get_config(preset: str, **overrides: Any) -> GPTConfig | LlamaConfig:
    """The config of ``preset`` with ``overrides`` replacing its fields.

    Raises:
        ValueError: unknown preset, or an override that is not a field of the config.
    """
    if preset not in PRESETS:
        raise ValueError(message("remat.models", f"unknown preset {preset!r}",
                                 {"known presets": ", ".join(PRESETS)},
                                 fix="pass one of the known presets"))
    config = PRESETS[preset]
    fields = [f.name for f in dataclasses.fields(config)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ValueError(message(
            "remat.models", f"{type(config).__name__} has no field(s) {', '.join(unknown)}",
            {"preset": repr(preset), "valid fields": ", ".join(fields)},
            fix="override valid fields only"))
    return dataclasses.replace(config, **overrides) if overrides else config


def model_from_config(config: GPTConfig | LlamaConfig) -> nn.Module:
    """Instantiate the model class that matches ``config``."""
    if isinstance(config, GPTConfig):
        return GPT(config)
    if isinstance(config, LlamaConfig):
        return Llama(config)
    raise TypeError(message("remat.models", "expected a GPTConfig or LlamaConfig",
                            {"found": type(config).__name__},
                            fix="pass a GPTConfig or LlamaConfig"))


def build_model(preset: str, **overrides: Any) -> nn.Module:
    """Build a built-in model from a named preset.

    Parameters are created on the current default device, so
    ``with torch.device("meta"): build_model("llama-7b")`` costs no memory.

    Args:
        preset: a key of :data:`PRESETS` ("gpt-tiny", "gpt-small", "gpt2-124m", "llama-tiny",
            "llama-small", "llama-1b", "llama-7b", "llama-70b", "llama-405b").
        **overrides: config fields to replace, e.g. ``n_layer=4, dropout=0.0``.

    Returns:
        A :class:`~remat.models.GPT` or :class:`~remat.models.Llama`, in train mode.

    Raises:
        ValueError: unknown preset or unknown field.

    Example::

        >>> model = build_model("gpt-tiny", dropout=0.0)
        >>> model.config.n_layer
        2
    """
    return model_from_config(get_config(preset, **overrides))
