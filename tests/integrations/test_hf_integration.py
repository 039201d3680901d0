"""remat on Hugging Face transformers models built from tiny configs (no downloads)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from remat.blocks import named_blocks  # noqa: E402
from remat.errors import BlocksNotFound, RematWarning  # noqa: E402
from remat.integrations.hf import (  # noqa: E402
    RematCallback,
    disable_kv_cache,
    prepare_model,
    to_model_batch,
)
from remat.strategies import applied, apply  # noqa: E402
from remat.validation import validate  # noqa: E402

VOCAB = 96
STRATEGIES = ["full", "every:2", "sqrt", "attn", "mlp", "ops", "offload"]


def _gpt2() -> Any:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=VOCAB, bos_token_id=0,
        eos_token_id=0))


def _llama() -> Any:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32))


def _bert() -> Any:
    return transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        vocab_size=VOCAB, max_position_embeddings=32))


def _t5() -> Any:
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, d_kv=8, num_heads=4,
        vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=0))


def _vit() -> Any:
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        image_size=16, patch_size=8, num_labels=3))


MODELS: dict[str, Callable[[], Any]] = {
    "gpt2": _gpt2, "llama": _llama, "bert": _bert, "t5": _t5, "vit": _vit,
}
BLOCKS = {
    "gpt2": ["transformer.h.0", "transformer.h.1"],
    "llama": ["model.layers.0", "model.layers.1"],
    "bert": ["bert.encoder.layer.0", "bert.encoder.layer.1"],
    "t5": ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"],
    "vit": ["vit.layers.0", "vit.layers.1"],
}


def _model(arch: str) -> Any:
    torch.manual_seed(0)
    return MODELS[arch]().train()


def _batch(arch: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if arch == "vit":
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g),
                "labels": torch.randint(0, 3, (2,), generator=g)}
    ids = torch.randint(1, VOCAB, (2, 8), generator=g)
    if arch == "t5":
        return {"input_ids": ids, "labels": torch.randint(1, VOCAB, (2, 6), generator=g)}
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' deprecations
        yield


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_blocks_are_found_in_every_stack(arch: str) -> None:
    model = _model(arch)
    assert [name for name, _ in named_blocks(model)] == BLOCKS[arch]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert", "t5"])
def test_gradients_are_unchanged(arch: str, strategy: str) -> None:
    model = _model(arch)  # dropout on (the configs' defaults): RNG state is replayed
    disable_kv_cache(model)
    if arch == "bert" and strategy == "mlp":
        # BertLayer splits its MLP into `intermediate` and `output`: no single module.
        with pytest.raises(BlocksNotFound,
                           match=r"(?s)no mlp sub-layer in BertLayer.*fix: pass names="):
            validate(model, _batch(arch), strategy)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RematWarning)  # offload on CPU is a no-op notice
        report = validate(model, _batch(arch), strategy)
    assert report.passed, (arch, strategy, report.max_rel_error, report.worst_param)
    assert report.max_rel_error <= 1e-6


def test_remat_apply_alone_turns_off_the_t5_decoder_cache() -> None:
    model = _model("t5")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RematWarning)
        report = validate(model, _batch("t5"), "full")
    assert report.passed


def test_use_cache_is_turned_off_with_a_warning() -> None:
    model = _model("llama")
    assert model.config.use_cache is True
    with pytest.warns(RematWarning, match="use_cache was True"):
        apply(model, "full")
    assert model.config.use_cache is False


def test_t5_sub_stack_caches_are_turned_off_by_prepare_model() -> None:
    model = _model("t5")
    with pytest.warns(RematWarning, match=r"use_cache was True \(the model, 'decoder'\)"):
        prepare_model(model, strategy="full")
    assert all(not getattr(m.config, "use_cache", False) for m in model.modules()
               if hasattr(m, "config"))
    assert disable_kv_cache(model) == []


def test_hf_own_checkpointing_is_detected_and_turned_off() -> None:
    model = _model("llama")
    enable = getattr(model, "activation_checkpointing_enable", None) or \
        model.gradient_checkpointing_enable
    enable()
    own = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
    assert own, "transformers did not turn its checkpointing on"
    with pytest.warns(RematWarning, match="own gradient checkpointing"):
        apply(model, "full")
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RematWarning)
        assert validate(model, _batch("llama"), "full").passed


def test_prepare_model_applies_a_strategy_and_keeps_the_mode() -> None:
    model = _model("gpt2").eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RematWarning)
        prepare_model(model, strategy="ops")
    info = applied(model)
    assert info is not None and info.strategy == "ops"
    assert not model.training
    keys = list(_model("gpt2").state_dict())
    assert list(model.state_dict()) == keys


def test_prepare_model_rejects_bad_arguments() -> None:
    model = _model("gpt2")
    with pytest.raises(ValueError, match="strategy= or budget=, not both"):
        prepare_model(model, strategy="full", budget="1GiB")
    with pytest.raises(ValueError, match="needs batch="):
        prepare_model(model, budget="60%")
    with pytest.raises(ValueError, match="strategy or budget=, not both"):
        RematCallback("full", budget="1GiB")


def test_to_model_batch_makes_a_plain_dict() -> None:
    encoding = transformers.BatchEncoding({"input_ids": torch.ones(1, 3, dtype=torch.long)})
    batch = to_model_batch(encoding, _model("gpt2"))
    assert type(batch) is dict and batch["input_ids"].shape == (1, 3)


def _example() -> Any:
    path = Path(__file__).resolve().parents[2] / "examples" / "finetune_hf.py"
    spec = importlib.util.spec_from_file_location("finetune_hf_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_trainer_callback_fine_tunes_with_remat(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = _example().main(["--arch", "gpt2", "--strategy", "full", "--steps", "3",
                                  "--batch", "2", "--seq", "16", "--gradient-checkpointing"])
    assert len(losses) == 3 and losses[-1] < losses[0]
    # The Trainer turned HF's own checkpointing on; remat turned it off, with one warning.
    ours = [str(w.message) for w in caught if issubclass(w.category, RematWarning)]
    assert sum("own gradient checkpointing" in m for m in ours) == 1, ours
    assert "remat applied full (transformer.h.0=full" in capsys.readouterr().out


def test_checkpointed_blocks_run_again_in_backward() -> None:
    model = _model("llama")
    calls = {"n": 0}

    def count(*_: Any) -> None:
        calls["n"] += 1

    for layer in model.model.layers:  # a pre-hook: recomputation stops early after the last
        layer.mlp.down_proj.register_forward_pre_hook(count)  # saved tensor, in down_proj
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RematWarning)  # hooks inside a region: expected here
        apply(model, "full")
    model(**_batch("llama")).loss.backward()
    assert calls["n"] == 2 * 2  # 2 blocks, forward + recompute


class _FakePlan:
    """Stands in for remat.Plan: what remat.apply reads from a plan."""

    blocks = None
    budget_bytes = 1 << 20
    on_new_shape = "error"

    def __init__(self) -> None:
        from remat.core.shapes import ShapeEnvelope
        from remat.strategies.builtin import Full

        self.decisions = {"model.layers.1": Full()}
        self.shape_envelope = ShapeEnvelope.of({"input_ids": (2, 8), "labels": (2, 8)})


def test_budget_plans_on_a_plain_dict_batch_then_applies(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    plan_module = importlib.import_module("remat.planning")
    seen: dict[str, Any] = {}

    def fake_plan(model: nn.Module, batch: Any, **kwargs: Any) -> _FakePlan:
        seen.update(batch_type=type(batch), **kwargs)
        return _FakePlan()

    monkeypatch.setattr(plan_module, "plan", fake_plan)
    model = _model("llama")
    ids = torch.randint(1, VOCAB, (2, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    callback = RematCallback(budget="70%")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RematWarning)
        callback.on_train_begin(None, None, None, model=model, optimizer=optimizer,
                                train_dataloader=[transformers.BatchEncoding(
                                    {"input_ids": ids, "labels": ids})])
    assert seen["batch_type"] is dict and seen["budget"] == "70%"
    assert seen["optimizer"] is optimizer
    assert callback.applied is not None and callback.applied.strategy == "plan"
    assert dict(callback.applied.decisions)["model.layers.1"] == "full"
    # planned at the first batch's shapes: a longer one warns and runs (NOTE [ Planning
    # from a Trainer batch ]), it does not stop the Trainer
    longer = torch.randint(1, VOCAB, (2, 12))
    with pytest.warns(RematWarning, match="on_new_shape='warn'"):
        model(input_ids=longer, labels=longer).loss.backward()
