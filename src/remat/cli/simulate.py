"""``remat simulate`` and ``remat estimate``: plan for hardware you don't have.

``simulate`` runs every strategy at every micro-batch size under FakeTensorMode
(exact bytes, nothing allocated) for a device from the device table and prints the
peak per rank, whether it fits, the roofline step time and throughput, and the
largest batch per strategy. ``estimate`` puts the classic closed-form activation
formulas next to the simulated bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from remat.cli import app
from remat.cli._common import (
    JsonOpt,
    err_console,
    fail,
    parse_strategies,
    stdout_console,
    user_errors,
    write_json,
)

if TYPE_CHECKING:
    from rich.table import Table
    from torch import nn

    from remat.simulate.estimate import EstimateTable
    from remat.simulate.run import SimulationResult

__all__ = ["estimate_command", "estimate_table", "simulate_command", "simulation_tables"]

_SIMULATE_EPILOG = """\
Examples:

  remat simulate --model llama-7b --seq 2048 --batch 1,2,4,8,16,32 --device h100-80gb

  remat simulate --model llama-7b --seq 4096 --dtype amp-bf16 --device a100-80gb --plot out/sim.png

  remat simulate --hf mistral --seq 4096 --batch 1,2,4 --world-size 8 --sharding fsdp

  remat simulate --hf-config llama-3-8b/config.json --seq 8192 --strategies none,full --json s.json

  remat simulate --hf llama --set num_hidden_layers=16 --set hidden_size=2048 --device l4
"""

_ESTIMATE_EPILOG = """\
Examples:

  remat estimate --model llama-7b

  remat estimate --model gpt2-124m --seq 512,1024 --batch 1,8

  remat estimate --hf mistral --seq 2048,4096 --json out/estimate.json
"""


# ---- option parsing --------------------------------------------------------------------------

def _int_list(value: str, option: str) -> list[int]:
    try:
        items = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers like 1,2,4, got {value!r}",
                                 param_hint=f"'{option}'") from None
    if not items or any(i < 1 for i in items):
        raise typer.BadParameter(f"expected positive integers, got {value!r}",
                                 param_hint=f"'{option}'")
    return sorted(set(items))


def _parse_value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _overrides(pairs: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"expected KEY=VALUE, got {pair!r}", param_hint="'--set'")
        out[key.strip()] = _parse_value(value.strip())
    return out


def _check_choice(value: str, choices: list[str], option: str) -> str:
    if value.lower() not in choices:
        raise typer.BadParameter(f"unknown value {value!r}; choose one of {', '.join(choices)}",
                                 param_hint=f"'{option}'")
    return value.lower()


def _check_device_name(value: str) -> str:
    from remat.devices import DEVICES

    key = value.lower().replace("_", "-")
    if key not in DEVICES:
        raise typer.BadParameter(f"unknown device {value!r}; known: {', '.join(DEVICES)}")
    return key


def _check_precision(value: str) -> str:
    from remat.simulate.precision import PRECISIONS, get_precision

    try:
        return get_precision(value).name
    except ValueError:
        raise typer.BadParameter(f"unknown precision {value!r}; known: "
                                 f"{', '.join(PRECISIONS)}") from None


def _check_optimizer(value: str) -> str:
    from remat.simulate.precision import OPTIMIZERS

    return _check_choice(value, list(OPTIMIZERS), "--optimizer")


_ModelOpt = Annotated[str | None, typer.Option(
    "--model", "-m", metavar="PRESET",
    help="Built-in preset (llama-7b, llama-1b, gpt2-124m, ...). Default: llama-7b unless "
         "--hf or --hf-config is given.",
)]
_HfOpt = Annotated[str | None, typer.Option(
    "--hf", metavar="NAME",
    help="Hugging Face model family built from its config class with default sizes "
         "(llama, mistral, gpt2, qwen2, gemma, phi3, ... or any model_type). No weights are "
         "downloaded. Needs pip install 'remat\\[hf]'.",
)]
_HfConfigOpt = Annotated[Path | None, typer.Option(
    "--hf-config", metavar="PATH", help="A Hugging Face config.json (or its directory).",
)]
_SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", metavar="KEY=VALUE",
    help="Override a config field of the preset or HF config; repeatable "
         "(e.g. --set num_hidden_layers=16).",
)]
def _check_strategies(value: str | None) -> str | None:
    return None if value is None else ",".join(parse_strategies(value))


_StrategiesOpt = Annotated[str | None, typer.Option(
    "--strategies", callback=_check_strategies, metavar="A,B,C",
    help="Comma-separated strategies. Default: none,full,every:2,sqrt,attn,mlp,ops (offload "
         "needs a separate host memory, which a simulation does not have).",
)]
_DtypeOpt = Annotated[str, typer.Option(
    "--dtype", callback=_check_precision, metavar="PRECISION",
    help="bf16 (params, grads, AdamW state all bf16), amp-bf16 (fp32 master weights, bf16 "
         "autocast), amp-fp16 or fp32.",
)]


@dataclass(frozen=True)
class _Choice:
    """The model the options name: a preset name or a meta-device factory, and its depth."""

    source: Callable[[], nn.Module] | str
    name: str
    n_layers: int | None


def _source(model: str | None, hf: str | None, hf_config: Path | None,
            overrides: dict[str, Any], seq_len: int, *, layers: int | None = None) -> _Choice:
    """Resolve --model / --hf / --hf-config (+ --set) to a model; ``layers`` caps the depth."""
    given = [flag for flag, v in (("--model", model), ("--hf", hf), ("--hf-config", hf_config))
             if v is not None]
    if len(given) > 1:
        fail(f"pass one of --model, --hf, --hf-config (got {', '.join(given)})")
    if hf is None and hf_config is None:
        return _preset_source(model or "llama-7b", overrides, seq_len, layers)
    from remat.simulate import hf as hf_models

    try:
        if hf is not None:
            config = hf_models.hf_config_from_name(hf, **overrides)
            name = f"hf:{hf}"
        else:
            config = hf_models.hf_config_from_file(str(hf_config), **overrides)
            name = f"hf:{config.model_type}"
    except ImportError as exc:
        fail(str(exc), code=1)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        fail(str(exc))
    depth = getattr(config, "num_hidden_layers", None)
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len > limit and config.model_type in (
            "gpt2", "opt", "gpt_neo", "bloom", "gpt_bigcode"):
        fail(f"--seq {seq_len} exceeds {name}'s learned position table "
             f"(max_position_embeddings={limit}); pass --set n_positions={seq_len} or a shorter "
             "--seq")
    if layers is not None and isinstance(depth, int) and depth > layers:
        config.num_hidden_layers = layers
    return _Choice(lambda: hf_models.hf_model_from_config(config), name,
                   depth if isinstance(depth, int) else None)


def _preset_source(name: str, overrides: dict[str, Any], seq_len: int,
                   layers: int | None) -> _Choice:
    from remat.models import PRESETS, build_model, get_config

    if name not in PRESETS:
        raise typer.BadParameter(f"unknown preset {name!r}. Valid presets: {', '.join(PRESETS)}",
                                 param_hint="'--model'")
    settings = dict(overrides)
    if seq_len > PRESETS[name].max_seq_len:
        settings.setdefault("max_seq_len", seq_len)
    try:
        depth = get_config(name, **settings).n_layer
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--set'") from None
    if layers is not None and depth > layers:
        settings["n_layer"] = layers
    if not settings:
        return _Choice(name, name, depth)
    return _Choice(lambda: build_model(name, **settings), name, depth)


@contextmanager
def _progress(description: str, total: int) -> Iterator[Callable[[str], None]]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=err_console,
                  transient=True) as bar:
        task = bar.add_task(description, total=total)

        def advance(step: str) -> None:
            bar.update(task, advance=1, description=f"{description}: {step}")

        yield advance


# ---- tables --------------------------------------------------------------------------------

def _rate(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:.2f} M"
    if value >= 1e3:
        return f"{value / 1e3:.1f} k"
    return f"{value:.1f}"


def _ms(value: float) -> str:
    return f"{value:.3f}" if value < 1 else f"{value:.1f}"


def simulation_tables(result: SimulationResult) -> tuple[Table, Table]:
    """The per-strategy-and-batch table and the largest-batch summary, as rich tables."""
    from rich.table import Table

    from remat.units import format_bytes

    ranks = f", {result.sharding} x{result.world_size}" if result.sharding != "none" else ""
    main = Table(title=f"{result.model}: seq {result.seq_len}, {result.precision} + "
                       f"{result.optimizer} on {result.device} "
                       f"({format_bytes(result.device_memory_bytes)}{ranks}), simulated",
                 title_justify="left")
    for header in ("Strategy", "Batch", "Peak / rank", "Fits", "Activations", "Step (ms)",
                   "Samples/s", "Tokens/s", "Recompute time"):
        main.add_column(header, justify="left" if header == "Strategy" else "right")
    for strategy in result.strategies:
        rows = result.rows_for(strategy)
        for i, r in enumerate(rows):
            recompute = f"{100 * r.recompute_ms / r.step_ms:.0f}%" if r.step_ms else "-"
            main.add_row(
                strategy if i == 0 else "", str(r.batch_size), format_bytes(r.peak_bytes),
                "[green]yes[/]" if r.fits else "[red]no[/]",
                format_bytes(r.activation_bytes) if not r.note else "-",
                _ms(r.step_ms) if not r.note else "-",
                _rate(r.samples_per_s) if not r.note else r.note,
                _rate(r.tokens_per_s) if not r.note else "-",
                recompute if not r.note else "-",
                end_section=i == len(rows) - 1,
            )
    best = result.best()
    summary = Table(title="Largest micro-batch that fits, per strategy", title_justify="left")
    for header in ("Strategy", "Largest batch", "Peak / rank", "Tokens/s"):
        summary.add_column(header, justify="left" if header == "Strategy" else "right")
    for strategy in result.strategies:
        largest = result.largest_batch(strategy)
        if largest is None:
            summary.add_row(strategy, "[red]none fits[/]", "-", "-")
            continue
        r = result.row(strategy, largest)
        mark = " (best)" if best is not None and r == best else ""
        summary.add_row(strategy + mark, str(largest), format_bytes(r.peak_bytes),
                        _rate(r.tokens_per_s))
    return main, summary


def estimate_table(table: EstimateTable) -> Table:
    """The formula-vs-simulation table, as a rich table."""
    from rich.table import Table

    from remat.simulate.estimate import FORMULAS
    from remat.units import format_bytes

    out = Table(title=f"{table.model}: activation bytes per layer (h={table.hidden_size}, "
                      f"a={table.n_heads}, {table.precision}), formulas vs simulation",
                title_justify="left", caption="error = (formula - simulated) / simulated",
                caption_justify="left")
    for header in ("Seq", "Batch", "Checkpointing", "Simulated", "12·s·b·h",
                   "Korthikanti Eq.1", "34·s·b·h (flash)", "2·s·b·h (full ckpt)"):
        out.add_column(header, justify="right")
    for i, row in enumerate(table.rows):
        cells = []
        for name in FORMULAS:
            est = row.estimate(name)
            cells.append("" if est is None else
                         f"{format_bytes(est.bytes)} ({100 * est.rel_error:+.0f}%)")
        out.add_row(str(row.seq_len), str(row.batch_size), row.checkpointing,
                    format_bytes(row.simulated_bytes), *cells,
                    end_section=row.checkpointing == "full" and i < len(table.rows) - 1)
    return out


# ---- commands ------------------------------------------------------------------------------

@app.command("simulate", epilog=_SIMULATE_EPILOG)
def simulate_command(
    model: _ModelOpt = None,
    hf: _HfOpt = None,
    hf_config: _HfConfigOpt = None,
    overrides: _SetOpt = None,
    seq: Annotated[int, typer.Option("--seq", "-s", min=1, metavar="S",
                                     help="Tokens per sequence.")] = 2048,
    batch: Annotated[str, typer.Option(
        "--batch", "-b", metavar="B1,B2,...", help="Micro-batch sizes per rank.",
    )] = "1,2,4,8,16,32",
    dtype: _DtypeOpt = "bf16",
    optimizer: Annotated[str, typer.Option(
        "--optimizer", callback=_check_optimizer, metavar="NAME",
        help="adamw, adam, sgd (momentum) or none.",
    )] = "adamw",
    device: Annotated[str, typer.Option(
        "--device", callback=_check_device_name, metavar="GPU",
        help="Target device: a100-40gb, a100-80gb, h100-80gb, h200, b200, l4, rtx-4090.",
    )] = "h100-80gb",
    world_size: Annotated[int, typer.Option(
        "--world-size", min=1, metavar="N", help="Data-parallel ranks.",
    )] = 1,
    sharding: Annotated[str | None, typer.Option(
        "--sharding", metavar="MODE",
        help="fsdp (FSDP/ZeRO-3: params, grads, optimizer state divided by N) or ddp. "
             "Default: fsdp when --world-size > 1, else none.",
    )] = None,
    strategies: _StrategiesOpt = None,
    plan: Annotated[bool, typer.Option(
        "--plan/--no-plan", help="Also simulate the planner's plan (when remat.plan exists).",
    )] = True,
    json_out: JsonOpt = None,
    plot: Annotated[Path | None, typer.Option(
        "--plot", metavar="FILE.png", dir_okay=False,
        help="Draw peak memory and throughput against micro-batch size to FILE.png.",
    )] = None,
) -> None:
    """Simulate every strategy at every micro-batch size on a GPU you don't have.

    The model is built on the meta device and each training step (forward, loss,
    backward, optimizer) runs under FakeTensorMode: bytes are exact, nothing is
    allocated, a Llama-7B step takes seconds on a laptop. Step times are roofline
    predictions from the recorded ops. Peaks are tensor bytes; leave a few GiB for
    the CUDA context, allocator fragmentation and workspaces.
    """
    from remat.simulate.plot import plot_simulation
    from remat.simulate.run import DEFAULT_STRATEGIES, simulate
    from remat.simulate.sharding import SHARDINGS

    batch_sizes = _int_list(batch, "--batch")
    mode = sharding or ("fsdp" if world_size > 1 else "none")
    _check_choice(mode, list(SHARDINGS), "--sharding")
    if mode == "none" and world_size > 1:
        raise typer.BadParameter("--world-size > 1 needs --sharding fsdp or ddp",
                                 param_hint="'--sharding'")
    choice = _source(model, hf, hf_config, _overrides(overrides), seq)
    name = choice.name
    names = strategies.split(",") if strategies else list(DEFAULT_STRATEGIES)
    total = len(batch_sizes) * (len(names) + (1 if plan else 0))
    with user_errors(), _progress(f"simulate {name}", total) as advance:
        result = simulate(
            choice.source, seq_len=seq, batch_sizes=batch_sizes, dtype=dtype, optimizer=optimizer,
            device=device, strategies=names, world_size=world_size, sharding=mode,
            plan=plan, on_row=lambda r: advance(f"{r.strategy} batch {r.batch_size}"),
        )
    if name != result.model:
        result = _renamed(result, name)
    if json_out != "-":
        err_console.print(f"Simulated {len(result.rows)} steps in {result.elapsed_s:.1f} s.",
                          highlight=False)
        console = stdout_console()
        for table in simulation_tables(result):
            console.print(table)
        best = result.best()
        if best is not None:
            console.print(f"Best: {best.strategy} at micro-batch {best.batch_size} "
                          f"({_rate(best.tokens_per_s)} tokens/s predicted).", highlight=False)
        else:
            console.print("[red]Nothing fits[/red]: try a smaller --seq, --sharding fsdp, or a "
                          "larger --device.")
    if json_out is not None:
        write_json(result.to_dict(), json_out)
    if plot is not None:
        err_console.print(f"Wrote {plot_simulation(result, plot)}", highlight=False)


def _renamed(result: SimulationResult, name: str) -> SimulationResult:
    import dataclasses

    return dataclasses.replace(result, model=name)


@app.command("estimate", epilog=_ESTIMATE_EPILOG)
def estimate_command(
    model: _ModelOpt = None,
    hf: _HfOpt = None,
    hf_config: _HfConfigOpt = None,
    overrides: _SetOpt = None,
    seq: Annotated[str, typer.Option(
        "--seq", "-s", metavar="S1,S2,...", help="Sequence lengths.",
    )] = "512,1024,2048,4096,8192",
    batch: Annotated[str, typer.Option(
        "--batch", "-b", metavar="B1,B2,...", help="Micro-batch sizes.",
    )] = "1,4,8",
    dtype: _DtypeOpt = "bf16",
    json_out: JsonOpt = None,
) -> None:
    """Closed-form activation estimates next to the exact simulated bytes, per layer.

    Formulas: the 12·s·b·h rule of thumb; Korthikanti et al. 2022 Eq. 1,
    s·b·h·(34 + 5·a·s/h) bytes; its fused-attention variant 34·s·b·h; and 2·s·b·h
    with full checkpointing. The simulated figure is exact for this model (two
    layers are simulated; per-layer bytes do not depend on depth).
    """
    from remat.simulate.estimate import estimate

    seq_lens = _int_list(seq, "--seq")
    batch_sizes = _int_list(batch, "--batch")
    choice = _source(model, hf, hf_config, _overrides(overrides), max(seq_lens), layers=2)
    name = choice.name
    total = len(seq_lens) * len(batch_sizes) * 2
    with user_errors(), _progress(f"estimate {name}", total) as advance:
        table = estimate(choice.source, seq_lens=seq_lens, batch_sizes=batch_sizes,
                         dtype=dtype, n_layers=choice.n_layers,
                         on_row=lambda r: advance(f"seq {r.seq_len} batch {r.batch_size}"))
    if name != table.model:
        import dataclasses

        table = dataclasses.replace(table, model=name)
    if json_out != "-":
        stdout_console().print(estimate_table(table))
    if json_out is not None:
        write_json(table.to_dict(), json_out)
