"""Cell formatters shared by the rich tables, the markdown tables and the plots.

remat keeps every quantity in base units (bytes, FLOPs, milliseconds, percent);
this module is where they become display strings. Byte counts go through
:func:`remat.units.format_bytes`, the one byte formatter.
"""

from __future__ import annotations

from remat.units import format_bytes

__all__ = [
    "format_bytes",
    "format_flops",
    "format_grad_check",
    "format_ms",
    "format_pct",
    "format_ratio",
    "mib",
]

_MIB = 1024**2


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
