"""Closed-form activation-memory estimates for one transformer layer.

These are the back-of-the-envelope formulas practitioners use before they have a
profile. remat prints them next to the exact simulated figure
(:func:`remat.simulate.estimate.estimate`) so their error is visible. All functions
return bytes for **one layer** and **one micro-batch**; multiply by the number of
layers for a model.

Symbols (Korthikanti et al. 2022, Table 1): ``s`` sequence length, ``b`` micro-batch
size, ``h`` hidden size, ``a`` number of attention heads.

NOTE [ Where the constants come from ]
Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models", MLSys 2023 (arXiv:2205.05198), Section 4.1, counts the bytes a GPT layer
keeps for backward with 16-bit activations and 1-byte dropout masks:

* attention block: ``11·s·b·h + 5·a·s²·b`` — QKV-projection input (2sbh), Q and K
  for QKᵀ (4sbh), softmax output (2as²b), its dropout mask (as²b), dropout output
  (2as²b), V (2sbh), output-projection input (2sbh), dropout mask (sbh);
* MLP block: ``19·s·b·h`` — input (2sbh), GELU input (8sbh), GELU output (8sbh),
  dropout mask (sbh);
* two LayerNorms: ``4·s·b·h``.

Sum, their Eq. 1: ``s·b·h·(34 + 5·a·s/h)`` bytes per layer. The ``5·a·s²·b`` term is
the attention matrix; a fused attention kernel (FlashAttention, Dao et al. 2022,
arXiv:2205.14135, and PyTorch's SDPA) never materialises it, which is also what the
paper's "selective recomputation" (Section 5, Eq. 6 with t = 1) reaches:
``34·s·b·h``. With full activation recomputation only each layer's input is kept:
``2·s·b·h`` (Section 5, "the total required memory is reduced to 2sbhL").

NOTE [ The 12·s·b·h rule of thumb ]
A shorter count, common in blog posts and interview questions, keeps one value per
hidden unit for every tensor a fused layer without dropout must save:
``1 + 1 + 3 + 1 + 1 + 1 + 4 = 12`` values per token — norm-1 input, QKV-projection
input, Q, K, V, output-projection input, norm-2 input, MLP input, the 4h MLP hidden
— i.e. ``12·s·b·h`` values, times the element size. It ignores dropout masks and the
second copy of the MLP hidden around the activation function, so it undercounts
GELU/SwiGLU MLPs; see the ``remat estimate`` table for by how much.

The paper's constants assume 16-bit activations. :func:`korthikanti_bytes` and
friends accept ``bytes_per_element`` and scale the 16-bit count by
``bytes_per_element / 2`` (the 1-byte dropout masks are scaled too: a coarse
approximation for fp32 that errs high by at most 2·s·b·h + a·s²·b bytes).
"""

from __future__ import annotations

from remat.errors import message


def _check(api: str, **values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(message(f"remat.simulate.formulas.{api}",
                                     f"{name} must be a positive int", {"found": repr(value)},
                                     fix=f"pass {name} as an int >= 1"))


def _scale(bytes_16bit: int, bytes_per_element: int) -> int:
    # The published constants count 16-bit (2-byte) activations; see NOTE above.
    return bytes_16bit * bytes_per_element // 2


def rule_of_thumb_bytes(*, seq_len: int, batch_size: int, hidden_size: int,
                        bytes_per_element: int = 2) -> int:
    """Activation bytes of one layer by the ``12·s·b·h`` rule of thumb.

    Cheapest estimate: 12 saved values per token and hidden unit (see
    NOTE [ The 12·s·b·h rule of thumb ]). It ignores the attention matrix, dropout
    masks and the extra MLP copies, so it is a lower bound for most models.

    Args:
        seq_len: tokens per sequence (``s``).
        batch_size: sequences per micro-batch (``b``).
        hidden_size: model width (``h``).
        bytes_per_element: activation element size in bytes. Default: ``2`` (bf16).

    Returns:
        ``12 · s · b · h · bytes_per_element`` bytes.

    Example:
        >>> rule_of_thumb_bytes(seq_len=2048, batch_size=1, hidden_size=4096)
        201326592
    """
    _check("rule_of_thumb_bytes", seq_len=seq_len, batch_size=batch_size,
           hidden_size=hidden_size, bytes_per_element=bytes_per_element)
    return 12 * seq_len * batch_size * hidden_size * bytes_per_element


def korthikanti_bytes(*, seq_len: int, batch_size: int, hidden_size: int, n_heads: int,
                      bytes_per_element: int = 2) -> int:
    """Activation bytes of one GPT layer, Korthikanti et al. 2022, Eq. 1.

    ``s·b·h·(34 + 5·a·s/h)`` bytes for 16-bit activations: everything a GPT layer
    with dropout and an unfused (materialised) attention matrix saves for backward
    (see NOTE [ Where the constants come from ]). The ``5·a·s²·b`` term dominates at
    long sequences; use :func:`korthikanti_flash_bytes` for fused attention.

    Args:
        seq_len: tokens per sequence (``s``).
        batch_size: sequences per micro-batch (``b``).
        hidden_size: model width (``h``).
        n_heads: attention heads (``a``).
        bytes_per_element: activation element size. Default: ``2`` (the paper's case).

    Returns:
        ``s·b·(34·h + 5·a·s)`` bytes, scaled by ``bytes_per_element / 2``.

    Example:
        >>> korthikanti_bytes(seq_len=2048, batch_size=1, hidden_size=4096, n_heads=32)
        956301312
    """
    _check("korthikanti_bytes", seq_len=seq_len, batch_size=batch_size,
           hidden_size=hidden_size, n_heads=n_heads, bytes_per_element=bytes_per_element)
    # s·b·h·(34 + 5·a·s/h) = s·b·(34·h + 5·a·s): integer arithmetic, no rounding.
    return _scale(seq_len * batch_size * (34 * hidden_size + 5 * n_heads * seq_len),
                  bytes_per_element)


def korthikanti_flash_bytes(*, seq_len: int, batch_size: int, hidden_size: int,
                            bytes_per_element: int = 2) -> int:
    """Activation bytes of one layer with fused attention: ``34·s·b·h``.

    Korthikanti et al. 2022 Eq. 1 without the ``5·a·s²·b`` attention-matrix term,
    which FlashAttention / SDPA never store (and which the paper's selective
    recomputation drops, Section 5).

    Args:
        seq_len: tokens per sequence (``s``).
        batch_size: sequences per micro-batch (``b``).
        hidden_size: model width (``h``).
        bytes_per_element: activation element size. Default: ``2``.

    Example:
        >>> korthikanti_flash_bytes(seq_len=2048, batch_size=1, hidden_size=4096)
        285212672
    """
    _check("korthikanti_flash_bytes", seq_len=seq_len, batch_size=batch_size,
           hidden_size=hidden_size, bytes_per_element=bytes_per_element)
    return _scale(34 * seq_len * batch_size * hidden_size, bytes_per_element)


def full_checkpoint_bytes(*, seq_len: int, batch_size: int, hidden_size: int,
                          bytes_per_element: int = 2) -> int:
    """Activation bytes of one layer under full checkpointing: ``2·s·b·h``.

    Only the layer input survives the forward pass (Korthikanti et al. 2022,
    Section 5); everything else is recomputed during backward, so the memory is one
    hidden-state tensor per layer at the cost of a second forward pass.

    Args:
        seq_len: tokens per sequence (``s``).
        batch_size: sequences per micro-batch (``b``).
        hidden_size: model width (``h``).
        bytes_per_element: activation element size. Default: ``2``.

    Example:
        >>> full_checkpoint_bytes(seq_len=2048, batch_size=1, hidden_size=4096)
        16777216
    """
    _check("full_checkpoint_bytes", seq_len=seq_len, batch_size=batch_size,
           hidden_size=hidden_size, bytes_per_element=bytes_per_element)
    return seq_len * batch_size * hidden_size * bytes_per_element


#: Rows of Korthikanti et al. 2022, Table 2 (``recompute``, ``sequence_parallel``).
TABLE2_ROWS: tuple[tuple[str, bool], ...] = (
    ("none", False), ("none", True), ("selective", False), ("selective", True), ("full", False),
)


def korthikanti_table2_bytes(*, seq_len: int, batch_size: int, hidden_size: int,
                             n_heads: int, tp: int = 1, sequence_parallel: bool = False,
                             recompute: str = "none", bytes_per_element: int = 2) -> int:
    """Activation bytes of one GPT layer per tensor-parallel rank, Korthikanti et al. Table 2.

    The paper's rows (16-bit activations, 1-byte dropout masks, unfused attention):

    * no recompute, TP: ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` (t = 1: Eq. 1);
    * no recompute, TP + sequence parallel: ``s·b·h/t · (34 + 5·a·s/h)``;
    * selective recompute (attention core recomputed), TP: ``s·b·h·(10 + 24/t)``;
    * selective recompute, TP + sequence parallel: ``34·s·b·h/t``;
    * full recompute: ``2·s·b·h`` (the layer input; the paper's row has no ``t``).

    The ``10·s·b·h`` a TP rank keeps whole are the LayerNorm inputs and the dropout
    outputs and masks that tensor parallelism replicates; sequence parallelism splits
    them along the sequence. Trade-off: each row is exact only for the paper's layer
    (see NOTE [ Where the constants come from ]); ``remat simulate`` counts a real model.

    Args:
        seq_len, batch_size, hidden_size, n_heads: ``s``, ``b``, ``h``, ``a``.
        tp: tensor-parallel degree ``t`` (>= 1). Default: ``1``.
        sequence_parallel: the TP + SP rows. Default: ``False``.
        recompute: ``"none"``, ``"selective"`` or ``"full"``. Default: ``"none"``.
        bytes_per_element: scales the 16-bit count by ``bytes_per_element / 2``.
            Default: ``2``.

    Returns:
        Bytes per layer per rank, rounded down to whole bytes.

    Raises:
        ValueError: a non-positive size or an unknown ``recompute``.

    Example:
        >>> korthikanti_table2_bytes(seq_len=2048, batch_size=1, hidden_size=12288,
        ...                          n_heads=96, tp=8, recompute="selective")
        327155712
    """
    api = "korthikanti_table2_bytes"
    _check(api, seq_len=seq_len, batch_size=batch_size, hidden_size=hidden_size,
           n_heads=n_heads, tp=tp, bytes_per_element=bytes_per_element)
    if recompute not in ("none", "selective", "full"):
        raise ValueError(message(f"remat.simulate.formulas.{api}", "unknown recompute",
                                 {"found": repr(recompute)},
                                 fix="pass 'none', 'selective' or 'full'"))
    s, b, h, a, t = seq_len, batch_size, hidden_size, n_heads, tp
    sbh = s * b * h
    if recompute == "full":
        bytes_16bit = 2 * sbh  # Table 2, last row: the layer input only
    elif sequence_parallel:
        # 34·sbh/t, plus 5·a·s²·b/t without recompute
        bytes_16bit = (34 * sbh + (5 * a * s * s * b if recompute == "none" else 0)) // t
    else:
        # 10·sbh kept whole, 24·sbh/t split, 5·a·s²·b/t without recompute
        split = 24 * sbh + (5 * a * s * s * b if recompute == "none" else 0)
        bytes_16bit = 10 * sbh + split // t
    return _scale(bytes_16bit, bytes_per_element)
