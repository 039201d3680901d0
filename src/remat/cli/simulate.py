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
from typing import TYPE_CHECKING, Annotated, Any

import typer

from remat.cli import app
from remat.cli.common import (
    ProgressFn,
    err_console,
    fail,
    progress_bar,
    stdout_console,
    user_errors,
    write_json,
)
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
from remat.cli.pipeline_ranks import check_pp, pp_rows, print_pp_rows
from remat.cli.sim_tables import longest_seq_table, longest_seqs, rate, simulation_tables
from remat.cli.sources import ModelChoice, batch_shape, given_flags, given_sources, model_choice
from remat.cli.tp_ranks import check_layout, check_tp, load_tp_plan, print_tp_rows, tp_rows
from remat.cli.user_model import raised
from remat.errors import RematError, message

if TYPE_CHECKING:
    from remat.simulate.result import SimulationResult, SimulationRow


_EPILOG = """\
Examples:

  remat simulate --model llama-7b --seq 2048 --batch 1,2,4,8,16,32 --device h100-80gb

  remat simulate --model llama-7b --seq 4096 --dtype amp-bf16 --device a100-80gb --plot out/sim.png

  remat simulate --hf mistral --seq 4096 --batch 1,2,4 --world-size 8 --sharding fsdp

  remat simulate --model llama-7b --seq 4096 --batch 1 --tp 8 --sp --strategies none,full

  remat simulate --model llama-70b --seq 4096 --batch 1 --pp 4 --tp 8 --dp 2

  remat simulate --hf-config llama-3-8b/config.json --seq 8192 --strategies none,full --json s.json

  remat simulate --hf llama --set num_hidden_layers=16 --set hidden_size=2048 --device l4

  remat simulate --module examples/my_model.py:build_training --seq 1024 --batch 1,8

  remat simulate --model llama-7b --seq 2048,4096,8192,16384 --batch 1,2 --strategies none,full
"""


def _check_optimizer(value: str) -> str:
    from remat.simulate.precision import OPTIMIZERS

    return check_choice(value, list(OPTIMIZERS), "--optimizer")


def _sharding(sharding: str | None, world_size: int) -> str:
    """``--sharding``, defaulting to fsdp with several ranks; exits 2 on a bad combination."""
    from remat.distributed.sharding import SHARDINGS

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
                  plan: bool, seqs: Sequence[int] = ()) -> Callable[[SimulationRow], None]:
    """An ``on_row`` callback that shows rows done of all rows and which row runs now.

    ``simulate`` runs every strategy's batch sizes in order, then the plan's, so the
    row after the last one done is the one running; with several ``seqs`` (one run per
    sequence length, in order) the rows of every run count.
    """
    labels = [f"{name} batch {b}" for name in names for b in batch_sizes]
    if plan:
        labels += [f"plan batch {b}" for b in batch_sizes]
    if len(seqs) > 1:
        labels = [f"seq {s}: {label}" for s in seqs for label in labels]
    done = 0
    update(labels[0], 0, len(labels))

    def on_row(_row: SimulationRow) -> None:
        nonlocal done
        done += 1
        update(labels[done] if done < len(labels) else "done", done, len(labels))

    return on_row


def _print_result(results: Sequence[SimulationResult]) -> None:
    err_console.print(f"Simulated {sum(len(r.rows) for r in results)} steps in "
                      f"{sum(r.elapsed_s for r in results):.1f} s.", highlight=False)
    console = stdout_console()
    for result in results:
        for table in simulation_tables(result):
            console.print(table)
    if len(results) > 1:
        console.print(longest_seq_table(results))
    fitting = [b for b in (r.best() for r in results) if b is not None]
    if fitting:
        best = max(fitting, key=lambda b: b.tokens_per_s)
        at = f" and seq {best.seq_len}" if len(results) > 1 else ""
        console.print(f"Best: {best.strategy} at micro-batch {best.batch_size}{at} "
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
    seq: Annotated[str, typer.Option(
        "--seq", "-s", metavar="S1,S2,...",
        help="Tokens per sequence; several give a run each and the longest sequence that "
             "fits per strategy.",
    )] = "2048",
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
    tp: Annotated[int, typer.Option(
        "--tp", min=1, metavar="T",
        help="Tensor-parallel degree: one rank's bytes per strategy, from rank 0's own step "
             "under a fake process group (llama-, OPT-style and fused-QKV blocks: GPT-2, "
             "GPT-NeoX, Falcon, litgpt).",
    )] = 1,
    tp_plan: Annotated[str | None, typer.Option(
        "--tp-plan", metavar="FILE.py:NAME",
        help="With --tp: your parallelize_module-style plan (a dict, or a function "
             "returning one): keys naming a module of the root stay, the rest are relative "
             "to every block.",
    )] = None,
    sp: Annotated[bool, typer.Option(
        "--sp", help="With --tp: sequence parallelism (norms and the residual stream "
                     "sharded on the sequence).",
    )] = False,
    pp: Annotated[int, typer.Option(
        "--pp", min=1, metavar="P",
        help="Pipeline stages: each pipeline rank's bytes under --schedule, and the plan "
             "per stage.",
    )] = 1,
    dp: Annotated[int, typer.Option(
        "--dp", min=1, metavar="D",
        help="With --pp or --tp: data-parallel (FSDP) replicas of the pipeline / TP group.",
    )] = 1,
    schedule: Annotated[str, typer.Option(
        "--schedule", metavar="NAME", help="With --pp: gpipe, 1f1b or interleaved-1f1b.",
    )] = "1f1b",
    microbatches: Annotated[int | None, typer.Option(
        "--microbatches", metavar="M",
        help="With --pp: micro-batches per step. Default: 2 x --pp.",
    )] = None,
    virtual_stages: Annotated[int, typer.Option(
        "--virtual-stages", min=1, metavar="V",
        help="With --schedule interleaved-1f1b: model chunks per pipeline rank.",
    )] = 1,
    reshard_after_forward: Annotated[bool, typer.Option(
        "--reshard-after-forward/--no-reshard-after-forward",
        help="With --pp and --dp: FSDP reshards each stage's parameters after every "
             "forward (an all-gather per micro-batch). Default: no (torchtitan's under "
             "pipeline parallelism): gathered from a stage's first forward to the step's end.",
    )] = False,
    plan: Annotated[bool, typer.Option(
        "--plan/--no-plan", help="Also simulate the planner's plan (when remat.plan exists).",
    )] = True,
    exact: Annotated[bool, typer.Option(
        "--exact", help="Simulate the whole step for every row instead of extrapolating "
                        "from shallow steps (slower; the same bytes).",
    )] = False,
    accumulating: Annotated[bool, typer.Option(
        "--accumulating",
        help="Simulate gradient-accumulation micro-steps (optimizer.step() every few "
             "micro-batches): each after the first starts with the gradients held.",
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
    from remat.strategies.registry import default_strategies

    sources = given_sources(model, hf, hf_config, module, overrides)
    batch_sizes = int_list(batch, "--batch")
    seqs = int_list(seq, "--seq")
    mode = _sharding(sharding, world_size)
    choices = [model_choice(sources, s, api=API) for s in seqs]
    if choices[0].fixed_batch is not None and choices[0].batch_fn is None and len(seqs) > 1:
        fail(message(API, f"{choices[0].name} gives one fixed batch; --seq asks for "
                          f"{len(seqs)} lengths",
                     fix="return an object with make_batch(batch_size, seq_len) from the "
                         "factory, or pass one --seq"))
    names = strategies.split(",") if strategies else default_strategies("simulate")
    if tp_plan is not None and tp == 1:
        fail(message(API, "--tp-plan needs --tp > 1", fix="pass --tp 2 (or more) with "
                                                          "--tp-plan"))
    user_plan = load_tp_plan(tp_plan, API) if tp_plan is not None else None
    if accumulating and (pp > 1 or dp > 1 or tp > 1):
        fail(message(API, "--accumulating is simulated on one device or data-parallel ranks "
                          "(--world-size with --sharding ddp)",
                     {"given": f"--pp {pp} --dp {dp} --tp {tp}"},
                     fix="drop --accumulating, or --pp, --dp and --tp"))
    if pp > 1 or dp > 1:
        m = check_pp(pp, dp, world_size, microbatches, schedule, virtual_stages, API)
        if sp and tp == 1:
            check_tp(tp, sp, 1, API)
        if tp > 1:
            check_layout(choices[0].source, seqs[0], tp=tp, sequence_parallel=sp,
                         tp_plan=user_plan, api=API)
        with user_errors(), progress_bar(f"simulate {choices[0].name} (PP x{pp}, TP x{tp}, "
                                         f"DP x{dp})") as update:
            rows = pp_rows(choices[0].source, name=choices[0].name, seqs=seqs,
                           batch_sizes=batch_sizes, strategies=names, pp=pp, dp=dp, tp=tp,
                           sequence_parallel=sp, schedule=schedule, microbatches=m,
                           virtual_stages=virtual_stages, dtype=dtype, optimizer=optimizer,
                           device=device, reshard_after_forward=reshard_after_forward,
                           update=update, tp_plan=user_plan)
        print_pp_rows(rows, json_out)
        return
    check_tp(tp, sp, world_size, API)
    if tp > 1:
        check_layout(choices[0].source, seqs[0], tp=tp, sequence_parallel=sp,
                     tp_plan=user_plan, api=API)
        with user_errors(), progress_bar(f"simulate {choices[0].name} (TP x{tp})"):
            rows = tp_rows(choices[0].source, name=choices[0].name, seqs=seqs,
                           batch_sizes=batch_sizes, strategies=names, tp=tp,
                           sequence_parallel=sp, dtype=dtype, optimizer=optimizer,
                           device=device, tp_plan=user_plan)
        print_tp_rows(rows, json_out)
        return
    results = []
    with user_errors(), progress_bar(f"simulate {choices[0].name}",
                                     log_when_piped=True) as update:
        on_row = None
        for seq_len, choice in zip(seqs, choices, strict=True):
            batch_fn = choice.batch_fn
            if choice.fixed_batch is not None and batch_fn is None:
                batch_sizes = [_fixed_batch_size(choice, given_flags(ctx, "batch"))]
                fixed = choice.fixed_batch
                batch_fn = lambda _b, _s, fixed=fixed: fixed  # noqa: E731
            on_row = on_row or _row_progress(update, names, batch_sizes, plan, seqs)
            result = _simulate_one(choice, module, seq_len=seq_len, batch_sizes=batch_sizes,
                                   batch_fn=batch_fn, dtype=dtype, optimizer=optimizer,
                                   device=device, strategies=names, world_size=world_size,
                                   sharding=mode, plan=plan, on_row=on_row, exact=exact,
                                   accumulating=accumulating)
            if choice.name != result.model:
                result = dataclasses.replace(result, model=choice.name)
            results.append(result)
    if json_out != "-":
        _print_result(results)
    if json_out is not None:
        write_json(results[0].to_dict() if len(results) == 1 else
                   {"runs": [r.to_dict() for r in results],
                    "longest_seq": longest_seqs(results)}, json_out)
    if plot is not None:
        for result in results:
            target = plot if len(results) == 1 else plot.with_stem(
                f"{plot.stem}-seq{result.seq_len}")
            err_console.print(f"Wrote {plot_simulation(result, target)}", highlight=False)


def _simulate_one(choice: ModelChoice, module: str | None, **kwargs: Any) -> SimulationResult:
    """One ``simulate`` run; a --module model that cannot run on fake tensors exits 1."""
    from remat.simulate.run import simulate

    try:
        return simulate(choice.source, loss_fn=choice.loss_fn, **kwargs)
    except (RematError, typer.Exit):
        raise
    except Exception as exc:
        if choice.user is None:
            raise
        raised(API, f"--module {module}: the model cannot be simulated", exc,
               fix="simulate a model that runs on fake tensors (no reading of tensor "
                   "values, batches in the parameters' dtype; see --dtype), or measure "
                   "it for real with remat profile / remat plan")
