"""Admission: compiled jobs into lanes of the arena, or the queue; host swap and back.

A compiled job is admitted by its footprint (``memory``: persistent + ephemeral + staging),
joins a fusion group, or queues; released memory places queued and swapped jobs. This object
owns every change to the arena's ledger that concerns jobs (groups resize their own
reservations in ``groups``) and the list of resumed jobs waiting for room.

No jax here: putting a job's state on the device, or moving it to host memory, goes through a
``Placer`` (``placement.py``); joining a group and ending a refused job go through callables the
dispatcher passes in. So admission is tested on the real (pure) ``memory.Arena`` with hand-made
jobs (``tests/runtime/engine/test_admission.py``). Owned by the dispatcher thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from ..._errors import AdmissionError
from ..._units import format_bytes
from ...memory import Admitted
from ..causes import short_error
from .states import Event, JobState, transition
from .units import Units

S = JobState


class Placer(Protocol):
    """The device effects of admission (``placement.Placer``)."""

    device: Any

    def put(self, job: Any, lane: int) -> None:
        """Put ``job``'s state (initial, or back from the host) on the device. Raises on failure."""

    def to_host(self, job: Any) -> None:
        """Move ``job``'s state to host memory (``job.host_arrays``)."""


@dataclass(frozen=True)
class Refusal:
    """Why a job cannot run at all (the cause its record and the user see)."""

    cause: str
    error: BaseException


class Admission:
    """The ledger, placement, the queue and host swap.

    ``join(job)``: put ``job`` in a fusion group (True) or say it runs alone (False).
    ``refuse(job, cause, err)``: end a job that cannot run (lifecycle's ``abort``).
    ``started(job)``: a placed job starts stepping (feeding its batches).
    """

    def __init__(self, units: Units, arena: Any, placer: Placer, recorder: Any, *,
                 capacity_source: str, staging: int, t0: float, clock: Callable[[], float],
                 join: Callable[[Any], bool] | None = None,
                 started: Callable[[Any], None] = lambda job: None):
        self.units, self.arena, self.placer, self.recorder = units, arena, placer, recorder
        self.capacity_source, self.staging = capacity_source, staging
        self.t0, self.clock = t0, clock
        self.join, self.started = join, started
        self.refuse: Callable[[Any, str, BaseException | None], None] = _unwired
        self.swap_waiting: list[Any] = []   # resumed, state on the host, no room yet
        self.peak_in_flight_bytes = 0

    # ------------------------------------------------------------------ admitting
    def admit(self, job: Any) -> None:
        """Admit a compiled job: into a group, a lane, or the queue; or refuse it."""
        if self.join is not None and self.join(job):
            return
        if job.footprint is None:
            try:
                # A fused job that must run alone compiles its solo program here (rare: a
                # group had no room); every other job was compiled on the compile pool.
                job.footprint = job.program.with_staging(self.staging)
            except Exception as err:  # noqa: BLE001 - the job fails, the runtime goes on
                self.refuse(job, f"could not compile its step: {short_error(err)}", err)
                return
        refusal = self.check(job)
        if refusal is not None:
            self.refuse(job, refusal.cause, refusal.error)
            return
        fp = job.footprint
        # A job that truly holds nothing still takes a lane; the arena refuses zero-byte
        # footprints (zero is how "unknown" looks), so charge it 1 byte.
        ephemeral = fp.ephemeral if fp.resident + fp.ephemeral > 0 else 1
        placed = self.arena.admit(job.id, fp.resident, ephemeral, name=job.name)
        job.in_ledger = True
        if isinstance(placed, Admitted):
            self.recorder.line(job, f"compiled: {fp.describe()}; lane {placed.lane_id}")
            self.place(job, placed.lane_id)
        else:
            self.recorder.line(job, f"compiled: {fp.describe()}; queued: {placed.reason}")
            job.state = transition(job.state, Event.QUEUE)

    def check(self, job: Any) -> Refusal | None:
        """A refusal if ``job`` could never fit in the arena, whatever else ends."""
        fp = job.footprint
        if fp.resident + fp.ephemeral <= self.arena.capacity:
            return None
        err = AdmissionError(
            f"job {job.name!r} needs {format_bytes(fp.resident + fp.ephemeral)} ({fp.describe()}) "
            f"but the arena holds {format_bytes(self.arena.capacity)} ({self.capacity_source}); "
            "lower its batch size or model size, or give the runtime more memory (--memory)")
        return Refusal(str(err), err)

    def place(self, job: Any, lane: int) -> None:
        """Put an admitted job's state on the device and let the scheduler see it."""
        try:
            self.placer.put(job, lane)
        except Exception as err:  # noqa: BLE001 - the job fails, the runtime goes on
            self.refuse(job, f"could not place its state on {self.placer.device}: {short_error(err)}", err)
            return
        job.host_arrays, job.lane = None, lane
        self.units.run(job)
        self.start(job)

    def rehome(self, job: Any) -> None:
        """A running job that leaves the group it stepped in (``fusecheck.dissolve``): a
        reservation and lane of its own, and its state (``job.host_arrays``, taken from the
        group's stack) put there. The caller checked that the arena has room for it now."""
        fp = job.footprint
        placed = self.arena.admit(job.id, fp.resident, fp.ephemeral if fp.resident + fp.ephemeral > 0 else 1,
                                  name=job.name)
        job.in_ledger = True
        if not isinstance(placed, Admitted):  # pragma: no cover - checked by the caller
            raise AssertionError(f"job {job.name!r} left its group but was queued: {placed.reason}")
        try:
            self.placer.put(job, placed.lane_id)
        except Exception as err:  # noqa: BLE001 - the job fails, the others go on
            self.refuse(job, f"could not place its state on {self.placer.device}: {short_error(err)}", err)
            return
        job.host_arrays, job.lane = None, placed.lane_id
        self.units.run(job)
        self.account_peak()

    def start(self, job: Any) -> None:
        """A job placed (alone or in a group slot) starts: the clock of its queue wait stops."""
        job.state = transition(job.state, Event.ADMIT)
        if job.started_s is None:
            job.started_s = self.clock() - self.t0
            job.queue_wait_s = job.started_s - (job.compiled_s if job.compiled_s is not None else job.arrival_s)
        self.started(job)
        self.account_peak()

    def account_peak(self) -> None:
        """The runtime's own record of device memory that may be in use (from its units'
        footprints, not the arena's books, so it checks the admissions): every resident unit
        holds P + staging; every lane holds the largest E among its resident units."""
        resident, lane_e = 0, dict[Any, int]()
        for unit in self.units.running.values():
            fp = unit.footprint
            resident += fp.resident
            lane_e[unit.lane] = max(lane_e.get(unit.lane, 0), fp.ephemeral)
        self.peak_in_flight_bytes = max(self.peak_in_flight_bytes, resident + sum(lane_e.values()))

    # ------------------------------------------------------------------ giving memory back
    def admitted(self, admitted: list) -> None:
        """Place jobs the arena admitted from its queue, then bring back swapped jobs."""
        for placed in admitted:
            job = self.units.jobs.get(placed.job_id)
            if job is not None:
                self.place(job, placed.lane_id)
        for job in list(self.swap_waiting):
            if self.arena.swap_in(job.id):
                self.swap_waiting.remove(job)
                self.place(job, job.lane)

    def release(self, unit_id: int) -> None:
        """``unit_id``'s reservation ends: its bytes go to the queue, then to swapped jobs."""
        self.admitted(self.arena.release(unit_id))

    def retry(self) -> None:
        """Bytes came back without a release (a group shrank, a job went to the host)."""
        self.admitted(self.arena.retry())

    def withdraw(self, job: Any) -> None:
        """``job`` leaves the ledger (it ends, or moves into a group): out of the waiting list,
        and its reservation released."""
        self.forget(job)
        self._leave_ledger(job)

    def forget(self, job: Any) -> None:
        """An ending job: never brought back from the host (its reservation is released last,
        by ``withdraw``, once its buffers are gone)."""
        if job in self.swap_waiting:
            self.swap_waiting.remove(job)

    def _leave_ledger(self, job: Any) -> None:
        if job.in_ledger:
            job.in_ledger = False
            self.release(job.id)

    # ------------------------------------------------------------------ host swap
    def swap_out(self, job: Any) -> None:
        """A paused job's state goes to host memory; its bytes to whoever waits."""
        self.placer.to_host(job)
        if job.in_ledger:
            self.arena.swap_out(job.id)
        job.state = transition(job.state, Event.OFFLOAD)
        self.recorder.line(job, "state offloaded to host memory")
        self.retry()

    def swap_in(self, job: Any) -> None:
        """A resumed, swapped-out job: back on the device if its lane has room, else it waits."""
        if not job.in_ledger:
            self.admit(job)
        elif self.arena.swap_in(job.id):
            self.place(job, job.lane)
            self.recorder.line(job, "state back on the device")
        else:
            job.state = transition(job.state, Event.QUEUE)
            self.swap_waiting.append(job)

    def unqueue(self, job: Any) -> None:
        """A queued job is paused: it leaves the queue (resume queues it again)."""
        if job in self.swap_waiting:
            self.swap_waiting.remove(job)  # (a swapped job keeps its place in its lane)
        else:
            self._leave_ledger(job)


def _unwired(job: Any, cause: str, err: BaseException | None) -> None:
    raise AssertionError(f"Admission.refuse is not wired (job {job.name!r}: {cause})")
