"""Temporaries a composite kernel makes and frees inside one op, which the tracker models.

NOTE [ Kernel scratch the tracker models ]
    A ``CompositeExplicitAutograd`` kernel calls other aten ops below the dispatch
    mode, so the tracker sees its output only (NOTE [ What the tracker cannot see ],
    1. in tracker.py). Where such a kernel's temporaries are a fixed function of its
    inputs' shapes, and large, the tracker adds them for one moment, with the output
    alive, as the allocator sees them:

    * ``aten._safe_softmax(x, dim)`` (the softmax of SDPA's math path, which CPU
      attention takes with a float mask or an expanded key/value, e.g. Falcon's
      multi-query attention): ``out = softmax(x, dim)``, then ``isneginf(x)`` (one
      bool per element), ``all(that, dim, keepdim=True)`` (one bool per row) and a
      0-dim tensor of ``out``'s dtype, all alive at once before the rows that are all
      ``-inf`` are zeroed in place: ``numel(x) + numel(x) / x.size(dim) +
      out.element_size()`` bytes on top of the output (PyTorch's
      aten/src/ATen/native/SoftMax.cpp; measured on the CPU allocator: 8452 B for a
      float32 ``(2, 4, 32, 32)`` input, 1.2% of a tiny Falcon's step). The
      intermediate bool tensors are a quarter of the scores in float32, half in
      bfloat16, so the term grows with the attention, not only on tiny models.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def scratch_bytes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """Bytes ``func``'s kernel holds besides its output at its own peak (NOTE [ Kernel
    scratch the tracker models ]); 0 for ops not modelled.

    Example:
        >>> x = torch.randn(2, 8)
        >>> scratch_bytes(torch.ops.aten._safe_softmax.default, (x, -1), {},
        ...               torch.ops.aten._safe_softmax.default(x, -1))
        22
    """
    if func is not torch.ops.aten._safe_softmax.default or not isinstance(out, Tensor):
        return 0
    x = args[0] if args else kwargs.get("self")
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if not isinstance(x, Tensor) or not isinstance(dim, int) or x.dim() == 0:
        return 0
    numel = x.numel()
    rows = numel // x.size(dim) if x.size(dim) else 0
    return int(numel + rows + out.element_size())
