"""Write the Hugging Face compatibility matrix: gradient parity and memory per strategy.

For each transformers architecture, built from a small config with random weights on
the CPU (no downloads), and each remat strategy:

* gradient parity: ``remat.validate`` (loss and every parameter gradient against the
  un-checkpointed model, same weights, batch and RNG seed; dropout on as configured),
  PASS when the worst relative error is <= 1e-6;
* memory: ``remat.profile`` (exact storage-level bytes of one training step, no
  optimizer): the peak and the activation bytes (alive when backward starts), as a
  change against strategy ``none``.

The table goes to stdout and into docs/compat.md between the markers
``<!-- compat:start -->`` and ``<!-- compat:end -->`` (the file is created if missing).

Usage::

    .venv/bin/python scripts/compat_matrix.py                 # all, under a minute on CPU
    .venv/bin/python scripts/compat_matrix.py --archs gpt2,t5 --no-write
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from remat.blocks import named_blocks
from remat.measure import profile
from remat.units import format_bytes
from remat.validation import validate

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "compat.md"
START, END = "<!-- compat:start -->", "<!-- compat:end -->"
STRATEGIES = ("full", "every:2", "sqrt", "attn", "mlp", "ops", "offload")
RTOL = 1e-6
BATCH, SEQ, VOCAB = 4, 128, 512
LAYERS, HIDDEN, FFN, HEADS = 4, 128, 512, 4


def _causal(config_class: Any, **extra: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        config = config_class(num_hidden_layers=LAYERS, hidden_size=HIDDEN,
                              intermediate_size=FFN, num_attention_heads=HEADS,
                              num_key_value_heads=HEADS // 2, vocab_size=VOCAB,
                              max_position_embeddings=SEQ, **extra)
        return transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-any-return]
    return build


def _gpt2() -> nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=LAYERS, n_embd=HIDDEN, n_inner=FFN, n_head=HEADS, n_positions=SEQ,
        vocab_size=VOCAB, bos_token_id=0, eos_token_id=0))


def _bert() -> nn.Module:
    return transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=FFN,
        num_attention_heads=HEADS, vocab_size=VOCAB, max_position_embeddings=SEQ))


def _t5() -> nn.Module:
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=LAYERS // 2, num_decoder_layers=LAYERS // 2, d_model=HIDDEN, d_ff=FFN,
        d_kv=HIDDEN // HEADS, num_heads=HEADS, vocab_size=VOCAB, decoder_start_token_id=0,
        pad_token_id=0))  # type: ignore[call-arg]


def _vit() -> nn.Module:
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=FFN,
        num_attention_heads=HEADS, image_size=32, patch_size=4, num_labels=10))  # type: ignore[call-arg]


@dataclass(frozen=True)
class Arch:
    """One architecture of the matrix: how to build it and a batch for it."""

    name: str
    build: Callable[[], nn.Module]
    kind: str  # "lm", "mlm", "seq2seq" or "image"


ARCHS: dict[str, Arch] = {
    "gpt2": Arch("GPT-2", _gpt2, "lm"),
    "llama": Arch("Llama", _causal(transformers.LlamaConfig), "lm"),
    "mistral": Arch("Mistral", _causal(transformers.MistralConfig), "lm"),
    "qwen2": Arch("Qwen2", _causal(transformers.Qwen2Config), "lm"),
    "bert": Arch("BERT", _bert, "mlm"),
    "t5": Arch("T5", _t5, "seq2seq"),
    "vit": Arch("ViT", _vit, "image"),
}


def make_batch(kind: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if kind == "image":
        return {"pixel_values": torch.randn(BATCH, 3, 32, 32, generator=g),
                "labels": torch.randint(0, 10, (BATCH,), generator=g)}
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    if kind == "seq2seq":
        return {"input_ids": ids, "labels": torch.randint(1, VOCAB, (BATCH, SEQ // 2), generator=g)}
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


@dataclass(frozen=True)
class Cell:
    """One strategy on one architecture."""

    status: str  # "PASS", "FAIL", "n/a" (refused with a clear error) or "ERROR"
    max_rel_error: float | None = None
    peak_change: float | None = None  # (peak - peak_none) / peak_none
    activation_change: float | None = None
    note: str = ""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:220]}"


def run_arch(arch: Arch, strategies: tuple[str, ...]) -> tuple[list[str], int, dict[str, Cell]]:
    """Blocks found, the none-strategy peak, and one Cell per strategy."""
    torch.manual_seed(0)
    model = arch.build().train()
    batch = make_batch(arch.kind)
    blocks = [name for name, _ in named_blocks(model)]
    base = profile(model, batch, timing=False)
    cells: dict[str, Cell] = {}
    for strategy in strategies:
        try:
            report = validate(model, batch, strategy, rtol=RTOL)
        except (ValueError, LookupError) as exc:  # refused up front: BlocksNotFound, ...
            cells[strategy] = Cell("n/a", note=_first_line(exc))
            continue
        except Exception as exc:  # failed while running
            cells[strategy] = Cell("ERROR", note=_first_line(exc))
            continue
        from remat.strategies import apply, remove

        apply(model, strategy)
        try:
            prof = profile(model, batch, timing=False)
        finally:
            remove(model)
        cells[strategy] = Cell(
            "PASS" if report.passed else "FAIL", report.max_rel_error,
            (prof.peak_bytes - base.peak_bytes) / base.peak_bytes,
            (prof.activation_bytes - base.activation_bytes) / max(base.activation_bytes, 1),
            "" if report.passed else f"worst parameter {report.worst_param}",
        )
    return blocks, base.peak_bytes, cells


def _pct(x: float | None) -> str:
    if x is None:
        return ""
    percent = round(x * 100)
    return "0%" if percent == 0 else f"{percent:+d}%".replace("-", "−")


def render(results: dict[str, tuple[list[str], int, dict[str, Cell]]],
           strategies: tuple[str, ...], seconds: float) -> str:
    lines = [
        "| model | blocks found | peak (none) | " + " | ".join(f"`{s}`" for s in strategies)
        + " | worst grad error |",
        "|---|---|---|" + "---|" * len(strategies) + "---|",
    ]
    notes: list[str] = []
    for key, (blocks, peak, cells) in results.items():
        row = [ARCHS[key].name, _blocks_label(blocks), format_bytes(peak)]
        for strategy in strategies:
            cell = cells[strategy]
            if cell.status in ("PASS", "FAIL"):
                text = f"{cell.status} {_pct(cell.peak_change)} ({_pct(cell.activation_change)})"
            else:
                notes.append(f"{ARCHS[key].name} `{strategy}`: {cell.note}")
                text = f"{cell.status} [{len(notes)}]"
            row.append(text)
        errors = [c.max_rel_error for c in cells.values() if c.max_rel_error is not None]
        row.append(f"{max(errors):.1e}" if errors else "")
        lines.append("| " + " | ".join(row) + " |")
    legend = [
        "",
        f"Cell: gradient parity (PASS: loss and every gradient within {RTOL:g} relative "
        "error of the un-checkpointed model), then the step's peak memory change and, in "
        "parentheses, the activation memory change against `none` (exact bytes from "
        "`remat.profile`, one training step without optimizer). `offload` keeps activations "
        "in host memory, so on a CPU-only run it changes nothing.",
        "",
        f"Models: random weights from small configs ({LAYERS} blocks, hidden {HIDDEN}, MLP "
        f"{FFN}, {HEADS} heads, T5 {LAYERS // 2} + {LAYERS // 2} blocks), batch {BATCH} x "
        f"{SEQ} tokens (ViT: 32x32 images, 64 patches), float32, dropout as configured; "
        f"transformers {transformers.__version__}, torch {torch.__version__}, "
        f"{platform.machine()} CPU, {seconds:.0f} s. Produced by "
        "`python scripts/compat_matrix.py`.",
    ]
    if notes:
        legend += ["", *(f"[{i}] {note}" for i, note in enumerate(notes, 1))]
    return "\n".join(lines + legend)


def _blocks_label(blocks: list[str]) -> str:
    stacks: dict[str, int] = {}
    for name in blocks:
        stacks[name.rsplit(".", 1)[0]] = stacks.get(name.rsplit(".", 1)[0], 0) + 1
    return " + ".join(f"`{stack}` x{n}" for stack, n in stacks.items())


def write(table: str, path: Path = DOC) -> None:
    """Put ``table`` between the markers of ``path`` (created with a title if missing)."""
    if path.exists():
        text = path.read_text()
    else:
        text = ("# Compatibility with Hugging Face transformers\n\n"
                f"{START}\n{END}\n")
    if START not in text or END not in text:
        raise SystemExit(f"compat_matrix.py: {path} lacks the markers {START} / {END}")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{head}{START}\n{table}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default=",".join(ARCHS),
                        help=f"comma-separated, from {', '.join(ARCHS)} (default: all)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--no-write", action="store_true", help=f"do not update {DOC.name}")
    args = parser.parse_args(argv)
    keys = [k.strip() for k in args.archs.split(",") if k.strip()]
    unknown = [k for k in keys if k not in ARCHS]
    if unknown:
        parser.error(f"unknown architectures {unknown}; choose from {', '.join(ARCHS)}")
    strategies = tuple(s.strip() for s in args.strategies.split(",") if s.strip())
    torch.set_num_threads(1)  # tiny ops: threads cost more than they give, and the run is steadier
    warnings.simplefilter("ignore")  # pitfall notices (use_cache, offload on CPU) are expected
    transformers.logging.set_verbosity_error()
    start = time.perf_counter()
    results = {}
    for key in keys:
        t0 = time.perf_counter()
        results[key] = run_arch(ARCHS[key], strategies)
        print(f"{ARCHS[key].name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    table = render(results, strategies, time.perf_counter() - start)
    print(table)
    if not args.no_write:
        write(table)
        print(f"wrote {DOC.relative_to(ROOT)}", file=sys.stderr)
    failed = [k for k, (_, _, cells) in results.items()
              if any(c.status in ("FAIL", "ERROR") for c in cells.values())]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
