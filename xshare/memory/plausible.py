"""When XLA's memory analysis is not to be trusted, and the safe bound admission uses instead.

``compiled.memory_analysis()`` is best-effort: it has reported 0 temporary bytes on GPU for
programs that plainly need temporaries (jax #18954), and a 0 admitted as "free" oversubscribes
the arena. Two checks, both pure (text and numbers in, a verdict out; no jax):

* ``temp_bound(hlo_text)``: the bytes of every intermediate buffer of the optimized program
  (each instruction of a non-fused computation that materializes an array: not a parameter,
  a constant, a tuple, a get-tuple-element or a bitcast, and not the entry's result), as if
  all were live at once. XLA's buffer assignment can only share and reuse them, so this is an
  upper bound on ``temp_size_in_bytes``. A reported 0 where this is > 0 is implausible, and
  admission charges the bound instead.
* ``above_measured(predicted, peak)``: a measured peak (``memory_stats()["peak_bytes_in_use"]``
  of a program run alone) above the prediction means the analysis under-counts; the measured
  peak is the bound.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .._units import format_bytes

# Bytes per element of XLA's primitive types (as printed in HLO text).
_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
          "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
         "partition-id", "replica-id"}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\(")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*[({]")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")


@dataclass(frozen=True)
class TempBound:
    buffers: int   # intermediate buffers found
    bytes: int     # their total size


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string (an array, or a tuple of arrays: summed)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _BYTES.get(dtype, 1 if dtype.startswith("f8") else 4)
    return total


def temp_bound(hlo_text: str) -> TempBound:
    """An upper bound on the temporaries of an optimized HLO module (``compiled.as_text()``)."""
    computations: list[tuple[str, bool, list[str]]] = []  # (name, is_entry, body lines)
    current: tuple[str, bool, list[str]] | None = None
    for line in hlo_text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and line.rstrip().endswith("{"):
                current = (m.group(2), bool(m.group(1)), [])
            continue
        if line.strip() == "}":
            computations.append(current)
            current = None
        else:
            current[2].append(line)
    fused = {name for _, _, body in computations for line in body
             if " fusion(" in line for name in _CALLS.findall(line)}
    buffers = total = 0
    for name, entry, body in computations:
        if name in fused:  # a fusion's insides never materialize
            continue
        for line in body:
            m = _INSTR.match(line)
            if not m or m.group(4) in _FREE or (entry and m.group(1)):
                continue
            size = shape_bytes(m.group(3))
            if size:
                buffers += 1
                total += size
    return TempBound(buffers, total)


def implausible_temp(temp: int, hlo_text: str | None) -> tuple[int, str] | None:
    """(bytes to charge, why) when XLA's ``temp`` cannot be right for this program; else None.
    ``hlo_text`` None (``compiled.as_text()`` where the backend has no text): nothing to check."""
    if temp > 0 or hlo_text is None:
        return None
    bound = temp_bound(hlo_text)
    if bound.bytes <= 0:
        return None  # nothing is computed apart from parameters and outputs: 0 is right
    return bound.bytes, (
        f"memory_analysis() reported 0 temporary bytes for a program with {bound.buffers} "
        f"intermediate buffers (jax #18954); admission charges their sum, "
        f"{format_bytes(bound.bytes)}, as if all were live at once (an upper bound)")


def above_measured(predicted: int, peak: int | None) -> tuple[int, str] | None:
    """(bytes to charge, why) when a measured peak exceeds the prediction; else None."""
    if peak is None or peak <= predicted:
        return None
    return peak, (f"a measured peak of {format_bytes(peak)} is above memory_analysis()'s "
                  f"{format_bytes(predicted)}; admission charges the measured peak")
