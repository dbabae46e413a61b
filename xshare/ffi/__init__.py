"""XLA FFI fences: timestamp each job step on the device, at zero copy.

``begin(tree)`` and ``end(tree)`` are identity custom calls (``xshare_fence_begin`` /
``xshare_fence_end``, C++ in ``fences.cc``) over every array leaf of ``tree``, with
``input_output_aliases={i: i}``: with donated buffers they copy nothing. Each execution
appends ``(seq, t_ns, job, lane, kind)`` to a ring buffer that the runtime drains.

Identity is data: the last operand of each fence is ``ident``, an int32[3]
``[ring_id, job_id, lane_id]`` (``ident()`` builds it). No attribute names the job, so the
program of ``fenced(fn)`` is the same for every job and N jobs share one compile.

Ordering comes only from data dependencies (docs/explanation/ffi-fences.md): every op of the
step consumes what ``begin`` returns, and ``end`` consumes every output, so ``begin`` runs
when all inputs are ready and ``end`` after the last op. No ``has_side_effect`` (it puts
every call on JAX's slow dispatch path); fence outputs must be used, or XLA removes them.

Importing this module starts nothing: ``ensure_loaded()`` (the first ``Runtime`` calls it,
and so does every function here that needs the library) finds or builds the library for the
running jaxlib, loads it and registers the fences; a failure leaves them off with one
warning (``_loader``).
"""

from __future__ import annotations

from ._fences import begin, end, end_after, fenced
from ._loader import BEGIN, END, available, enabled, ensure_loaded, unavailable_reason
from ._loader import state as _state  # noqa: F401 - the loader's state, read as ffi._state by tests
from ._rings import (
    RECORD_DTYPE,
    close_ring,
    drain,
    dropped,
    ident,
    now_ns,
    open_ring,
    poll,
    set_lane,
)

__all__ = [
    "BEGIN",
    "END",
    "RECORD_DTYPE",
    "available",
    "begin",
    "close_ring",
    "drain",
    "dropped",
    "enabled",
    "end",
    "end_after",
    "ensure_loaded",
    "fenced",
    "ident",
    "now_ns",
    "open_ring",
    "poll",
    "set_lane",
    "unavailable_reason",
]
