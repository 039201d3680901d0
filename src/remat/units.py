"""Parse and format byte quantities.

remat keeps every quantity in bytes internally (``budget_bytes``, ``peak_bytes``);
this module is the only place that turns user strings into bytes, and
:func:`format_bytes` the only formatter.
"""

from __future__ import annotations

import re

__all__ = ["format_bytes", "parse_bytes"]

_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
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
        ValueError: the string is not a non-negative number with a known unit.

    Example:
        >>> parse_bytes("1.5GiB")
        1610612736
    """
    if isinstance(value, bool):
        raise ValueError(f"parse_bytes: expected bytes as int or str, got bool {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"parse_bytes: bytes must be >= 0, got {value!r}")
        return int(value)
    match = _PATTERN.match(value)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"parse_bytes: cannot read {value!r} as a byte count. "
            "Use a number with an optional unit, e.g. 12GiB, 800MB, 1.5e9."
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


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
