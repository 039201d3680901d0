"""Supervised fine-tuning with TRL's SFTTrainer and remat (no downloads, in-memory data).

A tiny Llama is built from a config (random weights), the tokenizer is a word-level
vocabulary built in memory, and the dataset is a few random sentences. ``SFTTrainer``
is a ``transformers.Trainer``, so remat comes in as the same callback: a strategy, or a
budget planned on the first training batch. SFTTrainer computes its loss with TRL's
fused LM head (``model(**batch, fused_lm_head=True)``); ``forward_kwargs`` makes the
planned step the same.

Examples::

    python examples/sft_trl.py --strategy full
    python examples/sft_trl.py --budget 85%
"""

from __future__ import annotations

import argparse
import random
import tempfile
from collections.abc import Sequence
from typing import Any

import datasets
import tokenizers
import torch
import transformers
from trl import SFTConfig, SFTTrainer

from remat.integrations.hf import RematCallback

WORDS = "the cat sat on a mat dog ran far away and then came back home".split()


def word_tokenizer() -> Any:
    """A word-level tokenizer over :data:`WORDS`, built in memory."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                                eos_token="<eos>", unk_token="<unk>")


def sentences(count: int, words: int, seed: int = 0) -> datasets.Dataset:
    rng = random.Random(seed)
    return datasets.Dataset.from_dict(
        {"text": [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(count)]})


def tiny_llama(vocab_size: int, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=1, bos_token_id=1)
    return transformers.LlamaForCausalLM(config).train()


class LossLog(transformers.TrainerCallback):  # type: ignore[misc]
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
               **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--strategy", default=None, help="remat strategy (default: full)")
    how.add_argument("--budget", default=None, help="peak memory budget: 85%%, 2MiB, ...")
    how.add_argument("--no-remat", action="store_true", help="train without remat")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32, help="max_length, tokens")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> tuple[list[float], RematCallback | None]:
    """Train; returns the logged losses and the remat callback (None with --no-remat)."""
    args = parse_args(argv)
    tokenizer = word_tokenizer()
    data = sentences(2 * args.batch, args.seq - 1)
    model = tiny_llama(len(tokenizer))
    callback = None if args.no_remat else RematCallback(
        args.strategy if args.budget is None else None, budget=args.budget,
        forward_kwargs={"fused_lm_head": True})
    log = LossLog()
    with tempfile.TemporaryDirectory() as tmp:
        config = SFTConfig(output_dir=tmp, report_to=[], max_steps=args.steps, use_cpu=True,
                           per_device_train_batch_size=args.batch, max_length=args.seq,
                           logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0,
                           learning_rate=1e-2, dataloader_num_workers=0)
        trainer = SFTTrainer(model=model, args=config, train_dataset=data,
                             processing_class=tokenizer,
                             callbacks=[log] + ([callback] if callback else []))
        trainer.train()
    print("losses: " + ", ".join(f"{loss:.6f}" for loss in log.losses))
    if callback is not None and callback.applied is not None:
        print(f"remat applied {callback.applied.strategy}: "
              + ", ".join(f"{name}={kind}" for name, kind in callback.applied.decisions))
    if callback is not None and callback.plan is not None:
        plan = callback.plan
        print(f"plan: budget {plan.budget_bytes:,} B, measured peak {plan.measured_peak_bytes:,} B"
              f", without checkpointing {plan.no_checkpoint_peak_bytes:,} B")
    return log.losses, callback


if __name__ == "__main__":
    main()
