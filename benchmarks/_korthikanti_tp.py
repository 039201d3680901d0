"""Korthikanti et al. 2022, Table 2, per tensor-parallel rank: the paper's rows next to
``remat.distributed.tensor_parallel.tp_rank_bytes`` for a GPT-3-style layer, and every
difference as a term of known shape (used by korthikanti.py).

The layer: Hugging Face OPT, the GPT-3 replica (separate ``q_proj`` / ``k_proj`` /
``v_proj``, ``out_proj``, ``fc1`` / ``fc2`` on the block, pre-LayerNorm, exact GELU MLP of
4h, dropout 0.1 on attention probabilities and both residual branches), eager attention
(the ``a·s·s`` scores materialised), bf16, on the meta device under PyTorch's fake process
group. ``apply_tp``'s layout splits it the Megatron way (q/k/v and fc1 column-wise,
out_proj and fc2 row-wise). One layer's bytes per rank are a 2-layer model's activation
bytes minus a 1-layer one's, as in the t = 1 table.

:func:`layer_terms` lists what one layer keeps for backward, term by term: its bytes on
one device (read from the shapes, the dtype each op writes on CPU) and how tensor and
sequence parallelism divide it in remat's run, next to the paper's bytes and division.
:func:`tp_table` asserts that the terms add up to the simulated bytes in every row.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from remat.blocks import find_sublayer
from remat.measure.outside import cpu_rng_state_bytes
from remat.simulate.formulas import (
    full_checkpoint_bytes,
    korthikanti_bytes,
    korthikanti_flash_bytes,
    korthikanti_table2_bytes,
)
from remat.strategies.base import BlockStrategy, Strategy
from remat.strategies.builtin.ops import SelectiveOps
from remat.strategies.handler import Handler, add_handler

#: s, b, h, a: 16 heads, so that every rank keeps at least two at t = 8 (with one head per
#: rank the heads' transposes are contiguous already, the copies the save set names are
#: not made and its ``aten.clone#3`` would name another tensor); d = h / a = 4.
SHAPE = {"seq_len": 32, "batch_size": 2, "hidden_size": 64, "n_heads": 16}
DEGREES = (1, 2, 4, 8)
#: The paper's selective recomputation (Sec. 5) on OPT's attention sub-layer: keep the
#: q, k and v projections' outputs (its first three ``aten.addmm``) and the output
#: projection's input (the contiguous copy of the heads merged back, its fourth
#: ``aten.clone``); recompute QKᵀ, the softmax, its dropout and the product with V.
SELECTIVE_SAVE_OPS = frozenset({"aten.addmm#0", "aten.addmm#1", "aten.addmm#2",
                                "aten.clone#3"})


@dataclass(frozen=True)
class AttentionOps(Strategy):
    """``ops[save_ops]`` on each block's attention sub-layer only (the rest not
    checkpointed): the paper's selective recomputation as a strategy ``tp_rank_bytes``
    can apply to its parallelized copy."""

    name: ClassVar[str] = "attn_ops"
    save_ops: frozenset[str] = SELECTIVE_SAVE_OPS

    def __str__(self) -> str:
        return "attn=ops[" + ",".join(sorted(self.save_ops)) + "]"


class AttentionOpsHandler(Handler[AttentionOps]):
    """``ops[save_ops]`` decided on each block's attention sub-layer."""

    def decisions(self, config: AttentionOps, blocks: Sequence[tuple[str, nn.Module]]
                  ) -> dict[str, BlockStrategy]:
        return {f"{name}.{find_sublayer(block, 'attn')[0]}": SelectiveOps(config.save_ops)
                for name, block in blocks}


# A handler with no name: applied as a config, never parsed from a string or listed.
add_handler(AttentionOps, AttentionOpsHandler())


#: (label, remat strategy, the paper's recompute row)
STRATEGIES: tuple[tuple[str, Any, str], ...] = (
    ("none", "none", "none"), ("selective", AttentionOps(), "selective"),
    ("full", "full", "full"))


def opt_model(n_layer: int, *, seq_len: int, hidden_size: int, n_heads: int) -> nn.Module:
    """A tiny OPT of ``n_layer`` layers (random weights, untied head: SP shards the
    embedding), eager attention, GELU, dropout 0.1."""
    from transformers import OPTConfig, OPTForCausalLM

    return OPTForCausalLM(OPTConfig(
        vocab_size=128, hidden_size=hidden_size, num_hidden_layers=n_layer,
        ffn_dim=4 * hidden_size, num_attention_heads=n_heads, word_embed_proj_dim=hidden_size,
        max_position_embeddings=seq_len, do_layer_norm_before=True, dropout=0.1,
        attention_dropout=0.1, activation_function="gelu", tie_word_embeddings=False,
        attn_implementation="eager", use_cache=False))


@functools.cache
def rank_layer_bytes(strategy: Any, *, tp: int, sequence_parallel: bool, seq_len: int,
                     batch_size: int, hidden_size: int, n_heads: int) -> int:
    """One layer's activation bytes on rank 0 of ``tp``, simulated: ``tp_rank_bytes`` of a
    2-layer OPT minus a 1-layer one's."""
    from remat.distributed.tensor_parallel import tp_rank_bytes

    two, one = (tp_rank_bytes(functools.partial(opt_model, n, seq_len=seq_len,
                                                hidden_size=hidden_size, n_heads=n_heads),
                              seq_len=seq_len, batch_size=batch_size, tp=tp,
                              sequence_parallel=sequence_parallel, strategy=strategy,
                              optimizer="none").activation_bytes
                for n in (2, 1))
    return two - one


@dataclass(frozen=True)
class Term:
    """One thing a layer keeps for backward: bytes on one device (remat's run on CPU, and
    the paper's count), and the degree each divides it by under TP and under TP + SP
    (``True``: ``/ t``; ``False``: whole on every rank)."""

    name: str
    shape: str
    remat_bytes: int
    remat_tp: bool
    remat_sp: bool
    paper_bytes: int
    paper_tp: bool
    paper_sp: bool

    def remat(self, t: int, sp: bool) -> int:
        return self.remat_bytes // t if (self.remat_sp if sp else self.remat_tp) else \
            self.remat_bytes

    def paper(self, t: int, sp: bool) -> int:
        return self.paper_bytes // t if (self.paper_sp if sp else self.paper_tp) else \
            self.paper_bytes


def layer_terms(recompute: str, *, seq_len: int, batch_size: int, hidden_size: int,
                n_heads: int) -> list[Term]:
    """The terms of one OPT layer (bf16 on CPU) for the paper's ``recompute`` row, next to
    Korthikanti et al. Sec. 4.1's terms (16-bit, 1-byte masks) and Table 2's division.

    remat on CPU: dropout masks are bf16 (ATen's unfused CPU dropout keeps its noise
    tensor), LayerNorm keeps its mean and 1/std (bf16 on CPU), OPT's softmax runs in
    fp32 (``softmax(..., dtype=torch.float32)``) and keeps that output; PyTorch's
    sequence parallelism saves each norm's all-gathered output for the colwise
    linears' backward where Megatron keeps the shard and gathers again in backward.
    """
    s, b, h, a = seq_len, batch_size, hidden_size, n_heads
    sbh, as2b, stats = s * b * h, a * s * s * b, 2 * s * b * 2  # stats: mean, 1/std
    d = h // a
    terms = [  # name, shape, remat B, /t TP, /t SP, paper B, /t TP, /t SP
        Term("layer input (LN 1 input)", f"({b}, {s}, {h})", 2 * sbh, False, True,
             2 * sbh, False, True),
        Term("LN 1 mean, 1/std", f"2 x ({b}, {s}, 1)", stats, False, True, 0, False, False),
        Term("QKV-projection input (LN 1 output)", f"({b}, {s}, {h})", 2 * sbh, False, False,
             2 * sbh, False, True),
        Term("Q (QKᵀ's copy)", f"({b}, {a}, {s}, {d})", 2 * sbh, True, True, 2 * sbh, True, True),
        Term("Kᵀ (QKᵀ's copy)", f"({b}, {a}, {d}, {s})", 2 * sbh, True, True, 2 * sbh, True,
             True),
        Term("softmax output (fp32)", f"({b}, {a}, {s}, {s})", 4 * as2b, True, True, 2 * as2b,
             True, True),
        Term("softmax dropout mask (bf16)", f"({b}, {a}, {s}, {s})", 2 * as2b, True, True,
             as2b, True, True),
        Term("softmax dropout output", f"({b}, {a}, {s}, {s})", 2 * as2b, True, True, 2 * as2b,
             True, True),
        Term("V (·V's copy)", f"({b}, {a}, {s}, {d})", 2 * sbh, True, True, 2 * sbh, True, True),
        Term("output-projection input", f"({b}, {s}, {a}, {d})", 2 * sbh, True, True, 2 * sbh,
             True, True),
        Term("attention dropout mask (bf16)", f"({b}, {s}, {h})", 2 * sbh, False, True, sbh,
             False, True),
        Term("LN 2 input", f"({b}, {s}, {h})", 2 * sbh, False, True, 2 * sbh, False, True),
        Term("LN 2 mean, 1/std", f"2 x ({b * s}, 1)", stats, False, True, 0, False, False),
        Term("MLP input (LN 2 output)", f"({b * s}, {h})", 2 * sbh, False, False, 2 * sbh,
             False, True),
        Term("GELU input (fc1 output)", f"({b * s}, {4 * h})", 8 * sbh, True, True, 8 * sbh,
             True, True),
        Term("GELU output (fc2 input)", f"({b * s}, {4 * h})", 8 * sbh, True, True, 8 * sbh,
             True, True),
        Term("MLP dropout mask (bf16)", f"({b * s}, {h})", 2 * sbh, False, True, sbh, False,
             True),
    ]
    rng = Term("CPU RNG state (per checkpointed region)", f"({cpu_rng_state_bytes()},)",
               cpu_rng_state_bytes(), False, False, 0, False, False)
    if recompute == "full":
        return [replace_paper(terms[0], sp=False), rng]
    if recompute == "selective":
        # The 5as²b terms are recomputed. OPT's attention-output dropout runs in the
        # block, after the attention sub-layer's region: its mask stays.
        dropped = {"softmax output (fp32)", "softmax dropout mask (bf16)",
                   "softmax dropout output"}
        return [t for t in terms if t.name not in dropped] + [rng]
    return terms


def replace_paper(term: Term, *, sp: bool) -> Term:
    """``term`` with the paper's division under SP set to ``sp`` (the full-recompute row
    of Table 2 keeps ``2sbh`` at every ``t``)."""
    return Term(term.name, term.shape, term.remat_bytes, term.remat_tp, term.remat_sp,
                term.paper_bytes, term.paper_tp, sp)


def closed_form_bytes(recompute: str, *, seq_len: int, batch_size: int, hidden_size: int,
                      n_heads: int) -> int:
    """``remat estimate``'s closed form for the row (16-bit; it has no ``t``: the t = 1
    table's and the t = 1 rows of the per-rank table)."""
    shape = {"seq_len": seq_len, "batch_size": batch_size, "hidden_size": hidden_size}
    if recompute == "full":
        return full_checkpoint_bytes(**shape)
    if recompute == "selective":
        return korthikanti_flash_bytes(**shape)
    return korthikanti_bytes(**shape, n_heads=n_heads)


def _divided(term: Term, sp: bool, *, paper: bool) -> bool:
    if paper:
        return term.paper_sp if sp else term.paper_tp
    return term.remat_sp if sp else term.remat_tp


def _formula(terms: list[Term], sp: bool, *, paper: bool) -> str:
    """``whole + (split)/t`` in ``sbh``, ``as²b`` and plain bytes (16 bits: sbh bytes =
    2 bytes x sbh / 2; the paper's Table 2 coefficients)."""
    s, b, h, a = (SHAPE[k] for k in ("seq_len", "batch_size", "hidden_size", "n_heads"))
    units = (("sbh", s * b * h), ("as²b", a * s * s * b))

    def written(chosen: list[Term]) -> str:
        coefficients = {"sbh": 0, "as²b": 0, "B": 0}
        for x in chosen:
            nbytes = x.paper_bytes if paper else x.remat_bytes
            unit = "as²b" if "softmax" in x.name else "sbh" if "mean" not in x.name \
                and "RNG" not in x.name else "B"
            size = dict(units).get(unit, 1)
            coefficients[unit] += nbytes // size
        parts = [f"{c} {u}" if u != "B" else f"{c} B" for u, c in coefficients.items() if c]
        return " + ".join(parts) or "0"

    whole = written([x for x in terms if not _divided(x, sp, paper=paper)])
    split = written([x for x in terms if _divided(x, sp, paper=paper)])
    if split == "0":
        return whole
    return f"({split})/t" if whole == "0" else f"{whole} + ({split})/t"


def tp_table() -> str:
    """Every Table 2 setting at t = 1, 2, 4, 8: the paper, ``remat estimate`` (t = 1) and
    ``tp_rank_bytes``, with each side's bytes kept whole on a rank and divided by ``t``
    (in the paper's units); raises if the terms do not add up to the simulation."""
    lines = ["| Table 2 row | t | paper, B | remat estimate, B | remat simulate, B "
             "| simulate - paper, B | paper: whole + (split)/t | remat: whole + (split)/t |",
             "|---|---:|---:|---:|---:|---:|---|---|"]
    for label, strategy, recompute in STRATEGIES:
        terms = layer_terms(recompute, **SHAPE)
        for sp in (False, True):
            for t in DEGREES:
                if sp and t == 1:
                    continue
                simulated = rank_layer_bytes(strategy, tp=t, sequence_parallel=sp, **SHAPE)
                by_terms = sum(term.remat(t, sp) for term in terms)
                paper = korthikanti_table2_bytes(**SHAPE, tp=t, sequence_parallel=sp,
                                                 recompute=recompute)
                if simulated != by_terms or paper != sum(term.paper(t, sp) for term in terms):
                    raise AssertionError(f"{label} t={t} sp={sp}: simulated {simulated} B, "
                                         f"terms {by_terms} B; paper {paper} B")
                estimate = (str(closed_form_bytes(recompute, **SHAPE)) if t == 1 else "-")
                sides = [_formula(terms, sp, paper=side) for side in (True, False)]
                name = {"none": "no recompute", "selective": "selective",
                        "full": "full recompute"}[recompute]
                setting = ("TP+SP" if sp else "TP" if t > 1 else "one device") + ", " + name
                lines.append(f"| {setting} | {t} | {paper} | {estimate} | {simulated} "
                             f"| {simulated - paper:+d} | {sides[0]} | {sides[1]} |")
    return "\n".join(lines)


def terms_table() -> str:
    """One layer's terms with no recompute: bytes on one device and how TP and TP + SP
    divide them, remat's run next to the paper's."""
    def how(divided: bool) -> str:
        return "/t" if divided else "whole"

    lines = ["| term | shape (one device) | remat, B | TP | TP+SP | paper, B | TP | TP+SP |",
             "|---|---|---:|---|---|---:|---|---|"]
    for x in layer_terms("none", **SHAPE):
        lines.append(f"| {x.name} | {x.shape} | {x.remat_bytes} | {how(x.remat_tp)} "
                     f"| {how(x.remat_sp)} | {x.paper_bytes} | {how(x.paper_tp)} "
                     f"| {how(x.paper_sp)} |")
    return "\n".join(lines)
