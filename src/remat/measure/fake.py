"""Fake-tensor copies of a model, its batch and its optimizer, for simulated steps.

Under ``FakeTensorMode`` every op computes only shapes, dtypes and strides, so a
training step of a model far larger than the machine runs in seconds and
allocates nothing, while :class:`~remat.measure.tracker.MemoryTracker` still sees
every storage the real step would create (fake tensors have meta storages of the
real size). This module turns the real (or meta-device) objects into fake ones.

NOTE [ Fake copies ]
    ``copy.deepcopy(model, memo)`` with ``memo`` pre-filled so that every
    parameter, buffer and plain tensor attribute maps to its fake replacement:
    no tensor data is ever copied, tied weights stay tied (one memo entry), and
    everything else is copied the usual way. Instance-level state survives, as
    deepcopy rebinds it to the copy: a bound-method forward (``types.MethodType``,
    or the picklable one ``remat.apply`` installs, see strategies/regions.py
    NOTE [ Instance forward ]) is re-bound to the copied module and a ``functools.partial`` gets its
    arguments deep-copied through the same memo. A closure over the original
    module (TRL and accelerate install them) is rebuilt to close over the copy
    (measure/closures.py NOTE [ Closures over the original model ]).
    Meta tensors become fake tensors on ``device`` (CPU by default) that keep
    the meta tensor's storage, so aliasing between them is kept too.

NOTE [ What fake tensors cannot run ]
    A fake step stops where the real one needs a value: an op whose output shape
    depends on values (``nonzero``, ``torch.where(mask)``, ``masked_select``: raises
    ``DynamicOutputShapeException``) or a value read into Python (``.item()``,
    ``.tolist()``: ``DataDependentOutputException``), unless the value is known (NOTE
    [ Data-dependent branches under fake tensors ] in shadow.py). A module that converts
    its own parameters in forward (``self.router = self.router.to(torch.float32)``) cannot
    run either: a fake parameter is a tensor subclass, so ``Module._apply`` swaps it with
    ``torch.utils.swap_tensors``, which refuses a tensor something holds a weak reference
    to (the fake mode's converter does). :func:`fake_failure` recognizes these, however
    deep in an exception's chain (remat re-raises the first two as its own errors), and
    says why in a line, so callers can fall back to real tensors or refuse clearly.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)

from remat.distributed.sharded import is_dtensor, local_tensor
from remat.errors import message
from remat.measure import shadow
from remat.measure.closures import rebind_closures
from remat.measure.fake_kernels import install_fake_kernels


def fake_tensor(
    t: Tensor, fake_mode: FakeTensorMode, *, device: torch.device | str | None = None
) -> Tensor:
    """A fake tensor with ``t``'s shape, strides and dtype (no data is copied).

    Tensors sharing a storage keep sharing one when their device is kept.

    Args:
        t: a real, meta or fake tensor.
        fake_mode: the mode the result belongs to.
        device: device of the result. Default: ``t``'s device, or CPU for meta tensors.
    """
    if is_dtensor(t):  # the same sharding over a fake local shard
        spec = t._spec  # type: ignore[attr-defined]
        dtensor: Any = type(t)
        out: Tensor = dtensor(fake_tensor(local_tensor(t), fake_mode, device=device), spec,
                              requires_grad=t.requires_grad)
        return out
    converter = fake_mode.fake_tensor_converter
    if isinstance(t, FakeTensor) and t.fake_mode is fake_mode:
        if device is None or t.device == torch.device(device):
            return t
        with fake_mode:
            return t.to(device)
    if t.device.type == "meta" or (device is not None and t.device != torch.device(device)):
        # A meta tensor of the same layout, claimed to live on the target device: no data,
        # no device runtime needed (a fake "cuda" tensor works on a CPU-only build).
        meta = t.detach() if t.device.type == "meta" else t.detach().to("meta")
        target = torch.device(device) if device is not None else torch.device("cpu")
        fake = converter.from_meta_and_device(fake_mode, meta, target)
    else:
        fake = fake_mode.from_tensor(t.detach())
    shadow.remember(fake, t)  # NOTE [ Data-dependent branches under fake tensors ]
    return fake


def check_fake_device(device: torch.device | str | None) -> None:
    """Raise ValueError for a fake device this PyTorch build cannot even pretend to have.

    Fake CUDA tensors need a CUDA-enabled build (no GPU required); on a CPU-only build
    the first kernel's device guard aborts the process, so refuse early.
    """
    if device is None:
        return
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.backends.cuda.is_built():
        raise ValueError(message(
            "remat.profile(simulate=True)", f"device={str(dev)!r} needs a CUDA-enabled "
            "PyTorch build", {"this PyTorch": f"{torch.__version__}, CPU only"},
            fix="simulate on 'cpu' instead: byte counts are the same except for "
                "device-specific kernels (attention)"))


def _plain_tensor_attributes(module: nn.Module) -> Iterable[Tensor]:
    for value in module.__dict__.values():
        if isinstance(value, Tensor):
            yield value


def fake_copy_with_map(
    model: nn.Module, fake_mode: FakeTensorMode, *, device: torch.device | str | None = None
) -> tuple[nn.Module, dict[int, Tensor]]:
    """:func:`fake_copy`, also returning ``{id(original_tensor): fake_tensor}``."""
    check_fake_device(device)
    install_fake_kernels()  # NOTE [ Grouped matmul under fake tensors ] in fake_kernels.py
    replaced: dict[int, Tensor] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) not in replaced:
                fake = fake_tensor(p, fake_mode, device=device)
                replaced[id(p)] = nn.Parameter(fake, requires_grad=p.requires_grad)
        for b in module.buffers(recurse=False):
            if id(b) not in replaced:
                replaced[id(b)] = fake_tensor(b, fake_mode, device=device)
        for t in _plain_tensor_attributes(module):
            if id(t) not in replaced:
                replaced[id(t)] = fake_tensor(t, fake_mode, device=device)
    memo: dict[int, Any] = dict(replaced)
    copied = copy.deepcopy(model, memo)
    rebind_closures(copied, memo)
    return copied, replaced


def fake_copy(
    model: nn.Module, fake_mode: FakeTensorMode, *, device: torch.device | str | None = None
) -> nn.Module:
    """A structural copy of ``model`` whose tensors are fake (see NOTE [ Fake copies ]).

    Parameters stay ``nn.Parameter`` with the same ``requires_grad``; buffers and
    tensor attributes become fake tensors of the same shape and dtype; the
    original model is untouched and no memory is allocated for the copy's
    tensors. Works for models on the meta device (``with torch.device("meta"):``),
    the usual way to hold a model too large for the machine.

    Args:
        model: the model (real, meta or already fake tensors).
        fake_mode: the ``FakeTensorMode`` to run the copy under.
        device: device of the fake tensors (a CUDA device needs a CUDA-enabled build, not
            a GPU). Default: each tensor's own device, CPU for meta tensors.

    Example:
        >>> from torch._subclasses.fake_tensor import FakeTensorMode
        >>> with torch.device("meta"):
        ...     big = torch.nn.Linear(4096, 4096)
        >>> mode = FakeTensorMode()
        >>> fake = fake_copy(big, mode)
        >>> with mode:
        ...     y = fake(torch.empty(8, 4096))
        >>> (y.shape, y.device.type)
        (torch.Size([8, 4096]), 'cpu')
    """
    return fake_copy_with_map(model, fake_mode, device=device)[0]


def real_copy_with_map(model: nn.Module) -> tuple[nn.Module, dict[int, Tensor]]:
    """A real copy of ``model`` (tensors copied, on their devices) and
    ``{id(original_tensor): copied_tensor}`` for every parameter, buffer and tensor attribute.

    What the planner measures on where a fake copy cannot run the step (NOTE [ What fake
    tensors cannot run ]): the same structure as :func:`fake_copy_with_map` (tied weights
    stay tied, closures over the original re-pointed), at the cost of a second copy of
    the model's tensors.
    """
    memo: dict[int, Any] = {}
    copied = copy.deepcopy(model, memo)
    rebind_closures(copied, memo)
    replaced: dict[int, Tensor] = {}
    for module in model.modules():
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False),
                   *_plain_tensor_attributes(module)]
        for t in tensors:
            if id(t) in memo:
                replaced[id(t)] = memo[id(t)]
    return copied, replaced


_SWAP_REFUSED = "because it has weakref"


def fake_failure(error: BaseException) -> str | None:
    """Why fake tensors cannot run a step, in a line, when ``error`` (or an exception in
    its chain) says so; None for any other error (NOTE [ What fake tensors cannot run ]).

    Example:
        >>> fake_failure(ValueError("bad batch")) is None
        True
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, DynamicOutputShapeException):
            return (f"{current.func} has an output shape that depends on tensor values "
                    "(torch.where / nonzero / masked_select)")
        if isinstance(current, DataDependentOutputException):
            return f"{current.func} reads a tensor's value (.item(), .tolist(), a branch on it)"
        if isinstance(current, RuntimeError) and _SWAP_REFUSED in str(current):
            return ("a module converts its own parameters in forward (module.to(dtype)), "
                    "which fake parameters cannot")
        current = current.__cause__ or current.__context__
    return None


def fake_batch(
    batch: Any, fake_mode: FakeTensorMode, *, device: torch.device | str | None = None
) -> Any:
    """``batch`` (tensor, tuple/list or mapping, nested) with every tensor made fake.

    Mappings come back as plain dicts. ``device`` as for :func:`fake_tensor`.
    """
    if isinstance(batch, Tensor):
        return fake_tensor(batch, fake_mode, device=device)
    if isinstance(batch, Mapping):
        return {k: fake_batch(v, fake_mode, device=device) for k, v in batch.items()}
    if isinstance(batch, tuple):
        items = [fake_batch(v, fake_mode, device=device) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else tuple(items)
    if isinstance(batch, list):
        return [fake_batch(v, fake_mode, device=device) for v in batch]
    return batch


def fake_optimizer(
    optimizer: torch.optim.Optimizer, replaced: Mapping[int, Tensor]
) -> torch.optim.Optimizer:
    """The same optimizer class and hyperparameters, over the fake parameters.

    Built as ``type(optimizer)(groups, **optimizer.defaults)`` with each param group's
    hyperparameters kept; the state starts empty (run a warm-up step to create it).

    Args:
        optimizer: the real optimizer.
        replaced: ``{id(real_parameter): fake_parameter}`` from :func:`fake_copy_with_map`.

    Raises:
        ValueError: the optimizer holds a parameter that is not in ``replaced``.
    """
    groups: list[dict[str, Any]] = []
    for index, group in enumerate(optimizer.param_groups):
        params = []
        for p in group["params"]:
            if id(p) not in replaced:
                raise ValueError(message(
                    "remat.profile(simulate=True)", f"param group {index} of "
                    f"{type(optimizer).__name__} holds a tensor that is not a parameter of the "
                    "model", {"shape": tuple(p.shape)},
                    fix="build the optimizer from model.parameters()"))
            params.append(replaced[id(p)])
        hyper = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": params})
    cls: Any = type(optimizer)
    try:
        return cls(groups, **optimizer.defaults)  # type: ignore[no-any-return]
    except TypeError:  # a constructor that does not take its defaults back as keywords
        return cls(groups)  # type: ignore[no-any-return]
