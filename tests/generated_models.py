"""Seeded random Hugging Face decoders: the held-out models no fixed set can be tuned to.

``generated_model(seed)`` draws a family (dense rotary, GQA, parallel attention + MLP
(GPT-NeoX), learned positions with dropout, mixture of experts (Mixtral, OLMoE,
Qwen2-MoE)), a depth, a width, heads, dropout on
or off and tied or untied heads from ``random.Random(seed)``, and builds the model with
random weights (no downloads). The same seed always gives the same model and batch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["GeneratedModel", "generated_model"]

_VOCAB = 96


@dataclass(frozen=True)
class GeneratedModel:
    """A drawn model: its description (for test ids and messages), model and batch."""

    label: str
    model: nn.Module
    batch: dict[str, torch.Tensor]


#: Families drawn from a second stream (``_LATER_SHARE`` of the seeds), so that adding them
#: left the models every other seed draws as they were: OLMoE's and Qwen2-MoE's top-k
#: routers with per-expert loops (Qwen2-MoE with a gated shared expert). Parallel attention
#: + MLP comes from GPT-NeoX. No family of benchmarks/planner.py's held-out set is drawn
#: (tests/benchmarks/test_planner_held_out.py checks this file too).
_LATER = ("olmoe", "qwen2_moe")
_LATER_SHARE = 0.25


def _config(rng: random.Random, seed: int) -> tuple[str, dict[str, Any]]:
    family = rng.choice(("llama", "qwen2", "gpt_neox", "opt", "mixtral", "phi"))
    later = random.Random(f"{seed}-family")
    if later.random() < _LATER_SHARE:
        family = later.choice(_LATER)
    heads = rng.choice((2, 4))
    width = heads * rng.choice((8, 12, 16))
    depth = rng.randint(2, 4)
    dropout = rng.choice((0.0, 0.1))
    tied = rng.random() < 0.5
    common: dict[str, Any] = {"vocab_size": _VOCAB, "hidden_size": width,
                              "num_hidden_layers": depth, "num_attention_heads": heads,
                              "max_position_embeddings": 64, "tie_word_embeddings": tied}
    ffn = width * rng.choice((2, 3, 4))
    if family == "olmoe":
        common.update(intermediate_size=width, num_key_value_heads=rng.choice((1, heads)),
                      num_experts=rng.choice((2, 4)), num_experts_per_tok=2,
                      attention_dropout=dropout)
    elif family == "qwen2_moe":
        common.update(intermediate_size=ffn, num_key_value_heads=rng.choice((1, heads)),
                      num_experts=rng.choice((2, 4)), num_experts_per_tok=2,
                      moe_intermediate_size=width, shared_expert_intermediate_size=width,
                      attention_dropout=dropout)
    elif family in ("llama", "qwen2", "mixtral"):
        common.update(intermediate_size=ffn, num_key_value_heads=rng.choice((1, heads)),
                      attention_dropout=dropout)
        if family == "mixtral":
            common.update(num_local_experts=rng.choice((2, 4)), num_experts_per_tok=2)
    elif family == "gpt_neox":
        common.update(intermediate_size=ffn, use_parallel_residual=rng.random() < 0.7,
                      attention_dropout=dropout, hidden_dropout=dropout,
                      rotary_pct=rng.choice((0.25, 1.0)))
    elif family == "phi":
        common.update(intermediate_size=ffn, resid_pdrop=dropout, attention_dropout=dropout,
                      partial_rotary_factor=rng.choice((0.5, 1.0)))
    else:  # opt: learned positions, ReLU MLP, dropout
        common.update(ffn_dim=ffn, word_embed_proj_dim=width, dropout=dropout,
                      attention_dropout=dropout)
    return family, common


def generated_model(seed: int, *, batch_size: int = 2, seq: int = 32) -> GeneratedModel:
    """The decoder drawn by ``seed``, in train mode, and a batch with labels."""
    transformers = __import__("transformers")
    rng = random.Random(seed)
    family, config = _config(rng, seed)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(family, **config)).train()
    ids = torch.randint(0, _VOCAB, (batch_size, seq),
                        generator=torch.Generator().manual_seed(seed))
    parallel = config.get("use_parallel_residual") or config.get("parallel_attn")
    label = (f"{family}-L{config['num_hidden_layers']}-d{config['hidden_size']}"
             f"-h{config['num_attention_heads']}"
             f"{'-tied' if config['tie_word_embeddings'] else ''}"
             f"{'-drop' if config.get('dropout') or config.get('attention_dropout') else ''}"
             f"{'-parallel' if parallel else ''}")
    return GeneratedModel(label, model, {"input_ids": ids, "labels": ids.clone()})
