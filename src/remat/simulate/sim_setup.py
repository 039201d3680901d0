"""The model, batch and precision of a simulation, resolved once: :class:`Setup`.

Implementation of :mod:`remat.simulate`; :func:`default_batch` is public (re-exported by
:mod:`remat.simulate.run`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.card_fit import CardBudget, card_budget
from remat.core.allocator_settings import AllocatorSettings
from remat.device_memory import OutsideMemory, Workspaces, layout_process_groups
from remat.devices import DeviceSpec
from remat.errors import message
from remat.simulate.precision import Precision, make_optimizer

API = "remat.simulate"
#: What a row's fit is judged on (NOTE [ Reserved per rank ] in point.py).
FITS_ON = ("reserved", "allocated")

ModelSource = nn.Module | Callable[[], nn.Module] | str
BatchFn = Callable[[int, int], Any]
LossFn = Callable[[Any, Any], torch.Tensor]


class Autocast(nn.Module):
    """Runs the wrapped model's forward (and loss) under ``torch.autocast``."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.model = model
        self.dtype = dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        device_type = next(self.model.parameters()).device.type
        with torch.autocast(device_type, dtype=self.dtype):
            return self.model(*args, **kwargs)


def _preset_factory(name: str, seq_len: int) -> tuple[Callable[[], nn.Module], str]:
    from remat.models import PRESETS, build_model

    if name not in PRESETS:
        raise ValueError(message(API, f"unknown preset {name!r}", {"presets": ", ".join(PRESETS)},
                                 fix="pass a preset, or a module or a factory for other "
                                     "models"))
    overrides: dict[str, Any] = {}
    if seq_len > PRESETS[name].max_seq_len:
        overrides["max_seq_len"] = seq_len
    return (lambda: build_model(name, **overrides)), name


def build_model(source: ModelSource, seq_len: int) -> tuple[nn.Module, str]:
    if isinstance(source, str):
        factory, name = _preset_factory(source, seq_len)
    elif isinstance(source, nn.Module):
        return source, type(source).__name__
    elif callable(source):
        factory, name = source, ""
    else:
        raise TypeError(message(API, "model must be an nn.Module, a factory returning one, or "
                                "a preset name", {"found": type(source).__name__},
                                fix="pass one of those"))
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise TypeError(message(API, "the model factory did not return an nn.Module",
                                {"returned": type(model).__name__},
                                fix="return the model from the factory"))
    return model, name or type(model).__name__


def default_batch(model: nn.Module, batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    """Random ``input_ids``/``labels`` for a built-in or Hugging Face causal LM.

    Raises:
        ValueError: the model has no ``config.vocab_size``; pass ``batch_fn``.
    """
    from remat.models import GPTConfig, LlamaConfig, make_batch

    config = getattr(model, "config", None)
    if isinstance(config, (GPTConfig, LlamaConfig)):
        return make_batch(config, batch_size, seq_len, device="cpu")
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int):
        raise ValueError(message(
            API, f"cannot make a batch for {type(model).__name__}",
            {"why": "no config.vocab_size"},
            fix="pass batch_fn=lambda batch_size, seq_len: {...} returning the model's inputs"))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=generator)  # (B, T)
    return {"input_ids": ids, "labels": ids.clone()}


@dataclass(frozen=True)
class Layout:
    """Parameter bytes of the largest block and of the root (outside every block)."""

    block_param_bytes: int
    block_grad_bytes: int
    root_param_bytes: int
    root_grad_bytes: int


def _nbytes(params: Iterable[nn.Parameter], *, trainable: bool) -> int:
    return sum(p.numel() * p.element_size() for p in params if p.requires_grad or not trainable)


def _layout(model: nn.Module, blocks: Any) -> Layout:
    from remat.blocks import named_blocks
    from remat.errors import BlocksNotFound

    try:
        named = named_blocks(model, blocks, api=API)
    except BlocksNotFound:
        named = []
    in_block: set[int] = set()
    largest = (0, 0)
    for _, block in named:
        params = list(block.parameters())
        in_block.update(id(p) for p in params)
        largest = max(largest, (_nbytes(params, trainable=False),
                                _nbytes(params, trainable=True)))
    root = [p for p in dict.fromkeys(model.parameters()) if id(p) not in in_block]
    return Layout(largest[0], largest[1], _nbytes(root, trainable=False),
                   _nbytes(root, trainable=True))


@dataclass(frozen=True)
class Setup:
    """Everything one simulated point needs besides the strategy and the batch size."""

    model: nn.Module          # what is profiled (maybe wrapped for autocast)
    inner: nn.Module          # what strategies are applied to
    optimizer: torch.optim.Optimizer | None
    precision: Precision
    device: DeviceSpec
    world_size: int
    sharding: str
    layout: Layout
    blocks: Any
    loss_fn: LossFn | None
    batch_fn: BatchFn
    card: CardBudget  # what a rank may hold on its card: NOTE [ Fits on the card ]
    allocator: AllocatorSettings  # the job's caching-allocator settings (from the environment)
    fits_on: str = "reserved"  # or "allocated": NOTE [ Reserved per rank ] in point.py


def _adapt_blocks(blocks: Any, wrapped: bool) -> Any:
    if not wrapped or blocks is None or isinstance(blocks, type) \
            or isinstance(blocks, (list, tuple)):
        return blocks
    user = blocks
    return lambda name, module: user(name.removeprefix("model."), module)


def check_ints(api: str, name: str, values: Iterable[Any]) -> tuple[int, ...]:
    out = tuple(values)
    if not out or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in out):
        raise ValueError(message(api, f"{name} must be a non-empty list of positive ints",
                                 {"found": list(out)}, fix=f"pass {name} such as [1, 2, 4]"))
    return tuple(sorted(set(out)))


def make_setup(inner: nn.Module, *, precision: Precision, optimizer: str, device: DeviceSpec,
               world_size: int, sharding: str, blocks: Any, loss_fn: LossFn | None,
               batch_fn: BatchFn | None, process_groups: Sequence[int] | None = None,
               outside: OutsideMemory | None = None,
               workspaces: Workspaces | None = None, fits_on: str = "reserved") -> Setup:
    """Convert ``inner`` to the precision's dtype, wrap it for autocast, build its optimizer;
    the card's budget counts one NCCL communicator per process group (default: one over
    the data-parallel ranks when there are several)."""
    if fits_on not in FITS_ON:
        raise ValueError(message(API, f"unknown fits_on={fits_on!r}",
                                 fix=f"pass one of {', '.join(FITS_ON)}"))
    inner.to(precision.param_dtype)
    inner.train()
    wrapped = precision.autocast_dtype is not None
    run_model = Autocast(inner, precision.autocast_dtype) if wrapped else inner  # type: ignore[arg-type]
    run_blocks = _adapt_blocks(blocks, wrapped)
    trainable = [p for p in dict.fromkeys(inner.parameters()) if p.requires_grad]
    return Setup(
        model=run_model, inner=inner, optimizer=make_optimizer(optimizer, trainable),
        precision=precision, device=device, world_size=world_size, sharding=sharding,
        layout=_layout(run_model, run_blocks), blocks=run_blocks, loss_fn=loss_fn,
        batch_fn=batch_fn or (lambda b, s: default_batch(inner, b, s)),
        card=card_budget(device, outside=outside, workspaces=workspaces,
                         process_groups=layout_process_groups(dp=world_size)
                         if process_groups is None else tuple(process_groups)),
        allocator=AllocatorSettings.from_env(), fits_on=fits_on,
    )
