"""Korthikanti et al. 2022, Table 2, next to remat: the paper's formula, ``remat estimate``'s
closed form and ``remat simulate``'s exact bytes for one GPT-3-style layer; every Table 2
setting per tensor-parallel rank, simulated on an OPT layer (``_korthikanti_tp.py``); then
the paper's 22B / 175B / 530B / 1T configurations per rank (formula rows).

The layer: Hugging Face GPT-2 (LayerNorm, GELU MLP of 4h, dropout 0.1 on attention
probabilities and both residual branches) with ``attn_implementation="eager"`` (the s x s
scores are materialised), exact GELU (``activation_function="gelu"``), bf16, on the meta
device. One layer's saved bytes are the activation bytes of a 2-layer model minus those of a
1-layer one. Strategies: ``none``; ``attn`` (the whole attention sub-layer is
checkpointed, not only its core); the paper's selective recomputation as remat's ``ops``
strategy on each attention sub-layer (:data:`SELECTIVE_SAVE_OPS`; then with both
projections kept); ``full``. ``none``, the selective save set and ``full`` are then
itemized storage by storage (``remat.measure.saved_storages``) next to the paper's terms.

Run: ``PYTHONPATH=src python benchmarks/korthikanti.py`` (about 20 s, CPU only); writes
the ``korthikanti`` section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _korthikanti_tp import SHAPE as TP_SHAPE  # noqa: E402
from _korthikanti_tp import closed_form_bytes, terms_table, tp_table  # noqa: E402
from _results import RESULTS, replace_section, run_header  # noqa: E402

from remat.core.results import SavedStorage  # noqa: E402
from remat.simulate.formulas import (  # noqa: E402
    korthikanti_table2_bytes,
)

#: The paper's Table 3 (s = 2048, micro-batch 1, t = 8).
CONFIGS: tuple[tuple[str, int, int, int, int], ...] = (  # name, h, a, layers, t
    ("22B", 6144, 64, 48, 8), ("175B", 12288, 96, 96, 8),
    ("530B", 20480, 128, 105, 8), ("1T", 25600, 160, 128, 8),
)
SMALL = {"seq_len": 32, "batch_size": 2, "hidden_size": 64, "n_heads": 4}
#: The paper's selective recomputation (Sec. 5: QKᵀ, softmax, its dropout and the product
#: with V recomputed, everything else kept) as remat's op-level strategy on each block's
#: attention sub-layer: keep the QKV projection's output (Q, K, V: ``aten.addmm#0``) and
#: the output projection's input (the contiguous copy of the product with V, the
#: sub-layer's fourth ``aten.clone``: ``aten.clone#3``); recompute the rest.
SELECTIVE_SAVE_OPS = frozenset({"aten.addmm#0", "aten.clone#3"})
SELECTIVE = "attn=ops[" + ",".join(sorted(SELECTIVE_SAVE_OPS)) + "]"
#: ... and with both projections kept: more bytes, less recompute.
SELECTIVE_BOTH = "attn=ops[aten.addmm,aten.clone#3]"
STRATEGIES = (("none", "none"), ("attn", "selective"), (SELECTIVE, "selective"),
              (SELECTIVE_BOTH, "selective"), ("full", "full"))
LAYER = "transformer.h.1"  # the second layer of the 2-layer model: one whole layer


def _model(strategy: str, n_layer: int, *, seq_len: int, hidden_size: int,
           n_heads: int) -> torch.nn.Module:
    """An eager GPT-2 of ``n_layer`` layers (bf16, dropout 0.1) on meta, ``strategy`` applied."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from remat.strategies import apply, apply_decisions
    from remat.strategies.builtin.ops import SelectiveOps

    config = GPT2Config(n_embd=hidden_size, n_head=n_heads, n_layer=n_layer,
                        n_positions=seq_len, vocab_size=128, activation_function="gelu",
                        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                        attn_implementation="eager")
    with torch.device("meta"):
        model = GPT2LMHeadModel(config).to(torch.bfloat16)
    model.train()
    if strategy.startswith("attn=ops[") and strategy.endswith("]"):  # on each attention
        save_ops = frozenset(strategy[len("attn=ops["):-1].split(","))
        apply_decisions(model, {f"transformer.h.{i}.attn": SelectiveOps(save_ops)
                                for i in range(n_layer)})
    else:
        apply(model, strategy)
    return model


def _batch(seq_len: int, batch_size: int) -> dict[str, torch.Tensor]:
    ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


def simulated_layer(strategy: str, *, seq_len: int, batch_size: int, hidden_size: int,
                    n_heads: int) -> tuple[int, int]:
    """Saved activation bytes and recompute FLOPs of one eager GPT-2 layer (bf16, dropout
    0.1), simulated: a 2-layer model's minus a 1-layer one's."""
    from remat.measure.profile import profile_simulated

    profiles = [profile_simulated(_model(strategy, n, seq_len=seq_len, hidden_size=hidden_size,
                                         n_heads=n_heads), _batch(seq_len, batch_size))
                for n in (1, 2)]
    return (profiles[1].activation_bytes - profiles[0].activation_bytes,
            profiles[1].recompute_flops - profiles[0].recompute_flops)


def simulated_layer_bytes(strategy: str, *, seq_len: int, batch_size: int, hidden_size: int,
                          n_heads: int) -> int:
    """Saved activation bytes of one eager GPT-2 layer (bf16, dropout 0.1), simulated."""
    return simulated_layer(strategy, seq_len=seq_len, batch_size=batch_size,
                           hidden_size=hidden_size, n_heads=n_heads)[0]


def layer_storages(strategy: str, *, seq_len: int, batch_size: int, hidden_size: int,
                   n_heads: int) -> list[SavedStorage]:
    """The storages the second layer of the 2-layer model keeps for backward (their sum is
    :func:`simulated_layer_bytes`: checked), each unit relative to the layer."""
    from remat.measure.saved import saved_storages

    model = _model(strategy, 2, seq_len=seq_len, hidden_size=hidden_size, n_heads=n_heads)
    saved = saved_storages(model, _batch(seq_len, batch_size))
    mine = [replace(s, unit=s.unit[len(LAYER) + 1:] if s.unit != LAYER else "")
            for s in saved if s.unit is not None and (s.unit + ".").startswith(LAYER + ".")]
    layer = simulated_layer_bytes(strategy, seq_len=seq_len, batch_size=batch_size,
                                  hidden_size=hidden_size, n_heads=n_heads)
    if sum(s.nbytes for s in mine) != layer:
        raise AssertionError(f"{strategy}: {LAYER}'s storages sum to "
                             f"{sum(s.nbytes for s in mine)} B, the layer to {layer} B")
    return mine


def paper_terms(recompute: str, *, seq_len: int, batch_size: int, hidden_size: int,
                n_heads: int) -> dict[str, int]:
    """Korthikanti et al. Sec. 4.1's terms of one layer (16-bit, 1-byte masks), bytes, for
    the ``recompute`` row of Table 2 at t = 1 (selective: the ``5as²b`` terms dropped;
    full: the layer input only)."""
    sbh = seq_len * batch_size * hidden_size
    as2b = n_heads * seq_len * seq_len * batch_size
    terms = {
        "layer input (LayerNorm 1 input)": 2 * sbh, "QKV-projection input": 2 * sbh,
        "Q": 2 * sbh, "K": 2 * sbh, "softmax output": 2 * as2b,
        "softmax dropout mask": as2b, "softmax dropout output": 2 * as2b, "V": 2 * sbh,
        "output-projection input": 2 * sbh, "attention dropout mask": sbh,
        "LayerNorm 2 input": 2 * sbh, "MLP input": 2 * sbh, "GeLU input": 8 * sbh,
        "GeLU output (fc2 input)": 8 * sbh, "MLP dropout mask": sbh,
    }
    if recompute == "selective":
        for name in ("softmax output", "softmax dropout mask", "softmax dropout output"):
            del terms[name]
    if recompute == "full":
        terms = {"layer input (LayerNorm 1 input)": terms["layer input (LayerNorm 1 input)"]}
    return terms


def _term_rules(*, seq_len: int, batch_size: int, hidden_size: int,
                n_heads: int) -> dict[tuple[str, str, tuple[int, ...]], list[tuple[str, ...]]]:
    """(unit in the layer, op, shape) -> the paper terms a storage can be, in the order
    they are tried when the layer's storages are matched from its last one back (so the
    layer's closing residual sum is the next layer's input and the earlier one
    LayerNorm 2's; of the two (b, a, s, d) copies the later is V)."""
    s, b, h, a = seq_len, batch_size, hidden_size, n_heads
    d = h // a
    return {
        ("", "aten.add", (b, s, h)): [("layer input (LayerNorm 1 input)",),
                                      ("LayerNorm 2 input",)],
        ("ln_1", "aten.native_layer_norm", (b, s, h)): [("QKV-projection input",)],
        ("attn.c_attn", "aten.addmm", (b * s, 3 * h)): [("Q", "K", "V")],
        ("attn", "aten.clone", (b, a, s, d)): [("V",), ("Q",)],
        ("attn", "aten.clone", (b, a, d, s)): [("K",)],
        ("attn", "aten._softmax", (b, a, s, s)): [("softmax output",)],
        ("attn", "aten.empty_like", (b, a, s, s)): [("softmax dropout mask",)],
        ("attn", "aten.mul", (b, a, s, s)): [("softmax dropout output",)],
        ("attn", "aten.clone", (b, s, a, d)): [("output-projection input",)],
        ("attn.resid_dropout", "aten.empty_like", (b, s, h)): [("attention dropout mask",)],
        ("ln_2", "aten.native_layer_norm", (b, s, h)): [("MLP input",)],
        ("mlp.c_fc", "aten.addmm", (b * s, 4 * h)): [("GeLU input",)],
        ("mlp.act", "aten.gelu", (b, s, 4 * h)): [("GeLU output (fc2 input)",)],
        ("mlp.dropout", "aten.empty_like", (b, s, h)): [("MLP dropout mask",)],
    }


def _uncounted(storage: SavedStorage) -> str:
    """What a storage the paper has no term for is."""
    if storage.op == "torch.get_rng_state":
        return "(no term: CPU RNG state checkpoint keeps)"
    if storage.op == "aten.native_layer_norm" and storage.shape[-1] == 1:
        return "(no term: LayerNorm mean or 1/std)"
    return "(no term)"


def itemized_table(strategy: str, recompute: str) -> str:
    """One layer's saved storages (remat) next to the paper's terms they stand for."""
    storages = layer_storages(strategy, **SMALL)
    terms = paper_terms(recompute, **SMALL)
    rules = _term_rules(**SMALL)
    used: set[str] = set()
    matched: list[tuple[str, ...]] = []
    for st in reversed(storages):
        options = rules.get((st.unit or "", st.op, st.shape), [])
        found = next((o for o in options if all(t in terms and t not in used for t in o)), ())
        used.update(found)
        matched.append(found)
    matched.reverse()
    lines = ["| unit | op | shape | dtype | remat, B | paper term | paper, B | remat - paper, B |",
             "|---|---|---|---|---:|---|---:|---:|"]
    for st, names in zip(storages, matched, strict=True):
        paper = sum(terms[t] for t in names)
        lines.append(f"| {st.unit or '(layer)'} | {st.op} | {tuple(st.shape)} | {st.dtype} "
                     f"| {st.nbytes} | {', '.join(names) or _uncounted(st)} | {paper} "
                     f"| {st.nbytes - paper:+d} |")
    for name, paper in terms.items():
        if name not in used:
            lines.append(f"| - | - | - | - | 0 | {name} (not kept) | {paper} | {-paper:+d} |")
    remat, paper = sum(s.nbytes for s in storages), sum(terms.values())
    lines.append(f"| **total** | | | | **{remat}** | | **{paper}** | **{remat - paper:+d}** |")
    return "\n".join(lines)


def t1_table() -> str:
    lines = ["| strategy (paper row) | paper, B | remat estimate, B | remat simulate, B |"
             " simulate - paper, B | remat recompute, FLOP |",
             "|---|---:|---:|---:|---:|---:|"]
    for strategy, recompute in STRATEGIES:
        paper = korthikanti_table2_bytes(**SMALL, recompute=recompute)
        closed = closed_form_bytes(recompute, **SMALL)
        simulated, flops = simulated_layer(strategy, **SMALL)
        lines.append(f"| {strategy} ({recompute}) | {paper} | {closed} | {simulated} |"
                     f" {simulated - paper:+d} | {flops} |")
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
    started = time.time()
    parts = [
        f"One layer, t = 1, s={SMALL['seq_len']} b={SMALL['batch_size']} "
        f"h={SMALL['hidden_size']} a={SMALL['n_heads']}, bf16 (see docs/distributed.md for "
        "every difference); recompute FLOPs per layer, simulated:",
        t1_table(),
    ]
    for strategy, recompute in (("none", "none"), (SELECTIVE, "selective"), ("full", "full")):
        parts += [f"`{strategy}`, op by op: the storages layer {LAYER} keeps for backward "
                  f"(remat.measure.saved_storages, in the order they were made) next to "
                  f"the paper's Sec. 4.1 terms of its `{recompute}` row:",
                  itemized_table(strategy, recompute)]
    s, b, h, a = (TP_SHAPE[k] for k in ("seq_len", "batch_size", "hidden_size", "n_heads"))
    parts += [
        f"Every Table 2 setting per tensor-parallel rank, one layer, s={s} b={b} h={h} a={a}, "
        "bf16: Hugging Face OPT (GPT-3's layout: q/k/v, out_proj, fc1/fc2, pre-LayerNorm, "
        "GELU, dropout 0.1, eager attention) split by apply_tp's layout, simulated on rank 0 "
        "under a fake process group (remat.distributed.tensor_parallel.tp_rank_bytes, a "
        "2-layer model minus a 1-layer one); selective = ops on each attention sub-layer "
        "keeping q/k/v's outputs and the output projection's input; `remat estimate` has "
        "t = 1 only. Each side as bytes kept whole on every rank + bytes divided by t "
        "(sbh, as²b: the paper's units, 16-bit); the script checks that the terms below add "
        "up to every simulated row:",
        tp_table(),
        "One layer's terms with no recompute: bytes on one device and how TP and TP+SP "
        "divide them (remat's run on CPU next to the paper's count):",
        terms_table(),
        "The paper's configurations (s = 2048, b = 1), activation GiB per rank for all "
        "layers, by formula:",
        configs_table(),
    ]
    header = run_header("Korthikanti et al. Table 2 vs remat", "korthikanti.py",
                        sys.argv[1:], started).rstrip()
    body = "\n\n".join([header, *parts])
    text = RESULTS.read_text() if RESULTS.exists() else ""
    RESULTS.write_text(replace_section(text, "korthikanti", body))
    print(body)


if __name__ == "__main__":
    main()
