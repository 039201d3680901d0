"""Fused QKV projections and transposed linears under tensor parallelism: layouts read from
the model (NOTE [ Fused projections ]) and one rank's simulated bytes, by hand."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from torch import nn

from remat.distributed.tensor_parallel import rank_param_bytes, tp_roles
from remat.distributed.tp_fused import natural_order, rank_major
from remat.distributed.tp_layout import fused_of
from remat.distributed.tp_step import simulate_ranks
from remat.errors import RematError
from remat.models import build_model

transformers = pytest.importorskip("transformers")


def gpt2() -> nn.Module:
    """Hugging Face GPT-2: Conv1D (weights (in, out)), [q|k|v] in ``c_attn``; no dropout
    (gloo ranks would draw their own masks)."""
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(  # type: ignore[no-any-return]
        vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=32,
        tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def neox() -> nn.Module:
    """GPT-NeoX: ``query_key_value`` interleaved per head ([heads, 3, head_dim])."""
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(  # type: ignore[no-any-return]
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=32, tie_word_embeddings=False))


def falcon(**config: Any) -> nn.Module:
    """Falcon (a sequential block unless ``config`` says otherwise); the fused layout by
    ``config``."""
    config = {"parallel_attn": False, **config}
    return transformers.FalconForCausalLM(transformers.FalconConfig(  # type: ignore[no-any-return]
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        tie_word_embeddings=False, **config))


def falcon_grouped() -> nn.Module:
    """Falcon's new decoder architecture: 2 groups of (2 q, 1 k, 1 v) heads in
    ``query_key_value``, a parallel block adding in place to the MLP's output."""
    return falcon(new_decoder_architecture=True, num_kv_heads=2, parallel_attn=True)


def phi3() -> nn.Module:
    """Phi-3: ``qkv_proj`` sliced into q, k, v (2 key/value heads), ``gate_up_proj`` chunked."""
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(  # type: ignore[no-any-return]
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        pad_token_id=0, tie_word_embeddings=False))


def falcon_mqa() -> nn.Module:
    return falcon(multi_query=True)


class LitLlama(nn.Module):
    """litgpt's Llama (GQA: 4 query heads, 2 key/value groups, [q|k|v] in ``attn.qkv``),
    called as a Hugging Face causal LM."""

    def __init__(self) -> None:
        super().__init__()
        litgpt = pytest.importorskip("litgpt")
        self.gpt = litgpt.GPT(litgpt.Config(
            block_size=32, vocab_size=128, padded_vocab_size=128, n_layer=2, n_head=4,
            n_query_groups=2, n_embd=64, intermediate_size=128, mlp_class_name="LLaMAMLP",
            norm_class_name="RMSNorm", bias=False, rotary_percentage=1.0,
            parallel_residual=False))
        self.config = types.SimpleNamespace(vocab_size=128)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        logits = self.gpt(input_ids)
        return types.SimpleNamespace(loss=nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten()))


def test_rank_major_gives_each_rank_its_heads_and_natural_order_undoes_it() -> None:
    w = torch.arange(16.0).view(16, 1)  # q: rows 0-7, k: 8-11, v: 12-15
    ranked = rank_major(w, 0, (8, 4, 4), 2)
    assert ranked[:8].flatten().tolist() == [0, 1, 2, 3, 8, 9, 12, 13]  # rank 0's shard
    assert torch.equal(natural_order(ranked, 0, (8, 4, 4), 2), w)


@pytest.mark.parametrize(("factory", "fused", "sections"), [
    (gpt2, "transformer.h.0.attn.c_attn", (64, 64, 64)),                   # split(E)
    (neox, "gpt_neox.layers.0.attention.query_key_value", (192,)),         # per head
    (falcon, "transformer.h.0.self_attention.query_key_value", (64, 16, 16)),  # MQA heads
    (falcon_grouped, "transformer.h.0.self_attention.query_key_value", (128,)),  # groups
    (LitLlama, "gpt.transformer.h.0.attn.qkv", (64, 32, 32)),              # split(q, k, v)
    (lambda: build_model("gpt-tiny", n_layer=2), "blocks.0.attn.qkv", (64, 64, 64)),
    (phi3, "model.layers.0.self_attn.qkv_proj", (64, 32, 32)),             # qkv[..., :q]
    (phi3, "model.layers.0.mlp.gate_up_proj", (128, 128)),                 # chunk(2)
])
def test_fused_layout_is_read_from_the_model(factory: Any, fused: str,
                                             sections: tuple[int, ...]) -> None:
    model = factory()
    roles = tp_roles(model)
    assert roles[fused] == "fused"
    assert fused_of(model, roles, api="test")[fused][0] == sections


def _hand_rank_params(model: nn.Module, t: int, whole: tuple[str, ...]) -> int:
    """Rank 0's parameter bytes: every weight and bias split ``t`` ways but the norms', the
    rowwise linears' biases and the modules named in ``whole`` (position embeddings)."""
    total = 0
    for name, p in model.named_parameters():
        keep = "ln" in name or "norm" in name or any(w in name for w in whole)
        total += p.numel() * 4 // (1 if keep else t)
    return total


@pytest.mark.parametrize(("factory", "whole"), [
    (falcon_grouped, ()),
    (LitLlama, ()),
])
def test_one_rank_holds_half_of_every_sharded_weight(factory: Any,
                                                     whole: tuple[str, ...]) -> None:
    model = factory()
    (rank,) = simulate_ranks(factory, seq_len=16, points=[("full", 2)], tp=2,
                             sequence_parallel=False, dtype="fp32", optimizer="none")
    assert rank.param_bytes == _hand_rank_params(model, 2, whole)
    assert rank.param_bytes == rank_param_bytes(model, tp_roles(model), 2)


def test_one_key_value_head_is_refused_and_an_mlp_only_plan_runs() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    with pytest.raises(RematError, match="cannot give each of 2 ranks whole heads") as info:
        simulate_ranks(falcon_mqa, seq_len=16, points=[("none", 1)], tp=2,
                       sequence_parallel=False, dtype="fp32", optimizer="none")
    assert "parts tp does not divide: [16, 16]" in str(info.value)
    assert "tp_plan=" in str(info.value)
    plan = {"mlp.dense_h_to_4h": ColwiseParallel(), "mlp.dense_4h_to_h": RowwiseParallel()}
    (rank,) = simulate_ranks(falcon_mqa, seq_len=16, points=[("none", 1)], tp=2,
                             sequence_parallel=False, dtype="fp32", optimizer="none",
                             tp_plan=plan)
    model = falcon_mqa()
    assert rank.param_bytes == _hand_rank_params(model, 2, (
        "word_embeddings", "lm_head", "self_attention", "dense_4h_to_h.bias"))


@pytest.mark.parametrize("seed", [7, 8])  # GPT-NeoX (fused); Qwen2 with one k/v head
def test_generated_decoders_are_sharded_or_refused_with_a_remat_error(seed: int) -> None:
    from tests.generated_models import generated_model

    drawn = generated_model(seed)
    try:
        (rank,) = simulate_ranks(drawn.model, seq_len=8, points=[("none", 1)], tp=2,
                                 sequence_parallel=False, dtype="fp32", optimizer="none")
    except RematError as error:
        assert "fix:" in str(error), drawn.label
        return
    assert rank.param_bytes == rank_param_bytes(drawn.model, tp_roles(drawn.model), 2), \
        drawn.label
