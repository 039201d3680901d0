"""Tests for remat.models: shapes, loss, determinism, GQA, presets, make_batch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from remat.models import (
    GPT,
    PRESETS,
    GPTConfig,
    LlamaBlock,
    LlamaConfig,
    LMOutput,
    build_model,
    make_batch,
)
from remat.models.llama import apply_rotary, rotary_cos_sin

TINY = ["gpt-tiny", "llama-tiny"]


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("preset", TINY)
def test_forward_shapes_and_finite_loss(preset):
    torch.manual_seed(0)
    model = build_model(preset)
    batch = make_batch(model, batch_size=3, seq_len=16)
    out = model(**batch)
    assert isinstance(out, LMOutput)
    assert out.logits.shape == (3, 16, model.config.vocab_size)
    assert out.loss is not None and out.loss.dtype == torch.float32 and out.loss.ndim == 0
    # Random init: loss is close to ln(vocab).
    assert abs(out.loss.item() - math.log(model.config.vocab_size)) < 0.5
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert model(batch["input_ids"]).loss is None


@pytest.mark.parametrize("preset", TINY)
def test_loss_is_shifted_next_token_cross_entropy(preset):
    model = build_model(preset).eval()
    batch = make_batch(model, batch_size=2, seq_len=8, seed=3)
    out = model(**batch)
    V = model.config.vocab_size
    logits, labels = out.logits[:, :-1].reshape(-1, V), batch["labels"][:, 1:].reshape(-1)
    expected = F.cross_entropy(logits, labels)
    torch.testing.assert_close(out.loss, expected)


@pytest.mark.parametrize("preset", TINY)
def test_init_is_deterministic_given_seed(preset):
    torch.manual_seed(123)
    a = build_model(preset)
    torch.manual_seed(123)
    b = build_model(preset)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    batch = make_batch(a, 2, 8)
    torch.manual_seed(7)
    la = a(**batch).loss
    torch.manual_seed(7)
    lb = b(**batch).loss
    assert torch.equal(la, lb)


def test_init_statistics():
    torch.manual_seed(0)
    model = build_model("gpt-small")
    assert abs(model.tok_emb.weight.std().item() - 0.02) < 1e-3
    assert torch.count_nonzero(model.blocks[0].attn.qkv.bias) == 0
    # Residual projections scaled by 1/sqrt(2 * n_layer) (GPT-2 paper, section 2.3).
    expected = 0.02 / math.sqrt(2 * model.config.n_layer)
    assert abs(model.blocks[0].mlp.proj.weight.std().item() - expected) < 1e-3


def test_gpt_ties_lm_head_by_default():
    model = build_model("gpt-tiny")
    assert model.lm_head.weight is model.tok_emb.weight
    untied = build_model("gpt-tiny", tie_weights=False)
    assert untied.lm_head.weight is not untied.tok_emb.weight
    d, V = 64, 256
    assert n_params(untied) - n_params(model) == d * V


def test_gpt_block_structure_and_dropout_modes():
    model = build_model("gpt-tiny")
    block = model.blocks[0]
    assert isinstance(model.blocks, torch.nn.ModuleList)
    assert {"ln_1", "attn", "ln_2", "mlp"} <= dict(block.named_children()).keys()
    x = torch.randn(2, 8, 64)
    model.eval()
    assert torch.equal(block(x), block(x))
    model.train()
    assert not torch.equal(block(x), block(x))  # dropout 0.1 is active


def test_llama_gqa_shapes_and_block_signature():
    torch.manual_seed(0)
    model = build_model("llama-tiny")
    cfg = model.config
    block = model.blocks[0]
    assert isinstance(block, LlamaBlock)
    assert block.attn.k_proj.weight.shape == (cfg.n_kv_head * cfg.head_dim, cfg.d_model)
    assert block.attn.q_proj.weight.shape == (cfg.n_head * cfg.head_dim, cfg.d_model)
    assert all(m.bias is None for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert model.lm_head.weight is not model.tok_emb.weight
    x = torch.randn(2, 8, cfg.d_model)
    cos, sin = rotary_cos_sin(8, cfg.head_dim, cfg.rope_theta, device=x.device, dtype=x.dtype)
    assert cos.shape == sin.shape == (8, cfg.head_dim)
    assert block(x, cos, sin).shape == x.shape


def test_llama_gqa_equals_repeated_kv_heads():
    """GQA with n_kv_head=2 equals MHA whose k/v weights repeat each kv head's rows."""
    torch.manual_seed(0)
    gqa = build_model("llama-tiny").eval()
    mha = build_model("llama-tiny", n_kv_head=4).eval()
    sd = gqa.state_dict()
    hs, group = gqa.config.head_dim, gqa.config.n_head // gqa.config.n_kv_head
    for key, value in list(sd.items()):
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            sd[key] = value.view(-1, hs, value.size(1)).repeat_interleave(group, 0).flatten(0, 1)
    mha.load_state_dict(sd)
    ids = make_batch(gqa, 2, 12)["input_ids"]
    torch.testing.assert_close(gqa(ids).logits, mha(ids).logits, rtol=1e-5, atol=1e-5)


def test_rope_is_a_rotation_and_relative():
    cos, sin = rotary_cos_sin(6, 8, 10000.0, device=torch.device("cpu"), dtype=torch.float32)
    q = torch.randn(1, 1, 6, 8)
    rq = apply_rotary(q, cos, sin)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    torch.testing.assert_close(rq[..., 0, :], q[..., 0, :])  # position 0: identity
    # Dot products depend only on the offset between positions.
    same = q[..., :1, :].expand(1, 1, 6, 8)
    r = apply_rotary(same, cos, sin)[0, 0]
    torch.testing.assert_close(r[1] @ r[3], r[2] @ r[4], rtol=1e-5, atol=1e-5)


def test_llama_is_causal():
    model = build_model("llama-tiny").eval()
    ids = make_batch(model, 1, 10)["input_ids"]
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % model.config.vocab_size
    torch.testing.assert_close(model(ids).logits[:, :-1], model(changed).logits[:, :-1])


# Real sizes: GPT-2 small 124,439,808; Llama-3.2-1B 1,235,814,400 (tied);
# Llama-2-7B 6,738,415,616; Llama-3.1-70B 70,553,706,496; Llama-3.1-405B 405,853,388,800.
# Counted on the meta device: nothing is allocated.
@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ("gpt-tiny", 118_528),
        ("llama-tiny", 125_248),
        ("gpt2-124m", 124_439_808),
        ("llama-1b", 1_235_814_400),
        ("llama-7b", 6_738_415_616),
        ("llama-70b", 70_553_706_496),
        ("llama-405b", 405_853_388_800),
    ],
)
def test_preset_parameter_counts_on_meta(preset, expected):
    with torch.device("meta"):
        model = build_model(preset)
    assert n_params(model) == expected
    assert all(p.is_meta for p in model.parameters())


def test_presets_match_the_spec():
    assert set(PRESETS) >= {"gpt-tiny", "gpt-small", "gpt2-124m", "llama-tiny", "llama-small",
                            "llama-1b", "llama-7b"}
    small = PRESETS["gpt-small"]
    assert (small.n_layer, small.d_model, small.n_head, small.vocab_size, small.max_seq_len) == (
        6, 256, 8, 4096, 128)
    l1b = PRESETS["llama-1b"]
    assert isinstance(l1b, LlamaConfig)
    assert (l1b.n_kv_head, l1b.d_ff, l1b.rope_theta, l1b.max_seq_len) == (8, 8192, 500000.0, 4096)
    assert PRESETS["llama-7b"].n_kv_head == 32


def test_build_model_overrides_and_errors():
    model = build_model("gpt-tiny", n_layer=3, dropout=0.0)
    assert isinstance(model, GPT) and len(model.blocks) == 3 and model.config.dropout == 0.0
    assert PRESETS["gpt-tiny"].n_layer == 2  # presets are not mutated
    with pytest.raises(ValueError,
                       match=r"(?s)^remat.models: unknown preset 'gpt-huge'.*gpt-tiny.*llama-7b"):
        build_model("gpt-huge")
    with pytest.raises(ValueError,
                       match=r"(?s)GPTConfig has no field\(s\) n_kv_head.*valid fields"):
        build_model("gpt-tiny", n_kv_head=2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"d_model": 65}, "not divisible by n_head=4"),
        ({"n_layer": 0}, "n_layer must be a positive integer\n  found: 0"),
        ({"dropout": 1.0}, r"dropout must be in \[0, 1\)\n  found: 1.0"),
    ],
)
def test_gpt_config_validation(kwargs, match):
    base = {"vocab_size": 256, "n_layer": 2, "n_head": 4, "d_model": 64, "max_seq_len": 32}
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**base, **kwargs})


def test_llama_config_validation():
    with pytest.raises(ValueError, match="n_head=4 is not divisible by n_kv_head=3"):
        build_model("llama-tiny", n_kv_head=3)
    with pytest.raises(ValueError, match="head_dim=9 .* must be even"):
        build_model("llama-tiny", d_model=36)


def test_forward_rejects_too_long_sequences():
    model = build_model("gpt-tiny")
    with pytest.raises(ValueError, match="sequence length 33 exceeds max_seq_len=32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_make_batch_contents_and_determinism():
    b1 = make_batch("llama-tiny", 4, 16, seed=1)
    b2 = make_batch(PRESETS["llama-tiny"], 4, 16, seed=1)
    b3 = make_batch("llama-tiny", 4, 16, seed=2)
    assert set(b1) == {"input_ids", "labels"}
    assert b1["input_ids"].shape == (4, 16) and b1["input_ids"].dtype == torch.long
    assert torch.equal(b1["input_ids"], b1["labels"])
    assert b1["labels"].data_ptr() != b1["input_ids"].data_ptr()
    assert torch.equal(b1["input_ids"], b2["input_ids"])
    assert not torch.equal(b1["input_ids"], b3["input_ids"])
    assert 0 <= b1["input_ids"].min() and b1["input_ids"].max() < 256
    assert make_batch(build_model("gpt-tiny"), 2)["input_ids"].shape == (2, 32)  # default seq


def test_make_batch_leaves_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    make_batch("gpt-tiny", 2)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0,), "batch_size must be an integer >= 1\n  found: 0"),
        ((2, 33), "seq_len=33 exceeds the model's max_seq_len=32"),
        ((2, 1), "seq_len must be an integer >= 2"),
    ],
)
def test_make_batch_validation(args, match):
    with pytest.raises(ValueError, match=match):
        make_batch("gpt-tiny", *args)


def test_make_batch_rejects_foreign_models():
    with pytest.raises(TypeError, match="expected a built-in model"):
        make_batch(torch.nn.Linear(2, 2), 2)
