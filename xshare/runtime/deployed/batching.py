"""A deployed model's requests as its batcher sees them (Triton's dynamic batcher, named as
Triton names it): :class:`Request`, where one goes in the queue (its priority level), whether
the oldest requests make a preferred batch size, which requests waited past their timeout, and
the counters of Triton's statistics extension (:class:`InferStats`). Plain data and pure
functions over a queue: the model (:mod:`.models`) holds the lock and the effects.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class InferFuture(Future):
    """A request's future; ``model_version``, set when it is queued (``ModelHandle.submit``): the
    version that answers (a default handle's may change)."""
    model_version: int


@dataclass
class Request:
    inputs: dict[str, np.ndarray]
    rows: int
    t_arrival: float
    future: InferFuture = field(default_factory=InferFuture)
    level: int = 0                # priority level: 1 goes first (Triton's); 0 when the model has none
    deadline: float | None = None  # monotonic seconds: past it, waiting, the request fails alone
    timeout_us: int | None = None
    t_start: float = 0.0   # its batch began (taken from the queue): the end of its queue time
    t_ready: float = 0.0   # its batch stacked and padded: compute_input ends, compute_infer begins


def insert_at(queue: deque[Request], level: int) -> int | None:
    """Where a request of ``level`` goes: after every request of its level or a higher one (a
    smaller number), before the first of a lower one; ``None`` = at the end (the O(1) case
    whenever no lower-level request waits, which is always so without priority levels)."""
    if not queue or queue[-1].level <= level:
        return None
    return next(i for i, r in enumerate(queue) if r.level > level)


def preferred_rows(queue: deque[Request], preferred: tuple[int, ...]) -> int:
    """The largest preferred batch size the oldest waiting requests add up to exactly (0: none).
    Triton's dynamic batcher runs such a batch at once instead of waiting out its delay."""
    if not preferred:
        return 0
    best, rows, top = 0, 0, preferred[-1]
    for r in list(queue):  # a copy: other threads append while the dispatcher looks
        rows += r.rows
        if rows > top:
            break
        if rows in preferred:
            best = rows
    return best


def oldest_arrival(queue: deque[Request], levels: bool) -> float | None:
    """When the oldest waiting request arrived: the queue's head, unless priority levels put a
    younger request in front (then the earliest of all)."""
    try:
        return min(r.t_arrival for r in list(queue)) if levels else queue[0].t_arrival
    except (IndexError, ValueError):  # emptied in between
        return None


def next_deadline(queue: deque[Request]) -> float | None:
    return min((r.deadline for r in list(queue) if r.deadline is not None), default=None)


DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


class InferStats:
    """Triton's statistics of one model (:mod:`xshare.serving.extensions` renders them): ``[count,
    ns]`` per duration, and per executed batch size ``[batches, input ns, infer ns, output ns]``.
    Written by the completion thread (and whoever fails queued requests), read by any."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._durations = {k: [0, 0] for k in DURATIONS}
        self._batches: dict[int, list[int]] = {}
        self._inferences = self._executions = 0
        self._last_inference_ms = 0

    def done(self, reqs: list[Request], t_host: float, t_out: float) -> None:
        """One answered batch: each request is charged its own queue time and its batch's compute
        times, as Triton charges the requests of a batch."""
        first = reqs[0]
        c_in, c_infer, c_out = first.t_ready - first.t_start, t_host - first.t_ready, t_out - t_host
        rows = sum(r.rows for r in reqs)
        with self._lock:
            d = self._durations
            for r in reqs:
                for key, secs in (("success", t_out - r.t_arrival), ("queue", r.t_start - r.t_arrival),
                                  ("compute_input", c_in), ("compute_infer", c_infer), ("compute_output", c_out)):
                    d[key][0] += 1
                    d[key][1] += int(secs * 1e9)
            b = self._batches.setdefault(rows, [0, 0, 0, 0])
            for i, secs in enumerate((1, c_in, c_infer, c_out)):
                b[i] += 1 if i == 0 else int(secs * 1e9)
            self._inferences += rows
            self._executions += 1
            self._last_inference_ms = int(time.time() * 1000)

    def failed(self, reqs: list[Request], now: float) -> None:
        with self._lock:
            for r in reqs:
                self._durations["fail"][0] += 1
                self._durations["fail"][1] += int((now - r.t_arrival) * 1e9)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {**{k: tuple(v) for k, v in self._durations.items()},
                    "batches": {k: tuple(v) for k, v in self._batches.items()},
                    "inference_count": self._inferences, "execution_count": self._executions,
                    "last_inference_ms": self._last_inference_ms}


__all__ = ["InferFuture", "Request", "InferStats", "insert_at", "preferred_rows", "oldest_arrival", "next_deadline"]
