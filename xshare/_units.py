"""Byte quantities as users write them ("4GiB", "512MB", 1 << 30) and as we print them."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """``"4GiB"`` -> 4294967296. Raises ``ValueError`` naming the value and the accepted forms."""
    if isinstance(value, bool):
        raise ValueError(f"memory size {value!r} is a bool; give bytes (int) or a string like '4GiB'")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"memory size {value!r} must be positive")
        return int(value)
    match = _PATTERN.match(str(value))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(
            f"cannot read memory size {value!r}: use bytes (1073741824) or a number with a unit "
            "such as '512MiB', '2GiB', '1.5GB' (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"memory size {value!r} must be positive")
    return size


def format_bytes(n: int | float | None) -> str:
    """Human-readable binary units; ``None`` (unknown) prints as N/A."""
    if n is None:
        return "N/A"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
