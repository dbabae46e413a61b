"""The arena: a reservation ledger of lanes (admission, queueing, release, host swap).

Pure bookkeeping over byte counts (no jax, no clocks). A job needs persistent bytes ``P`` (its
state) while admitted and ephemeral bytes ``E`` while a step runs. A lane is a reservation, not
an address range (XLA's allocator places the buffers): the ``P`` of its resident jobs plus one
``E`` as large as their largest, time-shared since a lane runs one step at a time. Invariant:
``sum(lane sizes) = sum(resident P) + sum(lane max E) <= capacity``.

Placement (Salus §3.3): a new lane if ``P + E`` fits in the free bytes, else the lane that grows
least, else queue in arrival order. Salus left defragmentation as a TODO; reservations need
none: lanes grow and shrink at step boundaries (release and swap-out shrink a lane's ``E``),
and freed bytes are at once usable by any lane.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

from .._errors import AdmissionError
from .._units import format_bytes


@dataclass(frozen=True)
class Admitted:
    """The job's state may be placed: it is a member of lane ``lane_id`` (``new_lane``: just opened)."""
    job_id: Hashable
    lane_id: int
    new_lane: bool


@dataclass(frozen=True)
class Queued:
    """The job waits in the arena's queue; ``reason`` says how much it needs and what is free."""
    job_id: Hashable
    reason: str


@dataclass(frozen=True)
class LaneInfo:
    """A snapshot of one lane: ``size = persistent + ephemeral`` over resident jobs only;
    ``jobs`` lists every member in joining order, ``swapped`` those whose state is on the host."""
    id: int
    size: int
    ephemeral: int
    persistent: int
    jobs: tuple[Hashable, ...]
    swapped: tuple[Hashable, ...] = ()


@dataclass
class _Job:
    id: Hashable
    label: str  # how messages name it: repr of its name, else of its id
    persistent: int
    ephemeral: int
    lane: int | None = None  # None while queued
    swapped: bool = False  # its state is on the host: its P and E do not count

    @property
    def need(self) -> int:
        return self.persistent + self.ephemeral

    def describe(self) -> str:
        return f"{format_bytes(self.need)} (P {format_bytes(self.persistent)} + E {format_bytes(self.ephemeral)})"


@dataclass
class _Lane:
    id: int
    jobs: list[Hashable] = field(default_factory=list)  # members in joining order
    persistent: int = 0  # resident members' P, kept current by Arena._fit
    ephemeral: int = 0  # the largest E among resident members


class Arena:
    """Reservation ledger of one device's memory budget of ``capacity`` bytes. Not thread-safe:
    the runtime serializes every call under its own lock."""

    def __init__(self, capacity: int, *, max_lanes: int | None = None):
        capacity = operator.index(capacity)
        if capacity <= 0:
            raise ValueError(f"arena capacity must be a positive number of bytes, got {capacity}")
        if max_lanes is not None and (not isinstance(max_lanes, int) or max_lanes < 1):
            raise ValueError(f"max_lanes={max_lanes!r} must be an int >= 1, or None for no limit")
        self.capacity = capacity
        # A cap on lanes makes jobs share them (and their one ephemeral reservation).
        self.max_lanes = max_lanes
        self._jobs: dict[Hashable, _Job] = {}
        self._lanes: dict[int, _Lane] = {}  # ids only grow, so insertion order is id order
        self._queue: deque[Hashable] = deque()
        self._next_lane = 0
        self._committed = 0  # sum of lane sizes, kept by _fit so that `free` costs O(1)

    def admit(self, job_id: Hashable, persistent: int, ephemeral: int, *,
              name: str | None = None) -> Admitted | Queued:
        """Place a job, or queue it behind earlier arrivals. A job that fits by bytes (``P + E``
        or some lane's growth ``<= free``) is never queued unless jobs are already waiting: a
        newcomer never overtakes the queue, so a large job cannot starve. Raises AdmissionError
        if ``P + E > capacity`` (it could never run), ValueError for a negative or all-zero
        footprint or a known id."""
        persistent, ephemeral = operator.index(persistent), operator.index(ephemeral)
        job = _Job(job_id, repr(job_id if name is None else name), persistent, ephemeral)
        if persistent < 0 or ephemeral < 0:
            raise ValueError(f"job {job.label} has a negative footprint "
                             f"(P {persistent} B, E {ephemeral} B); sizes are bytes >= 0")
        if job_id in self._jobs:
            raise ValueError(f"job id {job_id!r} is already in the arena; release it first or pick another id")
        if job.need == 0:  # memory_analysis() reports zeros when it does not know (jax #18954)
            raise ValueError(f"job {job.label} has a zero footprint (P 0 B + E 0 B); "
                             "measure it instead of admitting it as free")
        if job.need > self.capacity:
            raise AdmissionError(
                f"job {job.label} needs {job.describe()} but the arena holds "
                f"{format_bytes(self.capacity)}; lower its batch size or give the runtime more "
                "memory (--memory)")
        self._jobs[job_id] = job
        ahead = len(self._queue)
        placed = None if ahead else self._place(job)
        if placed is not None:
            return placed
        self._queue.append(job_id)
        return Queued(job_id, self._reason(job, ahead))

    def release(self, job_id: Hashable) -> list[Admitted]:
        """Remove an admitted or queued job; its lane shrinks (its ``E`` may have been the
        largest) or is freed once empty. Returns the jobs then admitted from the queue."""
        job = self._job(job_id)
        del self._jobs[job_id]
        if job.lane is None:
            self._queue.remove(job_id)
        else:
            lane = self._lanes[job.lane]
            lane.jobs.remove(job_id)
            self._fit(lane)
            if not lane.jobs:
                del self._lanes[lane.id]
        return self.retry()

    def retry(self) -> list[Admitted]:
        """Admit queued jobs in strict arrival order, stopping at the first that does not fit."""
        admitted = []
        while self._queue and (placed := self._place(self._jobs[self._queue[0]])) is not None:
            self._queue.popleft()
            admitted.append(placed)
        return admitted

    def swap_out(self, job_id: Hashable) -> None:
        """The admitted job's state now lives on the host: its ``P`` and ``E`` stop counting,
        it stays a member of its lane but cannot run until ``swap_in``. Twice is a no-op; never
        swap out a running job. Call ``retry`` afterwards to give the bytes to the queue."""
        job = self._job(job_id, "swap out")
        job.swapped = True
        self._fit(self._lane(job))

    def swap_in(self, job_id: Hashable) -> bool:
        """Count the job's bytes again if its lane's growth fits in ``free``: True if it does
        (or it was resident already), False to retry later."""
        job = self._job(job_id, "swap in")
        if job.swapped:
            lane = self._lane(job)
            if self._growth(lane, job) > self.free:
                return False
            job.swapped = False
            self._fit(lane)
        return True

    def resize(self, job_id: Hashable, persistent: int, ephemeral: int) -> bool:
        """Change an admitted job's footprint at a step boundary (a fused group gaining or losing
        members): True if its lane's new reservation fits (a shrink always does; call ``retry``
        to give the bytes to the queue), False with nothing changed otherwise."""
        job = self._job(job_id, "resize")
        persistent, ephemeral = operator.index(persistent), operator.index(ephemeral)
        if persistent < 0 or ephemeral < 0 or persistent + ephemeral == 0:
            raise ValueError(f"job {job.label} resized to P {persistent} B, E {ephemeral} B; "
                             "sizes are bytes >= 0, not both zero")
        old = job.persistent, job.ephemeral
        job.persistent, job.ephemeral = persistent, ephemeral
        self._fit(self._lane(job))
        if self._committed > self.capacity or job.need > self.capacity:  # it could never swap in
            job.persistent, job.ephemeral = old
            self._fit(self._lane(job))
            return False
        return True

    def lane_of(self, job_id: Hashable) -> int | None:
        """The lane an admitted job belongs to; None for a queued or unknown job."""
        return getattr(self._jobs.get(job_id), "lane", None)

    def lanes(self) -> tuple[LaneInfo, ...]:
        """Snapshots of every lane, by lane id."""
        return tuple(LaneInfo(lane.id, lane.persistent + lane.ephemeral, lane.ephemeral, lane.persistent,
                              tuple(lane.jobs), tuple(j for j in lane.jobs if self._jobs[j].swapped))
                     for lane in self._lanes.values())

    @property
    def committed(self) -> int:
        """Bytes reserved by lanes: the most memory the admitted jobs can use at once."""
        return self._committed

    @property
    def free(self) -> int:
        return self.capacity - self._committed

    @property
    def queue(self) -> tuple[Hashable, ...]:
        """Queued job ids in arrival order."""
        return tuple(self._queue)

    def footprint(self, job_id: Hashable) -> tuple[int, int]:
        """``(P, E)`` of an admitted or queued job."""
        job = self._job(job_id)
        return job.persistent, job.ephemeral

    def check(self) -> None:
        """Raise AssertionError naming the broken invariant (linear in jobs and lanes)."""
        def require(ok: bool, what: str) -> None:
            if not ok:
                raise AssertionError(f"arena invariant broken: {what}")

        total = members = 0
        for lane in self._lanes.values():
            require(bool(lane.jobs), f"lane {lane.id} has no jobs but was not freed")
            resident = self._resident(lane)
            p, e = sum(j.persistent for j in resident), max((j.ephemeral for j in resident), default=0)
            require((lane.persistent, lane.ephemeral) == (p, e), f"lane {lane.id} reserves "
                    f"P {lane.persistent} + E {lane.ephemeral}, its resident jobs need P {p} + E {e}")
            require(all(self._jobs[j].lane == lane.id for j in lane.jobs), f"lane {lane.id} lists a job of another")
            total, members = total + p + e, members + len(lane.jobs)
        require(self._committed == total, f"committed {self._committed} B, lanes reserve {total} B")
        require(total <= self.capacity, f"{total} B committed > capacity {self.capacity} B")
        require(self.max_lanes is None or len(self._lanes) <= self.max_lanes,
                f"{len(self._lanes)} lanes open, max_lanes={self.max_lanes}")
        require(members + len(self._queue) == len(self._jobs), "a job is neither in a lane nor queued once")
        require(len(set(self._queue)) == len(self._queue), "a job is queued twice")
        queued = [self._jobs[j] for j in self._queue]
        require(all(j.lane is None and not j.swapped for j in queued), "a queued job is placed")
        require(all(j.need <= self.capacity for j in queued), "a queued job can never fit")

    def _place(self, job: _Job) -> Admitted | None:
        """A new lane if ``P + E`` fits; else the lane that grows least (lowest id on a tie).
        Growth never exceeds ``P + E``, so a job that fits by bytes is placed even at max_lanes."""
        new = (self.max_lanes is None or len(self._lanes) < self.max_lanes) and job.need <= self.free
        if new:
            lane = self._lanes[self._next_lane] = _Lane(self._next_lane)
            self._next_lane += 1
        else:
            growth, lane_id = min(((self._growth(ln, job), ln.id) for ln in self._lanes.values()),
                                  default=(self.free + 1, None))
            if growth > self.free or lane_id is None:  # (no lane: the default growth never fits)
                return None
            lane = self._lanes[lane_id]
        lane.jobs.append(job.id)
        job.lane = lane.id
        self._fit(lane)
        return Admitted(job.id, lane.id, new_lane=new)

    @staticmethod
    def _growth(lane: _Lane, job: _Job) -> int:
        """Bytes ``lane`` grows by when ``job`` joins it or returns from the host: the E
        reservation is shared, so only E beyond the lane's current one counts."""
        return job.persistent + max(0, job.ephemeral - lane.ephemeral)

    def _fit(self, lane: _Lane) -> None:
        """Re-derive the lane's reservation from its resident members (it grows or shrinks)."""
        resident = self._resident(lane)
        before = lane.persistent + lane.ephemeral
        lane.persistent = sum(j.persistent for j in resident)
        lane.ephemeral = max((j.ephemeral for j in resident), default=0)
        self._committed += lane.persistent + lane.ephemeral - before

    def _resident(self, lane: _Lane) -> list[_Job]:
        return [job for job in map(self._jobs.__getitem__, lane.jobs) if not job.swapped]

    def _job(self, job_id: Hashable, admitted_for: str | None = None) -> _Job:
        if job_id not in self._jobs:
            raise KeyError(f"job {job_id!r} is neither admitted nor queued in this arena")
        job = self._jobs[job_id]
        if admitted_for and job.lane is None:
            raise ValueError(f"job {job.label} is queued, not admitted: there is nothing to {admitted_for}")
        return job

    def _lane(self, job: _Job) -> _Lane:
        """An admitted job's lane (callers got ``job`` from ``_job(..., admitted_for=...)``)."""
        if job.lane is None:
            raise ValueError(f"job {job.label} is queued, not admitted: it has no lane")
        return self._lanes[job.lane]

    def _reason(self, job: _Job, ahead: int) -> str:
        reason = f"needs {job.describe()}; {format_bytes(self.free)} free"
        if ahead:
            return f"{reason}, {ahead} job{'s' if ahead != 1 else ''} ahead in queue"
        # Queued with nothing ahead: P + E and every lane's growth exceed `free`. Sharing a lane
        # may come closer than a lane of its own; say by how much, so the user sees the gap.
        least = min((self._growth(ln, job) for ln in self._lanes.values()), default=job.need)
        return f"{reason}; sharing a lane needs {format_bytes(least)}" if least < job.need else reason

