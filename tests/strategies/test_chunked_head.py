"""``chunked_head``: the output head and loss in token slices (NOTE [ Chunked head ]).

Gradient parity against the un-chunked model (loss to 1e-6 relative, every parameter's
gradient to float rounding) on Hugging Face Llama, GPT-2 (tied head) and Gemma2 (logit
softcapping) and on the built-in GPT and Llama; the recompute counted in FLOPs; the bytes
saved, tracked and on the CPU allocator, real and simulated.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import remat
from loading import load_measure_helper
from remat.errors import StrategyError
from remat.models import build_model
from remat.strategies import applied, apply, apply_decisions, parse_strategy, remove
from remat.strategies.builtin import ChunkedHead, Full
from remat.strategies.head import HEAD_KEY, chunked_next_token_loss, head_of

transformers = pytest.importorskip("transformers")




allocator_util = load_measure_helper("allocator_util")

_SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
          "use_cache": False}
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": _SMALL,
    "gemma2": {**_SMALL, "head_dim": 8, "final_logit_softcapping": 3.0},
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 128, "use_cache": False,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0,
             "eos_token_id": 0},
}


def _hf(model_type: str, vocab: int = 512, **overrides: Any) -> nn.Module:
    config = transformers.AutoConfig.for_model(model_type, vocab_size=vocab,
                                               **{**CONFIGS[model_type], **overrides})
    torch.manual_seed(0)
    model: nn.Module = transformers.AutoModelForCausalLM.from_config(config).train()
    return model


def _batch(vocab: int, batch: int = 2, seq: int = 64) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq))
    labels = ids.clone()
    labels[0, :7] = -100  # a prompt left out of the loss
    labels[1, 30:33] = -100
    return {"input_ids": ids, "labels": labels}


def _step(model: nn.Module, batch: dict[str, torch.Tensor]
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                               if p.grad is not None}


def _assert_parity(model: nn.Module, batch: dict[str, torch.Tensor], strategy: str) -> None:
    expected_loss, expected = _step(model, batch)
    apply(model, strategy)
    loss, grads = _step(model, batch)
    remove(model)
    assert torch.allclose(loss, expected_loss, rtol=1e-6, atol=0), (loss, expected_loss)
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "gemma2"])
@pytest.mark.parametrize("chunks", [1, 5])  # 5 does not divide 2 x 64 tokens
def test_hf_gradient_parity(model_type: str, chunks: int) -> None:
    model = _hf(model_type)
    _assert_parity(model, _batch(512), f"chunked_head:{chunks}")


def test_gpt2_head_is_tied_and_gets_both_gradients() -> None:
    model = _hf("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    _assert_parity(model, _batch(512, seq=63), "full+chunked_head:4")


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])
def test_builtin_gradient_parity(preset: str) -> None:
    model = build_model(preset, vocab_size=1024, max_seq_len=128, dropout=0.0) \
        if preset.startswith("gpt") else build_model(preset, vocab_size=1024, max_seq_len=128)
    _assert_parity(model, _batch(1024, seq=100), "every:2+chunked_head:3")


def test_num_items_in_batch_and_shift_labels_as_hugging_face() -> None:
    model = _hf("llama")
    batch = _batch(512)
    shifted = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[..., 1:]
    _assert_parity(model, {**batch, "num_items_in_batch": torch.tensor(77)}, "chunked_head:3")
    _assert_parity(model, {"input_ids": batch["input_ids"], "labels": batch["labels"],
                           "shift_labels": shifted.flip(-1).contiguous()}, "chunked_head:3")


def test_head_is_recomputed_once_in_backward() -> None:
    """Exactly one extra output projection: 2 * tokens * d * V FLOPs."""
    model, batch = _hf("llama", vocab=1024), _batch(1024)

    def flops() -> int:
        with FlopCounterMode(display=False) as counter:
            model(**batch).loss.backward()
        return int(counter.get_total_flops())

    plain = flops()
    apply(model, "chunked_head:4")
    chunked = flops()
    assert chunked - plain == 2 * 2 * 64 * 32 * 1024


def test_output_without_labels_is_unchanged_and_loss_output_has_no_logits() -> None:
    model = _hf("llama")
    batch = _batch(512)
    expected = model(input_ids=batch["input_ids"]).logits
    apply(model, "chunked_head:4")
    assert torch.equal(model(input_ids=batch["input_ids"]).logits, expected)
    out = model(**batch)
    assert out.logits is None and out.loss is not None
    assert "logits" not in out.keys()


def test_apply_remove_pickle_and_state_dict() -> None:
    model = _hf("gpt2")
    keys = list(model.state_dict())
    apply(model, "full+chunked_head:4")
    assert list(model.state_dict()) == keys
    info = applied(model)
    assert info is not None and info.decisions[0] == (HEAD_KEY, "chunked_head(chunks=4)")
    clone = pickle.loads(pickle.dumps(model))
    assert head_of(clone) == head_of(model) and head_of(clone) is not None
    assert clone.forward.__self__ is clone
    assert copy.deepcopy(model).forward.__self__ is not model
    remove(model)
    assert head_of(model) is None and "forward" not in model.__dict__
    assert model(**_batch(512)).logits is not None


def test_parse_label_and_decisions() -> None:
    assert parse_strategy("chunked_head:8") == ChunkedHead(chunks=8)
    assert parse_strategy("chunked_head(chunks=3)") == ChunkedHead(chunks=3)
    assert parse_strategy("chunked_head") == ChunkedHead(chunks=8)
    assert str(ChunkedHead(2)) == "chunked_head:2"
    with pytest.raises(StrategyError, match=r"(?s)^remat.apply: cannot read.*fix: write "
                                            r"chunked_head:N"):
        apply(_hf("llama"), "chunked_head:0")
    with pytest.raises(ValueError, match="chunks must be an int >= 1"):
        ChunkedHead(chunks=0)


def test_decisions_put_the_head_under_its_key_only() -> None:
    model = _hf("llama")
    apply_decisions(model, {"model.layers.0": Full(), HEAD_KEY: ChunkedHead(2)})
    assert head_of(model) is not None
    with pytest.raises(StrategyError, match=r"(?s)^remat.apply: 'chunked_head\(chunks=2\)' "
                                            r"cannot be decided for 'model.layers.0'.*fix:"):
        apply_decisions(model, {"model.layers.0": ChunkedHead(2)})
    with pytest.raises(StrategyError, match=r"^remat.apply: 'full' cannot be decided"):
        apply_decisions(model, {HEAD_KEY: Full()})
    with pytest.raises(StrategyError, match=r"(?s)^remat.apply: sqrt does not combine"):
        apply(model, "sqrt+chunked_head:2")
    with pytest.raises(StrategyError, match=r"(?s)^remat.apply: full\+every:2 decides"):
        apply(model, "full+every:2")


def test_refuses_what_it_cannot_reproduce() -> None:
    config = transformers.AutoConfig.for_model("bert", vocab_size=128, hidden_size=32,
                                               num_hidden_layers=2, num_attention_heads=4,
                                               intermediate_size=64)
    bert = transformers.AutoModelForMaskedLM.from_config(config).train()
    with pytest.raises(StrategyError, match=r"(?s)^remat.apply: chunked_head cannot reproduce "
                                            r"the loss of BertForMaskedLM.*fix:"):
        apply(bert, "chunked_head:2")
    cohere_config = transformers.AutoConfig.for_model("cohere", vocab_size=128, **_SMALL)
    cohere = transformers.AutoModelForCausalLM.from_config(cohere_config).train()
    apply(cohere, "chunked_head:2")
    with pytest.raises(StrategyError, match=r"(?s)^CohereForCausalLM.forward with chunked_head: "
                                            r"the forward changes the logits.*fix:"):
        cohere(**_batch(128, seq=16))
    llama = _hf("llama")
    apply(llama, "chunked_head:2")
    with pytest.raises(StrategyError, match=r"(?s)labels do not line up.*fix:"):
        llama(**_batch(512, seq=16), logits_to_keep=4)


def test_loss_function_matches_cross_entropy_on_odd_chunks() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(3, 11, 8, requires_grad=True)
    weight = torch.randn(40, 8, requires_grad=True)
    labels = torch.randint(0, 40, (3, 11))
    labels[2, :] = -100
    logits = hidden @ weight.T
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 40),
                                                 labels[:, 1:].reshape(-1))
    for chunks in (1, 4, 7, 33, 50):
        got = chunked_next_token_loss(hidden, labels, weight, chunks=chunks)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    g1 = torch.autograd.grad(expected, (hidden, weight))
    g2 = torch.autograd.grad(chunked_next_token_loss(hidden, labels, weight, chunks=7),
                             (hidden, weight))
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def _head_heavy() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Vocabulary 4096, d 32: the logits dominate the step."""
    model = build_model("llama-tiny", vocab_size=4096, d_model=32, n_head=2, n_kv_head=1,
                        d_ff=64, max_seq_len=128)
    return model, _batch(4096, seq=128)


def test_profile_saves_the_logits_bytes_tracked_allocated_and_simulated() -> None:
    model, batch = _head_heavy()
    logits_bytes = 2 * 128 * 4096 * 4  # B * S * V float32
    peaks: dict[str, int] = {}
    for strategy in ("none", "chunked_head:8"):
        apply(model, strategy)
        prof = remat.profile(model, batch, timing=False)
        static = prof.param_bytes + prof.buffer_bytes + prof.batch_bytes
        alloc = allocator_util.allocator_step_peak(model, batch, baseline_bytes=static)
        assert prof.peak_bytes == alloc.absolute_peak_bytes, (strategy, prof.peak_bytes,
                                                              alloc.absolute_peak_bytes)
        simulated = remat.profile(model, batch, simulate=True)
        assert simulated.peak_bytes == prof.peak_bytes, (strategy, simulated.peak_bytes)
        peaks[strategy] = prof.peak_bytes
    saved = peaks["none"] - peaks["chunked_head:8"]
    assert saved >= 0.6 * logits_bytes, (
        f"saved {saved} B of {logits_bytes} B logits ({saved / logits_bytes:.2f})")
