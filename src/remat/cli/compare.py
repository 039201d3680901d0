"""``remat compare``: every strategy on one model, side by side."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from remat.cli import app
from remat.cli.common import (
    check_fits,
    err_console,
    notices,
    parse_strategies,
    progress_bar,
    resolve_device,
    stdout_console,
    user_errors,
    write_json,
)
from remat.cli.options import (
    DEFAULT_MODEL,
    BatchOpt,
    DeviceOpt,
    Framework,
    FrameworkOpt,
    HfConfigOpt,
    HfOpt,
    JsonOpt,
    ModelOpt,
    ModuleOpt,
    RegistryHelpCommand,
    SeedOpt,
    SeqOpt,
    SetOpt,
    StrategiesOpt,
    plot_option,
)
from remat.cli.sources import (
    Sources,
    batch_shape,
    given_flags,
    given_sources,
    run_source,
    shape_label,
)

_EPILOG = """\
Examples:

  remat compare

  remat compare --model llama-small --batch 4 --seq 64

  remat compare --model gpt-tiny --strategies none,full,every:2 --json out/compare.json

  remat compare --plot out/compare.png --repeats 9

  remat compare --plan-budget 40% (the plan row: the cheapest plan under 40% of none's peak)

  remat compare --framework jax --model gpt-small   (JAX/Flax NNX, XLA's compiled analysis)

  remat compare --module examples/my_model.py:build_training --batch 2 --seq 64
"""


@app.command("compare", epilog=_EPILOG, cls=RegistryHelpCommand)
def compare_command(
    ctx: typer.Context,
    model: ModelOpt = None,
    hf: HfOpt = None,
    hf_config: HfConfigOpt = None,
    module: ModuleOpt = None,
    settings: SetOpt = None,
    batch: BatchOpt = 8,
    seq: SeqOpt = None,
    strategies: StrategiesOpt = None,
    device: DeviceOpt = "auto",
    repeats: Annotated[int, typer.Option(
        "--repeats", min=0, help="Timed steps per strategy (median); 0 skips timing.",
    )] = 5,
    seed: SeedOpt = 0,
    check_grads: Annotated[bool, typer.Option(
        "--check-grads/--no-check-grads",
        help="Check each strategy's gradients against the un-checkpointed model.",
    )] = True,
    json_out: JsonOpt = None,
    plot: Annotated[Path | None, plot_option(
        "Draw peak memory against recompute overhead to FILE.png (dirs created).")] = None,
    plan_budget: Annotated[str, typer.Option(
        "--plan-budget", metavar="BUDGET",
        help="Add a 'plan' row: remat.plan's (or remat.jax.plan's) cheapest plan for this "
             "budget (bytes, 12GiB, or a % of none's peak); 'off' leaves it out.",
    )] = "50%",
    framework: FrameworkOpt = Framework.torch,
) -> None:
    """Run every checkpointing strategy on a model and compare them.

    For each strategy: a fresh model with identical weights, one measured training
    step (exact peak and activation bytes, FLOPs including recomputation), a
    gradient check against the un-checkpointed model, and the median step time,
    measured side by side with the other strategies. Exits with code 1 when a
    gradient check fails. The model is a preset, a Hugging Face config or your own
    (--module; its factory is called once per strategy). With --framework jax: the JAX
    backend on the NNX preset of the same name, every byte and FLOP from XLA's compiled
    analysis of the step.
    """
    from remat.report.plots import plot_comparison
    from remat.report.tables import comparison_table

    sources = given_sources(model, hf, hf_config, module, settings)
    started = time.perf_counter()
    if framework is Framework.jax:
        result = _compare_jax(ctx, model or DEFAULT_MODEL, batch, seq, strategies, repeats,
                              seed, check_grads, plan_budget)
    else:
        result = _compare_torch(sources, given_flags(ctx, "batch", "seq"), batch, seq,
                                strategies, device, repeats, seed, check_grads, plan_budget)
    elapsed_s = time.perf_counter() - started

    if json_out != "-":
        err_console.print(f"Ran {len(result.rows)} strategies in {elapsed_s:.1f} s.",
                          highlight=False)
        stdout_console().print(comparison_table(result))
    if json_out is not None:
        write_json(result.to_dict(), json_out)
    if plot is not None:
        written = plot_comparison(result, plot)
        err_console.print(f"Wrote {written}", highlight=False)
    failed = [row.strategy for row in result.rows if row.grad_passed is False]
    if failed:
        err_console.print(f"[bold red]Gradient check failed for: {', '.join(failed)}[/]")
        raise typer.Exit(1)


def _compare_torch(sources: Sources, given: list[str], batch: int, seq: int | None,
                   strategies: str | None, device: str, repeats: int, seed: int,
                   check_grads: bool, plan_budget: str) -> Any:
    """The PyTorch comparison (and its plan row)."""
    import torch

    from remat.compare.runner import compare
    from remat.strategies.registry import default_strategies

    names = parse_strategies(strategies) if strategies else default_strategies("compare")
    target = resolve_device(device)
    source = run_source(sources, api="remat compare", seq=seq, seed=seed, target=target,
                        given=given)
    # One model per strategy stays alive for interleaved timing; the gradient check adds two.
    check_fits(source.name, source.param_bytes, target,
               copies=(len(names) + 1 if repeats else 1) + 2)
    sample = source.batch(batch)
    batch_size, seq_len = batch_shape(sample)
    meta = {"model": source.name, "batch_size": batch_size, "seq_len": seq_len, "seed": seed,
            "torch": torch.__version__}
    with user_errors(), notices(), progress_bar(f"compare {source.name}") as update:
        result = compare(source.build, sample, names, loss_fn=source.loss_fn, seed=seed,
                         repeats=repeats, check_grads=check_grads,
                         label=shape_label(source.name, batch_size, seq_len), meta=meta,
                         progress=update)
        if plan_budget.strip().lower() != "off":
            from remat.compare.frontier import add_plan_row

            result = _with_plan_row(result, plan_budget, update, lambda r: add_plan_row(
                r, budget=plan_budget, model_factory=source.build, batch=sample,
                loss_fn=source.loss_fn, check_grads=check_grads))
    return result


def _with_plan_row(result: Any, plan_budget: str, update: Callable[..., None],
                   add: Callable[[Any], Any]) -> Any:
    """``add(result)`` (the result with a plan row), or ``result`` and a note on stderr when
    no plan fits ``--plan-budget`` (the default budget may not suit every model)."""
    from remat.errors import BudgetTooSmall

    update(f"plan for {plan_budget}", len(result.rows), len(result.rows) + 1)
    try:
        return add(result)
    except BudgetTooSmall as exc:
        err_console.print(
            f"No plan row: no plan fits --plan-budget {plan_budget} (smallest reachable peak "
            f"{exc.min_peak_bytes} B); pass a larger --plan-budget.", highlight=False)
        return result


def _compare_jax(ctx: typer.Context, model: str, batch: int, seq: int | None,
                 strategies: str | None, repeats: int, seed: int, check_grads: bool,
                 plan_budget: str) -> Any:
    """``remat.jax.compare`` on the NNX preset, plan row included (see jax_backend.py)."""
    from remat.cli.jax_backend import SOURCES_REFUSED, load_jax, refuse, strategies_for_jax

    refuse(ctx, {
        "device": "JAX runs on its default backend (set JAX_PLATFORMS=cpu to force the CPU)",
        **SOURCES_REFUSED,
    })
    rj = load_jax(model)
    names = strategies_for_jax(rj, strategies)
    with user_errors(), progress_bar(f"compare {model} (jax)") as update:
        try:
            net = rj.build_model(model, seed=seed)
            sample = rj.make_batch(model, batch, seq, seed=seed)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="'--seq'") from None
        seq_len = int(sample["input_ids"].shape[1])
        result = rj.compare(net, sample, names, repeats=repeats, check_grads=check_grads,
                            label=f"{model} (JAX), batch {batch}, seq {seq_len}",
                            meta={"model": model, "batch_size": batch, "seq_len": seq_len,
                                  "seed": seed},
                            progress=update)
        if plan_budget.strip().lower() != "off":
            from remat.jax.compare import add_plan_row

            result = _with_plan_row(result, plan_budget, update, lambda r: add_plan_row(
                r, net, sample, budget=plan_budget, check_grads=check_grads))
        return result
