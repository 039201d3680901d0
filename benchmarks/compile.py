"""Benchmark torch.compile's own ``activation_memory_budget`` against remat's plans.

For gpt-small and llama-small (remat's models, batch 8, seq 128) and a Hugging Face
Llama built in-process (6 layers, d 256, seq 256, batch 4), dropout off, CPU, float32:

1. eager, no checkpointing: the reference (allocator peak, FLOPs, gradients);
2. the whole model compiled with inductor at ``activation_memory_budget`` 1.0, 0.75,
   0.5, 0.25 and 0.0, each with its own backend
   (:func:`remat.compiled.install.compile_with_budget`), measured with
   :func:`remat.compiled.measure.measure_compiled`: the allocator's peak (plus the
   bytes alive at the step's start), compiled FLOPs counted on the partitioned
   graphs;
3. remat's side (``--remat``, on by default): ``remat.plan(model, batch,
   budget=<that compiled run's peak>)`` applied, then every block compiled
   (:func:`remat.compiled.install.compile_blocks_with_budget` at 1.0,
   i.e. inductor's default partitioner, with the plan's checkpoints and SAC tags),
   measured the same way;
4. ``remat.plan_compiled(model, batch, budget=<each compiled run's peak>)``
   (``--compiled-plan``, on by default): planned for the compiled step (candidates
   measured once per model and shared across budgets), applied with ``remat.apply``,
   which compiles the blocks as the plan records, and measured the same way.

Columns: peak bytes; recompute = compiled FLOPs minus the budget-1.0 compiled FLOPs
(as a share of them); step time = median of interleaved untracked steps, and its ratio
to eager; gradient error = max |g - g_eager| / max |g_eager| over all parameters.

Writes ``benchmarks/RESULTS_compile.md`` (the ``compile`` section of RESULTS.md).

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/compile.py            # ~10-20 min, 2 cores
    PYTHONPATH=src .venv/bin/python benchmarks/compile.py --quick    # tiny smoke run
    PYTHONPATH=src .venv/bin/python benchmarks/compile.py --no-remat --repeats 3 \
        --models hf-gpt2,hf-qwen2 --section compile-heldout \
        --title "Held-out Hugging Face models: GPT-2 and Qwen2 (same protocol)"
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
from torch import nn

import remat
from remat.compiled.candidates import CompiledCandidate, default_candidates, prepare_compiled
from remat.compiled.install import compile_blocks_with_budget, compile_with_budget
from remat.compiled.measure import measure_compiled
from remat.measure.allocator import allocator_peak
from remat.measure.step import Step, clear_grads, run_step
from remat.models import build_model, make_batch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import replace_section, run_header  # noqa: E402

HERE = Path(__file__).resolve().parent
OUT = HERE / "RESULTS_compile.md"
SECTION = "compile"
BUDGETS = (1.0, 0.75, 0.5, 0.25, 0.0)
MiB = float(1 << 20)


@dataclass
class Row:
    """One configuration of one model."""

    model: str
    config: str
    peak_bytes: int
    flops: int
    grad_error: float
    budget_bytes: int | None = None
    step_ms: float | None = None
    recompute_flops: int | None = None
    recompute_share: float | None = None
    new_graphs: int = 0
    note: str = ""


@dataclass
class Variant:
    row: Row
    model: nn.Module


def _hf_causal(config_name: str, model_name: str, seq: int, batch: int, vocab: int,
               **config: Any) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A Hugging Face causal LM built from a config (no download), sdpa, with a batch."""
    import transformers

    cfg = getattr(transformers, config_name)(vocab_size=vocab, use_cache=False, **config)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(cfg).train()
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids.clone()}


def _hf_gqa(config: str, cls: str, kv_heads: int, layers: int, d: int, seq: int, batch: int,
            vocab: int) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A Llama-shaped Hugging Face decoder: 8 query heads, ``kv_heads`` key/value heads."""
    return _hf_causal(config, cls, seq, batch, vocab, hidden_size=d,
                      intermediate_size=688 * d // 256, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=kv_heads,
                      max_position_embeddings=seq, attention_dropout=0.0)


def hf_llama(layers: int = 6, d: int = 256, seq: int = 256, batch: int = 4,
             vocab: int = 4096) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A Hugging Face Llama."""
    return _hf_gqa("LlamaConfig", "LlamaForCausalLM", 4, layers, d, seq, batch, vocab)


def hf_gpt2(layers: int = 6, d: int = 256, seq: int = 256, batch: int = 4,
            vocab: int = 4096) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A Hugging Face GPT-2 (Conv1D projections, learned positions), dropout off."""
    return _hf_causal("GPT2Config", "GPT2LMHeadModel", seq, batch, vocab, n_embd=d,
                      n_layer=layers, n_head=8, n_positions=seq, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, loss_type="ForCausalLM")


def hf_qwen2(layers: int = 6, d: int = 256, seq: int = 256, batch: int = 4,
             vocab: int = 4096) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A Hugging Face Qwen2 (grouped-query attention with q/k/v biases)."""
    return _hf_gqa("Qwen2Config", "Qwen2ForCausalLM", 2, layers, d, seq, batch, vocab)


def _models(quick: bool) -> list[tuple[str, Callable[[], tuple[nn.Module, Any]]]]:
    def remat_model(name: str, batch: int, **overrides: Any) -> Callable[[], tuple[nn.Module,
                                                                                   Any]]:
        def build() -> tuple[nn.Module, Any]:
            torch.manual_seed(0)
            model = build_model(name, dropout=0.0, **overrides)
            return model, make_batch(model, batch)
        return build

    if quick:
        return [("gpt-tiny (1 layer)", remat_model("gpt-tiny", 2, n_layer=1))]
    return [("gpt-small", remat_model("gpt-small", 8)),
            ("llama-small", remat_model("llama-small", 8)),
            ("hf-llama (6L d256 s256 b4)", hf_llama),
            ("hf-gpt2 (6L d256 s256 b4)", hf_gpt2),
            ("hf-qwen2 (6L d256 s256 b4)", hf_qwen2)]


def _grads(model: nn.Module, batch: Any) -> list[torch.Tensor]:
    clear_grads(model)
    run_step(model, batch)
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
             for p in model.parameters()]
    clear_grads(model)
    return grads


def _grad_error(model: nn.Module, batch: Any, ref: list[torch.Tensor]) -> float:
    got = _grads(model, batch)
    scale = max(float(g.abs().max()) for g in ref) or 1.0
    return max(float((a - b).abs().max()) for a, b in zip(got, ref, strict=True)) / scale


def _note(m: Any, extra: str = "") -> str:
    parts = [extra] if extra else []
    if m.eager_regions:
        parts.append(f"ran eagerly: {', '.join(m.eager_regions)}")
    elif not m.counted:
        parts.append("FLOPs not counted")
    return "; ".join(parts)


def _decisions(plan: Any) -> str:
    kinds = [d.kind for d in plan.decisions.values()]
    return " ".join(f"{k}x{kinds.count(k)}" for k in dict.fromkeys(kinds))


def _eager_peak(model: nn.Module, batch: Any, static_bytes: int) -> int:
    clear_grads(model)
    run_step(model, batch)  # warm-up
    clear_grads(model)
    peak = allocator_peak(lambda: run_step(model, batch)).peak_bytes
    clear_grads(model)
    return static_bytes + peak


def _time_interleaved(variants: list[Variant], batch: Any, repeats: int) -> None:
    times: dict[int, list[float]] = {i: [] for i in range(len(variants))}
    for v in variants:  # one untimed step each
        run_step(v.model, batch)
        clear_grads(v.model)
    for _ in range(repeats):
        for i, v in enumerate(variants):
            clear_grads(v.model)
            start = time.perf_counter()
            run_step(v.model, batch)
            times[i].append((time.perf_counter() - start) * 1e3)
            clear_grads(v.model)
    for i, v in enumerate(variants):
        v.row.step_ms = statistics.median(times[i])


def _candidates(step: Step, labels: tuple[str, ...] | None
                ) -> tuple[CompiledCandidate, ...] | None:
    """The default compiled candidates named by ``labels`` (None: all of them)."""
    if labels is None:
        return None
    known = {c.label(): c for c in default_candidates(step)}
    unknown = [label for label in labels if label not in known]
    if unknown:
        raise SystemExit(f"--candidates: unknown {unknown}; known: {list(known)}")
    return tuple(known[label] for label in labels)


def _compiled_plans(name: str, model: nn.Module, batch: Any, ref: list[torch.Tensor],
                    compiled_peaks: dict[float, int],
                    log: Callable[[str], None], *,
                    candidates: tuple[str, ...] | None = None,
                    whole_budgets: tuple[float, ...] | None = None) -> list[Variant]:
    """remat.plan_compiled at each compiler setting's peak, applied and measured.

    ``candidates`` (labels) and ``whole_budgets`` narrow what
    :func:`~remat.compiled.candidates.prepare_compiled` measures (``--candidates``,
    ``--whole-budgets``); None: its defaults.
    """
    t0 = time.time()
    planning = copy.deepcopy(model)
    step = Step(planning, batch)
    options = {} if whole_budgets is None else {"whole_budgets": whole_budgets}
    ctx = prepare_compiled(step, _candidates(step, candidates), **options)
    log(f"{name}: compiled candidates measured "
        f"({', '.join(c.label() for c in ctx.candidates)}), {time.time() - t0:.0f} s")
    out = []
    targets = {f"compile-{budget:g} peak": target for budget, target in compiled_peaks.items()}
    try:  # the lowest peak remat's compiled candidates reach: the plan at that budget
        remat.plan_compiled(planning, batch, budget=1, context=ctx)
    except remat.BudgetTooSmall as exc:
        targets["its lowest peak"] = exc.min_peak_bytes
    for where, target in targets.items():
        label = f"remat plan_compiled @ {where}"
        try:
            plan = remat.plan_compiled(planning, batch, budget=target, context=ctx)
        except remat.BudgetTooSmall as exc:
            log(f"{name}: {label}: BudgetTooSmall (lowest {exc.min_peak_bytes / MiB:.1f} MiB)")
            out.append(Variant(Row(name, label, 0, 0, float("nan"), budget_bytes=target,
                                   note="BudgetTooSmall, lowest measured "
                                        f"{exc.min_peak_bytes / MiB:.1f} MiB"), model))
            continue
        planned = remat.apply(copy.deepcopy(model), plan)  # compiles the blocks as recorded
        m = measure_compiled(planned, batch, timing=False)
        assert plan.compiled is not None
        if "" in plan.compiled:  # the compiler's own setting won (whole-model compile)
            how = f"whole model compiled at {plan.compiled['']:g}"
        else:
            budgets = [plan.compiled[n] for n in plan.block_names]
            how = " ".join(f"{plan.label_of(n)}@{b:g}"
                           for n, b in zip(plan.block_names, budgets, strict=True))
        out.append(Variant(Row(name, label, m.peak_bytes, m.profile.flops,
                               _grad_error(planned, batch, ref), budget_bytes=target,
                               new_graphs=m.new_graphs,
                               note=_note(m, f"planned peak {plan.measured_peak_bytes / MiB:.1f}"
                                             f" MiB; {how}")), planned))
        log(f"{name}: {label}: {m.peak_bytes / MiB:.1f} MiB ({how})")
    return out


def bench_model(name: str, build: Callable[[], tuple[nn.Module, Any]], *,
                budgets: tuple[float, ...], remat_budgets: tuple[float, ...],
                repeats: int, log: Callable[[str], None],
                compiled_plan: bool = False, candidates: tuple[str, ...] | None = None,
                whole_budgets: tuple[float, ...] | None = None) -> list[Row]:
    model, batch = build()
    eager = remat.profile(model, batch, timing=False)
    static = eager.param_bytes + eager.buffer_bytes + eager.optimizer_bytes + eager.batch_bytes
    ref = _grads(model, batch)
    variants = [Variant(Row(name, "eager, none", _eager_peak(model, batch, static),
                            eager.flops, 0.0), model)]
    log(f"{name}: eager peak {variants[0].row.peak_bytes / MiB:.1f} MiB")
    base_flops: int | None = None
    compiled_peaks: dict[float, int] = {}
    for budget in budgets:
        t0 = time.time()
        compiled = compile_with_budget(copy.deepcopy(model), budget)
        m = measure_compiled(compiled, batch, timing=False)
        if budget == 1.0:
            base_flops = m.profile.flops
        row = Row(name, f"compile, budget {budget:g}", m.peak_bytes, m.profile.flops,
                  _grad_error(compiled, batch, ref), new_graphs=m.new_graphs,
                  note=_note(m))
        compiled_peaks[budget] = m.peak_bytes
        variants.append(Variant(row, compiled))
        log(f"{name}: compile {budget:g}: {m.peak_bytes / MiB:.1f} MiB, "
            f"{time.time() - t0:.0f} s")
    for budget in remat_budgets:
        if budget not in compiled_peaks:
            continue
        target = compiled_peaks[budget]
        t0 = time.time()
        label = f"remat plan @ compile-{budget:g} peak + compile blocks"
        try:
            plan = remat.plan(copy.deepcopy(model), batch, budget=target)
            planned = remat.apply(copy.deepcopy(model), plan)
            compile_blocks_with_budget(planned, 1.0)
            m = measure_compiled(planned, batch, timing=False)
        except Exception as exc:  # infeasible budget, an uncompilable strategy: say so
            log(f"{name}: {label}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
            variants_row = Row(name, label, 0, 0, float("nan"), budget_bytes=target,
                               note=f"{type(exc).__name__}")
            variants.append(Variant(variants_row, model))
            continue
        row = Row(name, label, m.peak_bytes, m.profile.flops,
                  _grad_error(planned, batch, ref), budget_bytes=target,
                  new_graphs=m.new_graphs,
                  note=_note(m, f"eager plan peak {plan.measured_peak_bytes / MiB:.1f} MiB; "
                            f"{_decisions(plan)}"))
        variants.append(Variant(row, planned))
        log(f"{name}: {label}: {m.peak_bytes / MiB:.1f} MiB, {time.time() - t0:.0f} s")
    if compiled_plan:
        variants += _compiled_plans(name, model, batch, ref, compiled_peaks, log,
                                    candidates=candidates, whole_budgets=whole_budgets)
    timed = [v for v in variants if v.row.peak_bytes > 0]
    _time_interleaved(timed, batch, repeats)
    for v in variants:
        if base_flops and v.row.flops:
            v.row.recompute_flops = v.row.flops - base_flops
            v.row.recompute_share = v.row.recompute_flops / base_flops
    return [v.row for v in variants]


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None or value != value else f"{value:{spec}}{suffix}"


def markdown(rows: list[Row]) -> str:
    head = ("| model | configuration | budget | peak | recompute | step | vs eager | "
            "grad error | note |\n|---|---|--:|--:|--:|--:|--:|--:|---|\n")
    lines = []
    eager_ms: dict[str, float] = {}
    for r in rows:
        if r.config.startswith("eager") and r.step_ms:
            eager_ms[r.model] = r.step_ms
    for r in rows:
        ratio = (r.step_ms / eager_ms[r.model]
                 if r.step_ms and r.model in eager_ms else None)
        budget = _fmt(r.budget_bytes / MiB if r.budget_bytes else None, ".1f", " MiB")
        peak = _fmt(r.peak_bytes / MiB if r.peak_bytes else None, ".1f", " MiB")
        share = _fmt(100 * r.recompute_share if r.recompute_share is not None else None,
                     ".1f", "%")
        note = r.note + (f" ({r.new_graphs} new graphs while measuring!)"
                         if r.new_graphs else "")
        lines.append(f"| {r.model} | {r.config} | {budget} | {peak} | {share} | "
                     f"{_fmt(r.step_ms, '.0f', ' ms')} | {_fmt(ratio, '.2f', 'x')} | "
                     f"{_fmt(r.grad_error, '.1e')} | {note} |")
    return head + "\n".join(lines) + "\n\n" + lowest_peaks(rows)


def lowest_peaks(rows: list[Row]) -> str:
    """Per model, the lowest peak any compiler setting reaches and the lowest remat's
    compiled plans reach (issue #10: "remat reaches lower peaks than any compiler setting")."""
    lines = ["| model | lowest compiler peak | lowest remat peak (compiled plans) | remat vs "
             "compiler |", "|---|--:|--:|--:|"]
    for model in dict.fromkeys(r.model for r in rows):
        ours = [r for r in rows if r.model == model and r.peak_bytes]
        compiler = [r for r in ours if r.config.startswith("compile,")]
        remat_rows = [r for r in ours if r.config.startswith("remat plan")]
        if not compiler or not remat_rows:
            continue
        c, m = (min(group, key=lambda r: r.peak_bytes) for group in (compiler, remat_rows))
        lines.append(f"| {model} | {c.peak_bytes / MiB:.1f} MiB ({c.config}) | "
                     f"{m.peak_bytes / MiB:.1f} MiB ({m.config}) | "
                     f"{100 * (m.peak_bytes / c.peak_bytes - 1):+.1f}% |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 1-layer gpt-tiny, budgets 1.0 and 0.0")
    parser.add_argument("--no-remat", action="store_true", help="skip remat's plans")
    parser.add_argument("--no-compiled-plan", action="store_true",
                        help="skip remat.plan_compiled")
    parser.add_argument("--candidates", default=None,
                        help="comma-separated labels of the compiled candidates "
                             "remat.plan_compiled measures, none@1 first (e.g. "
                             "none@1,none@0.5; default: all of default_candidates)")
    parser.add_argument("--whole-budgets", default=None,
                        help="comma-separated compiler budgets at which remat.plan_compiled "
                             "also tries the whole model compiled (default: 1,0.75,0.5,0.25)")
    parser.add_argument("--models", default="gpt-small,llama-small,hf-llama",
                        help="comma-separated model names to run: gpt-small, llama-small, "
                             "hf-llama, and the held-out hf-gpt2, hf-qwen2 "
                             "(default: the first three)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--out", type=Path, default=OUT, help="markdown file to write")
    parser.add_argument("--section", default=SECTION,
                        help=f"the section of --out to replace (default {SECTION}; the held-out "
                             "run writes compile-heldout)")
    parser.add_argument("--title", default="torch.compile's activation memory budget vs remat",
                        help="the section's heading")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # Every variant below is a separate compile of the same classes' code, and dynamo
    # keeps at most recompile_limit (8) entries per code object before running the rest
    # eagerly: a silent eager fallback. Raise it for this many variants, and reset dynamo
    # between models; measure_compiled flags any region that still ran eagerly.
    torch._dynamo.config.recompile_limit = 64
    budgets = (1.0, 0.0) if args.quick else BUDGETS
    candidates = (None if args.candidates is None
                  else tuple(c.strip() for c in args.candidates.split(",") if c.strip()))
    whole_budgets = (None if args.whole_budgets is None
                     else tuple(float(b) for b in args.whole_budgets.split(",") if b.strip()))
    remat_budgets = () if args.no_remat else ((0.0,) if args.quick else (0.75, 0.5, 0.25))
    start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - start:6.0f} s] {msg}", flush=True)

    rows: list[Row] = []
    wanted = {m.strip() for m in args.models.split(",") if m.strip()}
    known = {name.split(" ")[0] for name, _ in _models(args.quick)}
    if wanted - known and not args.quick:
        parser.error(f"--models: unknown {sorted(wanted - known)}; known: {sorted(known)}")
    for name, build in _models(args.quick):
        if not args.quick and name.split(" ")[0] not in wanted:
            continue
        rows.extend(bench_model(name, build, budgets=budgets, remat_budgets=remat_budgets,
                                repeats=1 if args.quick else args.repeats, log=log,
                                compiled_plan=not args.no_compiled_plan,
                                candidates=candidates, whole_budgets=whole_budgets))
        torch._dynamo.reset()
    table = markdown(rows)
    print(table)
    body = (run_header(args.title, "compile.py", sys.argv[1:] if argv is None else argv, start)
            + "Peak: the allocator's high-water mark of the step (PyTorch profiler memory "
            "events) plus parameters, batch and optimizer state. Recompute: FLOPs beyond the "
            "budget-1.0 compiled step, as a share of it (eager has none by definition; "
            "counted on the partitioned graphs). Step: median of interleaved steps "
            f"({args.repeats} each). Grad error: max |g - g_eager| / max |g_eager|.\n\n"
            + table)
    # Only this run's section is replaced; the file's other sections and text stay.
    args.out.write_text(replace_section(args.out.read_text() if args.out.exists() else "",
                                        args.section, body))
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
