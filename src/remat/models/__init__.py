"""Built-in models for tests, demos and simulation: a GPT-2 style and a Llama style decoder.

Example::

    >>> from remat.models import build_model, make_batch
    >>> model = build_model("gpt-tiny")
    >>> loss = model(**make_batch(model, batch_size=2)).loss
"""

from __future__ import annotations

from remat.models.common import LMOutput
from remat.models.data import make_batch
from remat.models.gpt import GPT, GPTMLP, CausalSelfAttention, GPTBlock, GPTConfig
from remat.models.llama import (
    Llama,
    LlamaAttention,
    LlamaBlock,
    LlamaConfig,
    LlamaMLP,
    RMSNorm,
)
from remat.models.presets import PRESETS, ModelConfig, build_model, get_config, model_from_config

__all__ = [
    "GPT",
    "PRESETS",
    "CausalSelfAttention",
    "GPTBlock",
    "GPTConfig",
    "GPTMLP",
    "LMOutput",
    "Llama",
    "LlamaAttention",
    "LlamaBlock",
    "LlamaConfig",
    "LlamaMLP",
    "ModelConfig",
    "RMSNorm",
    "build_model",
    "get_config",
    "make_batch",
    "model_from_config",
]
