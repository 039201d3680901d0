"""Hugging Face models built from config classes on the meta device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from remat.simulate.hf import hf_config_from_name, hf_model_from_config_file, hf_model_from_name

TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128)


def _n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_llama_tiny_on_meta_with_exact_parameter_count() -> None:
    model = hf_model_from_name("llama", dtype=torch.bfloat16, **TINY_LLAMA)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.config.use_cache is False and model.training
    # embed 128*64 + head 128*64 + per layer (q 64*64, k,v 64*32 each, o 64*64,
    # gate/up/down 3*64*128, 2 norms 2*64) + final norm 64
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64
    assert _n_params(model) == 2 * 128 * 64 + 2 * per_layer + 64


def test_gpt2_tiny_and_default_sizes() -> None:
    model = hf_model_from_name("gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=100,
                               n_positions=64)
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert next(model.parameters()).is_meta
    assert hf_config_from_name("gpt2").n_embd == 768  # the config class's default
    assert hf_config_from_name("llama").hidden_size == 4096


def test_config_file_and_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **TINY_LLAMA}))
    for where in (tmp_path, tmp_path / "config.json"):
        model = hf_model_from_config_file(where)
        assert model.config.hidden_size == 64 and next(model.parameters()).is_meta


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown Hugging Face model 'nope'"):
        hf_model_from_name("nope")
    with pytest.raises(FileNotFoundError, match="no config file"):
        hf_model_from_config_file(tmp_path / "missing.json")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="has no 'model_type'"):
        hf_model_from_config_file(tmp_path)


def test_simulating_an_hf_model_equals_a_real_cpu_run() -> None:
    from remat.measure import profile
    from remat.simulate.hf import hf_model_from_config
    from remat.simulate.precision import make_optimizer
    from remat.simulate.run import simulate
    from remat.simulate.sim_setup import default_batch

    config = hf_config_from_name("llama", **TINY_LLAMA)
    result = simulate(lambda: hf_model_from_config(config), seq_len=16, batch_sizes=[2],
                      dtype="fp32", strategies=["full"], device="l4")
    assert result.model == "LlamaForCausalLM"
    real = hf_model_from_config(config, device="cpu")
    from remat.strategies import apply

    apply(real, "full")
    prof = profile(real, default_batch(real, 2, 16),
                   optimizer=make_optimizer("adamw", real.parameters()), timing=False)
    row = result.row("full", 2)
    assert (row.peak_bytes, row.activation_bytes, row.flops) == (
        prof.peak_bytes, prof.activation_bytes, prof.flops)
