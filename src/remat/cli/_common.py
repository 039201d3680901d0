"""Options and helpers shared by the ``remat`` commands.

Every option is an ``Annotated`` alias so commands declare them in one line and
behave the same: ``--model`` takes any :data:`remat.models.PRESETS` key,
``--strategies`` a comma-separated list checked against
:func:`remat.strategies.parse_strategy`, ``--device`` ``auto`` (CUDA when
available), ``cpu``, ``cuda`` or ``cuda:N``. Bad values exit with code 2 and a
message that lists the valid ones, never a traceback.

torch and the model zoo are imported inside the callbacks, so ``remat --help``
stays fast.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console

__all__ = [
    "DEFAULT_MODEL",
    "BatchOpt",
    "DeviceOpt",
    "JsonOpt",
    "ModelOpt",
    "SeqOpt",
    "StrategiesOpt",
    "StrategyOpt",
    "check_fits",
    "err_console",
    "fail",
    "notices",
    "parse_strategies",
    "resolve_device",
    "stdout_console",
    "user_errors",
    "write_json",
]

DEFAULT_MODEL = "gpt-small"

#: Progress, notices and errors go to stderr so stdout stays clean for ``--json -``.
err_console = Console(stderr=True)


def fail(message: str, *, code: int = 2) -> NoReturn:
    """Print ``Error: message`` on stderr and exit with ``code`` (2: bad input)."""
    err_console.print(f"[bold red]Error:[/bold red] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn remat's deliberate errors into a clean message and exit code, not a traceback.

    Unknown strategies and blocks that cannot be found are bad input (exit 2);
    any other :class:`remat.errors.RematError` exits 1.
    """
    from remat.errors import BlocksNotFound, RematError, StrategyError

    try:
        yield
    except (StrategyError, BlocksNotFound) as exc:
        fail(str(exc), code=2)
    except RematError as exc:
        fail(str(exc), code=1)


@contextlib.contextmanager
def notices() -> Iterator[None]:
    """Collect remat's warnings while a command runs and print each distinct one once.

    Warnings such as "offload is a no-op on the CPU" fire once per strategy or per
    model build; printed raw they would interleave with the progress bar.
    """
    import warnings

    from remat.errors import RematWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RematWarning)
        try:
            yield
        finally:
            seen: set[str] = set()
            for item in caught:
                if not issubclass(item.category, RematWarning):
                    warnings.showwarning(item.message, item.category, item.filename,
                                         item.lineno)
                    continue
                text = str(item.message)
                if text not in seen:
                    seen.add(text)
                    err_console.print(f"[yellow]Note:[/yellow] {text}", highlight=False,
                                      soft_wrap=True)


def _check_model(value: str) -> str:
    from remat.models import PRESETS

    if value not in PRESETS:
        raise typer.BadParameter(
            f"unknown preset {value!r}. Valid presets: {', '.join(PRESETS)}"
        )
    return value


def parse_strategies(value: str) -> list[str]:
    """Split ``"none,full,every:2"`` and check each name.

    Raises:
        typer.BadParameter: an empty list, a duplicate, or an unknown strategy
            (the message lists the valid ones).
    """
    from remat.strategies import STRATEGIES, parse_strategy

    names = [part.strip() for part in value.split(",") if part.strip()]
    if not names:
        raise typer.BadParameter(
            f"no strategy given. Valid strategies: {', '.join(STRATEGIES)}"
        )
    out: list[str] = []
    for name in names:
        try:
            canonical = str(parse_strategy(name))
        except ValueError as exc:
            message = str(exc).removeprefix("remat.apply: ")
            if "Valid strategies" not in message:
                message += f" Valid strategies: {', '.join(STRATEGIES)}"
            raise typer.BadParameter(message) from None
        if canonical in out:
            raise typer.BadParameter(f"strategy {canonical!r} is listed twice")
        out.append(canonical)
    return out


def _check_strategies(value: str | None) -> str | None:
    if value is None:
        return None
    return ",".join(parse_strategies(value))


def _check_strategy(value: str) -> str:
    names = parse_strategies(value)
    if len(names) != 1:
        raise typer.BadParameter(f"expected one strategy, got {len(names)}: {', '.join(names)}")
    return names[0]


def _check_device(value: str) -> str:
    if value == "auto":
        return value
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise typer.BadParameter(
            f"cannot read {value!r} as a device. Use auto, cpu, cuda or cuda:N"
        ) from None
    if device.type not in ("cpu", "cuda"):
        raise typer.BadParameter(
            f"device type {device.type!r} is not supported. Use auto, cpu, cuda or cuda:N"
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise typer.BadParameter(
                f"{value!r} requested but CUDA is not available "
                f"(torch {torch.__version__}). Use --device cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise typer.BadParameter(
                f"{value!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist"
            )
    return value


def resolve_device(value: str) -> Any:
    """``"auto"`` -> CUDA when available, else CPU; prints a one-line notice about CUDA.

    Returns:
        A :class:`torch.device`.
    """
    import torch

    available = torch.cuda.is_available()
    if value == "auto":
        device = torch.device("cuda", torch.cuda.current_device()) if available \
            else torch.device("cpu")
    else:
        device = torch.device(value)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        err_console.print(
            f"Using CUDA device {device} ({torch.cuda.get_device_name(device)}); "
            "pass --device cpu to run on the CPU.", highlight=False,
        )
    elif available:
        err_console.print("CUDA is available but --device cpu was given; running on the CPU.",
                          highlight=False)
    return device


def stdout_console() -> Console:
    """A console on stdout, at least 160 columns wide even when piped (tables don't wrap)."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 160))
    return console


def _available_bytes(device: Any) -> int | None:
    import os

    import torch

    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def check_fits(preset: str, device: Any, *, copies: int) -> None:
    """Exit 2 with advice when ``copies`` x (params + grads) of ``preset`` cannot fit on ``device``.

    The parameter count comes from building the model on the meta device (no memory).
    Activations are not counted, so this only rejects runs that are sure to fail,
    e.g. ``remat compare --model llama-7b`` on a laptop.
    """
    import torch

    from remat.models import build_model
    from remat.units import format_bytes

    with torch.device("meta"):
        model = build_model(preset)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    needed = copies * 2 * param_bytes  # parameters + gradients per live copy
    available = _available_bytes(device)
    if available is not None and needed > available:
        fail(
            f"{preset} has {format_bytes(param_bytes)} of parameters; this run keeps about "
            f"{copies} copies with gradients alive (~{format_bytes(needed)}), but {device} has "
            f"{format_bytes(available)} free. Use a smaller preset (e.g. gpt-small), fewer "
            "--strategies, --repeats 0 (one model at a time), or `remat simulate` to "
            "measure without allocating."
        )


def write_json(data: Any, target: str) -> None:
    """Write ``data`` as JSON to the file ``target`` (parents created) or to stdout for ``-``."""
    text = json.dumps(data, indent=2)
    if target == "-":
        typer.echo(text)
        return
    path = Path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    err_console.print(f"Wrote {path}", highlight=False)


ModelOpt = Annotated[str, typer.Option(
    "--model", "-m", callback=_check_model, metavar="PRESET",
    help="Built-in model preset (gpt-tiny, gpt-small, gpt2-124m, llama-tiny, llama-small, ...).",
)]
BatchOpt = Annotated[int, typer.Option(
    "--batch", "-b", min=1, metavar="N", help="Sequences per batch.",
)]
SeqOpt = Annotated[int | None, typer.Option(
    "--seq", "-s", min=2, metavar="S",
    help="Tokens per sequence. Default: the preset's max_seq_len.",
)]
StrategiesOpt = Annotated[str | None, typer.Option(
    "--strategies", callback=_check_strategies, metavar="A,B,C",
    help="Comma-separated strategies; none (the baseline) is always run. "
         "Default: none,full,every:2,sqrt,attn,mlp,ops,offload.",
)]
StrategyOpt = Annotated[str, typer.Option(
    "--strategy", callback=_check_strategy, metavar="NAME",
    help="Strategy to apply: none, full, every:N, sqrt, attn, mlp, ops or offload.",
)]
DeviceOpt = Annotated[str, typer.Option(
    "--device", callback=_check_device, metavar="DEVICE",
    help="auto (CUDA when available, else CPU), cpu, cuda or cuda:N.",
)]
JsonOpt = Annotated[str | None, typer.Option(
    "--json", metavar="FILE",
    help="Also write the results as JSON to FILE (dirs created); --json - prints only the "
         "JSON, on stdout.",
)]
