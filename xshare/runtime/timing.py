"""The device timeline: FFI fence records paired into executed steps, per-job device time,
and the measured step times and FLOP rate the policies read.

With fences, the recorder thread drains the ring every few tens of milliseconds (never the
dispatcher: pairing records costs more host time than a small step). Without fences, the
dispatcher records host times when it retires a step. The timeline keeps a bounded window.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable

from .. import ffi
from .records import StepRecord

_EMA = 0.2  # weight of the newest step in the measured step-time and FLOP-rate estimates


class Timeline:
    def __init__(self, ring: int | None, lookup: Callable[[int], Any], *, window: int = 100_000):
        self.ring = ring
        self._lookup = lookup               # job id -> JobRecord (or None once forgotten)
        self.records: deque[StepRecord] = deque(maxlen=window)
        self.flops_per_s: float | None = None
        self._open_begins: dict[int, int] = {}
        self._last_end: int = 0             # host timing: the previous step's end
        self._lock = threading.Lock()

    def drain(self) -> None:
        """Pair begin/end fence events into executed-step records."""
        if self.ring is None:
            return
        with self._lock:
            for ev in ffi.drain(self.ring):
                jid, t = int(ev["job"]), int(ev["t_ns"])
                if ev["kind"] == 0:
                    self._open_begins[jid] = t
                    continue
                t0 = self._open_begins.pop(jid, None)
                job = self._lookup(jid)
                if t0 is not None and job is not None:
                    self.record(job, int(ev["lane"]), t0, t)

    def host_step(self, job: Any, t_dispatch_ns: int, t_end_ns: int) -> None:
        """Without fences: a step ran from its dispatch or the previous step's end, whichever
        was later (steps of one runtime run one after another), to when the host saw it end."""
        t0 = max(t_dispatch_ns, self._last_end)
        self._last_end = t_end_ns
        self.record(job, job.lane if job.lane is not None else -1, t0, t_end_ns)

    def record(self, job: Any, lane: int, t0: int, t1: int) -> None:
        dt = max(t1 - t0, 0) / 1e9
        job.device_time_s += dt
        job.step_times.append(dt)
        job.step_time_s = dt if job.step_time_s is None else (1 - _EMA) * job.step_time_s + _EMA * dt
        flops = job.program.flops if job.program is not None else None
        if flops and dt > 0:
            rate = flops / dt
            self.flops_per_s = rate if self.flops_per_s is None else (1 - _EMA) * self.flops_per_s + _EMA * rate
        self.records.append(StepRecord(job.id, lane, job.spec.start_step + job.steps_recorded, t0, t1))
        job.steps_recorded += 1

    def steps(self) -> list[StepRecord]:
        self.drain()
        return sorted(self.records, key=lambda r: r.t_begin_ns)
