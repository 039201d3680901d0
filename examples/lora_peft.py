"""LoRA fine-tuning with PEFT and remat: profile, validate and plan a tiny Llama (no downloads).

The model is built from a config (random weights) and wrapped with
``peft.get_peft_model`` (LoRA on the q and v projections). remat finds the decoder
layers through PEFT's wrapper (``base_model.model.model.layers``), so everything works
on the PEFT model as it is. Frozen base weights need no saved inputs for their weight
gradients, so the LoRA model saves fewer activation bytes than the same model with
every parameter trainable; remat measures that, and plans with it.

Example::

    python examples/lora_peft.py --seq 32 --budget mid
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Sequence
from typing import Any

import peft
import torch
import transformers

import remat
from remat.errors import RematWarning

STRATEGIES = ("full", "every:2", "sqrt", "attn", "mlp", "ops", "offload")


def tiny_llama(*, vocab_size: int = 128, seed: int = 0) -> Any:
    """A 2-layer Llama, hidden size 64, MLP 128, random weights, in train mode."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=vocab_size, max_position_embeddings=128,
                                      use_cache=False)
    return transformers.LlamaForCausalLM(config).train()


def with_lora(model: Any, *, rank: int = 4) -> Any:
    """``model`` wrapped by PEFT, LoRA of ``rank`` on q_proj and v_proj (no dropout)."""
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                             target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(model, config)


def make_batch(batch_size: int, seq_len: int, *, vocab_size: int = 128) -> dict[str, Any]:
    ids = torch.randint(1, vocab_size, (batch_size, seq_len),
                        generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2, help="sequences per step")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--rank", type=int, default=4, help="LoRA rank")
    parser.add_argument("--budget", default="mid",
                        help="peak budget for remat.plan: bytes, 60%%, ... or 'mid' (halfway "
                             "between the peaks under full and none)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Profile, validate and plan; returns the numbers it prints."""
    args = parse_args(argv)
    batch = make_batch(args.batch, args.seq)
    trainable = tiny_llama()
    model = with_lora(tiny_llama(), rank=args.rank)
    lora_params = [n for n, p in model.named_parameters() if p.requires_grad]
    base = remat.profile(trainable, batch, timing=False)
    none = remat.profile(model, batch, timing=False)
    remat.apply(model, "full")
    full = remat.profile(model, batch, timing=False)
    remat.remove(model)
    print(f"blocks: {[b.name for b in none.blocks]}")
    print(f"LoRA params: {len(lora_params)} tensors, "
          f"{sum(p.numel() for p in model.parameters() if p.requires_grad)} values")
    print(f"saved activations, all trainable: {base.activation_bytes:,} B "
          f"(per block {[b.saved_bytes for b in base.blocks]})")
    print(f"saved activations, LoRA:          {none.activation_bytes:,} B "
          f"(per block {[b.saved_bytes for b in none.blocks]})")
    print(f"peak, LoRA: none {none.peak_bytes:,} B, full {full.peak_bytes:,} B")
    errors: dict[str, float] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RematWarning)  # offload on CPU changes nothing
        for strategy in STRATEGIES:
            report = remat.validate(model, batch, strategy)
            errors[strategy] = report.max_rel_error
            print(f"validate {strategy:8s} {'PASS' if report.passed else 'FAIL'} "
                  f"max rel error {report.max_rel_error:.1e} over "
                  f"{len(report.per_param_rel_error)} gradients")
    budget: int | str = (none.peak_bytes + full.peak_bytes) // 2 if args.budget == "mid" \
        else args.budget
    plan = remat.plan(model, batch, budget=budget)
    parity = remat.validate(model, batch, plan)
    print(f"plan for {plan.budget_bytes:,} B: measured peak {plan.measured_peak_bytes:,} B, "
          f"{plan.label()}, gradients {'PASS' if parity.passed else 'FAIL'} "
          f"({parity.max_rel_error:.1e})")
    return {"base": base, "none": none, "full": full, "errors": errors, "plan": plan,
            "plan_parity": parity, "lora_params": lora_params}


if __name__ == "__main__":
    main()
