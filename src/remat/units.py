"""Parse and format quantities: bytes, FLOPs, times, percentages.

remat keeps every quantity in base units internally (``budget_bytes``, ``peak_bytes``,
``recompute_flops``, ``step_ms``); this module is the only place that turns user strings
into bytes and the only place that turns quantities into display strings (tables, plots,
plan summaries all format through it).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from remat.errors import message

__all__ = [
    "format_bytes",
    "format_flops",
    "format_grad_check",
    "format_ms",
    "format_pct",
    "format_ratio",
    "markdown_table",
    "mib",
    "parse_bytes",
]

_MIB = 1024**2

_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
#: The largest byte count remat takes (what an int64 holds: PyTorch's and numpy's sizes).
MAX_BYTES = 2**63 - 1
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """Turn ``12GiB``, ``800MB``, ``1.5e9`` or an int into a byte count.

    Decimal units (kB, MB, GB, TB) are powers of 1000, binary units (KiB, MiB,
    GiB, TiB) powers of 1024; units are case-insensitive.

    Args:
        value: an int or float number of bytes, or a string with an optional unit.

    Returns:
        The number of bytes, rounded down to an int.

    Raises:
        ValueError: the string is not a non-negative number with a known unit, or the
            count is not finite or above :data:`MAX_BYTES` (8 EiB).

    Example:
        >>> parse_bytes("1.5GiB")
        1610612736
    """
    if isinstance(value, bool):
        raise ValueError(message("parse_bytes", "expected bytes as int or str, got a bool",
                                 {"found": repr(value)}, fix="pass an int or a string"))
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(message("parse_bytes", "bytes must be >= 0", {"found": repr(value)},
                                     fix="pass a byte count >= 0"))
        return _in_range(value, value)
    match = _PATTERN.match(value)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(message(
            "parse_bytes", f"cannot read {value!r} as a byte count",
            fix="use a number with an optional unit, e.g. 12GiB, 800MB, 1.5e9"))
    return _in_range(float(match.group(1)) * _UNITS[match.group(2).lower()], value)


def _in_range(count: int | float, given: int | float | str) -> int:
    """``count`` as an int, or a ValueError where it is not finite or above MAX_BYTES."""
    if count != count or count > MAX_BYTES:  # NaN, infinities, 1e30
        raise ValueError(message(
            "parse_bytes", "not a byte count remat can hold",
            {"found": repr(given), "largest": f"{MAX_BYTES} bytes (8 EiB)"},
            fix="pass a finite byte count, e.g. 80GiB"))
    return int(count)


def format_bytes(num_bytes: int | float, *, signed: bool = False) -> str:
    """Format a byte count with binary units, e.g. ``1.50 GiB``.

    Args:
        num_bytes: the count; may be negative (a change).
        signed: prefix positive values with ``+``. Default: ``False``.
    """
    sign = "-" if num_bytes < 0 else ("+" if signed and num_bytes > 0 else "")
    value = float(abs(num_bytes))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")



def mib(num_bytes: int | float) -> float:
    """Bytes as MiB (a float), for plot axes."""
    return float(num_bytes) / _MIB


def format_flops(flops: int | float) -> str:
    """Format a FLOP count with decimal prefixes, e.g. ``12.3 GFLOP``."""
    value = float(flops)
    for unit in ("FLOP", "kFLOP", "MFLOP", "GFLOP", "TFLOP"):
        if abs(value) < 1000 or unit == "TFLOP":
            return f"{value:.0f} {unit}" if unit == "FLOP" else f"{value:.2f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def format_pct(value: float | None, *, signed: bool = False) -> str:
    """Format a percentage (``12.5`` -> ``12.5%``); ``None`` -> ``n/a``."""
    if value is None:
        return "n/a"
    if signed:
        return f"{value:+.1f}%"
    return f"{value:.1f}%"


def format_ratio(value: float | None) -> str:
    """Format a ratio (``1.234`` -> ``1.23x``); ``None`` -> ``n/a``."""
    return "n/a" if value is None else f"{value:.2f}x"


def format_ms(value: float | None) -> str:
    """Format milliseconds (``12.345`` -> ``12.35 ms``); ``None`` -> ``n/a``."""
    if value is None:
        return "n/a"
    return f"{value:.3f} ms" if value < 1 else f"{value:.2f} ms"


def format_grad_check(passed: bool | None, max_rel_error: float | None) -> str:
    """``PASS (3.1e-08)`` / ``FAIL (2.0e-03)`` / ``skipped``."""
    if passed is None or max_rel_error is None:
        return "skipped"
    return f"{'PASS' if passed else 'FAIL'} ({max_rel_error:.1e})"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table; every column but the first is right-aligned."""
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    align = [":---"] + ["---:"] * (len(headers) - 1)
    return "\n".join([line(headers), "|" + "|".join(align) + "|", *(line(r) for r in rows)])
