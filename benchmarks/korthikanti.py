"""Korthikanti et al. 2022, Table 2, next to remat: the paper's formula, ``remat estimate``'s
closed form and ``remat simulate``'s exact bytes for one GPT-3-style layer; then the paper's
22B / 175B / 530B / 1T configurations per tensor-parallel rank (formula rows).

The layer: Hugging Face GPT-2 (LayerNorm, GELU MLP of 4h, dropout 0.1 on attention
probabilities and both residual branches) with ``attn_implementation="eager"`` (the s x s
scores are materialised), exact GELU (``activation_function="gelu"``), bf16, on the meta
device. One layer's saved bytes are the activation bytes of a 2-layer model minus those of a
1-layer one. Strategies: ``none``; ``attn`` (remat's closest to the paper's selective
recompute: the whole attention sub-layer is checkpointed, not only its core); ``full``.

Run: ``PYTHONPATH=src python benchmarks/korthikanti.py`` (a few seconds, CPU only); writes
the ``korthikanti`` section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS, replace_section, run_header  # noqa: E402

from remat.simulate.formulas import (  # noqa: E402
    full_checkpoint_bytes,
    korthikanti_bytes,
    korthikanti_flash_bytes,
    korthikanti_table2_bytes,
)

#: The paper's Table 3 (s = 2048, micro-batch 1, t = 8).
CONFIGS: tuple[tuple[str, int, int, int, int], ...] = (  # name, h, a, layers, t
    ("22B", 6144, 64, 48, 8), ("175B", 12288, 96, 96, 8),
    ("530B", 20480, 128, 105, 8), ("1T", 25600, 160, 128, 8),
)
SMALL = {"seq_len": 32, "batch_size": 2, "hidden_size": 64, "n_heads": 4}
STRATEGIES = (("none", "none"), ("attn", "selective"), ("full", "full"))


def simulated_layer_bytes(strategy: str, *, seq_len: int, batch_size: int, hidden_size: int,
                          n_heads: int) -> int:
    """Saved activation bytes of one eager GPT-2 layer (bf16, dropout 0.1), simulated."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from remat.measure.profile import profile_simulated
    from remat.strategies import apply

    saved = []
    for n_layer in (1, 2):
        config = GPT2Config(n_embd=hidden_size, n_head=n_heads, n_layer=n_layer,
                            n_positions=seq_len, vocab_size=128, activation_function="gelu",
                            resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                            attn_implementation="eager")
        with torch.device("meta"):
            model = GPT2LMHeadModel(config).to(torch.bfloat16)
        model.train()
        apply(model, strategy)
        ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
        saved.append(profile_simulated(model, {"input_ids": ids, "labels": ids})
                     .activation_bytes)
    return saved[1] - saved[0]


def closed_form_bytes(recompute: str, *, seq_len: int, batch_size: int, hidden_size: int,
                      n_heads: int) -> int:
    """``remat estimate``'s closed form for the row (16-bit)."""
    shape = {"seq_len": seq_len, "batch_size": batch_size, "hidden_size": hidden_size}
    if recompute == "full":
        return full_checkpoint_bytes(**shape)
    if recompute == "selective":
        return korthikanti_flash_bytes(**shape)
    return korthikanti_bytes(**shape, n_heads=n_heads)


def t1_table() -> str:
    lines = ["| strategy (paper row) | paper, B | remat estimate, B | remat simulate, B |"
             " simulate - paper, B |", "|---|---:|---:|---:|---:|"]
    for strategy, recompute in STRATEGIES:
        paper = korthikanti_table2_bytes(**SMALL, recompute=recompute)
        closed = closed_form_bytes(recompute, **SMALL)
        simulated = simulated_layer_bytes(strategy, **SMALL)
        lines.append(f"| {strategy} ({recompute}) | {paper} | {closed} | {simulated} |"
                     f" {simulated - paper:+d} |")
    return "\n".join(lines)


def configs_table() -> str:
    gib = 1 << 30
    rows = (("none", False, "TP"), ("none", True, "TP+SP"), ("selective", False, "TP+selective"),
            ("selective", True, "TP+SP+selective"), ("full", False, "full recompute"))
    lines = ["| model | h | a | L | t | " + " | ".join(r[2] for r in rows) + " |",
             "|---|---:|---:|---:|---:|" + "---:|" * len(rows)]
    for name, h, a, layers, t in CONFIGS:
        cells = [korthikanti_table2_bytes(seq_len=2048, batch_size=1, hidden_size=h,
                                          n_heads=a, tp=t, sequence_parallel=sp,
                                          recompute=rc) * layers / gib
                 for rc, sp, _ in rows]
        lines.append(f"| {name} | {h} | {a} | {layers} | {t} | "
                     + " | ".join(f"{c:.1f}" for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    started = time.time()  # noqa: F841 (reported by run_header)
    body = "\n\n".join([
        run_header("Korthikanti et al. Table 2 vs remat", "benchmarks/korthikanti.py",
                   sys.argv[1:], started),
        f"One layer, t = 1, s={SMALL['seq_len']} b={SMALL['batch_size']} "
        f"h={SMALL['hidden_size']} a={SMALL['n_heads']}, bf16 (see docs/distributed.md for "
        "every difference):",
        t1_table(),
        "The paper's configurations (s = 2048, b = 1), activation GiB per rank for all "
        "layers, by formula (remat has no tensor parallelism to simulate them yet):",
        configs_table(),
    ])
    text = RESULTS.read_text() if RESULTS.exists() else ""
    RESULTS.write_text(replace_section(text, "korthikanti", body))
    print(body)


if __name__ == "__main__":
    main()
