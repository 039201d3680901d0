"""Tiny Hugging Face models built in-process (random weights, no downloads) for measure tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["ARCHITECTURES", "build_hf"]

#: model_type -> (config overrides, head): every architecture family the simulation must match.
ARCHITECTURES: dict[str, tuple[dict[str, Any], str]] = {
    "llama": ({}, "causal"),
    "mistral": ({}, "causal"),
    "qwen2": ({}, "causal"),
    "phi": ({}, "causal"),
    "gemma": ({"head_dim": 8}, "causal"),
    "gpt_neox": ({}, "causal"),
    "gpt2": ({"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}, "causal"),
    "mixtral": ({"num_local_experts": 4, "num_experts_per_tok": 2}, "causal"),
    "qwen2_moe": ({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32}, "causal"),
    "olmoe": ({"num_experts": 4, "num_experts_per_tok": 2}, "causal"),
    "bert": ({}, "masked"),
    "deberta-v2": ({"relative_attention": True, "pos_att_type": ["p2c", "c2p"],
                    "position_buckets": 16, "max_relative_positions": -1,
                    "norm_rel_ebd": "layer_norm", "share_att_key": True,
                    "position_biased_input": False}, "masked"),
    "t5": ({"d_model": 32, "d_ff": 64, "d_kv": 8, "num_layers": 2, "num_heads": 4,
            "decoder_start_token_id": 0, "pad_token_id": 0}, "seq2seq"),
}

_COMMON = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
_VOCAB = 128


def build_hf(model_type: str, *, batch_size: int = 2, seq: int = 16,
             dtype: torch.dtype = torch.float32,
             **config: Any) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A 2-layer ``model_type`` in train mode (seed 0) and a batch with labels; ``config``
    overrides the configuration (e.g. ``num_hidden_layers=1``)."""
    transformers = __import__("transformers")
    overrides, head = ARCHITECTURES[model_type]
    common = {} if model_type in ("gpt2", "t5") else dict(_COMMON)
    if model_type in ("gpt_neox", "bert", "deberta-v2", "phi"):
        common.pop("num_key_value_heads")
    config = transformers.AutoConfig.for_model(model_type, vocab_size=_VOCAB,
                                               **{**common, **overrides, **config})
    torch.manual_seed(0)
    auto = {"causal": transformers.AutoModelForCausalLM,
            "masked": transformers.AutoModelForMaskedLM,
            "seq2seq": transformers.AutoModelForSeq2SeqLM}[head]
    model = auto.from_config(config, dtype=dtype).train()
    ids = torch.randint(0, _VOCAB, (batch_size, seq))
    labels = torch.randint(0, _VOCAB, (batch_size, seq // 2)) if head == "seq2seq" else ids.clone()
    return model, {"input_ids": ids, "labels": labels}
