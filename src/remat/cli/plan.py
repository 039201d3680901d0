"""``remat plan``: the cheapest checkpointing plan for a memory budget, and its frontier."""

from __future__ import annotations

import time
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from remat.cli import app
from remat.cli._common import (
    DEFAULT_MODEL,
    DeviceOpt,
    JsonOpt,
    ModelOpt,
    SeqOpt,
    err_console,
    notices,
    resolve_device,
    stdout_console,
    user_errors,
    write_json,
)
from remat.cli.profile import OptimizerChoice

__all__ = ["Maximize", "plan_command"]

_EPILOG = """\
Examples:

  remat plan --budget 60%

  remat plan --model llama-small --budget 120MiB --batch 4 --out out/plan.json

  remat plan --model gpt-tiny --budget 70% --plot out/frontier.png --json out/plan-run.json

  remat plan --model gpt-small --budget 60% --maximize throughput --simulate

  remat plan --model gpt-tiny --budget 80% --cost measured   # time candidates (auto on CUDA)

Then train with it:  remat.apply(model, remat.Plan.from_json(open("plan.json").read()))
"""


class Maximize(str, Enum):
    """What ``remat plan --maximize`` searches for."""

    throughput = "throughput"


class CostChoice(str, Enum):
    """What ``remat plan --cost`` minimizes (see ``remat.plan``'s ``cost``)."""

    auto = "auto"
    roofline = "roofline"
    measured = "measured"


def _check_budget(value: str) -> str:
    from remat.planning.budget import parse_budget

    try:
        parse_budget(int(value) if value.strip().isdigit() else value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc).removeprefix("remat.plan: ")) from None
    return value


@app.command("plan", epilog=_EPILOG)
def plan_command(
    model: ModelOpt = DEFAULT_MODEL,
    budget: Annotated[str, typer.Option(
        "--budget", callback=_check_budget, metavar="BUDGET",
        help="Peak memory of the whole step: bytes, 12GiB / 800MB, or 60% of the "
             "un-checkpointed peak.",
    )] = "60%",
    batch: Annotated[int, typer.Option(
        "--batch", "-b", min=1, metavar="N",
        help="Sequences per batch (with --maximize: the batch size a % budget refers to).",
    )] = 8,
    seq: SeqOpt = None,
    maximize: Annotated[Maximize | None, typer.Option(
        "--maximize", case_sensitive=False,
        help="throughput: search the batch size (and plan) with the most samples/s.",
    )] = None,
    max_batch: Annotated[int, typer.Option(
        "--max-batch", min=1, metavar="N", help="Largest batch size --maximize tries.",
    )] = 256,
    optimizer: Annotated[OptimizerChoice, typer.Option(
        "--optimizer", case_sensitive=False,
        help="Include an optimizer step (its state counts towards the peak).",
    )] = OptimizerChoice.none,
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
    frontier: Annotated[bool, typer.Option(
        "--frontier/--no-frontier",
        help="Also measure every manual strategy and print the frontier.",
    )] = True,
    seed: Annotated[int, typer.Option("--seed", help="Seed for weights and batch.")] = 0,
    out: Annotated[Path | None, typer.Option(
        "--out", metavar="FILE.json", dir_okay=False,
        help="Write the plan as JSON (read it back with remat.Plan.from_json).",
    )] = None,
    json_out: JsonOpt = None,
    plot: Annotated[Path | None, typer.Option(
        "--plot", metavar="FILE.png", dir_okay=False,
        help="Draw the frontier: peak memory vs recompute overhead, the budget as a line.",
    )] = None,
) -> None:
    """Plan checkpointing for a built-in model under a peak-memory budget.

    Finds, block by block, the decisions (keep, checkpoint the block, its attention or
    MLP, or keep only chosen ops' outputs) with the least recompute whose measured peak
    fits the budget, and prints the plan and the frontier: every manual strategy (none,
    full, every:N, sqrt, attn, mlp, ops) and the plan as points (peak memory, recompute
    overhead). Recompute cost is measured time on a GPU and roofline time on the cost
    device elsewhere (--cost).
    """
    import torch

    from remat.cli.compare import progress_bar
    from remat.compare.frontier import frontier as measure_frontier
    from remat.models import build_model, make_batch
    from remat.planning import plan as make_plan
    from remat.report.frontier import frontier_table, plot_frontier

    if cost is CostChoice.measured and simulate:
        raise typer.BadParameter(
            "measured costs time real runs, but --simulate runs on fake tensors; drop one",
            param_hint="'--cost'",
        )
    target = resolve_device(device)
    try:
        sample = make_batch(model, batch, seq, seed=seed, device=target)
    except ValueError as exc:
        raise typer.BadParameter(str(exc).removeprefix("remat.models.make_batch: "),
                                 param_hint="'--seq'") from None
    seq_len = int(sample["input_ids"].shape[1])
    budget_value: int | str = int(budget) if budget.strip().isdigit() else budget

    started = time.perf_counter()
    with user_errors(), notices(), progress_bar(f"plan {model}") as update:
        update("build model", 0, 3)
        torch.manual_seed(seed)
        with torch.device(target):
            net = build_model(model)
        net.train()
        opt = _make_optimizer(optimizer, net)
        update("measure candidates and plan", 1, 3)
        if maximize is Maximize.throughput:
            def batch_of(n: int) -> Any:
                return make_batch(model, n, seq, seed=seed, device=target)

            result = make_plan(net, batch_of, budget=budget_value, optimizer=opt,
                               simulate=simulate, maximize="throughput", device=cost_device,
                               batch_size=batch, max_batch_size=max_batch, cost=cost.value)
            chosen_batch = result.batch_size or batch
            sample = batch_of(chosen_batch)
        else:
            result = make_plan(net, sample, budget=budget_value, optimizer=opt,
                               simulate=simulate, device=cost_device, cost=cost.value)
            chosen_batch = batch
        front = None
        if frontier or plot is not None:
            update("measure manual strategies", 2, 3)
            front = measure_frontier(net, sample, result, optimizer=opt, simulate=simulate,
                                     label=f"{model}, batch {chosen_batch}, seq {seq_len}")
        update("done", 3, 3)
    elapsed_s = time.perf_counter() - started

    if json_out != "-":
        console = stdout_console()
        console.print(f"remat plan: {model}, batch {chosen_batch}, seq {seq_len}, budget "
                      f"{budget} on {target}", highlight=False)
        console.print(result)
        if front is not None:
            console.print(frontier_table(front))
            best = front.best_manual()
            if best is not None and best.recompute_ms > 0:
                saved = 100.0 * (1.0 - front.point("plan").recompute_ms / best.recompute_ms)
                console.print(f"The plan recomputes {saved:.0f}% less than the best manual "
                              f"strategy that fits ({best.name}).", highlight=False)
        err_console.print(f"Planned in {elapsed_s:.1f} s.", highlight=False)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(result.to_json() + "\n")
        err_console.print(f"Wrote {out}", highlight=False)
    if json_out is not None:
        meta = {"model": model, "batch_size": chosen_batch, "seq_len": seq_len,
                "budget": budget, "optimizer": optimizer.value, "seed": seed,
                "simulate": simulate, "torch": torch.__version__}
        write_json({"meta": meta, "plan": result.to_dict(),
                    "frontier": front.to_dict() if front is not None else None}, json_out)
    if plot is not None and front is not None:
        written = plot_frontier(front, plot)
        err_console.print(f"Wrote {written}", highlight=False)


def _make_optimizer(choice: OptimizerChoice, model: Any) -> Any:
    import torch

    if choice is OptimizerChoice.sgd:
        return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    if choice is OptimizerChoice.adamw:
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    return None
