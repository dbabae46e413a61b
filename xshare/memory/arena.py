"""The arena: lanes, admission, release, defragmentation and host-swap bookkeeping.

Pure bookkeeping over byte counts: no jax, no clocks, no devices. A job's footprint is its
persistent bytes ``P`` (its state, resident while it is admitted) and ephemeral bytes ``E``
(needed only while one of its steps runs). A lane is an interval ``[offset, offset + size)`` of
the arena (a logical layout; XLA's allocator owns the physical one) holding the ``P`` of its
jobs plus one ephemeral region as large as their largest ``E``, which they time-share: at most
one step per lane is in flight. So ``size = sum(P) + max(E)`` and the peak never exceeds
``sum(lane sizes) <= capacity``.

Placement follows Salus §3.3 (Yu & Chowdhury, MLSys 2020) and adds the defragmentation it left
as a TODO: (1) a new lane in the smallest free gap that holds ``P + E``; (2) else the lane whose
growth ``P + max(0, E - lane E)`` leaves the least free space directly after it; (3) else, if
moving lanes that have no step in flight gathers enough free space, move them and retry; (4)
else queue, in arrival order.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import AbstractSet

from .._errors import AdmissionError
from .._units import format_bytes
from .lanes import Block, best_gap, compact, gaps, moved, room_after


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
class Move:
    """Defragmentation slid lane ``lane_id`` from ``old_offset`` to ``new_offset``."""

    lane_id: int
    old_offset: int
    new_offset: int


@dataclass(frozen=True)
class LaneInfo:
    """A snapshot of one lane. ``persistent``/``ephemeral`` count resident jobs only; ``jobs``
    lists every member in joining order, ``swapped`` those whose state is on the host."""

    id: int
    offset: int
    size: int
    ephemeral: int
    persistent: int
    jobs: tuple[Hashable, ...]
    swapped: tuple[Hashable, ...] = ()


@dataclass
class _Job:
    id: Hashable
    name: str | None
    persistent: int
    ephemeral: int
    lane: int | None = None  # None while queued
    swapped: bool = False

    @property
    def label(self) -> str:
        return repr(self.name if self.name is not None else self.id)

    @property
    def need(self) -> int:
        return self.persistent + self.ephemeral

    def describe(self) -> str:
        return (f"{format_bytes(self.need)} (P {format_bytes(self.persistent)} + "
                f"E {format_bytes(self.ephemeral)})")


@dataclass
class _Lane:
    id: int
    offset: int
    size: int
    jobs: list[Hashable] = field(default_factory=list)  # members in joining order


class Arena:
    """Lane-partitioned bookkeeping of one device's memory budget of ``capacity`` bytes.

    Not thread-safe: the runtime serializes every call under its own lock. Calls that may move
    lanes take ``in_flight``, the ids of jobs with a step running now; a lane holding one of
    them never moves (it may still grow or shrink at its end); ids it does not know, or of
    swapped-out jobs, pin nothing. A lane whose members are all
    swapped out holds no bytes (size 0): it lies outside the layout until one of them returns.
    """

    def __init__(self, capacity: int, *, max_lanes: int | None = None):
        capacity = operator.index(capacity)
        if capacity <= 0:
            raise ValueError(f"arena capacity must be a positive number of bytes, got {capacity}")
        if max_lanes is not None and (not isinstance(max_lanes, int) or max_lanes < 1):
            raise ValueError(f"max_lanes={max_lanes!r} must be an int >= 1, or None for no limit")
        self.capacity = capacity
        # Lanes run in parallel; more lanes than the device has execution resources (CPU cores)
        # only makes them contend, so the runtime may cap them. Jobs then share lanes.
        self.max_lanes = max_lanes
        self._jobs: dict[Hashable, _Job] = {}
        self._lanes: dict[int, _Lane] = {}
        self._queue: deque[Hashable] = deque()
        self._next_lane = 0

    # ------------------------------------------------------------------ public: admission

    def admit(self, job_id: Hashable, persistent: int, ephemeral: int, *, name: str | None = None,
              in_flight: AbstractSet[Hashable] = frozenset()) -> Admitted | Queued:
        """Place a job, or queue it behind earlier arrivals.

        Raises ``AdmissionError`` if ``P + E`` exceeds the whole arena (it could never run), and
        ``ValueError`` for a negative or all-zero footprint or a job id already known.
        """
        persistent, ephemeral = operator.index(persistent), operator.index(ephemeral)
        job = _Job(job_id, name, persistent, ephemeral)
        if persistent < 0 or ephemeral < 0:
            raise ValueError(f"job {job.label} has a negative footprint "
                             f"(P {persistent} B, E {ephemeral} B); sizes are bytes >= 0")
        if job_id in self._jobs:
            raise ValueError(f"job id {job_id!r} is already in the arena; release it first or pick another id")
        if job.need == 0:
            # memory_analysis() reports zeros when it does not know (jax #18954): never trust it.
            raise ValueError(f"job {job.label} has a zero footprint (P 0 B + E 0 B); "
                             "measure it instead of admitting it as free")
        if job.need > self.capacity:
            raise AdmissionError(
                f"job {job.label} needs {job.describe()} but the arena holds "
                f"{format_bytes(self.capacity)}; lower its batch size or give the runtime more "
                "memory (--memory)")
        self._jobs[job_id] = job
        ahead = len(self._queue)
        if not ahead:  # never let a newcomer overtake the queue: a large job must not starve
            placed = self._place(job, in_flight)
            if placed is not None:
                return placed
        reason = self._reason(job, ahead, in_flight)
        self._queue.append(job_id)
        return Queued(job_id, reason)

    def release(self, job_id: Hashable, *, in_flight: AbstractSet[Hashable] = frozenset()) -> list[Admitted]:
        """Remove an admitted or queued job, then admit queued jobs in arrival order.

        The job's lane shrinks from its end (its ``E`` may have been the largest) and is freed
        once it has no members. Returns the jobs admitted from the queue.
        """
        job = self._job(job_id)
        del self._jobs[job_id]
        if job.lane is None:
            self._queue.remove(job_id)
        else:
            lane = self._lanes[job.lane]
            lane.jobs.remove(job_id)
            if lane.jobs:
                self._fit(lane)
            else:
                del self._lanes[lane.id]
        return self._drain(in_flight)

    def retry(self, *, in_flight: AbstractSet[Hashable] = frozenset()) -> list[Admitted]:
        """Try the queue again, in arrival order (call at step boundaries: fewer steps in flight
        pin fewer lanes). Returns the jobs admitted."""
        return self._drain(in_flight)

    def defragment(self, in_flight: AbstractSet[Hashable] = frozenset()) -> list[Move]:
        """Shrink lanes to their members' needs and slide lanes toward offset 0 without
        reordering them; lanes holding a job in ``in_flight`` stay where they are. Returns the
        moves made, lowest lane first (each slides into space the ones before it vacated)."""
        for lane in self._lanes.values():
            self._fit(lane)
        blocks = self._blocks()
        return self._apply(blocks, compact(blocks, self.capacity, self._pinned(in_flight)))

    # ------------------------------------------------------------------ public: host swap

    def swap_out(self, job_id: Hashable) -> None:
        """Mark an admitted job's state as living on the host: its lane shrinks by its ``P``
        (and its ``E`` stops counting). It stays a member of the lane but cannot run until
        ``swap_in``. Doing it twice is a no-op; the caller must not swap out a running job."""
        job = self._job(job_id)
        if job.lane is None:
            raise ValueError(f"job {job.label} is queued, not admitted: there is nothing to swap out")
        job.swapped = True
        self._fit(self._lanes[job.lane])

    def swap_in(self, job_id: Hashable, *, in_flight: AbstractSet[Hashable] = frozenset()) -> bool:
        """Grow the job's lane back to hold its state, moving lanes not in flight if needed.
        True if it fits now (also when it was never swapped out); False to retry later."""
        job = self._job(job_id)
        if job.lane is None:
            raise ValueError(f"job {job.label} is queued, not admitted: there is nothing to swap in")
        if not job.swapped:
            return True
        lane = self._lanes[job.lane]
        pinned = self._pinned(in_flight)
        if lane.size == 0:  # holds no bytes: it can reopen anywhere, like a new lane
            start = self._gap_for(job.need, pinned)
            if start is None:
                return False
            lane.offset = start
        elif not self._room_for(lane, self._growth(lane, job), pinned):
            return False
        job.swapped = False
        self._fit(lane)
        return True

    # ------------------------------------------------------------------ public: views

    def lane_of(self, job_id: Hashable) -> int | None:
        """The lane an admitted job belongs to; None for a queued or unknown job."""
        job = self._jobs.get(job_id)
        return None if job is None else job.lane

    def lanes(self) -> tuple[LaneInfo, ...]:
        """Snapshots of every lane, sorted by offset."""
        out = []
        for lane in sorted(self._lanes.values(), key=lambda l: (l.offset, l.id)):
            resident = self._resident(lane)
            out.append(LaneInfo(
                id=lane.id, offset=lane.offset, size=lane.size,
                ephemeral=max((j.ephemeral for j in resident), default=0),
                persistent=sum(j.persistent for j in resident),
                jobs=tuple(lane.jobs),
                swapped=tuple(j for j in lane.jobs if self._jobs[j].swapped)))
        return tuple(out)

    @property
    def committed(self) -> int:
        """Bytes held by lanes: the most memory the admitted jobs can use at once."""
        return sum(lane.size for lane in self._lanes.values())

    @property
    def free(self) -> int:
        return self.capacity - self.committed

    @property
    def largest_gap(self) -> int:
        """The largest free interval: the biggest new lane that fits without moving any."""
        return max((length for _, length in gaps(self._blocks(), self.capacity)), default=0)

    @property
    def queue(self) -> tuple[Hashable, ...]:
        """Queued job ids in arrival order."""
        return tuple(self._queue)

    def footprint(self, job_id: Hashable) -> tuple[int, int]:
        """``(P, E)`` of an admitted or queued job."""
        job = self._job(job_id)
        return job.persistent, job.ephemeral

    def check(self) -> None:
        """Raise AssertionError unless every invariant holds (cheap: linear in jobs and lanes)."""
        def require(ok: bool, what: str) -> None:
            if not ok:
                raise AssertionError(f"arena invariant broken: {what}")

        for lane in self._lanes.values():
            require(bool(lane.jobs), f"lane {lane.id} has no jobs but was not freed")
            require(lane.id < self._next_lane, f"lane id {lane.id} was never handed out")
            resident = self._resident(lane)
            need = sum(j.persistent for j in resident) + max((j.ephemeral for j in resident), default=0)
            require(lane.size == need, f"lane {lane.id} has size {lane.size}, its jobs need {need}")
            require(0 <= lane.offset <= self.capacity and lane.offset + lane.size <= self.capacity,
                    f"lane {lane.id} [{lane.offset}, {lane.offset + lane.size}) leaves the arena "
                    f"[0, {self.capacity})")
            for job_id in lane.jobs:
                require(self._jobs[job_id].lane == lane.id, f"job {job_id!r} is listed in lane {lane.id}")
        blocks = self._blocks()
        for before, after in zip(blocks, blocks[1:]):
            require(before.end <= after.offset, f"lanes {before.id} and {after.id} overlap")
        require(self.committed <= self.capacity, f"{self.committed} B committed > {self.capacity} B")
        members = sum(len(lane.jobs) for lane in self._lanes.values())
        require(members + len(self._queue) == len(self._jobs), "a job is neither in a lane nor queued once")
        require(len(set(self._queue)) == len(self._queue), "a job is queued twice")
        for job_id in self._queue:
            job = self._jobs[job_id]
            require(job.lane is None and not job.swapped, f"queued job {job_id!r} is placed")
            require(job.need <= self.capacity, f"queued job {job_id!r} can never fit")

    # ------------------------------------------------------------------ placement

    def _place(self, job: _Job, in_flight: AbstractSet[Hashable]) -> Admitted | None:
        blocks = self._blocks()
        may_open = self.max_lanes is None or len(self._lanes) < self.max_lanes
        # 1. A new lane in the smallest gap that holds it.
        start = best_gap(gaps(blocks, self.capacity), job.need) if may_open else None
        if start is not None:
            return self._open(start, job)
        # 2. Grow the lane that leaves the least free space after it (lowest offset on a tie).
        here = {b.id: b.offset for b in blocks}
        lane_id = self._best_growth(job, blocks, dict.fromkeys(here, here))
        if lane_id is not None:
            return self._join(self._lanes[lane_id], job)
        # 3. Move lanes with no step in flight to gather free space, then retry 1 and 2.
        pinned = self._pinned(in_flight)
        start = self._gap_for(job.need, pinned) if may_open else None
        if start is not None:
            return self._open(start, job)
        plans = {b.id: compact(blocks, self.capacity, pinned, toward=b.id) for b in blocks}
        lane_id = self._best_growth(job, blocks, plans)
        if lane_id is None:
            return None  # 4. The caller queues it.
        self._apply(blocks, plans[lane_id])
        return self._join(self._lanes[lane_id], job)

    def _best_growth(self, job: _Job, blocks: list[Block], plans: dict[int, dict[int, int]]) -> int | None:
        """The lane whose growth for ``job`` leaves the least room after it, given the layout
        ``plans[lane id]`` (offsets by lane id) each lane would grow in; None if none can."""
        best = None
        for block in blocks:
            room = room_after(moved(blocks, plans[block.id]), self.capacity, block.id)
            spare = room - self._growth(self._lanes[block.id], job)
            if spare >= 0 and (best is None or (spare, block.offset) < best[:2]):
                best = (spare, block.offset, block.id)
        return None if best is None else best[2]

    def _open(self, start: int, job: _Job) -> Admitted:
        lane = _Lane(self._next_lane, start, 0, [])
        self._next_lane += 1
        self._lanes[lane.id] = lane
        self._join(lane, job)
        return Admitted(job.id, lane.id, new_lane=True)

    def _join(self, lane: _Lane, job: _Job) -> Admitted:
        lane.jobs.append(job.id)
        job.lane = lane.id
        self._fit(lane)
        return Admitted(job.id, lane.id, new_lane=False)

    def _gap_for(self, need: int, pinned: AbstractSet[int]) -> int | None:
        """Start of a free gap of ``need`` bytes, compacting the movable lanes if that makes one."""
        blocks = self._blocks()
        start = best_gap(gaps(blocks, self.capacity), need)
        if start is not None:
            return start
        plan = compact(blocks, self.capacity, pinned)
        start = best_gap(gaps(moved(blocks, plan), self.capacity), need)
        if start is not None:
            self._apply(blocks, plan)
        return start

    def _room_for(self, lane: _Lane, growth: int, pinned: AbstractSet[int]) -> bool:
        """Make ``growth`` bytes free directly after ``lane``, moving lanes if needed."""
        blocks = self._blocks()
        if room_after(blocks, self.capacity, lane.id) >= growth:
            return True
        plan = compact(blocks, self.capacity, pinned, toward=lane.id)
        if room_after(moved(blocks, plan), self.capacity, lane.id) < growth:
            return False
        self._apply(blocks, plan)
        return True

    def _drain(self, in_flight: AbstractSet[Hashable]) -> list[Admitted]:
        admitted = []
        while self._queue:  # strict arrival order: stop at the first job that does not fit
            placed = self._place(self._jobs[self._queue[0]], in_flight)
            if placed is None:
                break
            self._queue.popleft()
            admitted.append(placed)
        return admitted

    def _apply(self, blocks: list[Block], plan: dict[int, int]) -> list[Move]:
        down = [Move(b.id, b.offset, plan[b.id]) for b in blocks if plan[b.id] < b.offset]
        up = [Move(b.id, b.offset, plan[b.id]) for b in reversed(blocks) if plan[b.id] > b.offset]
        for move in down + up:
            self._lanes[move.lane_id].offset = move.new_offset
        return down + up

    # ------------------------------------------------------------------ helpers

    def _job(self, job_id: Hashable) -> _Job:
        try:
            return self._jobs[job_id]
        except KeyError:
            raise KeyError(f"job {job_id!r} is neither admitted nor queued in this arena") from None

    def _resident(self, lane: _Lane) -> list[_Job]:
        return [job for job in map(self._jobs.__getitem__, lane.jobs) if not job.swapped]

    def _growth(self, lane: _Lane, job: _Job) -> int:
        """Bytes ``lane`` grows by when ``job`` joins it (or returns to it from the host)."""
        lane_e = max((j.ephemeral for j in self._resident(lane)), default=0)
        return job.persistent + max(0, job.ephemeral - lane_e)

    def _fit(self, lane: _Lane) -> None:
        """Set the lane's size to what its resident jobs need (grows or shrinks at its end)."""
        resident = self._resident(lane)
        lane.size = sum(j.persistent for j in resident) + max((j.ephemeral for j in resident), default=0)

    def _blocks(self) -> list[Block]:
        """The layout: lanes that hold bytes, by offset (all-swapped lanes hold none)."""
        return sorted((Block(l.id, l.offset, l.size) for l in self._lanes.values() if l.size > 0),
                      key=lambda b: b.offset)

    def _pinned(self, in_flight: AbstractSet[Hashable]) -> set[int]:
        """Lanes that must not move: a resident member has a step in flight."""
        pinned = set()
        for job_id in in_flight:
            job = self._jobs.get(job_id)
            if job is not None and job.lane is not None and not job.swapped:
                pinned.add(job.lane)
        return pinned

    def _reason(self, job: _Job, ahead: int, in_flight: AbstractSet[Hashable]) -> str:
        reason = f"needs {job.describe()}; largest free gap {format_bytes(self.largest_gap)}"
        if ahead:
            return f"{reason}, {ahead} job{'s' if ahead != 1 else ''} ahead in queue"
        if self.free >= job.need:
            return (f"{reason}, {format_bytes(self.free)} free in all but lanes with a step in "
                    "flight cannot move to gather it")
        return f"{reason}, {format_bytes(self.free)} free in all"
