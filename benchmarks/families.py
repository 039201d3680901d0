"""Speech, vision, encoder-decoder and data-dependent families: blocks, peaks and plans.

For tiny Hugging Face configs (random weights, CPU, float32) and litgpt's mixture of
experts (``torch.where`` dispatch), one row per model:

* ``profile %``: :func:`remat.profile`'s peak against the CPU allocator's for the same step
  (:func:`remat.measure.profile.allocator_step_peak`), signed, in percent;
* ``full``, ``HF gc``: the allocator's peak of a steady step under ``remat.apply(model,
  "full")`` and under Hugging Face's ``gradient_checkpointing_enable()`` (non-reentrant),
  each as a percentage of the un-checkpointed step's (lower is better);
* ``blocks``: the stacks :func:`remat.find_blocks` found, and their share of the step's
  activation bytes (``BlockProfile.saved_bytes`` over ``activation_bytes``);
* with ``--plan``: :func:`remat.plan` at ``activations:60%``, else 80% (closed loop
  measured for real: the allocator's peak of the first step after apply and of a steady
  step), whether it fits (``allocator_peak_bytes <= budget_bytes``), whether it fell back
  to a real copy (NOTE [ Planning on a real copy ]), and :func:`remat.validate` of the plan
  (exact: relative error <= 1e-6).

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/families.py            # peaks only
    PYTHONPATH=src .venv/bin/python benchmarks/families.py --plan     # and plans
    PYTHONPATH=src .venv/bin/python benchmarks/families.py --plan --models jetmoe,led
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import transformers as hf
from torch import nn

import remat
from remat.errors import BudgetTooSmall, RematWarning
from remat.measure.profile import allocator_step_peak
from remat.measure.step import Step

V = 64


def _ids(batch: int = 8, seq: int = 32, low: int = 0) -> torch.Tensor:
    return torch.randint(low, V, (batch, seq))


def _speech(config_class: Any, model_class: Any, hidden: int = 32,
            **extra: Any) -> Callable[[], tuple[nn.Module, Any]]:
    """A CTC model; ``hidden=128`` gives the feature encoder under 1% of the parameters
    (wav2vec2-base: 5%), where a rule by parameter share misses it."""
    def build() -> tuple[nn.Module, Any]:
        config = config_class(
            vocab_size=32, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=2 * hidden, conv_dim=(32, 32, 32), conv_stride=(5, 2, 2),
            conv_kernel=(10, 3, 3), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4,
            mask_time_prob=0.0, layerdrop=0.0, **extra)
        return model_class(config), {"input_values": torch.randn(4, 8000),
                                     "labels": torch.randint(1, 32, (4, 12))}
    return build


def _vit() -> tuple[nn.Module, Any]:
    config = hf.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, image_size=32, patch_size=4, num_labels=10)
    return hf.ViTForImageClassification(config), {
        "pixel_values": torch.randn(8, 3, 32, 32), "labels": torch.randint(0, 10, (8,))}


def _resnet() -> tuple[nn.Module, Any]:
    config = hf.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[2, 2],
                             num_labels=10)
    return hf.ResNetForImageClassification(config), {
        "pixel_values": torch.randn(8, 3, 32, 32), "labels": torch.randint(0, 10, (8,))}


def _t5() -> tuple[nn.Module, Any]:
    config = hf.T5Config(vocab_size=V, d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4,
                         decoder_start_token_id=0, pad_token_id=0)
    return hf.T5ForConditionalGeneration(config), {"input_ids": _ids(8, 64, 1),
                                                   "labels": _ids(8, 16, 1)}


def _bart() -> tuple[nn.Module, Any]:
    config = hf.BartConfig(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4,
                           encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128)
    return hf.BartForConditionalGeneration(config), {"input_ids": _ids(8, 64, 3),
                                                     "labels": _ids(8, 16, 3)}


def _jetmoe() -> tuple[nn.Module, Any]:
    config = hf.JetMoeConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                             num_key_value_heads=2, kv_channels=8, intermediate_size=64,
                             num_local_experts=4, num_experts_per_tok=2,
                             max_position_embeddings=64)
    ids = _ids()
    return hf.JetMoeForCausalLM(config), {"input_ids": ids, "labels": ids.clone()}


def _switch() -> tuple[nn.Module, Any]:
    config = hf.SwitchTransformersConfig(
        vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, num_experts=4, expert_capacity=8, decoder_start_token_id=0,
        pad_token_id=0)
    return hf.SwitchTransformersForConditionalGeneration(config), {
        "input_ids": _ids(), "labels": _ids(8, 8)}


def _led() -> tuple[nn.Module, Any]:
    config = hf.LEDConfig(
        vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        attention_window=[8, 8], max_encoder_position_embeddings=64,
        max_decoder_position_embeddings=64, pad_token_id=1)
    ids = _ids(low=2)
    return hf.LEDForConditionalGeneration(config), {
        "input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": _ids(8, 8, 2)}


def _litgpt_moe() -> tuple[nn.Module, Any]:
    from litgpt import GPT, Config

    config = Config(block_size=32, vocab_size=V, padded_vocab_size=V, n_layer=2, n_head=4,
                    n_embd=32, n_query_groups=2, mlp_class_name="LLaMAMoE",
                    intermediate_size=64, moe_intermediate_size=64, n_expert=4,
                    n_expert_per_token=2, bias=False, norm_class_name="RMSNorm")
    return GPT(config), _ids()


MODELS: dict[str, Callable[[], tuple[nn.Module, Any]]] = {
    "wav2vec2": _speech(hf.Wav2Vec2Config, hf.Wav2Vec2ForCTC),
    "wav2vec2-wide": _speech(hf.Wav2Vec2Config, hf.Wav2Vec2ForCTC, hidden=128),
    "hubert": _speech(hf.HubertConfig, hf.HubertForCTC),
    "wavlm": _speech(hf.WavLMConfig, hf.WavLMForCTC),
    "data2vec-audio": _speech(hf.Data2VecAudioConfig, hf.Data2VecAudioForCTC),
    "vit": _vit,
    "resnet": _resnet,
    "t5": _t5,
    "bart": _bart,
    "jetmoe": _jetmoe,
    "switch": _switch,
    "led": _led,
    "litgpt-moe": _litgpt_moe,
}


def build(name: str) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model, batch = MODELS[name]()
    return model.train(), batch


def _steady_peak(step: Step, start_bytes: int) -> int:
    step.run()  # warm-up: the first step after a change is measured apart
    return allocator_step_peak(step, start_bytes)


def peaks(name: str) -> dict[str, Any]:
    """The row of one model without a plan."""
    model, batch = build(name)
    step = Step(model, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = remat.profile(model, batch, timing=False)
        start = prof.param_bytes + prof.buffer_bytes + prof.optimizer_bytes + prof.batch_bytes
        none = _steady_peak(step, start)
        remat.apply(model, "full")
        full = _steady_peak(step, start)
        remat.remove(model)
        hf_gc: int | None = None
        if getattr(model, "supports_gradient_checkpointing", False):
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
            hf_gc = _steady_peak(step, start)
            model.gradient_checkpointing_disable()
    blocks = remat.find_blocks(model)
    stacks = sorted({n.rsplit(".", 1)[0] for n, _ in remat.blocks.named_blocks(model)})
    in_blocks = sum(b.saved_bytes for b in prof.blocks)
    return {"model": name, "profile %": 100.0 * (prof.peak_bytes - none) / none,
            "full %": 100.0 * full / none,
            "hf gc %": None if hf_gc is None else 100.0 * hf_gc / none,
            "blocks": f"{len(blocks)} in {', '.join(stacks)}",
            "block share %": 100.0 * in_blocks / max(prof.activation_bytes, 1)}


def planned(name: str, budgets: list[str]) -> dict[str, Any]:
    """Plan at the first budget that fits, fit on the allocator (first step included),
    gradients of the plan."""
    model, batch = build(name)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for budget in budgets:
            try:
                plan = remat.plan(model, batch, budget=budget)
                break
            except BudgetTooSmall as error:
                if budget == budgets[-1]:
                    return {"plan": f"no plan fits {budget}: {str(error).splitlines()[2]}"}
    seconds = time.perf_counter() - start
    real_copy = any("real copy" in str(w.message) for w in caught
                    if issubclass(w.category, RematWarning))
    allocated = plan.allocator_peak_bytes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        error = remat.validate(model, batch, plan).max_rel_error
    return {"budget": budget, "plan fits": allocated is not None and allocated <= plan.budget_bytes,
            "alloc/budget": f"{allocated}/{plan.budget_bytes}", "real copy": real_copy,
            "grad rel err": error, "plan s": round(seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--plan", action="store_true")
    parser.add_argument("--budgets", default="activations:60%,activations:80%",
                        help="tried in order until one fits")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in args.models.split(","):
        row = peaks(name)
        if args.plan:
            row.update(planned(name, args.budgets.split(",")))
        print(" | ".join(f"{k}: {v:.1f}" if isinstance(v, float) and k != "grad rel err"
                         else f"{k}: {v}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
