"""The ``remat`` command line: a typer ``app`` and one module per command group.

Each command module registers its commands on :data:`app` when imported:
``compare``, ``profile`` and ``doctor`` always exist; ``simulate``, ``estimate`` and ``plan`` are
loaded when their modules are installed (see Note [ Optional command modules ]).
Command modules never import each other: what they share lives in ``options.py``
(every shared option) and ``common.py`` (consoles, errors, progress, optimizers).

# NOTE [ Optional command modules ]
# A command module that does not exist is skipped; one that exists but fails to
# import re-raises, so a bug in it is never silently hidden as a missing command.
# importlib.util.find_spec tells the two apart without importing anything.
"""

from __future__ import annotations

import importlib
import importlib.util

import typer

__all__ = ["app", "main"]

app = typer.Typer(
    name="remat",
    help="Trade compute for memory in PyTorch training: measure, compare and plan "
         "activation checkpointing.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_COMMAND_MODULES: tuple[tuple[str, bool], ...] = (
    ("compare", True),
    ("profile", True),
    ("doctor", True),
    ("simulate", False),
    ("estimate", False),
    ("plan", False),
)


def _load_command_modules() -> None:
    # See Note [ Optional command modules ].
    for name, required in _COMMAND_MODULES:
        module = f"{__name__}.{name}"
        if not required and importlib.util.find_spec(module) is None:
            continue
        importlib.import_module(module)


_load_command_modules()


def main() -> None:
    """Entry point of the ``remat`` console script."""
    app()
