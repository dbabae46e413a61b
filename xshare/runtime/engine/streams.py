"""Lanes on execution streams of their own: on a CPU backend, different lanes' calls run in
parallel.

PJRT's CPU client runs the executions that share an *execution stream id* one after another
and executions with different ids side by side on its thread pool; the id defaults to the
calling thread's. The dispatcher is one thread (DESIGN.md: threads and ownership), so every
call it made queued behind the one before, whatever its lane: two independent chains of K=16
calls of the zoo MLP issued alternately from one thread cost 46-47 us a step, the same as one
chain, and 31-34 us a step with a stream id each (this project's 2-core VM; `jaxlib`
0.10.2). Setting the id per call keeps one thread the only one that calls executables.

Why per lane: a lane is what the ledger lets run beside the others (its P plus one ephemeral
reservation ``E``: ``sum(P) + sum(lane E) <= arena``), and at most one step per lane is in
flight, so the calls the ids let run in parallel are the ones memory was reserved for. The
units of a lane share its stream and stay in the order they were dispatched; a deployed
model's batches run on its own lane's stream (``deployed/hub.py``), so on a CPU they do not
queue behind training calls already in flight. Data dependencies
across streams (an evaluation reading a state a step is writing, a donated buffer another
call still reads) are PJRT's to order, as for calls from different threads. A unit's results
do not depend on the stream it ran on: the same executable on the same operands.

Off a CPU nothing is set: a GPU has one compute stream per device in PJRT, and the id's
meaning there is not ours to assume. Lanes are mapped onto as many ids as the machine has
cores (more could not run at once): lane ids only grow over a long runtime's life.
"""

from __future__ import annotations

import os
from typing import Any, Callable


def _setter() -> Callable[[int], None] | None:
    try:  # (jaxlib's ``xla_client.execution_stream_id`` is a context manager around these)
        from jaxlib import xla_client

        return getattr(xla_client._xla, "set_execution_stream_id", None)
    except ImportError:  # pragma: no cover - every jaxlib this project supports has it
        return None


def _cores() -> int:
    """The cores this process may run on (a container's share, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # (not on Linux)
        return os.cpu_count() or 1


class LaneStreams:
    """``enter(lane)`` before a lane's call, on the dispatcher thread: the thread's execution
    stream becomes that lane's (on a CPU backend; a no-op elsewhere, or with ``parallel=False``)."""

    def __init__(self, device: Any, *, parallel: bool = True, streams: int | None = None):
        on = parallel and getattr(device, "platform", None) == "cpu"
        self._set = _setter() if on else None
        self.streams = max(1, streams or _cores())
        self._current: int | None = None

    @property
    def enabled(self) -> bool:
        return self._set is not None

    def stream_of(self, lane: int | None) -> int:
        """The stream id of ``lane`` (ids start at 1: 0 is "the calling thread's")."""
        return 1 + (lane or 0) % self.streams

    def enter(self, lane: int | None) -> None:
        if self._set is None:
            return
        sid = self.stream_of(lane)
        if sid != self._current:
            self._set(sid)
            self._current = sid


def parallel_streams(device: Any, parallel: bool) -> int:
    """How many execution streams run side by side for ``device`` (``LaneStreams.streams`` on a
    CPU backend with parallel lanes; 1 elsewhere): what fused groups are split over."""
    lanes = LaneStreams(device, parallel=parallel)
    return lanes.streams if lanes.enabled else 1
