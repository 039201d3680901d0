"""Training precisions and optimizers as people train, for simulated training steps.

A :class:`Precision` says in which dtype the parameters (and therefore gradients and
``torch.optim`` states, which are created like the parameters) live, and whether the
forward runs under ``torch.autocast``.

NOTE [ Which precisions, and why ]
* ``"bf16"`` — parameters, gradients and AdamW moments all in bf16 ("pure bf16").
  This is what ``model.to(torch.bfloat16)`` plus ``torch.optim.AdamW`` gives, and what
  torchtune's recipes and most single-node fine-tuning scripts do by default.
  Bytes per parameter with AdamW: 2 + 2 + 4 = 8. bf16 parameters with *fp32*
  optimizer states is a niche setup (it needs a custom optimizer), so it is not offered.
* ``"amp-bf16"`` — fp32 parameters ("master weights"), fp32 gradients and fp32 AdamW
  moments, forward under ``torch.autocast(dtype=torch.bfloat16)``: the PyTorch AMP
  recipe and what Hugging Face ``Trainer(bf16=True)`` does. 4 + 4 + 8 = 16 bytes per
  parameter, plus the bf16 weight copies autocast keeps for backward.
* ``"amp-fp16"`` — the same with float16 autocast (a ``GradScaler`` adds no tensor of
  parameter size, so it is not modelled).
* ``"fp32"`` — everything float32, no autocast.

NOTE [ Autocast policy in simulation ]
Simulated steps run on (fake) CPU tensors, so autocast applies PyTorch's CPU policy.
It agrees with CUDA's for matmuls, convolutions, SDPA (lower precision) and
cross-entropy (fp32), but CUDA additionally runs ``layer_norm``, ``softmax``,
``log_softmax``, ``pow``, ``exp``, ``sum`` and a few more in fp32 (see
``aten/src/ATen/autocast_mode.cpp``). A model that calls ``nn.LayerNorm`` on bf16
activations under CUDA autocast therefore saves 4-byte norm outputs where the CPU
simulation saves 2-byte ones. Llama-style models (RMSNorm in explicit fp32, fused
attention) are not affected.

NOTE [ Optimizers ]
``torch.optim`` chooses its ``foreach`` implementation on CUDA and the per-parameter
loop on CPU. The foreach variant allocates list-wide temporaries (e.g. the square
root of every ``exp_avg_sq`` at once) and so has a higher peak during
``optimizer.step()``. Simulation builds optimizers with ``foreach=True`` so the
simulated step allocates what the CUDA default allocates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from remat.errors import message


@dataclass(frozen=True)
class Precision:
    """How a training step uses floating-point types.

    Args:
        name: short id (``"bf16"``, ``"amp-bf16"``, ``"fp32"``, ``"amp-fp16"``).
        param_dtype: dtype of parameters, hence of gradients and optimizer states.
        autocast_dtype: dtype of ``torch.autocast`` around the forward, or ``None``.
        description: one line for tables and help text.

    Example:
        >>> get_precision("amp-bf16").param_dtype
        torch.float32
    """

    name: str
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    description: str

    def __post_init__(self) -> None:
        if not self.param_dtype.is_floating_point:
            raise ValueError(message(f"Precision({self.name!r})",
                                     "param_dtype must be a floating dtype",
                                     {"found": self.param_dtype},
                                     fix="pass a floating dtype such as torch.bfloat16"))
        if self.autocast_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(message(f"Precision({self.name!r})",
                                     "autocast_dtype must be None, torch.bfloat16 or "
                                     "torch.float16", {"found": self.autocast_dtype},
                                     fix="pass one of those"))

    @property
    def activation_bytes_per_element(self) -> int:
        """Element size of most activations: the autocast dtype's, else the params'."""
        dtype = self.autocast_dtype or self.param_dtype
        return torch.empty((), dtype=dtype).element_size()


# See NOTE [ Which precisions, and why ].
PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("bf16", torch.bfloat16, None,
                  "bf16 params, grads and optimizer state (pure bf16)"),
        Precision("amp-bf16", torch.float32, torch.bfloat16,
                  "fp32 master params, grads and optimizer state; bf16 autocast"),
        Precision("amp-fp16", torch.float32, torch.float16,
                  "fp32 master params, grads and optimizer state; fp16 autocast"),
        Precision("fp32", torch.float32, None, "everything fp32"),
    )
}


def get_precision(name: str | Precision) -> Precision:
    """Look a precision up by name, or pass one through.

    Raises:
        ValueError: unknown name; lists the known ones.

    Example:
        >>> get_precision("bf16").param_dtype
        torch.bfloat16
    """
    if isinstance(name, Precision):
        return name
    key = name.lower().replace("_", "-")
    aliases = {"bfloat16": "bf16", "float32": "fp32", "amp": "amp-bf16"}
    key = aliases.get(key, key)
    if key not in PRECISIONS:
        raise ValueError(message(
            "remat.simulate", f"unknown precision {name!r}",
            {"known": f"{', '.join(PRECISIONS)} (bf16 = pure bf16; amp-bf16 = fp32 master "
                      "weights with bf16 autocast)"},
            fix="pass one of the known precisions"))
    return PRECISIONS[key]


#: Optimizer names and the number of parameter-sized states each keeps (for docs/tests).
OPTIMIZERS: dict[str, int] = {"adamw": 2, "adam": 2, "sgd": 1, "none": 0}


def make_optimizer(name: str, params: Iterable[nn.Parameter], *, lr: float | None = None,
                   foreach: bool | None = True) -> torch.optim.Optimizer | None:
    """Build a ``torch.optim`` optimizer the way a training script does.

    ``"adamw"`` / ``"adam"`` keep two moments per parameter, ``"sgd"`` is SGD with
    momentum 0.9 (one buffer), ``"none"`` returns ``None`` (forward and backward only).
    This is remat's one optimizer factory: simulations and the CLI's ``--optimizer``
    use it.

    Args:
        name: ``"adamw"``, ``"adam"``, ``"sgd"`` or ``"none"`` (any case).
        params: the parameters to optimise.
        lr: learning rate (it changes no byte and no FLOP). Default: ``1e-4`` for Adam
            and AdamW, ``1e-2`` for SGD.
        foreach: ``True`` allocates what the CUDA default allocates even on CPU and
            fake tensors (see NOTE [ Optimizers ]); ``None`` leaves the choice to torch
            (foreach on CUDA, a per-parameter loop on CPU). Default: ``True``.

    Raises:
        ValueError: unknown name.

    Example:
        >>> make_optimizer("sgd", nn.Linear(2, 2).parameters()).defaults["momentum"]
        0.9
    """
    key = _check_optimizer(name)
    return None if key == "none" else _build(key, params, lr=lr, foreach=foreach)


def _check_optimizer(name: str) -> str:
    key = name.lower()
    if key not in OPTIMIZERS:
        raise ValueError(message("remat.simulate", f"unknown optimizer {name!r}",
                                 {"known": ", ".join(OPTIMIZERS)},
                                 fix="pass one of the known optimizers"))
    return key


def _build(key: str, params: Iterable[nn.Parameter], *, lr: float | None = None,
           foreach: bool | None = True) -> torch.optim.Optimizer:
    if key == "adamw":
        return torch.optim.AdamW(params, lr=1e-4 if lr is None else lr, foreach=foreach)
    if key == "adam":
        return torch.optim.Adam(params, lr=1e-4 if lr is None else lr, foreach=foreach)
    return torch.optim.SGD(params, lr=1e-2 if lr is None else lr, momentum=0.9,
                           foreach=foreach)


def optimizer_factory(
    name: str,
) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None:
    """``make_optimizer`` bound to ``name``: ``params -> optimizer``; ``None`` for "none".

    Raises:
        ValueError: unknown name (raised now, not when the factory is called).
    """
    key = _check_optimizer(name)
    if key == "none":
        return None

    def factory(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return _build(key, params)

    return factory
