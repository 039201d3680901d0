"""Every option the ``remat`` commands share, declared once as an ``Annotated`` alias.

Commands declare an option in one line and behave the same: ``--model`` takes any
:data:`remat.models.PRESETS` key (``--hf``, ``--hf-config`` and ``--module`` are the other
model sources, resolved in :mod:`remat.cli.sources`), ``--strategies`` a
comma-separated list checked against :func:`remat.strategies.parse_strategy`,
``--device`` ``auto`` (CUDA when available), ``cpu``, ``cuda`` or ``cuda:N``. Bad
values exit with code 2 and a message that lists the valid ones, never a traceback.

NOTE [ Help from the registry ]
Strategy lists in help texts (``--strategies``' default, ``--strategy``'s names, the
frontier's strategies in ``remat plan --help``) come from the strategy registry when
the help is shown, so a strategy registered later appears in them. Importing the
registry imports torch, which ``remat --help`` should not wait for, so help texts
hold placeholders (:data:`COMPARE_DEFAULTS`, ...) that :class:`RegistryHelpCommand`
fills in just before a command's help is printed. Commands whose help names
strategies pass ``cls=RegistryHelpCommand`` to ``app.command``.

torch and the model zoo are imported inside the callbacks, so ``remat --help``
stays fast.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
import typer.core

from remat.cli.common import parse_strategies
from remat.errors import message

DEFAULT_MODEL = "gpt-small"

# ---- help texts from the strategy registry (NOTE [ Help from the registry ]) ---------------

#: Placeholder for ``remat compare``'s default strategies: ``none,full,every:2,...``.
COMPARE_DEFAULTS = "<compare-defaults>"
#: Placeholder for ``remat simulate``'s default strategies.
SIMULATE_DEFAULTS = "<simulate-defaults>"
#: Placeholder for every strategy name: ``none, full, every:N, ... or offload``.
STRATEGY_NAMES = "<strategy-names>"
#: Placeholder for the frontier's manual strategies: ``none, full, every:N, ...``.
FRONTIER_STRATEGIES = "<frontier-strategies>"


def _registry_texts() -> dict[str, str]:
    from remat.strategies.handler import handler_of
    from remat.strategies.registry import STRATEGIES, default_strategies, registered

    names = list(STRATEGIES)
    handlers = [handler_of(cls) for cls in registered()]
    frontier = [h.spelling() for h in handlers if "frontier" in h.purposes]
    return {
        COMPARE_DEFAULTS: ",".join(default_strategies("compare")),
        SIMULATE_DEFAULTS: ",".join(default_strategies("simulate")),
        STRATEGY_NAMES: ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1
        else ", ".join(names),
        FRONTIER_STRATEGIES: ", ".join(frontier),
    }


def fill_registry_help(text: str | None) -> str | None:
    """``text`` with the registry placeholders replaced by the registry's current lists."""
    if text is None or "<" not in text:
        return text
    for placeholder, value in _registry_texts().items():
        text = text.replace(placeholder, value)
    return text


class RegistryHelpCommand(typer.core.TyperCommand):
    """A command whose help (and its options' help) is filled from the strategy registry."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        template = getattr(self, "_help_template", None)
        if template is None:
            template = self._help_template = (
                self.help, {id(p): getattr(p, "help", None) for p in self.params})
        help_text, option_help = template
        self.help = fill_registry_help(help_text)
        for param in self.params:
            if option_help.get(id(param)) is not None:
                param.help = fill_registry_help(option_help[id(param)])  # type: ignore[attr-defined]
        super().format_help(ctx, formatter)


# ---- callbacks ----------------------------------------------------------------------------

def _jax(ctx: typer.Context | None) -> bool:
    """``--framework jax`` was given (it is eager: read before the other options)."""
    return ctx is not None and ctx.params.get("framework") == Framework.jax


def _check_model(ctx: typer.Context, value: str | None) -> str | None:
    # the NNX presets are checked when remat.jax is loaded (cli/jax_backend.py)
    if value is None or _jax(ctx):
        return value
    from remat.models import PRESETS

    if value not in PRESETS:
        raise typer.BadParameter(message("", f"unknown preset {value!r}",
                                         {"valid presets": ", ".join(PRESETS)},
                                         fix="pass one of the valid presets"))
    return value


def _check_strategies(ctx: typer.Context, value: str | None) -> str | None:
    if value is None or _jax(ctx):  # JAX strategies: cli/jax_backend.py strategies_for_jax
        return value
    return ",".join(parse_strategies(value))


def _check_strategy(value: str) -> str:
    names = parse_strategies(value)
    if len(names) != 1:
        raise typer.BadParameter(message("", f"expected one strategy, got {len(names)}",
                                         {"found": ", ".join(names)},
                                         fix="pass a single strategy"))
    return names[0]


def _check_device(value: str) -> str:
    if value == "auto":
        return value
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise typer.BadParameter(message("", f"cannot read {value!r} as a device",
                                         fix="use auto, cpu, cuda or cuda:N")) from None
    if device.type not in ("cpu", "cuda"):
        raise typer.BadParameter(message("", f"device type {device.type!r} is not supported",
                                         fix="use auto, cpu, cuda or cuda:N"))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise typer.BadParameter(message("", f"{value!r} requested but CUDA is not available",
                                             {"torch": torch.__version__},
                                             fix="use --device cpu"))
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise typer.BadParameter(message(
                "", f"{value!r} requested but only {torch.cuda.device_count()} CUDA device(s) "
                "exist", fix=f"use cuda:0 .. cuda:{torch.cuda.device_count() - 1}"))
    return value


def _check_device_name(value: str) -> str:
    from remat.devices import DEVICES

    key = value.lower().replace("_", "-")
    if key not in DEVICES:
        raise typer.BadParameter(message("", f"unknown device {value!r}",
                                         {"known": ", ".join(DEVICES)},
                                         fix="pass one of the known devices"))
    return key


def _check_precision(value: str) -> str:
    from remat.simulate.precision import PRECISIONS, get_precision

    try:
        return get_precision(value).name
    except ValueError:
        raise typer.BadParameter(message("", f"unknown precision {value!r}",
                                         {"known": ", ".join(PRECISIONS)},
                                         fix="pass one of the known precisions")) from None


# ---- options of the commands that build a preset and run it ------------------------------

class Framework(str, Enum):
    """Which backend ``remat compare`` / ``remat plan`` run on (``--framework``)."""

    torch = "torch"
    jax = "jax"


FrameworkOpt = Annotated[Framework, typer.Option(
    "--framework", case_sensitive=False, is_eager=True,
    help="torch, or jax: the JAX backend (remat.jax) on the Flax NNX preset of the same "
         "name, measured by XLA's compiled analysis. Needs pip install 'remat\\[jax]'.",
)]

class OptimizerChoice(str, Enum):
    """Optimizers ``remat profile`` and ``remat plan`` can include in the step."""

    none = "none"
    sgd = "sgd"
    adamw = "adamw"


ModelOpt = Annotated[str | None, typer.Option(
    "--model", "-m", callback=_check_model, metavar="PRESET",
    help="Built-in model preset (gpt-tiny, gpt-small, gpt2-124m, llama-tiny, llama-small, "
         f"...). Default: {DEFAULT_MODEL} unless --hf, --hf-config or --module is given.",
)]
BatchOpt = Annotated[int, typer.Option(
    "--batch", "-b", min=1, metavar="N", help="Sequences per batch.",
)]
SeqOpt = Annotated[int | None, typer.Option(
    "--seq", "-s", min=2, metavar="S",
    help="Tokens per sequence. Default: the preset's max_seq_len; 128 for --hf, "
         "--hf-config and --module batches made by remat or make_batch.",
)]
MinSeqOpt = Annotated[int | None, typer.Option(
    "--min-seq", min=1, metavar="S",
    help="Shortest sequence --maximize seq-len tries (a % budget refers to it). "
         "Default: --seq-multiple.",
)]
SeqMultipleOpt = Annotated[int, typer.Option(
    "--seq-multiple", min=1, metavar="S", help="--maximize seq-len tries multiples of S tokens.",
)]
StrategiesOpt = Annotated[str | None, typer.Option(
    "--strategies", callback=_check_strategies, metavar="A,B,C",
    help="Comma-separated strategies; none (the baseline) is always run. "
         f"Default: {COMPARE_DEFAULTS}.",
)]
StrategyOpt = Annotated[str, typer.Option(
    "--strategy", callback=_check_strategy, metavar="NAME",
    help=f"Strategy to apply: {STRATEGY_NAMES}.",
)]
DeviceOpt = Annotated[str, typer.Option(
    "--device", callback=_check_device, metavar="DEVICE",
    help="auto (CUDA when available, else CPU), cpu, cuda or cuda:N.",
)]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed for weights and batch.")]
OptimizerOpt = Annotated[OptimizerChoice, typer.Option(
    "--optimizer", case_sensitive=False,
    help="Include an optimizer step (its state counts towards the peak).",
)]
def check_output(value: Any) -> Any:
    """Typer callback: fail before any work when an output file cannot be written.

    Creates missing parent directories and opens the file for appending (removing it again
    if it did not exist), so a path the command could not write later (a directory, a
    read-only or virtual file system such as /proc, no permission) is refused at once
    instead of after minutes of planning. ``-`` (stdout) and ``None`` pass.
    """
    if value is None or str(value) == "-":
        return value
    path = Path(value)
    existed = path.exists()
    try:
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a"):
            pass
        if not existed:
            path.unlink()
    except OSError as exc:
        raise typer.BadParameter(message("", f"cannot write {str(path)!r}",
                                         {"error": exc.strerror or exc},
                                         fix="choose a writable path")) from None
    return value


JsonOpt = Annotated[str | None, typer.Option(
    "--json", metavar="FILE", callback=check_output,
    help="Also write the results as JSON to FILE (dirs created); --json - prints only the "
         "JSON, on stdout.",
)]


def plot_option(help: str) -> Any:
    """``--plot FILE.png`` with ``help`` saying what is drawn:
    ``plot: Annotated[Path | None, plot_option("Draw ...")] = None``."""
    return typer.Option("--plot", metavar="FILE.png", dir_okay=False, help=help,
                        callback=check_output)


# ---- list and KEY=VALUE options ----------------------------------------------------------

def int_list(value: str, option: str) -> list[int]:
    """``"4,1,2"`` as ``[1, 2, 4]`` (sorted, distinct); exits 2 unless positive integers."""
    try:
        items = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(message("", "expected comma-separated integers",
                                         {"found": repr(value)},
                                         fix="write integers like 1,2,4"),
                                 param_hint=f"'{option}'") from None
    if not items or any(i < 1 for i in items):
        raise typer.BadParameter(message("", "expected positive integers",
                                         {"found": repr(value)},
                                         fix="write integers >= 1 like 1,2,4"),
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


def overrides(pairs: list[str] | None) -> dict[str, Any]:
    """``--set KEY=VALUE`` pairs as a dict, numbers and booleans converted; exits 2 on a
    pair without ``=``."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(message("", "expected KEY=VALUE", {"found": repr(pair)},
                                             fix="write --set KEY=VALUE, e.g. n_layer=4"),
                                     param_hint="'--set'")
        out[key.strip()] = _parse_value(value.strip())
    return out


def check_choice(value: str, choices: list[str], option: str) -> str:
    """``value`` lower-cased if it is one of ``choices``; exits 2 otherwise."""
    if value.lower() not in choices:
        raise typer.BadParameter(message("", f"unknown value {value!r}",
                                         fix=f"choose one of {', '.join(choices)}"),
                                 param_hint=f"'{option}'")
    return value.lower()


# ---- model sources (every command) and options of simulate and estimate -----------------

SimModelOpt = Annotated[str | None, typer.Option(
    "--model", "-m", metavar="PRESET",
    help="Built-in preset (llama-7b, llama-1b, gpt2-124m, ...). Default: llama-7b unless "
         "--hf, --hf-config or --module is given.",
)]
HfOpt = Annotated[str | None, typer.Option(
    "--hf", metavar="NAME",
    help="Hugging Face model family built from its config class with default sizes "
         "(llama, mistral, gpt2, qwen2, gemma, phi3, ... or any model_type). No weights are "
         "downloaded. Needs pip install 'remat\\[hf]'.",
)]
HfConfigOpt = Annotated[Path | None, typer.Option(
    "--hf-config", metavar="PATH",
    help="A Hugging Face config.json (or its directory); random weights, nothing downloaded.",
)]
ModuleOpt = Annotated[str | None, typer.Option(
    "--module", metavar="FILE.py:FACTORY",
    help="Your own model: FILE.py:FACTORY or package.module:FACTORY. FACTORY() takes no "
         "arguments and returns an nn.Module (token batches made from its "
         "config.vocab_size), a tuple (model, batch), or an object with .model and optionally "
         ".make_batch(batch_size, seq_len), .batch and .loss_fn(output, batch). A fixed "
         "batch is used as it is (--batch/--seq ignored, with a note). Default loss: "
         "output.loss, else the mean of the output. See docs/cli.md.",
)]
SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", metavar="KEY=VALUE",
    help="Override a config field of the preset or Hugging Face config; repeatable "
         "(e.g. --set num_hidden_layers=16).",
)]
SimStrategiesOpt = Annotated[str | None, typer.Option(
    "--strategies", callback=_check_strategies, metavar="A,B,C",
    help=f"Comma-separated strategies. Default: {SIMULATE_DEFAULTS} (offload "
         "needs a separate host memory, which a simulation does not have).",
)]
DtypeOpt = Annotated[str, typer.Option(
    "--dtype", callback=_check_precision, metavar="PRECISION",
    help="bf16 (params, grads, AdamW state all bf16), amp-bf16 (fp32 master weights, bf16 "
         "autocast), amp-fp16 or fp32.",
)]
GpuOpt = Annotated[str, typer.Option(
    "--device", callback=_check_device_name, metavar="GPU",
    help="Target device: a100-40gb, a100-80gb, h100-80gb, h200, b200, l4, rtx-4090.",
)]
