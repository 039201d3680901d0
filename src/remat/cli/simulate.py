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
    fail,
    progress_bar,
    stdout_console,
    user_errors,
    write_json,
)
from remat.cli._sim_tables import rate, simulation_tables
from remat.cli._sources import ModelChoice, batch_shape, given_flags, given_sources, model_choice
from remat.cli._user_model import raised
from remat.cli.options import (
    DtypeOpt,
    GpuOpt,
    HfConfigOpt,
    HfOpt,
    JsonOpt,
    ModuleOpt,
    RegistryHelpCommand,
    SetOpt,
    SimModelOpt,
    SimStrategiesOpt,
    check_choice,
    int_list,
    plot_option,
)
from remat.errors import RematError, message

if TYPE_CHECKING:
    from remat.simulate.result import SimulationResult, SimulationRow


_EPILOG = """\
Examples:

  remat simulate --model llama-7b --seq 2048 --batch 1,2,4,8,16,32 --device h100-80gb

  remat simulate --model llama-7b --seq 4096 --dtype amp-bf16 --device a100-80gb --plot out/sim.png

  remat simulate --hf mistral --seq 4096 --batch 1,2,4 --world-size 8 --sharding fsdp

  remat simulate --hf-config llama-3-8b/config.json --seq 8192 --strategies none,full --json s.json

  remat simulate --hf llama --set num_hidden_layers=16 --set hidden_size=2048 --device l4

  remat simulate --module examples/my_model.py:build_training --seq 1024 --batch 1,8
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


API = "remat simulate"


def _fixed_batch_size(choice: ModelChoice, given: list[str]) -> int:
    """The size of a ``--module`` source's fixed batch: the one batch size to simulate."""
    size = batch_shape(choice.fixed_batch)[0]
    if given or size is None:
        fail(message(API, f"{choice.name} gives one fixed batch"
                          + (f" of {size}" if size is not None else "")
                          + ("; --batch asks for other sizes" if given else
                             ", whose size cannot be read"),
                     {"why": "simulate sweeps micro-batch sizes, which a fixed batch cannot"},
                     fix="return an object with make_batch(batch_size, seq_len) from the "
                         "factory" + (", or drop --batch" if given else "")))
    err_console.print(f"Simulating the fixed batch of {choice.name} (batch {size}).",
                      highlight=False)
    return size


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
    ctx: typer.Context,
    model: SimModelOpt = None,
    hf: HfOpt = None,
    hf_config: HfConfigOpt = None,
    module: ModuleOpt = None,
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
    the CUDA context, allocator fragmentation and workspaces. --module factories are
    called on the meta device too.
    """
    import dataclasses

    from remat.simulate.plot import plot_simulation
    from remat.simulate.run import simulate
    from remat.strategies.registry import default_strategies

    sources = given_sources(model, hf, hf_config, module, overrides)
    batch_sizes = int_list(batch, "--batch")
    mode = _sharding(sharding, world_size)
    choice = model_choice(sources, seq, api=API)
    batch_fn = choice.batch_fn
    if choice.fixed_batch is not None and batch_fn is None:
        batch_sizes = [_fixed_batch_size(choice, given_flags(ctx, "batch"))]
        fixed = choice.fixed_batch
        batch_fn = lambda _b, _s: fixed  # noqa: E731
    names = strategies.split(",") if strategies else default_strategies("simulate")
    with user_errors(), progress_bar(f"simulate {choice.name}", log_when_piped=True) as update:
        try:
            result = simulate(
                choice.source, seq_len=seq, batch_sizes=batch_sizes, dtype=dtype,
                optimizer=optimizer, device=device, strategies=names, world_size=world_size,
                sharding=mode, plan=plan, on_row=_row_progress(update, names, batch_sizes, plan),
                exact=exact, batch_fn=batch_fn, loss_fn=choice.loss_fn,
            )
        except (RematError, typer.Exit):
            raise
        except Exception as exc:
            if choice.user is None:
                raise
            raised(API, f"--module {module}: the model cannot be simulated", exc,
                   fix="simulate a model that runs on fake tensors (no reading of tensor "
                       "values, batches in the parameters' dtype; see --dtype), or measure "
                       "it for real with remat profile / remat plan")
    if choice.name != result.model:
        result = dataclasses.replace(result, model=choice.name)
    if json_out != "-":
        _print_result(result)
    if json_out is not None:
        write_json(result.to_dict(), json_out)
    if plot is not None:
        err_console.print(f"Wrote {plot_simulation(result, plot)}", highlight=False)
