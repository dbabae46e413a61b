"""The fence custom calls inside jit: ``begin``, ``end``, ``end_after`` and ``fenced``."""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from ._loader import BEGIN, END, TARGETS
from ._rings import ident as make_ident


def _call(kind: int, n_out: int, *operands):
    """``operands``: ``n_out`` passed-through buffers, then dependencies, then the ident."""
    call = jax.ffi.ffi_call(
        TARGETS[kind],
        [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in operands[:n_out]],
        input_output_aliases={i: i for i in range(n_out)},  # zero-copy when donated
        # Identity: any batching of the leaves is right. An ident that vmap broadcasts
        # arrives as identical rows, recorded once; a batched ident, one record per row.
        vmap_method="broadcast_all",
    )
    return tuple(call(*operands))


# Differentiable identity: the tangents pass through unchanged, so a fenced function can
# still be differentiated (the fence itself has no JVP rule). Free when not differentiated.
_call = jax.custom_jvp(_call, nondiff_argnums=(0, 1))


@_call.defjvp
def _call_jvp(kind, n_out, primals, tangents):
    return _call(kind, n_out, *primals), tuple(tangents[:n_out])


def _ident_operand(ident, ring_id, job_id, lane_id):
    """The ident operand: given as data, or a constant built from the keyword form."""
    if ident is None:
        if ring_id is None or job_id is None:
            raise TypeError("pass the fence identity: ident=<int32[3] array from "
                            "xshare.ffi.ident()>, or ring_id=... and job_id=...")
        return make_ident(ring_id, job_id, lane_id)  # validated: int32 ranges, ring open
    if ring_id is not None or job_id is not None:
        raise TypeError("pass either ident=... or ring_id=/job_id=, not both")
    shape, dtype = np.shape(ident), getattr(ident, "dtype", None)
    if dtype != np.int32 or not shape or shape[-1] != 3:
        raise TypeError("ident must be an int32[3] array [ring_id, job_id, lane_id] "
                        f"(build it with xshare.ffi.ident()), got {dtype}{list(shape)}")
    return ident


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _fenceable(leaf) -> bool:
    return isinstance(leaf, jax.Array) and leaf.dtype != jax.dtypes.float0


def _nbytes(x) -> int:
    try:
        return int(x.size) * int(x.dtype.itemsize)
    except (AttributeError, TypeError):  # typed PRNG keys have no plain itemsize
        return int(x.size) * 8


def _fence(kind: int, tree, ident, select=None):
    """Fence the jax.Array leaves of ``tree`` (those with ``select[i]`` true, if given)."""
    leaves, treedef = jax.tree.flatten(tree)
    # Each value is fenced once even if it appears twice (two aliased results of one
    # buffer would force XLA to copy). Python scalars and numpy arrays are constants
    # inside jit, with nothing to order: they pass through.
    slots: dict[int, int] = {}
    operands: list[Any] = []
    keys: dict[int, Any] = {}  # operand index -> the PRNG key's impl
    for i, leaf in enumerate(leaves):
        if not _fenceable(leaf) or id(leaf) in slots or (select is not None and not select[i]):
            continue
        if _is_key(leaf):  # typed PRNG keys: fence the raw key data
            keys[len(operands)] = jax.random.key_impl(leaf)
            leaf_operand = jax.random.key_data(leaf)
        else:
            leaf_operand = leaf
        slots[id(leaf)] = len(operands)
        operands.append(leaf_operand)
    if not operands:
        return tree
    outs = list(_call(kind, len(operands), *operands, ident))
    for i, impl in keys.items():
        outs[i] = jax.random.wrap_key_data(outs[i], impl=impl)
    new = [outs[slots[id(x)]] if id(x) in slots else x for x in leaves]
    return jax.tree.unflatten(treedef, new)


def _end_after(tree, ident, keep_from: int = 0):
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [i for i, x in enumerate(leaves) if _fenceable(x) and not _is_key(x)]
    if not arrays:
        return tree
    candidates = [i for i in arrays if i >= keep_from] or arrays
    keep = min(candidates, key=lambda i: _nbytes(leaves[i]))
    deps = [leaves[i] for i in arrays if i != keep and leaves[i] is not leaves[keep]]
    leaves[keep], = _call(END, 1, leaves[keep], *deps, ident)
    return jax.tree.unflatten(treedef, leaves)


def begin(tree, *, ident=None, ring_id: int | None = None, job_id: int | None = None,
          lane_id: int = -1):
    """Identity over every array leaf of ``tree`` (one custom call), recording a begin.

    Identity: ``ident=`` (an int32[3] array from ``ident()``, data: the program does not
    depend on it) or ``ring_id=, job_id=, lane_id=`` (baked in as a constant). Use what it
    returns: the step's ops must consume the fenced values to be ordered after it.
    ``lane_id=-1`` records the lane set with ``set_lane(job_id, lane)``. Zero-copy only for
    leaves that are donated *and* that jax aliases to an output; any other leaf costs XLA
    one copy (see ``fenced``, which avoids that).
    """
    return _fence(BEGIN, tree, _ident_operand(ident, ring_id, job_id, lane_id))


def end(tree, *, ident=None, ring_id: int | None = None, job_id: int | None = None,
        lane_id: int = -1):
    """Identity over every array leaf of ``tree`` (one custom call), recording an end."""
    return _fence(END, tree, _ident_operand(ident, ring_id, job_id, lane_id))


def end_after(tree, *, ident=None, ring_id: int | None = None, job_id: int | None = None,
              lane_id: int = -1, keep_from: int = 0):
    """Record an end after every array leaf of ``tree`` is computed, passing only the
    smallest leaf through the fence (the rest are its dependencies, read by nothing).

    ``end`` over every output would be written in place over each of them, and XLA then
    copies a step's new state out of its donated buffers (measured on the MLP step: 16
    copies and twice the temp memory). Here nothing but a few bytes is aliased, so the
    fenced step has the copies and temp memory of the unfenced one. Use what it returns.
    ``keep_from``: pass through the smallest leaf among leaves ``keep_from..`` (e.g. the
    metrics after the state: a state leaf aliased to a donated input would cost a copy).
    """
    return _end_after(tree, _ident_operand(ident, ring_id, job_id, lane_id), keep_from)


def _copy_free_inputs(inputs, outputs, donated: bool) -> list[bool]:
    """Which input leaves ``begin`` can alias without XLA inserting a copy.

    XLA may write a custom call's aliased result in place only over a parameter that jax
    passed as donated, and jax keeps a donation only when an output has the same shape and
    dtype (matched greedily in order, ``mlir._set_up_aliases``); any other donation is
    dropped ("Some donated buffers were not usable"). A typical batch has no such output,
    so fencing it would cost a full copy of the batch every step.
    """
    leaves = jax.tree.leaves(inputs)
    arrays = [i for i, x in enumerate(leaves) if _fenceable(x)]
    select = [False] * len(leaves)
    if donated:
        free: dict = {}
        for o in jax.tree.leaves(outputs):
            key = (tuple(o.shape), o.dtype)
            free[key] = free.get(key, 0) + 1
        for i in arrays:
            key = (tuple(leaves[i].shape), leaves[i].dtype)
            if free.get(key, 0) > 0:
                free[key] -= 1
                select[i] = True
    if arrays and not any(select):
        # Nothing aliasable (not donated): fence the smallest leaf, a copy of a few bytes,
        # so the step still has a begin timestamp.
        select[min(arrays, key=lambda i: _nbytes(leaves[i]))] = True
    return select


def _fenced_body(fn, ident, args, kwargs, donated: bool, all_inputs: bool, outputs=None):
    inputs = (args, kwargs)
    select = None
    if not all_inputs:
        # Which inputs jax will alias: from the outputs' shapes, given or from an abstract
        # trace of fn (shapes only; as long as tracing fn again: ~20 ms for a small Flax step).
        if outputs is None:
            outputs = jax.eval_shape(fn, *args, **kwargs)
        select = _copy_free_inputs(inputs, outputs, donated)
    args, kwargs = _fence(BEGIN, inputs, ident, select=select)
    out = fn(*args, **kwargs)
    # (new_state, metrics): pass a metrics leaf through the end fence, not a state leaf.
    keep_from = len(jax.tree.leaves(out[0])) if isinstance(out, tuple) and len(out) == 2 else 0
    return _end_after(out, ident, keep_from)


def fenced(fn, *, ring_id: int | None = None, job_id: int | None = None, lane_id: int = -1,
           donated: bool = True, all_inputs: bool = False, outputs=None):
    """Wrap ``fn(state, batch) -> (new_state, metrics)`` between two fences: ``begin``
    over its inputs and ``end`` after all its outputs (``end_after``), one custom call each.

    Identity as data (what the runtime uses): ``fenced(fn)`` returns
    ``wrapper(state, batch, ident)``, ``ident`` an int32[3] array from ``ident()`` kept on
    the device. The compiled program does not depend on it: one executable serves every
    job with the same step, each passing its own ident.
    Keyword form (standalone use): ``fenced(fn, ring_id=..., job_id=..., lane_id=-1)``
    returns ``wrapper(*args, **kwargs)`` with the identity baked in as a constant.

    Jit the result with ``donate_argnums=(0, 1)`` (never donate the ident). ``begin`` then
    covers every input that jax can alias to an output (the whole state, in practice) at
    zero copy; inputs jax cannot alias (usually the batch: no output has its shape) pass
    around it, since fencing them would add a copy of each per step. So every op that
    touches the state runs after ``begin``; an op that reads only the batch may start
    before it. ``all_inputs=True`` fences every input anyway (those copies included);
    ``donated=False`` (inputs not donated) fences only the smallest input. ``outputs``: what
    ``fn`` returns, as anything with leaves that have ``shape`` and ``dtype`` (a jaxpr's
    ``out_avals``), if the caller knows it: spares an abstract trace of ``fn``.
    """
    if ring_id is None and job_id is None:
        @functools.wraps(fn)
        def wrapper(state, batch, ident):
            ident = _ident_operand(ident, None, None, -1)
            return _fenced_body(fn, ident, (state, batch), {}, donated, all_inputs, outputs)

        return wrapper

    const = _ident_operand(None, ring_id, job_id, lane_id)

    @functools.wraps(fn)
    def keyword_wrapper(*args, **kwargs):
        return _fenced_body(fn, const, args, kwargs, donated, all_inputs, outputs)

    return keyword_wrapper
