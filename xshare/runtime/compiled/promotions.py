"""Which Python numbers of a state a step changes, remembered across processes.

The runtime keeps a state's Python numbers static (baked into the trace, as ``equinox.filter_jit``
does) unless the step changes them; then the trace raises ``leaves.Promote`` and the step is
traced again with them carried as arrays (as ``jax.jit`` carries them). A Flax ``TrainState``
always does this (``apply_gradients`` increments its ``step`` int), so every process paid one
wasted trace of every such step before its first program: 55 ms for the hook's 48-wide net and
100 ms for the scale benchmark's Adam MLP, a third of the time to its first step on a warm
machine. The compiler's in-process trace memo already spares the process's later jobs that.

``PROMOTIONS`` keeps what the first trace found, per step function and state shape, beside the
persistent compilation cache (``promotions.json``), so the next process traces once; a step
nothing is known of starts from ``prior`` (its Python ints: counters). A hint is only a
starting point, checked every time (``compiler.ProgramCache``): a number the step also
changes still raises ``Promote`` (and is added); a hinted number the step passes through
unchanged, or a trace that fails with the hint, sends the trace back to no hint, so the program
is always the one the hint-free path makes. No jax here beyond reading leaves.
"""

from __future__ import annotations

import hashlib
import types
from typing import Any

import jax

from .leaves import is_array, is_number
from .verdict_store import JsonTable

FILE = "promotions.json"


class Promotions:
    """step fingerprint -> the leaf indices its trace promoted (``leaves.Promote``)."""

    def __init__(self) -> None:
        self._table: JsonTable[str, frozenset] = JsonTable(FILE, _decode, _encode)

    def persist(self, directory: str | None) -> None:
        self._table.persist(directory)

    def hint(self, key: str | None, state: Any) -> frozenset:
        """What an earlier trace of the step ``key`` names (``fingerprint``) promoted, only the
        indices that are Python numbers in ``state``; ``prior`` if nothing is known of it."""
        found = self._table.get(key) if key is not None else None
        leaves = jax.tree.leaves(state)
        if found is None:
            return prior(leaves)
        return frozenset(i for i in found if i < len(leaves) and is_number(leaves[i]))

    def learn(self, key: str | None, promoted: frozenset) -> None:
        """Remember what the trace of the step ``key`` names promoted (if it differs from what
        is known)."""
        if key is not None and self._table.get(key) != promoted:
            self._table.put(key, frozenset(promoted))

    def clear(self) -> None:
        self._table.clear()


def prior(leaves: list) -> frozenset:
    """The first guess for a step nothing is known of: its state's Python ints (not bools).

    A Python int in a state is nearly always a counter the step increments (flax's
    ``TrainState.step``, a ``{"step": 0}`` dict): config numbers are static fields of a
    module (``flax.struct.field(pytree_node=False)``, ``eqx.field(static=True)``), and the
    floats and bools that are leaves (a dropout rate, ``inference=True``) are the ones Python
    branches on. Guessing right spares the first process of each such step its wasted trace (a
    TrainState step: ~50 ms of a ~0.33 s start on this project's CPU machine). Guessing wrong
    costs what not guessing costs a counter: one more trace, as any hint the step does not bear
    out (``compiler._promoting``), and the program is always the hint-free one."""
    return frozenset(i for i, x in enumerate(leaves) if type(x) is int)


def fingerprint(fn: Any, state: Any) -> str | None:
    """A step function and a state's shape, the same in every process: the function's module,
    name and code (its bytecode, names and constants, and those of the functions it closes
    over), and per leaf of the state its kind (a Python number's type, an array's shape and
    dtype, another object's type). None for a callable without code (a hint is then not kept)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    digest = hashlib.sha256()
    digest.update(f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}".encode())
    _digest_function(digest, fn, depth=2)
    for x in jax.tree.leaves(state):
        if is_number(x):
            digest.update(f"n:{type(x).__name__}".encode())
        elif is_array(x) or hasattr(x, "dtype"):
            digest.update(f"a:{tuple(getattr(x, 'shape', ()))}:{getattr(x, 'dtype', '')}".encode())
        else:
            digest.update(f"o:{type(x).__module__}.{type(x).__qualname__}".encode())
    return digest.hexdigest()


def _digest_function(digest: Any, fn: Any, depth: int) -> None:
    _digest_code(digest, fn.__code__)
    if depth <= 0:
        return
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            inner = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(inner, types.FunctionType):
            _digest_function(digest, inner, depth - 1)


def _digest_code(digest: Any, code: types.CodeType) -> None:
    digest.update(code.co_code)
    digest.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _digest_code(digest, const)
        elif isinstance(const, frozenset):  # (a set's order follows string hashing: per process)
            digest.update(repr(sorted(map(repr, const))).encode())
        else:
            digest.update(repr(const).encode())


def _decode(r: dict[str, Any]) -> tuple[str, frozenset]:
    return str(r["step"]), frozenset(int(i) for i in r["promoted"])


def _encode(key: str, promoted: frozenset) -> dict[str, Any]:
    return {"step": key, "promoted": sorted(promoted)}


PROMOTIONS = Promotions()
