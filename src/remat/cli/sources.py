"""Which model a ``remat`` command runs, from its source options: resolved here, once.

Every command takes exactly one source: ``--model`` (a preset, the default), ``--hf``
(a Hugging Face family built from its config class), ``--hf-config`` (a config.json)
or ``--module`` (your factory, see :mod:`remat.cli.user_model`), with ``--set
KEY=VALUE`` overriding config fields of the first three. Commands that run steps for
real (``profile``, ``compare``, ``plan``) get a :class:`RunSource` from
:func:`run_source`; ``simulate`` and ``estimate`` a :class:`ModelChoice` (meta-device
factory) from :func:`model_choice`. Both name the source the same way in titles and
JSON (``gpt-small``, ``hf:llama``, ``module:my_model.py:build``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from remat.cli.common import err_console, fail
from remat.cli.options import overrides
from remat.cli.user_model import UserModel, call_factory, load_factory, raised
from remat.errors import message

if TYPE_CHECKING:
    from torch import nn

#: Tokens per sequence of ``profile``/``compare``/``plan`` when ``--seq`` is not given and
#: the source is not a preset (presets use their ``max_seq_len``).
DEFAULT_SEQ = 128


@dataclass(frozen=True)
class Sources:
    """The source options as given (see :func:`given_sources`).

    Args:
        model: ``--model`` preset name.
        hf: ``--hf`` family name.
        hf_config: ``--hf-config`` path.
        module: ``--module`` spec.
        settings: ``--set`` as ``KEY=VALUE`` strings.
    """

    model: str | None = None
    hf: str | None = None
    hf_config: Path | None = None
    module: str | None = None
    settings: tuple[str, ...] = ()

    @property
    def overrides(self) -> dict[str, Any]:
        """``--set`` parsed (numbers and booleans converted)."""
        return overrides(list(self.settings))


def given_sources(model: str | None, hf: str | None, hf_config: Path | None,
                  module: str | None, settings: list[str] | None) -> Sources:
    """The source options as :class:`Sources`; exits 2 when more than one source is given,
    or ``--set`` goes with ``--module``."""
    given = [flag for flag, value in (("--model", model), ("--hf", hf),
                                      ("--hf-config", hf_config), ("--module", module))
             if value is not None]
    if len(given) > 1:
        fail(f"pass one of --model, --hf, --hf-config, --module (got {', '.join(given)})")
    if module is not None and settings:
        fail(message("", "--set changes config fields of a preset or a Hugging Face config; "
                         "--module builds the model in your code",
                     fix="change the sizes in your factory, or drop --set"))
    return Sources(model, hf, hf_config, module, tuple(settings or ()))


def given_flags(ctx: typer.Context, *names: str) -> list[str]:
    """The options among ``names`` (parameter names) given on the command line, as flags."""
    flags = {p.name: p.opts[0] for p in ctx.command.params}
    # by name: typer may bring its own copy of click's ParameterSource enum
    return [flags.get(n, n) for n in names
            if getattr(ctx.get_parameter_source(n), "name", "DEFAULT") != "DEFAULT"]


def batch_shape(batch: Any) -> tuple[int | None, int | None]:
    """``(batch size, tokens per sequence)`` of ``batch``, read from its first tensor: the
    first dimension, and the second when that tensor holds token ids (integers, 2-D);
    ``None`` for what cannot be read."""
    import torch
    from torch.utils._pytree import tree_leaves

    first = next((leaf for leaf in tree_leaves(batch) if isinstance(leaf, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        return None, None
    tokens = first.dim() == 2 and not first.is_floating_point() and not first.is_complex()
    return int(first.shape[0]), int(first.shape[1]) if tokens else None


def shape_label(name: str, batch_size: int | None, seq_len: int | None) -> str:
    """``"gpt-tiny, batch 2, seq 32"`` for titles (the parts that are known)."""
    return name + (f", batch {batch_size}" if batch_size is not None else "") + \
        (f", seq {seq_len}" if seq_len is not None else "")


def _to_device(batch: Any, device: Any) -> Any:
    import torch
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.to(device), batch)


def module_name(spec: str) -> str:
    """How titles and JSON name a ``--module`` source."""
    return f"module:{spec}"


# ---- simulate and estimate: a model on the meta device -----------------------------------

@dataclass(frozen=True)
class ModelChoice:
    """The model a simulation runs: a preset name or a meta-device factory, its depth,
    and for ``--module`` the batches and loss the factory gave.

    Args:
        source: a preset name or a factory ``() -> nn.Module`` (called on the meta device).
        name: as titles and JSON name it.
        n_layers: depth, when known.
        batch_fn: ``batch_fn(batch_size, seq_len)``, or ``None`` (remat's token batches).
        loss_fn: ``loss_fn(output, batch)``, or ``None`` (remat's default loss).
        fixed_batch: the factory's one batch (``--module`` returning a batch), or ``None``.
        user: the factory's checked result (``--module`` only).
    """

    source: Callable[[], nn.Module] | str
    name: str
    n_layers: int | None
    batch_fn: Callable[[int, int], Any] | None = None
    loss_fn: Callable[[Any, Any], Any] | None = None
    fixed_batch: Any = None
    user: UserModel | None = None


def model_choice(sources: Sources, seq_len: int, *, api: str,
                 layers: int | None = None) -> ModelChoice:
    """Resolve the source options to a model to simulate; ``layers`` caps the depth."""
    if sources.module is not None:
        factory, folder = load_factory(sources.module, api)
        user = call_factory(factory, folder, sources.module, api, meta=True)
        model = user.model
        make = user.make_batch
        return ModelChoice(lambda: model, module_name(sources.module), None,
                           batch_fn=(lambda b, s: make(b, s)) if make is not None else None,
                           loss_fn=user.loss_fn, fixed_batch=user.batch, user=user)
    if sources.hf is None and sources.hf_config is None:
        return _preset_choice(sources.model or "llama-7b", sources.overrides, seq_len, layers)
    from remat.simulate import hf as hf_models

    config, name = hf_config(sources, seq_len)
    depth = getattr(config, "num_hidden_layers", None)
    if layers is not None and isinstance(depth, int) and depth > layers:
        config.num_hidden_layers = layers
    return ModelChoice(lambda: hf_models.hf_model_from_config(config), name,
                       depth if isinstance(depth, int) else None)


def hf_config(sources: Sources, seq_len: int) -> tuple[Any, str]:
    """The transformers config ``--hf`` or ``--hf-config`` (+ ``--set``) name, and its name."""
    from remat.simulate import hf as hf_models

    try:
        if sources.hf is not None:
            config = hf_models.hf_config_from_name(sources.hf, **sources.overrides)
            name = f"hf:{sources.hf}"
        else:
            config = hf_models.hf_config_from_file(str(sources.hf_config),
                                                   **sources.overrides)
            name = f"hf:{config.model_type}"
    except ImportError as exc:
        fail(str(exc), code=1)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        fail(str(exc))
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len > limit and config.model_type in (
            "gpt2", "opt", "gpt_neo", "bloom", "gpt_bigcode"):
        fail(f"--seq {seq_len} exceeds {name}'s learned position table "
             f"(max_position_embeddings={limit}); pass --set n_positions={seq_len} or a shorter "
             "--seq")
    return config, name


def _preset_choice(name: str, settings: dict[str, Any], seq_len: int,
                   layers: int | None) -> ModelChoice:
    from remat.models import PRESETS, build_model

    depth = preset_config(name, settings, seq_len).n_layer
    settings = dict(settings)
    if seq_len > PRESETS[name].max_seq_len:
        settings.setdefault("max_seq_len", seq_len)
    if layers is not None and depth > layers:
        settings["n_layer"] = layers
    if not settings:
        return ModelChoice(name, name, depth)
    return ModelChoice(lambda: build_model(name, **settings), name, depth)


def preset_config(name: str, settings: dict[str, Any], seq_len: int | None) -> Any:
    """The preset's config with ``--set`` applied (``max_seq_len`` raised to ``seq_len``);
    exits 2 on an unknown preset or field."""
    from remat.models import PRESETS, get_config

    if name not in PRESETS:
        raise typer.BadParameter(message("", f"unknown preset {name!r}",
                                         {"valid presets": ", ".join(PRESETS)},
                                         fix="pass one of the valid presets"),
                                 param_hint="'--model'")
    settings = dict(settings)
    if seq_len is not None and seq_len > PRESETS[name].max_seq_len:
        settings.setdefault("max_seq_len", seq_len)
    try:
        return get_config(name, **settings)
    except (ValueError, TypeError) as exc:
        raise typer.BadParameter(str(exc), param_hint="'--set'") from None


def fixed_batch_note(name: str, flags: list[str]) -> None:
    """The one-line note that ``flags`` (``--batch``, ``--seq``) cannot resize a fixed batch."""
    if flags:
        err_console.print(
            f"[yellow]Note:[/yellow] {name} gives one fixed batch: {' and '.join(flags)} "
            "ignored (return make_batch(batch_size, seq_len) from the factory to apply them).",
            highlight=False, soft_wrap=True)


# ---- profile, compare and plan: real models on a device ----------------------------------

@dataclass(frozen=True)
class RunSource:
    """A model source resolved for real runs: fresh models, batches, loss and name.

    Args:
        name: as titles and JSON name it (``gpt-small``, ``hf:llama``, ``module:f.py:build``).
        build: a fresh model on the device, in train mode, built after
            ``torch.manual_seed(seed)`` (the same weights every call).
        make_batch: ``make_batch(batch_size)`` on the device, or ``None`` when the source
            gives one fixed batch.
        fixed_batch: that batch (on the device), else ``None``.
        loss_fn: ``loss_fn(output, batch)``, or ``None`` (remat's default loss).
        param_bytes: bytes of the model's parameters.
        seq_len: tokens per sequence of its batches, when known.
        make_seq_batch: ``make_seq_batch(batch_size, seq_len)`` on the device (``remat plan
            --maximize seq-len``), or ``None`` when the source gives one fixed batch.
    """

    name: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[int], Any] | None
    fixed_batch: Any
    loss_fn: Callable[[Any, Any], Any] | None
    param_bytes: int
    seq_len: int | None
    make_seq_batch: Callable[[int, int], Any] | None = None

    def batch(self, batch_size: int) -> Any:
        """A batch of ``batch_size`` sequences, or the source's fixed batch."""
        return self.fixed_batch if self.make_batch is None else self.make_batch(batch_size)


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in dict.fromkeys(model.parameters()))


def run_source(sources: Sources, *, api: str, seq: int | None, seed: int, target: Any,
               given: list[str]) -> RunSource:
    """Resolve the source options for a real run on ``target``.

    ``given`` lists ``--batch``/``--seq`` when they were passed: a note says they are
    ignored when the source gives a fixed batch. Exits 2 on a bad source or ``--seq``.
    """
    if sources.module is not None:
        return _module_source(sources.module, api=api, seq=seq, seed=seed, target=target,
                              given=given)
    if sources.hf is not None or sources.hf_config is not None:
        return _hf_source(sources, seq=seq, seed=seed, target=target)
    return _preset_source(sources.model or "gpt-small", sources.overrides, seq=seq,
                          seed=seed, target=target)


def _preset_source(name: str, settings: dict[str, Any], *, seq: int | None, seed: int,
                   target: Any) -> RunSource:
    import torch

    from remat.models import make_batch, model_from_config

    config = preset_config(name, settings, None)
    try:  # reject a bad --seq before anything is built
        make_batch(config, 1, seq, device="meta")
    except ValueError as exc:
        raise typer.BadParameter(str(exc).removeprefix("remat.models.make_batch: "),
                                 param_hint="'--seq'") from None

    def build() -> nn.Module:
        torch.manual_seed(seed)
        with torch.device(target):
            return model_from_config(config)

    with torch.device("meta"):
        param_bytes = _param_bytes(model_from_config(config))
    return RunSource(name, build, lambda n: make_batch(config, n, seq, seed=seed, device=target),
                     None, None, param_bytes, seq or config.max_seq_len,
                     lambda n, s: make_batch(config, n, s, seed=seed, device=target))


def _hf_source(sources: Sources, *, seq: int | None, seed: int, target: Any) -> RunSource:
    import torch

    from remat.simulate import hf as hf_models
    from remat.simulate.sim_setup import default_batch

    config, name = hf_config(sources, seq or 0)
    limit = getattr(config, "max_position_embeddings", None)
    seq_len = seq or (min(DEFAULT_SEQ, limit) if isinstance(limit, int) else DEFAULT_SEQ)
    meta_model = hf_models.hf_model_from_config(config)

    def build() -> nn.Module:
        torch.manual_seed(seed)
        return hf_models.hf_model_from_config(config, device=target)

    return RunSource(name, build,
                     lambda n: _to_device(default_batch(meta_model, n, seq_len), target),
                     None, None, _param_bytes(meta_model), seq_len,
                     lambda n, s: _to_device(default_batch(meta_model, n, s), target))


def _module_source(spec: str, *, api: str, seq: int | None, seed: int, target: Any,
                   given: list[str]) -> RunSource:
    import torch

    from remat.simulate.sim_setup import default_batch

    factory, folder = load_factory(spec, api)

    def call() -> UserModel:
        torch.manual_seed(seed)
        return call_factory(factory, folder, spec, api)

    first = [call()]
    user = first[0]
    name = module_name(spec)

    def build() -> nn.Module:
        made = first.pop() if first else call()  # the checked first model, then new ones
        return made.model.to(target).train()  # type: ignore[no-any-return]

    seq_len = seq or DEFAULT_SEQ
    if user.batch is not None and user.make_batch is None:
        fixed_batch_note(name, given)
        batch = _to_device(user.batch, target)
        return RunSource(name, build, None, batch, user.loss_fn, _param_bytes(user.model),
                         batch_shape(batch)[1])
    make = user.make_batch

    def make_seq_batch(n: int, s: int) -> Any:
        if make is None:
            return _to_device(default_batch(user.model, n, s), target)
        try:
            return _to_device(make(n, s), target)
        except Exception as exc:
            raised(api, f"--module {spec}: make_batch({n}, {s}) raised an error", exc,
                   fix="fix make_batch, or pass a --batch/--seq it accepts")

    def make_batch(n: int) -> Any:
        return make_seq_batch(n, seq_len)

    return RunSource(name, build, make_batch, None, user.loss_fn, _param_bytes(user.model),
                     seq_len, make_seq_batch)
