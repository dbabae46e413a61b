"""The dispatcher's admission: compiled jobs into lanes of the arena, or the queue.

A compiled job is admitted by its footprint (``memory``: persistent + ephemeral + staging),
joins a fusion group (``groups``), or queues; released memory places queued and swapped jobs
(``_admitted``); a paused job can swap its state to host memory and back. Every change to the
arena's ledger happens here or in ``lifecycle`` (release), on the dispatcher thread only.
"""

from __future__ import annotations

import logging
from typing import Any

import jax

from .. import ffi
from .._errors import AdmissionError
from .._units import format_bytes
from ..memory import Admitted
from . import fusion
from .causes import short_error
from .fusion import Group
from .records import JobRecord, Prepared, now_s
from .states import Event, JobState, transition

log = logging.getLogger("xshare.runtime")

S = JobState


class Admission:
    """Admission: the ledger, placement, the queue and host swap. A part of ``Dispatcher``:
    its methods run on the dispatcher thread and share the dispatcher's tables."""

    def arrived(self, job: JobRecord) -> None:
        """A submitted job: the dispatcher's table holds it from now (its compile is under way)."""
        self.jobs[job.id] = job

    def compiled(self, job: JobRecord, prepared: Prepared) -> None:
        """The compile pool is done with ``job``: admit it, queue it, or refuse it."""
        self.owned()
        if job.terminal:
            return
        program = prepared.program
        job.program, job.spec, job.source = program, prepared.spec, prepared.source
        job.layout, job.batch_layout = prepared.layout, prepared.batch_layout
        job.lifted, job.traced, job.fuse_hint = prepared.lifted, prepared.traced, prepared.fuse_hint
        job.shared = prepared.shared
        job.eval = prepared.eval
        if prepared.restored_metrics is not None:
            job.restored_metrics = prepared.restored_metrics
        job.compiled_s = now_s() - self.t0
        if program.compiled:  # (a fused job's solo program compiles only if it must run alone)
            job.footprint = program.with_staging(self.prefetch + self.ahead)
        if job.state is S.COMPILING:
            self._admit(job)

    def fail_now(self, job: JobRecord, cause: str, err: BaseException | None) -> None:
        self.owned()
        if not job.terminal:
            self._fail(job, cause, err)
            self._settle(job)

    def finish_now(self, job: JobRecord, host_state: Any, metrics: dict | None, note: str,
                   spec: Any = None) -> None:
        """End a job that never runs a step (no batches, or resumed already finished)."""
        self.owned()
        if job.terminal:
            return
        if spec is not None:
            job.spec = spec
        job.host_state, job.restored_metrics = host_state, metrics
        self.recorder.line(job, note)
        self._finalize(job, Event.FINISH)

    def _admit(self, job: JobRecord) -> None:
        self.owned()
        if self.fuse and self._join_group(job):
            return
        if job.footprint is None:
            try:
                # A fused job that must run alone compiles its solo program here (rare: a
                # group had no room); every other job was compiled on the compile pool.
                job.footprint = job.program.with_staging(self.prefetch + self.ahead)
            except Exception as err:  # noqa: BLE001
                self._fail(job, f"could not compile its step: {short_error(err)}", err)
                self._finalize(job, Event.FAIL)
                return
        fp = job.footprint
        if fp.resident + fp.ephemeral > self.arena.capacity:
            err = AdmissionError(
                f"job {job.name!r} needs {format_bytes(fp.resident + fp.ephemeral)} ({fp.describe()}) "
                f"but the arena holds {format_bytes(self.arena.capacity)} ({self.capacity_source}); "
                "lower its batch size or model size, or give the runtime more memory (--memory)")
            self._fail(job, str(err), err)
            self._finalize(job, Event.FAIL)
            return
        # A job that truly holds nothing still takes a lane; the arena refuses zero-byte
        # footprints (zero is how "unknown" looks), so charge it 1 byte.
        ephemeral = fp.ephemeral if fp.resident + fp.ephemeral > 0 else 1
        placed = self.arena.admit(job.id, fp.resident, ephemeral, name=job.name)
        job.in_ledger = True
        if isinstance(placed, Admitted):
            self.recorder.line(job, f"compiled: {fp.describe()}; lane {placed.lane_id}")
            self._place(job, placed.lane_id)
        else:
            self.recorder.line(job, f"compiled: {fp.describe()}; queued: {placed.reason}")
            job.state = transition(job.state, Event.QUEUE)

    def _started(self, job: JobRecord) -> None:
        job.state = transition(job.state, Event.ADMIT)
        if job.started_s is None:
            job.started_s = now_s() - self.t0
            job.queue_wait_s = job.started_s - (job.compiled_s if job.compiled_s is not None else job.arrival_s)
        job.prefetch_depth = self.prefetch
        want = self.prefetch - len(job.batches)
        if want > 0 and job.source is not None and self._fed(job):
            self.feeder.request(job, want)
        self._account_peak()

    def _state_of(self, job: JobRecord) -> Any:
        """A job's state leaves wherever they are: its own arrays, its group slot, the host."""
        if job.group is not None:
            return fusion.take(job.group.fused, job.group.arrays, job.slot)
        return job.arrays if job.arrays is not None else job.host_arrays

    def _place(self, job: JobRecord, lane: int) -> None:
        """Put an admitted job's state on the device and let the scheduler see it."""
        self.owned()
        try:
            if job.host_arrays is not None:  # back from host memory
                kind = self.device.default_memory().kind
                target = jax.sharding.SingleDeviceSharding(self.device, memory_kind=kind)
                job.arrays = jax.device_put(job.host_arrays, target, may_alias=False)
            else:
                # The runtime keeps the state as flat leaves (see compiler._flat_step) and owns
                # its copy: the user's arrays stay valid (bind does not take ownership).
                job.arrays = jax.device_put(job.initial_arrays(), self.device, may_alias=False)
            if self.ring is not None and (job.ident is None or job.lane != lane):
                job.ident = jax.device_put(ffi.ident(self.ring, job.id, lane), self.device)
        except Exception as err:  # noqa: BLE001
            self._fail(job, f"could not place its state on {self.device}: {short_error(err)}", err)
            self._finalize(job, Event.FAIL)
            return
        job.host_arrays, job.lane = None, lane
        self._running[job.id] = job
        self._dirty = True
        self._started(job)

    def _account_peak(self) -> None:
        """The runtime's own record of device memory that may be in use (from its job records,
        not the arena's books, so it checks the admissions): every resident job holds P +
        staging; every lane holds the largest E among its resident jobs."""
        resident, lane_e = 0, {}
        for job in self._running.values():
            fp = job.fused.footprint if isinstance(job, Group) else job.footprint
            resident += fp.resident
            lane_e[job.lane] = max(lane_e.get(job.lane, 0), fp.ephemeral)
        self.peak_in_flight_bytes = max(self.peak_in_flight_bytes, resident + sum(lane_e.values()))

    def _admitted(self, admitted: list) -> None:
        """Place jobs the arena admitted from its queue, then bring back swapped jobs."""
        for placed in admitted:
            job = self.jobs.get(placed.job_id)
            if job is not None:
                self._place(job, placed.lane_id)
        for job in list(self._swap_waiting):
            if self.arena.swap_in(job.id):
                self._swap_waiting.remove(job)
                self._place(job, job.lane)

    def _swap_out(self, job: JobRecord) -> None:
        self.owned()
        if job.group is not None:
            # A member's state leaves its slot for host memory; its memory was the group's, so
            # nothing is freed in the arena unless the group empties or shrinks.
            job.arrays = self._state_of(job)
            self._leave_group(job)
        kinds = {m.kind for m in self.device.addressable_memories()}
        kind = next((k for k in ("pinned_host", "unpinned_host") if k in kinds), None)
        if kind is not None:  # host memory of the device (pinned where it has it)
            host = jax.device_put(job.arrays, jax.sharding.SingleDeviceSharding(self.device, memory_kind=kind))
            jax.block_until_ready(host)
        else:
            host = jax.device_get(job.arrays)
        job.host_arrays, job.arrays = host, None
        if job.in_ledger:
            self.arena.swap_out(job.id)
        job.state = transition(job.state, Event.OFFLOAD)
        self.recorder.line(job, "state offloaded to host memory")
        self._admitted(self.arena.retry())

