"""The device timeline: FFI fence records paired into executed steps, per-job device time,
and the measured step times and FLOP rate the policies read.

With fences, the recorder thread drains the ring every few tens of milliseconds, never the
dispatcher, and pairs records with numpy, a chunk at a time: pairing them one by one in Python
would cost about as much host time as dispatching the steps did. Without fences, the
dispatcher records host times when it retires a step (a few attribute updates). The timeline
keeps a bounded window of steps.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable

import numpy as np

from ... import ffi
from ..engine.records import StepRecord

_EMA = 0.2  # weight of the newest measurement in the step-time and FLOP-rate estimates
# A lane's gap between one step's end and the next step's begin longer than this is idleness
# (no work, waiting for an arrival), not host time a step costs: left out of the host estimate.
_IDLE_GAP_NS = 20_000_000


class Timeline:
    def __init__(self, ring: int | None, lookup: Callable[[int], Any], *, window: int = 100_000):
        self.ring = ring
        self._lookup = lookup               # job id -> JobRecord (or None once forgotten)
        self.window = window
        self._chunks: deque[np.ndarray] = deque()   # paired fence steps, (job, lane, step, t0, t1)
        self._held = 0
        self._host: deque[tuple] = deque(maxlen=window)  # host-timed steps, same fields
        self.flops_per_s: float | None = None
        # Host seconds per step the device waits between steps (dispatch, the batch), EMA over
        # every unit; a unit's own in ``unit.host_gap_s``. On a host-bound CPU a small step's
        # wall time is mostly this, so remaining-time estimates that ignored it ranked jobs by
        # a small share of what they cost (srtf); on a device the host keeps ahead of it is ~0.
        self.host_gap_s: float | None = None
        self._lane_end: dict[int, int] = {}  # lane -> t of its latest end fence drained
        self._open: dict[int, int] = {}     # job id -> t of a begin whose end is not drained yet
        self._last_end: int = 0             # host timing: the previous step's end
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ fences (recorder thread)
    def drain(self) -> None:
        """Pair begin/end fence events (drained from the ring) into executed steps."""
        if self.ring is None:
            return
        with self._lock:
            events = ffi.drain(self.ring)
            if len(events):
                self._pair(events)

    def _pair(self, events: np.ndarray) -> None:
        events = events[np.argsort(events["seq"], kind="stable")]
        self._gaps(events)
        jobs = events["job"]
        for jid in np.unique(jobs):
            mine = events[jobs == jid]
            begins = mine["t_ns"][mine["kind"] == 0]
            ends = mine[mine["kind"] == 1]
            # A job's steps run one after another: its k-th end closes its k-th open begin.
            if int(jid) in self._open:
                begins = np.concatenate([[self._open.pop(int(jid))], begins])
            n = min(len(begins), len(ends))
            if len(begins) > n:
                self._open[int(jid)] = int(begins[n])
            job = self._lookup(int(jid))
            if job is None or n == 0:
                continue
            t0, t1 = begins[:n].astype(np.int64), ends["t_ns"][:n].astype(np.int64)
            chunk = np.empty(n, _STEP)
            chunk["job"], chunk["lane"], chunk["t0"], chunk["t1"] = jid, ends["lane"][:n], t0, t1
            chunk["step"] = _first_step(job) + job.steps_recorded + np.arange(n)
            job.steps_recorded += n
            self._account(job, np.maximum(t1 - t0, 0) / 1e9)
            self._chunks.append(chunk)
            self._held += n
        while self._held > self.window and len(self._chunks) > 1:
            self._held -= len(self._chunks.popleft())

    def _account(self, job: Any, dts: np.ndarray) -> None:
        total = float(dts.sum())
        job.device_time_s += total
        _share(job, total)
        job.step_times.extend(dts[-job.step_times.maxlen:].tolist())
        mean = total / len(dts)
        job.step_time_s = mean if job.step_time_s is None else (1 - _EMA) * job.step_time_s + _EMA * mean
        flops = _flops(job)
        if flops and mean > 0:
            rate = flops / mean
            self.flops_per_s = rate if self.flops_per_s is None else (1 - _EMA) * self.flops_per_s + _EMA * rate

    def _gaps(self, events: np.ndarray) -> None:
        """Per lane, the gap from each end fence to the next begin fence: the host time the
        device waited before that begin's step, charged to its unit (median per unit and drain,
        so one idle pause does not skew it)."""
        for lane in np.unique(events["lane"]):
            mine = events[events["lane"] == lane]
            kind, t = mine["kind"], mine["t_ns"].astype(np.int64)
            prev_end = self._lane_end.get(int(lane))
            ends = np.flatnonzero(kind == 1)
            if len(ends):
                self._lane_end[int(lane)] = int(t[ends[-1]])
            # For each begin: the time of the latest end before it on this lane, if the event
            # just before it is that end (two begins in a row: steps queued back to back).
            begins = np.flatnonzero(kind == 0)
            if not len(begins):
                continue
            before = np.empty(len(begins), np.int64)
            has = np.zeros(len(begins), bool)
            inner = begins > 0
            before[inner] = t[begins[inner] - 1]
            has[inner] = kind[begins[inner] - 1] == 1
            if not inner[0] and prev_end is not None:
                before[0], has[0] = prev_end, True
            gap = t[begins] - before
            ok = has & (gap >= 0) & (gap < _IDLE_GAP_NS)
            jobs = mine["job"][begins][ok]
            gap = gap[ok]
            for jid in np.unique(jobs):
                self._gap(self._lookup(int(jid)), float(np.median(gap[jobs == jid])) / 1e9)

    def _gap(self, unit: Any, seconds: float) -> None:
        self.host_gap_s = seconds if self.host_gap_s is None else (1 - _EMA) * self.host_gap_s + _EMA * seconds
        if unit is not None:
            old = getattr(unit, "host_gap_s", None)
            unit.host_gap_s = seconds if old is None else (1 - _EMA) * old + _EMA * seconds

    # ------------------------------------------------------------------ host times (dispatcher)
    def host_step(self, job: Any, t_dispatch_ns: int, t_end_ns: int) -> None:
        """Without fences: a step ran from its dispatch or the previous step's end, whichever
        was later (steps of one runtime run one after another), to when the host saw it end."""
        t0 = max(t_dispatch_ns, self._last_end)
        if self._last_end and 0 <= t_dispatch_ns - self._last_end < _IDLE_GAP_NS:
            self._gap(job, (t_dispatch_ns - self._last_end) / 1e9)
        self._last_end = t_end_ns
        dt = (t_end_ns - t0) / 1e9
        job.device_time_s += dt
        _share(job, dt)
        job.step_times.append(dt)
        job.step_time_s = dt if job.step_time_s is None else (1 - _EMA) * job.step_time_s + _EMA * dt
        flops = _flops(job)
        if flops and dt > 0:
            rate = flops / dt
            self.flops_per_s = rate if self.flops_per_s is None else (1 - _EMA) * self.flops_per_s + _EMA * rate
        self._host.append((job.id, -1 if job.lane is None else job.lane,
                           _first_step(job) + job.steps_recorded, t0, t_end_ns))
        job.steps_recorded += 1

    def steps(self) -> list[StepRecord]:
        """Every step in the window, in start order."""
        self.drain()
        with self._lock:
            rows = [StepRecord(int(j), int(ln), int(s), int(a), int(b))
                    for chunk in self._chunks for j, ln, s, a, b in chunk.tolist()]
        rows += [StepRecord(*r) for r in list(self._host)]
        return sorted(rows, key=lambda r: r.t_begin_ns)


def _first_step(unit: Any) -> int:
    spec = getattr(unit, "spec", None)  # a fusion group counts its own steps from 0
    return spec.start_step if spec is not None else 0


def _flops(unit: Any) -> float | None:
    fused = getattr(unit, "fused", None)
    if fused is not None:
        return fused.flops
    return unit.program.flops if unit.program is not None else None


def _share(unit: Any, seconds: float) -> None:
    """A fusion group's device time is charged to its members in equal shares (FAIR's rule)."""
    stepping = unit.stepping() if hasattr(unit, "stepping") else ()
    for _, member in stepping:
        member.device_time_s += seconds / len(stepping)


_STEP = np.dtype([("job", "i4"), ("lane", "i4"), ("step", "i8"), ("t0", "i8"), ("t1", "i8")])
