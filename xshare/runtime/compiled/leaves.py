"""A job's pytrees as the flat list of plain arrays the runtime carries, and back.

Whatever ``jax.jit`` accepts as state is a job's state, but the runtime's machinery (placement,
donation, stacking into fused groups, swap to host, checkpoints, the byte ledger) is written
for plain numeric arrays. So at the runtime's edge a pytree is *split* by a :class:`Layout`:

* a plain array (any numeric dtype: ints, bools, bf16, zero-size) travels as itself;
* a typed PRNG key array (``jax.random.key``, any impl) travels as its key data (``uint32``)
  and is wrapped again with its impl inside the traced step, so fused groups ``vmap`` over
  key data, checkpoints hold it, and resume is exact (the impl is part of the layout);
* any other leaf (a function, a Python number, a string, an object) is *static*, as under
  ``equinox.filter_jit``: it is baked into the trace, never placed on the device.

The layout is a job's own: two jobs whose states differ only in static objects (a
``TrainState``'s ``apply_fn`` and ``tx``) may share one program (it is keyed by what XLA
computes, see ``compiler``), and each unflattens its own leaves with its own layout.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ..._errors import XShareError

_KEY = "key"
_STATIC = "static"


def is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def is_array(x: Any) -> bool:
    """An array the runtime carries (jax arrays, tracers, numpy arrays and scalars); anything
    else is static, as ``equinox.is_array`` decides."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


@dataclass(frozen=True, eq=False)
class Layout:
    """How one pytree maps to flat plain arrays: its treedef, and for each leaf ``None``
    (an array), ``("key", impl)`` or ``("static", value)``; ``paths`` name the leaves."""

    treedef: Any
    kinds: tuple
    paths: tuple[str, ...]

    @functools.cached_property
    def plain(self) -> bool:
        """Every leaf is a plain array: split/merge are a flatten/unflatten. (Asked of every
        batch a job makes: worked out once per layout.)"""
        return all(k is None for k in self.kinds)

    @property
    def n_arrays(self) -> int:
        return sum(1 for k in self.kinds if k is None or k[0] == _KEY)

    def carried(self) -> list[int]:
        """The leaf indices of the carried arrays, in order."""
        return [i for i, k in enumerate(self.kinds) if k is None or k[0] == _KEY]

    def array_paths(self) -> list[str]:
        return [p for p, k in zip(self.paths, self.kinds) if k is None or k[0] == _KEY]

    def keys_of(self) -> tuple:
        """The key impls of the carried arrays, in order (None for plain arrays)."""
        return tuple(k[1] if k is not None else None for k in self.kinds if k is None or k[0] == _KEY)

    def memo_key(self) -> Any:
        """Hashable: the treedef and every static value (by value where hashable, else by
        identity). Two trees with equal memo keys trace to the same program."""
        statics: list[tuple[Any, ...]] = []
        for k in self.kinds:
            if k is not None and k[0] == _STATIC:
                v = k[1]
                try:
                    hash(v)
                    statics.append(("v", type(v), v))
                except TypeError:
                    statics.append(("id", id(v)))
            else:
                statics.append(k)
        try:
            hash(self.treedef)
            return (self.treedef, tuple(statics))
        except TypeError:
            return ("unhashable", id(self))

    def split(self, tree: Any) -> list:
        """``tree`` (of this layout's structure) as its carried arrays."""
        if self.plain:
            return jax.tree.leaves(tree)
        leaves = self.treedef.flatten_up_to(tree)
        return [jax.random.key_data(x) if k is not None else x
                for x, k in zip(leaves, self.kinds) if k is None or k[0] == _KEY]

    def merge(self, arrays: Any) -> Any:
        """The pytree from its carried arrays (numpy, jax arrays or tracers)."""
        if self.plain:
            return jax.tree.unflatten(self.treedef, list(arrays))
        it = iter(arrays)
        leaves = []
        for kind in self.kinds:
            if kind is None:
                leaves.append(next(it))
            elif kind[0] == _KEY:
                leaves.append(jax.random.wrap_key_data(next(it), impl=kind[1]))
            else:
                leaves.append(kind[1])
        return jax.tree.unflatten(self.treedef, leaves)

    def difference(self, other: "Layout", what: str = "state") -> str | None:
        """Why ``other`` is not this layout (None if it is), naming the first leaf that differs."""
        if self.treedef != other.treedef:
            return f"the {what}'s structure changed: {other.treedef} instead of {self.treedef}"
        for path, a, b in zip(self.paths, self.kinds, other.kinds):
            if a == b:
                continue
            if a is not None and b is not None and a[0] == b[0] == _STATIC:
                try:
                    if a[1] is b[1] or a[1] == b[1]:
                        continue
                except Exception:  # noqa: BLE001 - an object whose == raises is not equal
                    pass
            return f"{what} leaf {path!r} changed from {_describe(a)} to {_describe(b)}"
        return None


def _describe(kind: Any) -> str:
    if kind is None:
        return "an array"
    if kind[0] == _KEY:
        return f"a PRNG key array ({kind[1]})"
    return f"the static value {kind[1]!r}"


def layout_of(tree: Any, promote: frozenset = frozenset()) -> tuple[list, Layout]:
    """(the carried arrays of ``tree``, its layout). Leaves at the indices in ``promote`` that
    are Python numbers are carried as arrays of JAX's default dtype for them, as ``jax.jit``
    would trace them: a step that changes a Python number (``TrainState.step = 0``) needs it."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    arrays: list[Any] = []
    kinds: list[tuple[str, Any] | None] = []
    paths: list[str] = []
    for i, (path, x) in enumerate(with_paths):
        paths.append(path_name(path))
        if is_key(x):
            kinds.append((_KEY, str(jax.random.key_impl(x))))
            arrays.append(jax.random.key_data(x))
        elif is_array(x):
            kinds.append(None)
            arrays.append(x)
        elif i in promote and is_number(x):
            kinds.append(None)
            arrays.append(as_array(x))
        else:
            kinds.append((_STATIC, x))
    return arrays, Layout(treedef, tuple(kinds), tuple(paths))


def promoted(tree: Any, indices: frozenset) -> Any:
    """``tree`` with the Python numbers at leaf ``indices`` made arrays (see ``layout_of``)."""
    if not indices:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [as_array(x) if i in indices and is_number(x) else x
                                        for i, x in enumerate(leaves)])


def is_number(x: Any) -> bool:
    return isinstance(x, (bool, int, float, complex))


def as_array(x: Any) -> np.ndarray:
    """A Python number as the array ``jax.jit`` would make of it (int32/float32 unless x64)."""
    value = np.asarray(x)
    return np.asarray(x, dtype=jax.dtypes.canonicalize_dtype(value.dtype))


class Promote(XShareError):
    """The step changed Python numbers of its state (static until now): carry them as arrays."""

    def __init__(self, indices: frozenset):
        super().__init__(f"promote leaves {sorted(indices)}")
        self.indices = indices


def changed_numbers(before: Layout, after: Layout) -> frozenset:
    """Indices of static Python-number leaves of ``before`` that ``after`` turned into an array
    or another number: under ``jax.jit`` they would have been traced, so they are carried."""
    if before.treedef != after.treedef:
        return frozenset()
    out = set()
    for i, (a, b) in enumerate(zip(before.kinds, after.kinds)):
        if a is not None and a[0] == _STATIC and is_number(a[1]):
            if b is None or (b[0] == _STATIC and (type(b[1]) is not type(a[1]) or b[1] != a[1])):
                out.add(i)
    return frozenset(out)


def path_name(path: Any) -> str:
    """``opt_state.mu.w1`` / ``params['Dense_0']['kernel']`` as a dotted name a user reads."""
    parts = []
    for p in path:
        for attr in ("key", "name", "idx"):
            if hasattr(p, attr):
                parts.append(str(getattr(p, attr)))
                break
        else:
            parts.append(str(p))
    return ".".join(parts) or "<root>"


def describe_aval(x: Any) -> str:
    return f"{np.dtype(x.dtype).name}{list(x.shape)}"


def nbytes(arrays: Any) -> int:
    return int(sum(np.dtype(x.dtype).itemsize * math.prod(x.shape) for x in jax.tree.leaves(arrays)))
