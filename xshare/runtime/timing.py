"""The device timeline: FFI fence records paired into executed steps, per-job device time,
the measured step times and FLOP rate the policies read.

A mixin of :class:`xshare.runtime.Runtime`: these methods run with its lock held.
"""

from __future__ import annotations


from typing import Any

from .. import ffi
from .records import JobRecord, StepRecord

_EMA = 0.2  # weight of the newest step in the measured step-time and FLOP-rate estimates


class TimingMixin:
    def _drain_fences(self) -> None:
        """Pair begin/end fence events into executed-step records (lock held)."""
        if self._ring is None:
            return
        events = ffi.drain(self._ring)
        for ev in events:
            jid, t = int(ev["job"]), int(ev["t_ns"])
            if ev["kind"] == 0:
                self._open_begins[jid] = t
                continue
            t0 = self._open_begins.pop(jid, None)
            job = self._jobs.get(jid)
            if t0 is None or job is None:
                continue
            self._record_step(job, int(ev["lane"]), t0, t)

    def _host_timing(self, lane: int, job: JobRecord, item: Any, t_end: int) -> None:
        """Without fences: a step's device interval is approximated from the host: it started
        when dispatched or when the lane's previous step ended, whichever was later."""
        t0 = max(item.t_dispatch_ns, self._host_times.get(lane, 0))
        self._host_times[lane] = t_end
        self._record_step(job, lane, t0, t_end)

    def _record_step(self, job: JobRecord, lane: int, t0: int, t1: int) -> None:
        dt = max(t1 - t0, 0) / 1e9
        job.device_time_s += dt
        job.step_times.append(dt)
        job.step_time_s = dt if job.step_time_s is None else (1 - _EMA) * job.step_time_s + _EMA * dt
        if job.compiled is not None and job.compiled.flops and dt > 0:
            rate = job.compiled.flops / dt
            self._flops_per_s = rate if self._flops_per_s is None else (1 - _EMA) * self._flops_per_s + _EMA * rate
        self._timeline.append(StepRecord(job.id, lane, job.spec.start_step + job.steps_recorded, t0, t1))
        job.steps_recorded += 1
