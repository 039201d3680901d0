"""Fake-tensor kernels PyTorch lacks or restricts, so simulated steps run what real ones run.

NOTE [ Grouped matmul under fake tensors ]
    Mixture-of-experts layers in transformers >= 5 run their experts with
    ``torch._grouped_mm(tokens, expert_weights, offs=offsets)``: ``tokens`` is
    ``(S, K)`` with ``S = tokens * top_k`` rows sorted by expert, ``offs`` the
    cumulative row count per expert. PyTorch's meta kernel mirrors the CUDA one
    and accepts bfloat16 only, while the CPU kernel (and the real CUDA one in
    recent releases) takes float32 and float16 too, so a float32 MoE model runs
    for real but not under ``FakeTensorMode``. :func:`install_fake_kernels`
    registers a fake kernel for every dtype that builds the output exactly as
    ``torch._meta_registrations._create_grouped_mm_output_tensor`` does (shape,
    strides and the 16-byte row padding of CUDA builds), bfloat16 included: the
    meta kernel's stride checks also reject layouts the real kernels accept
    (the zero-stride gradient of a ``sum``). Dtype and stride checks are left to
    the real kernel.

    Routing: the output is ``(S, N)`` whatever the routing, and so is every
    tensor the grouped path creates (sort, gather, histogram of ``num_experts``
    bins, scatter-add back to tokens), so simulated bytes do not depend on how
    tokens are routed: no balanced-routing assumption is needed. An expert
    implementation that loops over experts and gathers each one's tokens
    (``experts_implementation="eager"``: ``torch.where(mask)``) has
    data-dependent shapes; see NOTE [ Data-dependent shapes ] in shadow.py.

NOTE [ Waiting on a collective under fake tensors ]
    ``torch.ops._c10d_functional.wait_tensor(t)`` waits for the collective that
    writes ``t`` and returns ``t`` itself (the C++ kernel returns its input); its
    meta kernel returns ``torch.empty_like(t)``, a second storage. Under fake
    tensors DTensor's functional collectives wait at once (``_are_we_tracing``), so
    every redistribution (a row-parallel linear's all-reduce, the head's all-gather)
    would count its output twice until the collective's own output is dropped.
    :func:`install_fake_kernels` makes the fake ``wait_tensor`` return its input, as
    the real one does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses import fake_impls

_aten = torch.ops.aten
_installed = False


def _is_grouped_mm(func: Any) -> bool:
    return func is _aten._grouped_mm.default


def _fake_grouped_mm(fake_mode: Any, func: Any, mat_a: torch.Tensor, mat_b: torch.Tensor,
                     offs: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None) -> Any:
    # See NOTE [ Grouped matmul under fake tensors ].
    from torch._meta_registrations import _create_grouped_mm_output_tensor

    if offs is None and (mat_a.dim() == 2 or mat_b.dim() == 2):
        return NotImplemented  # the meta kernel raises the usual error
    with fake_mode:
        return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)


def _is_wait_tensor(func: Any) -> bool:
    name: Any = getattr(func, "name", None)
    return getattr(func, "namespace", None) == "_c10d_functional" and callable(name) \
        and name() == "_c10d_functional::wait_tensor"


def _fake_wait_tensor(_fake_mode: Any, _func: Any, tensor: torch.Tensor) -> torch.Tensor:
    return tensor  # See NOTE [ Waiting on a collective under fake tensors ].


def install_fake_kernels() -> None:
    """Register remat's fake kernels with ``FakeTensorMode`` (idempotent).

    Called by :func:`remat.measure.fake.fake_copy_with_map`, so every simulated step has
    them. See NOTE [ Grouped matmul under fake tensors ] and NOTE [ Waiting on a collective
    under fake tensors ].
    """
    global _installed
    if _installed:
        return
    _installed = True
    fake_impls.op_implementations_checks.insert(0, (_is_grouped_mm, _fake_grouped_mm))
    fake_impls.op_implementations_checks.insert(0, (_is_wait_tensor, _fake_wait_tensor))
