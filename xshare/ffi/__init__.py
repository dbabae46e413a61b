"""XLA FFI fences: timestamp each job step on the device, at zero copy.

``begin(tree)`` and ``end(tree)`` are identity custom calls (``xshare_fence_begin`` /
``xshare_fence_end``, C++ in ``fences.cc``) over every array leaf of ``tree``, with
``input_output_aliases={i: i}``: with donated buffers they copy nothing. Each execution
appends ``(seq, t_ns, job, lane, kind)`` to a ring buffer that the runtime drains.

Ordering comes only from data dependencies (DESIGN.md, "XLA FFI fences"): every op of the
step consumes what ``begin`` returns, and ``end`` consumes every output, so ``begin`` runs
when all inputs are ready and ``end`` after the last op. No ``has_side_effect`` (it puts
every call on JAX's slow dispatch path); fence outputs must be used, or XLA removes them.

The library is loaded and its targets registered once, at import. It is compiled at install
time (``setup.py``); if missing or stale (sources edited since), it is compiled here on
first use, into this package directory when writable, else ``~/.cache/xshare/``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import time
from pathlib import Path

import jax
import numpy as np

from . import _build

__all__ = [
    "RECORD_DTYPE",
    "available",
    "begin",
    "close_ring",
    "drain",
    "dropped",
    "enabled",
    "end",
    "fenced",
    "now_ns",
    "open_ring",
    "set_lane",
    "unavailable_reason",
]

_log = logging.getLogger("xshare.ffi")

# One record per fence execution, oldest first (matches the packed C struct in fences.cc).
RECORD_DTYPE = np.dtype(
    [("seq", "u8"), ("t_ns", "i8"), ("job", "i4"), ("lane", "i4"), ("kind", "i4")]
)
BEGIN, END = 0, 1
_TARGETS = {BEGIN: "xshare_fence_begin", END: "xshare_fence_end"}
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


class _State:
    def __init__(self) -> None:
        self.lib: ctypes.CDLL | None = None
        self.cuda_lib: ctypes.CDLL | None = None
        self.lib_dir: Path | None = None
        self.registered: set[str] = set()  # platforms with fences: "cpu", "cuda"
        self.error: str | None = None  # why the fences are unavailable, if they are


_state = _State()


# --------------------------------------------------------------------------- loading


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "xshare" / f"ffi-{_build.source_hash()}"


def _cuda_backend() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def _locate(want_cuda: bool) -> Path:
    """A directory holding fresh libraries, building them if needed."""
    here = Path(__file__).resolve().parent
    cache = _cache_dir()

    def complete(d: Path) -> bool:
        if not _build.is_fresh(d / _build.CPU_LIB):
            return False
        return not want_cuda or _build.is_fresh(d / _build.CUDA_LIB) or not _build.find_cuda()

    for d in (here, cache):
        if complete(d):
            return d
    out = here if os.access(here, os.W_OK) else cache
    start = time.perf_counter()
    built = _build.build_library(out, cuda=None if want_cuda else False)
    _log.warning(
        "xshare.ffi: compiled the XLA FFI fences on first use into %s (%s; %.1f s). "
        "`pip install` builds them ahead of time.",
        out, ", ".join(p.name for p in built), time.perf_counter() - start,
    )
    return out


def _declare(lib: ctypes.CDLL) -> None:
    i32, i64 = ctypes.c_int32, ctypes.c_int64
    sigs = {
        "xshare_abi_version": (i32, []),
        "xshare_now_ns": (i64, []),
        "xshare_ring_open": (i32, [i64]),
        "xshare_ring_close": (i32, [i32]),
        "xshare_ring_size": (i64, [i32]),
        "xshare_ring_drain": (i64, [i32, ctypes.c_void_p, i64]),
        "xshare_ring_dropped": (i64, [i32]),
        "xshare_ring_exists": (i32, [i32]),
        "xshare_set_lane": (None, [i32, i32]),
        "xshare_get_lane": (i32, [i32]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args


def _load() -> None:
    # Create the backends before registering anything: a CPU client created lazily later
    # flushes handlers before types and fails with FAILED_PRECONDITION (DESIGN.md).
    jax.devices()
    want_cuda = _cuda_backend()
    try:
        d = _locate(want_cuda)
        lib = ctypes.CDLL(str(d / _build.CPU_LIB))
        _declare(lib)
        if lib.xshare_abi_version() != 1:
            raise RuntimeError(f"{d / _build.CPU_LIB} has C ABI version "
                               f"{lib.xshare_abi_version()}, expected 1")
    except Exception as e:  # no compiler, bad headers...: fences off, runtime goes on
        _state.error = f"{type(e).__name__}: {e}"
        _log.warning("xshare.ffi: XLA FFI fences unavailable: %s", _state.error)
        return
    _state.lib, _state.lib_dir = lib, d
    for kind, name in _TARGETS.items():
        sym = "XshareFenceBegin" if kind == BEGIN else "XshareFenceEnd"
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, sym)), platform="cpu")
    _state.registered.add("cpu")

    if want_cuda and _build.is_fresh(d / _build.CUDA_LIB):
        try:
            cuda_lib = ctypes.CDLL(str(d / _build.CUDA_LIB))
            for kind, name in _TARGETS.items():
                sym = "XshareFenceBeginCuda" if kind == BEGIN else "XshareFenceEndCuda"
                jax.ffi.register_ffi_target(
                    name, jax.ffi.pycapsule(getattr(cuda_lib, sym)), platform="CUDA"
                )
        except Exception as e:
            _log.warning("xshare.ffi: CUDA fences unavailable: %s: %s", type(e).__name__, e)
        else:
            _state.cuda_lib = cuda_lib
            _state.registered.add("cuda")


def _current_platform() -> str:
    backend = jax.default_backend()
    if backend == "gpu":
        return "cuda" if "cuda" in _state.registered and _cuda_backend() else "gpu"
    return backend


# --------------------------------------------------------------------------- public API


def available() -> bool:
    """The library is loaded and the fences are registered for the current backend."""
    return _state.lib is not None and _current_platform() in _state.registered


def enabled() -> bool:
    """``available()`` and not switched off with ``XSHARE_FFI=0``."""
    return available() and os.environ.get("XSHARE_FFI", "1") != "0"


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (None when it is True)."""
    if available():
        return None
    if _state.error:
        return _state.error
    return (f"no xshare fences for backend {jax.default_backend()!r} "
            f"(registered: {sorted(_state.registered) or 'none'})")


def _lib() -> ctypes.CDLL:
    if _state.lib is None:
        raise RuntimeError(f"xshare FFI fences are unavailable: {_state.error}")
    return _state.lib


def _int32(name: str, value, *, minimum: int = _INT32_MIN) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int (int32), got {type(value).__name__} {value!r}")
    value = int(value)
    if not minimum <= value <= _INT32_MAX:
        raise ValueError(f"{name} must be in [{minimum}, {_INT32_MAX}], got {value}")
    return value


def _unknown_ring(ring_id: int) -> ValueError:
    return ValueError(f"unknown ring_id {ring_id}: never opened with open_ring(), or closed")


def open_ring(capacity: int = 1 << 16) -> int:
    """A new ring of ``capacity`` records (28 bytes each); when full the oldest is dropped."""
    capacity = _int32("capacity", capacity, minimum=1)
    ring_id = _lib().xshare_ring_open(capacity)
    if ring_id < 0:  # pragma: no cover - capacity validated above
        raise ValueError(f"open_ring({capacity}) failed")
    return ring_id


def close_ring(ring_id: int) -> None:
    """Free a ring. Executables fenced on it fail with "unknown ring_id" from now on."""
    ring_id = _int32("ring_id", ring_id)
    if _lib().xshare_ring_close(ring_id) != 0:
        raise _unknown_ring(ring_id)


def set_lane(job_id: int, lane_id: int) -> None:
    """Lane recorded by fences of ``job_id`` compiled with ``lane_id=-1``; -1 unsets."""
    _lib().xshare_set_lane(_int32("job_id", job_id), _int32("lane_id", lane_id, minimum=-1))


def drain(ring_id: int) -> np.ndarray:
    """Move the ring's records out, oldest first, as a ``RECORD_DTYPE`` array."""
    ring_id = _int32("ring_id", ring_id)
    lib = _lib()
    n = lib.xshare_ring_size(ring_id)
    if n < 0:
        raise _unknown_ring(ring_id)
    out = np.empty(n, RECORD_DTYPE)
    if n:
        got = lib.xshare_ring_drain(ring_id, out.ctypes.data, n)
        if got < 0:  # closed between the two calls
            raise _unknown_ring(ring_id)
        out = out[:got]
    return out


def dropped(ring_id: int) -> int:
    """Records lost so far because the ring was full."""
    ring_id = _int32("ring_id", ring_id)
    n = _lib().xshare_ring_dropped(ring_id)
    if n < 0:
        raise _unknown_ring(ring_id)
    return int(n)


def now_ns() -> int:
    """The fences' clock (C++ steady_clock, i.e. CLOCK_MONOTONIC on Linux), in ns."""
    if _state.lib is not None:
        return int(_state.lib.xshare_now_ns())
    return time.monotonic_ns()


def _fence_call(kind: int, ring_id: int, job_id: int, lane_id: int, *xs):
    call = jax.ffi.ffi_call(
        _TARGETS[kind],
        [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs],
        input_output_aliases={i: i for i in range(len(xs))},  # zero-copy when donated
        vmap_method="broadcast_all",  # identity: any batching of the leaves is right
    )
    # Attributes as np.int32: Python ints would lower as int64 and fail Attr<int32_t>.
    return tuple(call(*xs, ring_id=np.int32(ring_id), job_id=np.int32(job_id),
                      lane_id=np.int32(lane_id)))


# Differentiable identity: the tangents pass through unchanged, so a fenced function can
# still be differentiated (the fence itself has no JVP rule). Free when not differentiated.
_fence_call = jax.custom_jvp(_fence_call, nondiff_argnums=(0, 1, 2, 3))


@_fence_call.defjvp
def _fence_jvp(kind, ring_id, job_id, lane_id, primals, tangents):
    return _fence_call(kind, ring_id, job_id, lane_id, *primals), tuple(tangents)


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _fence(kind: int, tree, ring_id, job_id, lane_id, select=None):
    """Fence the jax.Array leaves of ``tree`` (those with ``select[i]`` true, if given)."""
    ring_id = _int32("ring_id", ring_id)
    job_id = _int32("job_id", job_id)
    lane_id = _int32("lane_id", lane_id, minimum=-1)
    lib = _lib()
    if not lib.xshare_ring_exists(ring_id):
        raise _unknown_ring(ring_id)
    leaves, treedef = jax.tree.flatten(tree)
    # Each value is fenced once even if it appears twice (two aliased results of one
    # buffer would force XLA to copy). Python scalars and numpy arrays are constants
    # inside jit, with nothing to order: they pass through.
    slots: dict[int, int] = {}
    operands, keys = [], {}
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
    outs = list(_fence_call(kind, ring_id, job_id, lane_id, *operands))
    for i, impl in keys.items():
        outs[i] = jax.random.wrap_key_data(outs[i], impl=impl)
    new = [outs[slots[id(x)]] if id(x) in slots else x for x in leaves]
    return jax.tree.unflatten(treedef, new)


def _fenceable(leaf) -> bool:
    return isinstance(leaf, jax.Array) and leaf.dtype != jax.dtypes.float0


def _end_after_call(ring_id: int, job_id: int, lane_id: int, keep, deps):
    """The end fence over ``keep`` (returned, aliased) after ``deps`` (read by nothing)."""
    call = jax.ffi.ffi_call(
        _TARGETS[END],
        [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in keep],
        input_output_aliases={i: i for i in range(len(keep))},
        vmap_method="broadcast_all",
    )
    return tuple(call(*keep, *deps, ring_id=np.int32(ring_id), job_id=np.int32(job_id),
                      lane_id=np.int32(lane_id)))


def end_after(tree, *, ring_id: int, job_id: int, lane_id: int = -1, keep_from: int = 0):
    """Record an end after every array leaf of ``tree`` is computed, passing only the
    smallest leaf through the fence (the rest are its dependencies, read by nothing).

    ``end`` over every output would be written in place over each of them, and XLA then
    copies a step's new state out of its donated buffers (measured on the MLP step: 16
    copies and twice the temp memory). Here nothing but a few bytes is aliased, so the
    fenced step has the copies and temp memory of the unfenced one. Use what it returns.
    ``keep_from``: pass through the smallest leaf among leaves ``keep_from..`` (e.g. the
    metrics after the state: a state leaf aliased to a donated input would cost a copy).
    """
    ring_id, job_id = _int32("ring_id", ring_id), _int32("job_id", job_id)
    lane_id = _int32("lane_id", lane_id, minimum=-1)
    if not _lib().xshare_ring_exists(ring_id):
        raise _unknown_ring(ring_id)
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [i for i, x in enumerate(leaves) if _fenceable(x) and not _is_key(x)]
    if not arrays:
        return tree
    candidates = [i for i in arrays if i >= keep_from] or arrays
    keep = min(candidates, key=lambda i: _nbytes(leaves[i]))
    deps = [leaves[i] for i in arrays if i != keep and leaves[i] is not leaves[keep]]
    out, = _end_after_call(ring_id, job_id, lane_id, [leaves[keep]], deps)
    leaves[keep] = out
    return jax.tree.unflatten(treedef, leaves)


def begin(tree, *, ring_id: int, job_id: int, lane_id: int = -1):
    """Identity over every array leaf of ``tree`` (one custom call), recording a begin.

    Use what it returns: the step's ops must consume the fenced values to be ordered
    after it. ``lane_id=-1`` records the lane set with ``set_lane(job_id, lane)``.
    Zero-copy only for leaves that are donated *and* that jax aliases to an output; any
    other leaf costs XLA one copy (see ``fenced``, which avoids that).
    """
    return _fence(BEGIN, tree, ring_id, job_id, lane_id)


def end(tree, *, ring_id: int, job_id: int, lane_id: int = -1):
    """Identity over every array leaf of ``tree`` (one custom call), recording an end."""
    return _fence(END, tree, ring_id, job_id, lane_id)


def _copy_free_inputs(inputs, outputs, donated: bool) -> list[bool] | None:
    """Which input leaves ``begin`` can alias without XLA inserting a copy.

    XLA may write a custom call's aliased result in place only over a parameter that jax
    passed as donated, and jax 0.10 keeps a donation only when an output has the same
    shape and dtype (matched greedily in order, ``mlir._set_up_aliases``); any other
    donation is dropped ("Some donated buffers were not usable"). A typical batch has no
    such output, so fencing it would cost a full copy of the batch every step.
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


def _nbytes(x) -> int:
    try:
        return int(x.size) * int(x.dtype.itemsize)
    except (AttributeError, TypeError):  # typed PRNG keys have no plain itemsize
        return int(x.size) * 8


def fenced(fn, *, ring_id: int, job_id: int, lane_id: int = -1, donated: bool = True,
           all_inputs: bool = False):
    """Wrap ``fn(state, batch) -> (new_state, metrics)`` between two fences: ``begin``
    over its inputs and ``end`` after all its outputs (``end_after``), one custom call each.

    Jit the result with ``donate_argnums=(0, 1)``. ``begin`` then covers every input that
    jax can alias to an output (the whole state, in practice) at zero copy; inputs jax
    cannot alias (usually the batch: no output has its shape) pass around it, since
    fencing them would add a copy of each per step. So every op that touches the state
    runs after ``begin``; an op that reads only the batch may start before it.
    ``all_inputs=True`` fences every input anyway (those copies included);
    ``donated=False`` (inputs not donated) fences only the smallest input.
    """
    check = dict(ring_id=_int32("ring_id", ring_id), job_id=_int32("job_id", job_id),
                 lane_id=_int32("lane_id", lane_id, minimum=-1))

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        inputs = (args, kwargs)
        select = None
        if not all_inputs:
            # An abstract trace of fn (shapes only) to learn which inputs jax will alias.
            select = _copy_free_inputs(inputs, jax.eval_shape(fn, *args, **kwargs), donated)
        args, kwargs = _fence(BEGIN, inputs, **check, select=select)
        out = fn(*args, **kwargs)
        # (new_state, metrics): pass a metrics leaf through the end fence, not a state leaf.
        keep_from = (len(jax.tree.leaves(out[0]))
                     if isinstance(out, tuple) and len(out) == 2 else 0)
        return end_after(out, **check, keep_from=keep_from)

    return wrapper


_load()
