"""Helpers shared by the ``remat`` commands: consoles, errors, progress, devices, JSON.

Options live in :mod:`remat.cli.options`; command modules import from these two
modules and never from each other. torch and the model zoo are imported inside the
helpers, so ``remat --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console

ProgressFn = Callable[[str, int, int], None]
"""``update(step, done, total)``: what :func:`progress_bar` yields."""

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

    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RematWarning)
            yield
    finally:
        # Shown after catch_warnings has exited: inside it, showwarning appends to the
        # very list being read, so one foreign warning (torch 2.11's profiler warns on
        # its first cycle) made this loop grow the list until memory ran out.
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


def parse_strategies(value: str) -> list[str]:
    """Split ``"none,full,every:2"`` and check each name.

    Raises:
        typer.BadParameter: an empty list, a duplicate, or an unknown strategy
            (the message lists the valid ones).
    """
    from remat.errors import message
    from remat.strategies import STRATEGIES, parse_strategy

    names = [part.strip() for part in value.split(",") if part.strip()]
    if not names:
        raise typer.BadParameter(message(
            "", "no strategy given", {"valid strategies": ", ".join(STRATEGIES)},
            fix="pass a comma-separated list such as none,full,every:2"))
    out: list[str] = []
    for name in names:
        try:
            canonical = str(parse_strategy(name, api=""))
        except ValueError as exc:
            text = str(exc)
            if "valid strategies:" not in text:  # before the fix line
                head, sep, fix = text.rpartition("\n  fix: ")
                valid = f"\n  valid strategies: {', '.join(STRATEGIES)}"
                text = head + valid + sep + fix if sep else text + valid
            raise typer.BadParameter(text) from None
        if canonical in out:
            raise typer.BadParameter(message("", f"strategy {canonical!r} is listed twice",
                                             fix="list each strategy once"))
        out.append(canonical)
    return out


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


def check_fits(name: str, param_bytes: int, device: Any, *, copies: int) -> None:
    """Exit 2 with advice when ``copies`` x (params + grads) of a model cannot fit on ``device``.

    ``param_bytes`` is the model's parameter bytes (a preset or Hugging Face model is built
    on the meta device to count them: no memory). Activations are not counted, so this only
    rejects runs that are sure to fail, e.g. ``remat compare --model llama-7b`` on a laptop.
    """
    from remat.units import format_bytes

    needed = copies * 2 * param_bytes  # parameters + gradients per live copy
    available = _available_bytes(device)
    if available is not None and needed > available:
        fail(
            f"{name} has {format_bytes(param_bytes)} of parameters; this run keeps about "
            f"{copies} copies with gradients alive (~{format_bytes(needed)}), but {device} has "
            f"{format_bytes(available)} free. Use a smaller model (e.g. --model gpt-small), "
            "fewer --strategies, --repeats 0 (one model at a time), or `remat simulate` to "
            "measure without allocating."
        )


def budget_value(budget: str) -> int | str:
    """A ``--budget`` as ``remat.plan`` takes it: digits are bytes, anything else is parsed
    there (``"12GiB"``, ``"60%"``, ``"activations:50%"``, ``"device"``)."""
    return int(budget) if budget.strip().isdigit() else budget


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


@contextlib.contextmanager
def progress_bar(description: str, *, log_when_piped: bool = False) -> Iterator[ProgressFn]:
    """A rich progress bar on stderr; yields an ``update(step, done, total)`` callback.

    On a terminal the bar is live (``step`` shown next to the description, ``done`` of
    ``total`` units, elapsed time) and disappears when the block ends. When stderr is
    not a terminal (a log file, CI) rich draws nothing; with ``log_when_piped`` each
    update is printed there as one plain line instead. Nothing goes to stdout, so
    ``--json -`` output stays clean.
    """
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    if log_when_piped and not err_console.is_terminal:
        def log(step: str, done: int, total: int) -> None:
            err_console.print(f"{description}: {step} ({done}/{total})", highlight=False,
                              soft_wrap=True)

        yield log
        return
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=err_console,
                  transient=True) as bar:
        task = bar.add_task(description, total=None)

        def update(step: str, done: int, total: int) -> None:
            bar.update(task, description=f"{description}: {step}", completed=done, total=total)

        yield update


def make_optimizer(choice: str, model: Any) -> Any:
    """The optimizer ``--optimizer`` names for ``model``'s parameters; ``None`` for ``none``.

    One factory for every command: :func:`remat.simulate.precision.make_optimizer`
    (``adamw``, ``adam``, ``sgd`` with momentum 0.9, ``none``), here with ``lr=1e-3`` and
    torch's own choice of implementation for the model's device, as a training script
    gets it.
    """
    from remat.simulate.precision import make_optimizer as build

    return build(choice, model.parameters(), lr=1e-3, foreach=None)
