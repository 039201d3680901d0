"""``remat plan --maximize seq-len``: the longest sequence each strategy and a plan fit."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import typer

from remat.cli.common import (
    budget_value,
    err_console,
    fail,
    make_optimizer,
    notices,
    progress_bar,
    stdout_console,
    user_errors,
    write_json,
)
from remat.errors import message
from remat.progress import reporting

if TYPE_CHECKING:
    from rich.table import Table

    from remat.cli.sources import RunSource, Sources
    from remat.planning.seq_len import SeqLenResult


def sources_up_to(sources: Sources, seq: int | None) -> Sources:
    """A preset's sources with ``max_seq_len`` raised to ``seq`` (the longest length
    searched must fit its position table), unless ``--set max_seq_len=`` says otherwise."""
    if (seq is None or sources.hf is not None or sources.hf_config is not None
            or sources.module is not None
            or any(k.startswith("max_seq_len=") for k in sources.settings)):
        return sources
    return replace(sources, settings=(*sources.settings, f"max_seq_len={seq}"))


def seq_len_table(result: SeqLenResult, title: str) -> Table:
    """One row per strategy and the plan: the longest sequence that fits, and the next."""
    from rich.table import Table

    from remat.units import format_bytes

    table = Table(title=title, title_justify="left",
                  caption=f"lengths tried: multiples of {result.search.multiple_of} from "
                          f"{result.search.min_seq_len} to {result.search.max_seq_len}",
                  caption_justify="left")
    for header in ("Strategy", "Longest seq", "Peak", "Next seq", "Peak there", "Steps"):
        table.add_column(header, justify="left" if header == "Strategy" else "right")
    best = max((r.seq_len or 0) for r in result.rows)
    for r in result.rows:
        mark = " (longest)" if r.seq_len == best and best else ""
        table.add_row(r.strategy + mark,
                      str(r.seq_len) if r.seq_len is not None else "[red]none fits[/]",
                      format_bytes(r.peak_bytes) if r.peak_bytes is not None else "-",
                      str(r.next_seq_len) if r.next_seq_len is not None else "-",
                      format_bytes(r.next_peak_bytes) if r.next_peak_bytes is not None else "-",
                      str(r.tried))
    return table


def seq_len_command(ctx: typer.Context, sources: Sources, *, budget: str, seq: int | None,
                    min_seq: int | None, multiple_of: int, strategies: str | None,
                    optimizer: str, simulate: bool, cost: str, cost_device: str | None,
                    device: str, seed: int, json_out: str | None) -> None:
    """``remat plan --maximize seq-len``: resolve the source up to ``--seq``, then search."""
    from remat.cli.common import resolve_device
    from remat.cli.sources import given_flags, run_source

    target = resolve_device(device)
    source = run_source(sources_up_to(sources, seq), api="remat plan", seq=seq, seed=seed,
                        target=target, given=given_flags(ctx, "batch", "seq"))
    batch = ctx.params["batch"] if given_flags(ctx, "batch") else 1
    run_seq_len(source, budget=budget_value(budget),
                batch=batch, min_seq=min_seq or 0, max_seq=seq, multiple_of=multiple_of,
                strategies=strategies.split(",") if strategies else None, optimizer=optimizer,
                simulate=simulate, cost=cost, cost_device=cost_device, target=target,
                json_out=json_out, meta={"model": source.name, "budget": budget,
                                         "optimizer": optimizer, "seed": seed,
                                         "simulate": simulate})


def run_seq_len(source: RunSource, *, budget: int | str, batch: int, min_seq: int,
                max_seq: int | None, multiple_of: int, strategies: list[str] | None,
                optimizer: str, simulate: bool, cost: str, cost_device: str | None,
                target: Any, json_out: str | None, meta: dict[str, Any]) -> None:
    """Search, print the table (and the plan at its longest sequence), write ``--json``."""
    from remat.planning.seq_len import SeqLenSearch, plan_seq_len
    from remat.report.plan import plan_renderable

    make = source.make_seq_batch
    longest = max_seq or source.seq_len
    if make is None or longest is None:
        fail(message("remat plan", f"{source.name} gives one fixed batch",
                     {"why": "--maximize seq-len searches sequence lengths"},
                     fix="return an object with make_batch(batch_size, seq_len) from the "
                         "factory, or drop --maximize"))
    try:
        search = SeqLenSearch(batch_size=batch, min_seq_len=min_seq or multiple_of,
                              max_seq_len=longest, multiple_of=multiple_of)
    except ValueError as exc:
        fail(str(exc))
    started = time.perf_counter()
    with user_errors(), notices(), progress_bar(f"plan {source.name}") as update:
        update("build model", 0, 1)
        net = source.build()
        opt = make_optimizer(optimizer, net)
        with reporting(lambda step, done, total: update(f"seq-len: {step}", done, total)):
            result = plan_seq_len(net, make, budget=budget, search=search,
                                  strategies=strategies, optimizer=opt, simulate=simulate,
                                  cost=cost, device=cost_device, loss_fn=source.loss_fn)
    elapsed_s = time.perf_counter() - started
    if json_out != "-":
        console = stdout_console()
        from remat.units import format_bytes

        console.print(seq_len_table(result, f"remat plan: {source.name}, batch {batch}, "
                                            f"budget {format_bytes(result.budget_bytes)} on "
                                            f"{target}: longest sequence that fits"),
                      highlight=False)
        if result.plan is not None:
            console.print(f"The plan at seq {result.longest('plan')}:", highlight=False)
            console.print(plan_renderable(result.plan))
        err_console.print(f"Searched in {elapsed_s:.1f} s.", highlight=False)
    if json_out is not None:
        write_json({"meta": {**meta, "maximize": "seq-len"}, "seq_len_search": result.to_dict()},
                   json_out)
