"""Which model ``remat simulate`` and ``remat estimate`` run, from their options.

``--model`` (a preset), ``--hf`` (a Hugging Face family built from its config class)
or ``--hf-config`` (a config.json), each with ``--set KEY=VALUE`` overrides, resolve
to a :class:`ModelChoice`: a preset name or a meta-device factory, and its depth.
Also the parsing of their list options (``--batch 1,2,4``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from remat.cli._common import fail
from remat.errors import message

if TYPE_CHECKING:
    from torch import nn


def int_list(value: str, option: str) -> list[int]:
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


@dataclass(frozen=True)
class ModelChoice:
    """The model the options name: a preset name or a meta-device factory, and its depth."""

    source: Callable[[], nn.Module] | str
    name: str
    n_layers: int | None


def model_choice(model: str | None, hf: str | None, hf_config: Path | None,
                 overrides: dict[str, Any], seq_len: int, *,
                 layers: int | None = None) -> ModelChoice:
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
    return ModelChoice(lambda: hf_models.hf_model_from_config(config), name,
                       depth if isinstance(depth, int) else None)


def _preset_source(name: str, overrides: dict[str, Any], seq_len: int,
                   layers: int | None) -> ModelChoice:
    from remat.models import PRESETS, build_model, get_config

    if name not in PRESETS:
        raise typer.BadParameter(message("", f"unknown preset {name!r}",
                                         {"valid presets": ", ".join(PRESETS)},
                                         fix="pass one of the valid presets"),
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
        return ModelChoice(name, name, depth)
    return ModelChoice(lambda: build_model(name, **settings), name, depth)
