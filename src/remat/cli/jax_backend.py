"""``--framework jax``: run ``remat compare`` and ``remat plan`` on the JAX backend.

NOTE [ CLI and the JAX backend ]
    ``remat.jax`` is imported here only, inside the functions, and only when
    ``--framework jax`` is given, so ``remat --help`` and the torch commands never
    import jax; without jax the command exits 2 naming ``pip install 'remat[jax]'``.
    The same options mean the same things (``--model`` is the NNX preset of the same
    name, ``--batch``/``--seq`` its batch); an option the JAX backend has no use for,
    given on the command line, is refused (exit 2) with the reason, never ignored.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from remat.cli.common import (
    budget_value,
    err_console,
    fail,
    progress_bar,
    stdout_console,
    user_errors,
    write_json,
)
from remat.errors import message


def load_jax(model: str) -> Any:
    """``remat.jax``, with ``model`` checked against its presets (exit 2 otherwise)."""
    try:
        import remat.jax as rj
    except ImportError as exc:
        fail(escape(f"--framework jax needs jax and flax ({exc}). Install them with: "
                    "pip install 'remat[jax]'"))
    if model not in rj.PRESETS:
        raise typer.BadParameter(message("", f"unknown JAX preset {model!r}",
                                         {"presets with --framework jax": ", ".join(rj.PRESETS)},
                                         fix="pass one of those presets"),
                                 param_hint="'--model'")
    return rj


#: The torch model sources, which have no NNX counterpart (``refuse`` reasons).
SOURCES_REFUSED = {
    "hf": "the JAX backend runs remat.jax's NNX presets (--model)",
    "hf_config": "the JAX backend runs remat.jax's NNX presets (--model)",
    "module": "--module builds a PyTorch model; the JAX backend runs its NNX presets (--model)",
    "settings": "the NNX presets are run as they are",
}


def refuse(ctx: typer.Context, reasons: dict[str, str]) -> None:
    """Exit 2 when an option in ``reasons`` was given on the command line with jax.

    ``reasons`` maps a parameter name to why it has no meaning for the JAX backend
    (see NOTE [ CLI and the JAX backend ]).
    """
    # by name: typer may bring its own copy of click's ParameterSource enum
    given = [name for name in reasons
             if getattr(ctx.get_parameter_source(name), "name", "DEFAULT") != "DEFAULT"]
    if given:
        flags = {p.name: p.opts[0] for p in ctx.command.params}
        fail("; ".join(f"{flags.get(n, n)} is not supported with --framework jax: {reasons[n]}"
                       for n in given))


def strategies_for_jax(rj: Any, value: str | None) -> list[str]:
    """``--strategies`` read as JAX strategies (default: ``remat.jax.DEFAULT_STRATEGIES``)."""
    from remat.errors import StrategyError
    from remat.jax.policies import strategy_policies

    names = [s.strip() for s in value.split(",") if s.strip()] if value else \
        list(rj.DEFAULT_STRATEGIES)
    for name in names:
        try:
            strategy_policies(name, 1)
        except StrategyError as exc:
            head, sep, fix = str(exc).rpartition("\n  fix: ")
            text = f"{head}\n  JAX strategies: {', '.join(rj.STRATEGIES)}{sep}{fix}" if sep \
                else f"{exc}\n  JAX strategies: {', '.join(rj.STRATEGIES)}"
            raise typer.BadParameter(text, param_hint="'--strategies'") from None
    return names


PLAN_REFUSED = {
    **SOURCES_REFUSED,
    "maximize": "the JAX planner plans one batch size",
    "max_batch": "it goes with --maximize, which the JAX planner does not do",
    "optimizer": "the JAX step is loss and gradients (no optimizer state)",
    "device": "JAX runs on its default backend (set JAX_PLATFORMS=cpu to force the CPU)",
    "cost_device": "JAX costs are XLA's FLOPs of the compiled step",
    "simulate": "XLA's analysis allocates nothing already",
    "cost": "JAX plans minimize XLA's recompute FLOPs (no timed or roofline costs)",
    "frontier": "no frontier with --framework jax; remat compare --framework jax shows "
                "the manual policies",
    "plot": "the frontier plot is PyTorch's",
}


def plan_jax(ctx: typer.Context, *, model: str, budget: str, batch: int, seq: int | None,
              seed: int, out: Path | None, json_out: str | None) -> None:
    """``remat plan --framework jax``: ``remat.jax.plan_preset`` (NOTE [ CLI and the JAX
    backend ])."""
    refuse(ctx, PLAN_REFUSED)
    rj = load_jax(model)
    try:
        rj.make_batch(model, batch, seq)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--seq'") from None
    started = time.perf_counter()
    with user_errors(), progress_bar(f"plan {model} (jax)") as update:
        update("measure candidates and plan", 0, 1)
        result = rj.plan_preset(model, budget=budget_value(budget), batch_size=batch,
                                seq_len=seq, seed=seed)
        update("done", 1, 1)
    elapsed_s = time.perf_counter() - started
    if json_out != "-":
        stdout_console().print(result.summary(), highlight=False)
        err_console.print(f"Planned in {elapsed_s:.1f} s.", highlight=False)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(result.to_json() + "\n")
        err_console.print(f"Wrote {out}", highlight=False)
    if json_out is not None:
        meta = {"model": model, "batch_size": batch, "seq_len": seq, "budget": budget,
                "seed": seed, "framework": "jax"}
        write_json({"meta": meta, "plan": result.to_dict(), "frontier": None}, json_out)
