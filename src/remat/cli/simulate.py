"""``remat simulate``: plan for hardware you don't have.

Runs every strategy at every micro-batch size under FakeTensorMode (exact bytes,
nothing allocated) for a device from the device table and prints the peak per rank,
whether it fits, the roofline step time and throughput, and the largest batch per
strategy. ``remat estimate`` (estimate.py) puts the closed-form activation formulas
next to the simulated bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from remat.cli import app
from remat.cli._common import (
    ProgressFn,
    err_console,
    progress_bar,
    stdout_console,
    user_errors,
    write_json,
)
from remat.cli._sim_tables import rate, simulation_tables
from remat.cli._sources import check_choice, int_list, model_choice
from remat.cli._sources import overrides as parse_overrides
from remat.cli.options import (
    DtypeOpt,
    GpuOpt,
    HfConfigOpt,
    HfOpt,
    JsonOpt,
    RegistryHelpCommand,
    SetOpt,
    SimModelOpt,
    SimStrategiesOpt,
    plot_option,
)
from remat.errors import message

if TYPE_CHECKING:
    from remat.simulate.result import SimulationResult, SimulationRow


_EPILOG = """\
Examples:

  remat simulate --model llama-7b --seq 2048 --batch 1,2,4,8,16,32 --device h100-80gb

  remat simulate --model llama-7b --seq 4096 --dtype amp-bf16 --device a100-80gb --plot out/sim.png

  remat simulate --hf mistral --seq 4096 --batch 1,2,4 --world-size 8 --sharding fsdp

  remat simulate --hf-config llama-3-8b/config.json --seq 8192 --strategies none,full --json s.json

  remat simulate --hf llama --set num_hidden_layers=16 --set hidden_size=2048 --device l4
"""


def _check_optimizer(value: str) -> str:
    from remat.simulate.precision import OPTIMIZERS

    return check_choice(value, list(OPTIMIZERS), "--optimizer")


def _sharding(sharding: str | None, world_size: int) -> str:
    """``--sharding``, defaulting to fsdp with several ranks; exits 2 on a bad combination."""
    from remat.simulate.sharding import SHARDINGS

    mode = sharding or ("fsdp" if world_size > 1 else "none")
    check_choice(mode, list(SHARDINGS), "--sharding")
    if mode == "none" and world_size > 1:
        raise typer.BadParameter(message("", "--world-size > 1 needs sharding",
                                         fix="pass --sharding fsdp or ddp"),
                                 param_hint="'--sharding'")
    return mode


def _row_progress(update: ProgressFn, names: Sequence[str], batch_sizes: Sequence[int],
                  plan: bool) -> Callable[[SimulationRow], None]:
    """An ``on_row`` callback that shows rows done of all rows and which row runs now.

    ``simulate`` runs every strategy's batch sizes in order, then the plan's, so the
    row after the last one done is the one running.
    """
    labels = [f"{name} batch {b}" for name in names for b in batch_sizes]
    if plan:
        labels += [f"plan batch {b}" for b in batch_sizes]
    done = 0
    update(labels[0], 0, len(labels))

    def on_row(_row: SimulationRow) -> None:
        nonlocal done
        done += 1
        update(labels[done] if done < len(labels) else "done", done, len(labels))

    return on_row


def _print_result(result: SimulationResult) -> None:
    err_console.print(f"Simulated {len(result.rows)} steps in {result.elapsed_s:.1f} s.",
                      highlight=False)
    console = stdout_console()
    for table in simulation_tables(result):
        console.print(table)
    best = result.best()
    if best is not None:
        console.print(f"Best: {best.strategy} at micro-batch {best.batch_size} "
                      f"({rate(best.tokens_per_s)} tokens/s predicted).", highlight=False)
    else:
        console.print("[red]Nothing fits[/red]: try a smaller --seq, --sharding fsdp, or a "
                      "larger --device.")


@app.command("simulate", epilog=_EPILOG, cls=RegistryHelpCommand)
def simulate_command(
    model: SimModelOpt = None,
    hf: HfOpt = None,
    hf_config: HfConfigOpt = None,
    overrides: SetOpt = None,
    seq: Annotated[int, typer.Option("--seq", "-s", min=1, metavar="S",
                                     help="Tokens per sequence.")] = 2048,
    batch: Annotated[str, typer.Option(
        "--batch", "-b", metavar="B1,B2,...", help="Micro-batch sizes per rank.",
    )] = "1,2,4,8,16,32",
    dtype: DtypeOpt = "bf16",
    optimizer: Annotated[str, typer.Option(
        "--optimizer", callback=_check_optimizer, metavar="NAME",
        help="adamw, adam, sgd (momentum) or none.",
    )] = "adamw",
    device: GpuOpt = "h100-80gb",
    world_size: Annotated[int, typer.Option(
        "--world-size", min=1, metavar="N", help="Data-parallel ranks.",
    )] = 1,
    sharding: Annotated[str | None, typer.Option(
        "--sharding", metavar="MODE",
        help="fsdp (FSDP/ZeRO-3: params, grads, optimizer state divided by N) or ddp. "
             "Default: fsdp when --world-size > 1, else none.",
    )] = None,
    strategies: SimStrategiesOpt = None,
    plan: Annotated[bool, typer.Option(
        "--plan/--no-plan", help="Also simulate the planner's plan (when remat.plan exists).",
    )] = True,
    exact: Annotated[bool, typer.Option(
        "--exact", help="Simulate the whole step for every row instead of extrapolating "
                        "from shallow steps (slower; the same bytes).",
    )] = False,
    json_out: JsonOpt = None,
    plot: Annotated[Path | None, plot_option(
        "Draw peak memory and throughput against micro-batch size to FILE.png.")] = None,
) -> None:
    """Simulate every strategy at every micro-batch size on a GPU you don't have.

    The model is built on the meta device and each training step (forward, loss,
    backward, optimizer) runs under FakeTensorMode: bytes are exact, nothing is
    allocated, a Llama-7B step takes seconds on a laptop. Step times are roofline
    predictions from the recorded ops. Peaks are tensor bytes; leave a few GiB for
    the CUDA context, allocator fragmentation and workspaces.
    """
    import dataclasses

    from remat.simulate.plot import plot_simulation
    from remat.simulate.run import simulate
    from remat.strategies.registry import default_strategies

    batch_sizes = int_list(batch, "--batch")
    mode = _sharding(sharding, world_size)
    choice = model_choice(model, hf, hf_config, parse_overrides(overrides), seq)
    names = strategies.split(",") if strategies else default_strategies("simulate")
    with user_errors(), progress_bar(f"simulate {choice.name}", log_when_piped=True) as update:
        result = simulate(
            choice.source, seq_len=seq, batch_sizes=batch_sizes, dtype=dtype, optimizer=optimizer,
            device=device, strategies=names, world_size=world_size, sharding=mode,
            plan=plan, on_row=_row_progress(update, names, batch_sizes, plan), exact=exact,
        )
    if choice.name != result.model:
        result = dataclasses.replace(result, model=choice.name)
    if json_out != "-":
        _print_result(result)
    if json_out is not None:
        write_json(result.to_dict(), json_out)
    if plot is not None:
        err_console.print(f"Wrote {plot_simulation(result, plot)}", highlight=False)
