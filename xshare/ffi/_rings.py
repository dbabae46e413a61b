"""Rings of fence records, the lane table, the fences' clock and ``ident`` (through ctypes)."""

from __future__ import annotations

import time

import numpy as np

from . import _loader
from ._loader import state

# One record per fence execution, oldest first (matches the packed C struct in fences.cc).
RECORD_DTYPE = np.dtype(
    [("seq", "u8"), ("t_ns", "i8"), ("job", "i4"), ("lane", "i4"), ("kind", "i4")]
)
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def int32(name: str, value, *, minimum: int = _INT32_MIN) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int (int32), got {type(value).__name__} {value!r}")
    value = int(value)
    if not minimum <= value <= _INT32_MAX:
        raise ValueError(f"{name} must be in [{minimum}, {_INT32_MAX}], got {value}")
    return value


def unknown_ring(ring_id: int) -> ValueError:
    return ValueError(f"unknown ring_id {ring_id}: never opened with open_ring(), or closed")


# A runtime's ring (two records a step, 28 bytes each: 7 MiB) holds what comes between two
# drains by its recorder's tick (every 0.2 s, later when the GIL is busy). A sweep of 32 x
# 2,000 trivial steps runs 90-105k steps a second end to end on this project's 2-core CPU: at
# 1 << 16 the ring dropped 2-16k of its 128k records and the timeline lost those steps
# (benchmarks/scale.py's trivial runs); at 1 << 18 none, 6 runs of 6.
CAPACITY = 1 << 18


def open_ring(capacity: int = CAPACITY) -> int:
    """A new ring of ``capacity`` records (28 bytes each); when full the oldest is dropped."""
    capacity = int32("capacity", capacity, minimum=1)
    ring_id = _loader.lib().xshare_ring_open(capacity)
    if ring_id < 0:  # pragma: no cover - capacity validated above
        raise ValueError(f"open_ring({capacity}) failed")
    return ring_id


def close_ring(ring_id: int) -> None:
    """Free a ring. Executables fenced on it fail with "unknown ring_id" from now on (on
    CUDA, where the ident is read back after the step, their records are lost instead)."""
    ring_id = int32("ring_id", ring_id)
    if _loader.lib().xshare_ring_close(ring_id) != 0:
        raise unknown_ring(ring_id)


def ident(ring_id: int, job_id: int, lane_id: int = -1) -> np.ndarray:
    """The identity operand of the fences: ``int32[3]`` ``[ring_id, job_id, lane_id]``.

    Keep it on the device beside the job's state (one per job) and pass it to the wrapper
    of ``fenced(fn)`` at every call, undonated: the compiled program does not depend on it,
    so jobs with the same step share one executable. ``lane_id=-1``: the lane set with
    ``set_lane(job_id, lane)``, looked up when the fence runs.
    """
    ring_id = int32("ring_id", ring_id)
    job_id = int32("job_id", job_id)
    lane_id = int32("lane_id", lane_id, minimum=-1)
    if not _loader.lib().xshare_ring_exists(ring_id):
        raise unknown_ring(ring_id)
    return np.array([ring_id, job_id, lane_id], np.int32)


def set_lane(job_id: int, lane_id: int) -> None:
    """Lane recorded by fences of ``job_id`` whose ident has ``lane_id=-1``; -1 unsets."""
    _loader.lib().xshare_set_lane(int32("job_id", job_id),
                                  int32("lane_id", lane_id, minimum=-1))


def poll() -> int:
    """Read back completed CUDA fence events into their rings (no-op without CUDA fences);
    returns how many fences completed. ``drain`` calls it; it never waits on the device."""
    return int(state.cuda_lib.xshare_cuda_poll()) if state.cuda_lib is not None else 0


def drain(ring_id: int) -> np.ndarray:
    """Move the ring's records out, oldest first, as a ``RECORD_DTYPE`` array.

    On CUDA a fence's record reaches the ring once the device has passed the fence and this
    (or ``poll``) has read its event back; records of steps still running come later.
    """
    ring_id = int32("ring_id", ring_id)
    lib = _loader.lib()
    poll()
    n = lib.xshare_ring_size(ring_id)
    if n < 0:
        raise unknown_ring(ring_id)
    out = np.empty(n, RECORD_DTYPE)
    if n:
        got = lib.xshare_ring_drain(ring_id, out.ctypes.data, n)
        if got < 0:  # closed between the two calls
            raise unknown_ring(ring_id)
        out = out[:got]
    return out


def dropped(ring_id: int) -> int:
    """Records lost so far because the ring was full."""
    ring_id = int32("ring_id", ring_id)
    n = _loader.lib().xshare_ring_dropped(ring_id)
    if n < 0:
        raise unknown_ring(ring_id)
    return int(n)


def now_ns() -> int:
    """The fences' clock (C++ steady_clock, i.e. CLOCK_MONOTONIC on Linux), in ns.

    Does not load the library: before it is loaded this is ``time.monotonic_ns()``, the
    same clock."""
    if state.lib is not None:
        return int(state.lib.xshare_now_ns())
    return time.monotonic_ns()
