"""``remat plan``: the cheapest checkpointing plan for a memory budget, and its frontier."""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from remat.cli import app
from remat.cli.common import (
    budget_value,
    err_console,
    fail,
    make_optimizer,
    notices,
    progress_bar,
    resolve_device,
    stdout_console,
    user_errors,
    write_json,
)
from remat.cli.options import (
    DEFAULT_MODEL,
    DeviceOpt,
    Framework,
    FrameworkOpt,
    HfConfigOpt,
    HfOpt,
    JsonOpt,
    MinSeqOpt,
    ModelOpt,
    ModuleOpt,
    OptimizerChoice,
    OptimizerOpt,
    RegistryHelpCommand,
    SeedOpt,
    SeqMultipleOpt,
    SeqOpt,
    SetOpt,
    SimStrategiesOpt,
    check_output,
    plot_option,
)
from remat.cli.sources import batch_shape, given_flags, given_sources, run_source, shape_label
from remat.errors import message
from remat.progress import reporting

if TYPE_CHECKING:
    from remat.cli.sources import RunSource

_EPILOG = """\
Examples:

  remat plan --budget 60%        (or activations:50%)

  remat plan --model llama-small --budget 120MiB --batch 4 --out out/plan.json

  remat plan --model gpt-tiny --budget 70% --plot out/frontier.png --json out/plan-run.json

  remat plan --model gpt-small --budget 60% --maximize throughput --simulate
  remat plan --model llama-small --budget device --cost-device l4 --simulate   # the card
  remat plan --model gpt-small --budget 300MiB --maximize seq-len --seq 4096 --simulate

  remat plan --model gpt-tiny --budget 80% --cost measured   # time candidates (auto on CUDA)

  remat plan --framework jax --model gpt-small --budget 50% --out plan.json   (JAX/Flax NNX)

  remat plan --model gpt-tiny --budget 80% --compile --out out/plan.json   # compiled step

  remat plan --module examples/my_model.py:build --budget 70% --batch 2 --seq 128   # yours

Then train with it:  remat.apply(model, remat.Plan.from_json(open("plan.json").read()))
"""


class Maximize(str, Enum):
    """What ``remat plan --maximize`` searches for."""

    throughput = "throughput"
    seq_len = "seq-len"


class CostChoice(str, Enum):
    """What ``remat plan --cost`` minimizes (see ``remat.plan``'s ``cost``)."""

    auto = "auto"
    roofline = "roofline"
    measured = "measured"


def _check_budget(value: str) -> str:
    from remat.core.budget import parse_budget

    try:
        parse_budget(budget_value(value))
    except ValueError as exc:
        raise typer.BadParameter(str(exc).removeprefix("remat.plan: ")) from None
    return value


@app.command("plan", epilog=_EPILOG, cls=RegistryHelpCommand)
def plan_command(
    ctx: typer.Context,
    model: ModelOpt = None,
    hf: HfOpt = None,
    hf_config: HfConfigOpt = None,
    module: ModuleOpt = None,
    settings: SetOpt = None,
    budget: Annotated[str, typer.Option(
        "--budget", callback=_check_budget, metavar="BUDGET",
        help="Peak memory of the whole step: bytes, 12GiB / 800MB, 60% of the "
             "un-checkpointed peak, or activations:50% (the parameters, gradients, optimizer "
             "state and batch plus half of the rest of that peak).",
    )] = "60%",
    batch: Annotated[int, typer.Option(
        "--batch", "-b", min=1, metavar="N",
        help="Sequences per batch (with --maximize throughput: the batch size a % budget "
             "refers to; with --maximize seq-len: the micro-batch, default 1).",
    )] = 8,
    seq: SeqOpt = None,
    maximize: Annotated[Maximize | None, typer.Option(
        "--maximize", case_sensitive=False,
        help="throughput: the batch size (and plan) with the most samples/s; seq-len: the "
             "longest sequence (up to --seq) each strategy and a plan fit at --batch.",
    )] = None,
    max_batch: Annotated[int, typer.Option(
        "--max-batch", min=1, metavar="N", help="Largest batch size --maximize tries.",
    )] = 256,
    min_seq: MinSeqOpt = None,
    seq_multiple: SeqMultipleOpt = 64,
    strategies: SimStrategiesOpt = None,
    optimizer: OptimizerOpt = OptimizerChoice.none,
    device: DeviceOpt = "auto",
    cost_device: Annotated[str | None, typer.Option(
        "--cost-device", metavar="NAME",
        help="Device whose figures the costs use (h100-80gb, a100-80gb, ...). Default: the "
             "GPU in use, else h100-80gb.",
    )] = None,
    simulate: Annotated[bool, typer.Option(
        "--simulate", help="Measure under FakeTensorMode (nothing allocated; faster).",
    )] = False,
    cost: Annotated[CostChoice, typer.Option(
        "--cost", case_sensitive=False,
        help="What the plan minimizes: measured time (timed block runs; auto on CUDA) or "
             "roofline time on the cost device (auto elsewhere).",
    )] = CostChoice.auto,
    compile_: Annotated[bool, typer.Option(
        "--compile",
        help="Plan the step as it runs with each block torch.compile-d (real runs; the "
             "plan file records the compile, remat.apply compiles the blocks; no frontier).",
    )] = False,
    frontier: Annotated[bool, typer.Option(
        "--frontier/--no-frontier",
        help="Also measure every manual strategy and print the frontier.",
    )] = True,
    accumulating: Annotated[bool, typer.Option(
        "--accumulating",
        help="Plan for gradient accumulation (zero_grad every few micro-batches): each "
             "micro-step after the first starts with the gradients held, and must fit too.",
    )] = False,
    seed: SeedOpt = 0,
    out: Annotated[Path | None, typer.Option(
        "--out", metavar="FILE.json", dir_okay=False, callback=check_output,
        help="Write the plan as JSON (read it back with remat.Plan.from_json).",
    )] = None,
    json_out: JsonOpt = None,
    plot: Annotated[Path | None, plot_option(
        "Draw the frontier: peak memory vs recompute overhead, the budget as a line.")] = None,
    framework: FrameworkOpt = Framework.torch,
) -> None:
    """Plan checkpointing for a model (a preset, a Hugging Face config or --module yours)
    under a peak-memory budget.

    Finds, block by block, the decisions (keep, checkpoint the block, its attention or
    MLP, or keep only chosen ops' outputs) with the least recompute whose measured peak
    fits the budget, and prints the plan and the frontier: every manual strategy
    (<frontier-strategies>) and the plan as points (peak memory,
    recompute overhead). Recompute cost is measured time on a GPU and roofline time on
    the cost device elsewhere (--cost). With --framework jax: remat.jax's planner on the
    NNX preset of the same name (jax.checkpoint policies per block, XLA's compiled peak
    and FLOPs); --out writes the remat.jax plan.
    """
    sources = given_sources(model, hf, hf_config, module, settings)
    if framework is Framework.jax:
        from remat.cli.jax_backend import plan_jax

        plan_jax(ctx, model=model or DEFAULT_MODEL, budget=budget, batch=batch, seq=seq,
                  seed=seed, out=out, json_out=json_out)
        return
    if cost is CostChoice.measured and simulate:
        raise typer.BadParameter(
            message("", "--cost measured and --simulate do not go together",
                    {"why": "measured costs time real runs, but --simulate runs on fake tensors"},
                    fix="drop one"),
            param_hint="'--cost'",
        )
    if compile_ and (simulate or maximize is not None):
        raise typer.BadParameter(message(
            "", "--compile does not go with --simulate or --maximize",
            {"why": "compiled plans are measured for real, one batch size at a time"},
            fix="drop --simulate and --maximize, or drop --compile"), param_hint="'--compile'")
    if maximize is Maximize.seq_len:
        from remat.cli.seq_len import seq_len_command

        return seq_len_command(ctx, sources, budget=budget, seq=seq, min_seq=min_seq,
                               multiple_of=seq_multiple, strategies=strategies,
                               optimizer=optimizer.value, simulate=simulate, cost=cost.value,
                               cost_device=cost_device, device=device, seed=seed,
                               json_out=json_out)
    target = resolve_device(device)
    source = run_source(sources, api="remat plan", seq=seq, seed=seed, target=target,
                        given=given_flags(ctx, "batch", "seq"))
    if maximize is not None and source.make_batch is None:
        fail(message("remat plan", f"{source.name} gives one fixed batch",
                     {"why": "--maximize throughput searches batch sizes"},
                     fix="return an object with make_batch(batch_size, seq_len) from the "
                         "factory, or drop --maximize"))
    request = _Request(source=source, budget=budget, batch=batch, seq=seq, maximize=maximize,
                       max_batch=max_batch, optimizer=optimizer, target=target,
                       cost_device=cost_device, simulate=simulate, cost=cost,
                       frontier=(frontier or plot is not None) and not compile_, seed=seed,
                       compile=compile_, accumulating=accumulating)
    outcome = _run(request)
    if json_out != "-":
        _print_outcome(request, outcome)
    _write_outputs(request, outcome, out=out, json_out=json_out, plot=plot)


@dataclass(frozen=True)
class _Request:
    """What ``remat plan`` was asked for (its options, the device and source resolved)."""

    source: RunSource
    budget: str
    batch: int
    seq: int | None
    maximize: Maximize | None
    max_batch: int
    optimizer: OptimizerChoice
    target: Any
    cost_device: str | None
    simulate: bool
    cost: CostChoice
    frontier: bool
    seed: int
    compile: bool = False
    accumulating: bool = False

    def make_batch(self, n: int) -> Any:
        return self.source.batch(n)

    @property
    def loss_fn(self) -> Any:
        """The source's loss, as a gradient-accumulation micro-step runs it with
        ``--accumulating``."""
        from remat.measure.step import step_loss

        return step_loss(self.source.loss_fn, accumulating=self.accumulating,
                         api="remat plan")


@dataclass(frozen=True)
class _Outcome:
    """The plan, the batch it was made for, its frontier (or ``None``) and the time taken."""

    plan: Any
    batch_size: int
    seq_len: int | None
    frontier: Any
    elapsed_s: float


def _make_plan(request: _Request, net: Any, sample: Any, opt: Any) -> tuple[Any, int, Any]:
    """The plan, the batch size it is for, and that batch."""
    common = {"budget": budget_value(request.budget), "optimizer": opt,
              "device": request.cost_device, "loss_fn": request.loss_fn}
    size = batch_shape(sample)[0] or request.batch
    if request.compile:
        from remat.compiled.plan import plan_compiled

        return plan_compiled(net, sample, **common), size, sample
    from remat.planning import plan, plan_throughput
    from remat.planning.throughput import ThroughputSearch

    common |= {"simulate": request.simulate, "cost": request.cost.value}
    if request.maximize is Maximize.throughput:
        search = ThroughputSearch(batch_size=request.batch, max_batch_size=request.max_batch)
        result = plan_throughput(net, request.make_batch, search=search, **common)
        chosen_batch = result.batch_size or request.batch
        return result, chosen_batch, request.make_batch(chosen_batch)
    return plan(net, sample, **common), size, sample


def _run(request: _Request) -> _Outcome:
    """Build the model, plan it, and measure the frontier (with a progress bar)."""
    from remat.compare.frontier import frontier as measure_frontier

    sample = request.make_batch(request.batch)
    seq_len = batch_shape(sample)[1]
    name = request.source.name
    started = time.perf_counter()
    with user_errors(), notices(), progress_bar(f"plan {name}") as update:
        update("build model", 0, 3)
        net = request.source.build()
        opt = make_optimizer(request.optimizer.value, net)
        update("measure candidates and plan", 1, 3)
        with reporting(lambda step, done, total: update(f"plan: {step}", done, total)):
            result, chosen_batch, sample = _make_plan(request, net, sample, opt)
        front = None
        if request.frontier:
            update("measure manual strategies", 2, 3)
            with reporting(lambda step, done, total: update(f"frontier: {step}", done, total)):
                front = measure_frontier(net, sample, result, optimizer=opt,
                                         simulate=request.simulate,
                                         loss_fn=request.loss_fn,
                                         label=shape_label(name, chosen_batch, seq_len))
        update("done", 3, 3)
    return _Outcome(result, chosen_batch, seq_len, front, time.perf_counter() - started)


def _print_outcome(request: _Request, outcome: _Outcome) -> None:
    from remat.report.plan import plan_renderable
    from remat.report.tables import frontier_table

    console = stdout_console()
    shape = shape_label(request.source.name, outcome.batch_size, outcome.seq_len)
    held = ", gradients held (--accumulating)" if request.accumulating else ""
    console.print(f"remat plan: {shape}, budget {request.budget} on {request.target}{held}",
                  highlight=False)
    console.print(plan_renderable(outcome.plan))
    front = outcome.frontier
    if front is not None:
        console.print(frontier_table(front))
        best = front.best_manual()
        if best is not None and best.recompute_ms > 0:
            saved = 100.0 * (1.0 - front.point("plan").recompute_ms / best.recompute_ms)
            console.print(f"The plan recomputes {saved:.0f}% less than the best manual "
                          f"strategy that fits ({best.name}).", highlight=False)
    err_console.print(f"Planned in {outcome.elapsed_s:.1f} s.", highlight=False)


def _write_outputs(request: _Request, outcome: _Outcome, *, out: Path | None,
                   json_out: str | None, plot: Path | None) -> None:
    import torch

    from remat.report.plots import plot_frontier

    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(outcome.plan.to_json() + "\n")
        err_console.print(f"Wrote {out}", highlight=False)
    front = outcome.frontier
    if json_out is not None:
        meta = {"model": request.source.name, "batch_size": outcome.batch_size,
                "seq_len": outcome.seq_len, "budget": request.budget,
                "optimizer": request.optimizer.value, "seed": request.seed,
                "simulate": request.simulate, "accumulating": request.accumulating,
                "torch": torch.__version__}
        write_json({"meta": meta, "plan": outcome.plan.to_dict(),
                    "frontier": front.to_dict() if front is not None else None}, json_out)
    if plot is not None and front is not None:
        written = plot_frontier(front, plot)
        err_console.print(f"Wrote {written}", highlight=False)
