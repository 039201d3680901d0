"""Fine-tune a tiny Hugging Face model with Trainer and remat (no downloads, random data).

The model is built from a config (random weights); the data are random token
sequences that repeat, so the loss falls within a few steps. remat comes in as a
Trainer callback that applies a strategy, or plans for a memory budget, when
training begins.

Examples::

    python examples/finetune_hf.py --arch llama --strategy ops --steps 8
    python examples/finetune_hf.py --arch gpt2 --budget 60% --steps 8
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from typing import Any

import torch
import transformers
from torch import nn

from remat.integrations.hf import RematCallback

ARCHS = ("gpt2", "llama", "qwen2", "mistral")


def tiny_model(arch: str, *, vocab_size: int = 256, seed: int = 0) -> nn.Module:
    """A 4-layer causal LM of the given family, hidden size 64, random weights."""
    torch.manual_seed(seed)
    if arch == "gpt2":
        config: Any = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, n_positions=128,
                                              vocab_size=vocab_size, bos_token_id=0,
                                              eos_token_id=0)
    else:
        classes = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                   "mistral": transformers.MistralConfig}
        config = classes[arch](num_hidden_layers=4, hidden_size=64, intermediate_size=176,
                               num_attention_heads=4, num_key_value_heads=2,
                               vocab_size=vocab_size, max_position_embeddings=128,
                               bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-any-return]


class RandomTokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``size`` fixed random sequences; labels are the inputs (the model shifts them)."""

    def __init__(self, size: int, seq_len: int, vocab_size: int, seed: int = 1) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, vocab_size, (size, seq_len), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.ids[index]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


class LossLog(transformers.TrainerCallback):  # type: ignore[misc]
    """Keeps the training loss the Trainer logs at each step."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
               **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))
            print(f"step {state.global_step} | loss {logs['loss']:.4f}", flush=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="llama", choices=ARCHS)
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--strategy", default=None, help="remat strategy (default: full)")
    how.add_argument("--budget", default=None, help="peak memory budget: 60%%, 2GiB, ...")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="also ask the Trainer for HF's own checkpointing (remat turns it "
                             "off with a warning: one layer of checkpointing is enough)")
    parser.add_argument("--output-dir", default=None, help="Trainer output (default: a temp dir)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[float]:
    """Run the fine-tuning; returns the logged losses."""
    args = parse_args(argv)
    model = tiny_model(args.arch)
    data = RandomTokens(size=args.batch, seq_len=args.seq, vocab_size=256)
    remat_callback = RematCallback(args.strategy if args.budget is None else None,
                                   budget=args.budget)
    losses = LossLog()
    with tempfile.TemporaryDirectory() as tmp:
        fields = transformers.TrainingArguments.__dataclass_fields__
        # transformers >= 5.x renamed gradient_checkpointing to activation_checkpointing.
        hf_checkpointing = ("activation_checkpointing" if "activation_checkpointing" in fields
                            else "gradient_checkpointing")
        training_args = transformers.TrainingArguments(
            output_dir=args.output_dir or tmp, max_steps=args.steps,
            per_device_train_batch_size=args.batch, learning_rate=args.lr, logging_steps=1,
            save_strategy="no", report_to="none", disable_tqdm=True,
            use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, seed=0,
            **{hf_checkpointing: args.gradient_checkpointing},
        )
        trainer = transformers.Trainer(model=model, args=training_args, train_dataset=data,
                                       callbacks=[remat_callback, losses])
        trainer.train()
    info = remat_callback.applied
    label = info.strategy if info is not None else "nothing"
    decisions = ", ".join(f"{name}={kind}" for name, kind in info.decisions) if info else ""
    print(f"{type(model).__name__}: remat applied {label} ({decisions})")
    return losses.losses


if __name__ == "__main__":
    main()
