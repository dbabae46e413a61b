"""Fusion groups' lifecycle: open, join, adopt, grow, shrink, leave.

A group (``group.Group``) is one runnable unit to the planner and one reservation in the arena;
its members stay jobs. There is no group of one: a group opens for jobs submitted together, or
when a later job finds running jobs of its program (or of its constant-lifted family, see
``compiled/sweeps.py``) that it can adopt at a step boundary. Under a runtime's
``group_capacity`` (a floor, ``sched/capacity.py``) groups open with at least that many slots,
a lone job of a program others run opens one, and a group never shrinks below it.

No jax here: compiling a group's program and moving states in its stack go through a
``GroupDevice`` (``group_device.py``), so the group decisions are tested on hand-made jobs and
the real (pure) arena (``tests/runtime/engine/test_groups.py``). Owned by the dispatcher thread.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from ...memory import Admitted
from ...sched.capacity import opens_alone, parallel_groups, shrink_pays, shrink_target, split_capacity
from ..causes import short_error
from ..compiled.payoff import FUSION, unmeasured
from .admission import Admission
from .group import Group
from .states import JobState
from .units import Units

S = JobState

# Why a job of a fused runtime steps alone for now (``Prepared.unfused``): its group's program
# compiles while its own was ready (``prepare.Preparation._group_later``); ``gather`` moves it in.
GROUP_COMPILING = "its group's program is compiling: it steps alone on its own program meanwhile"


class GroupDevice(Protocol):
    """The device effects of groups (``group_device.GroupDevice``)."""

    platform: str  # the device's (what fusing costs there: payoff.unmeasured)

    def program(self, program: Any, capacity: int) -> Any: ...

    def cached(self, program: Any, capacity: int) -> bool: ...

    def open(self, gid: int, program: Any, fused: Any, lane: int, name: str) -> Group: ...

    def put(self, group: Group, leaves: list, slot: int) -> None: ...

    def regroup(self, group: Group, slots: list[int], fused: Any) -> None: ...


class Groups:
    """The fusion groups of one runtime, by id.

    ``drain()``: retire every step in flight (a group's stack is rebuilt, or a job moves into
    one, from the newest state). ``abort(job, cause, err)``: end a job that cannot join (the
    lifecycle's). ``sweeps``: the runtime's ``Sweeps`` (which running jobs a program can adopt).
    """

    def __init__(self, units: Units, arena: Any, admission: Admission, recorder: Any, device: GroupDevice, *,
                 floor: int | None, ids: Any, timeline: Any, drain: Callable[[], None], measured: bool = True,
                 streams: int = 1):
        self.units, self.arena, self.admission, self.recorder = units, arena, admission, recorder
        self.streams = streams  # execution streams that run side by side (engine/streams.py)
        self.device, self.floor, self.ids, self.timeline, self.drain = device, floor, ids, timeline, drain
        self.measured = measured  # fuse=True: a program measured to lose fused opens no group
        self.abort: Callable[[Any, str, BaseException | None], None] = _unwired
        self.sweeps: Any = None
        self.groups: dict[int, Group] = {}
        self.opened = 0

    def join(self, job: Any) -> bool:
        """Put ``job`` in a slot of a group of its program (growing the group, or opening one,
        if memory allows). False: it runs on its own (no room for a group, or fusing its program
        does not pay: ``job.unfused``)."""
        if job.unfused is not None:
            return False
        key = job.program.key
        same = [g for g in self.groups.values() if g.program.key == key]
        group = next((g for g in same if g.free_slot() is not None), None)
        # Jobs submitted together open a group per execution stream that runs beside the
        # others (sched/capacity.py: parallel_groups): the later ones open the next group
        # rather than grow the first.
        another = bool(same) and len(same) < parallel_groups(job.fuse_hint, self.streams, self.floor)
        if group is None and same and not another:
            group = self._grow(same[0])
        solos: list = []
        if group is None and (not same or another):
            # No group of one: a group opens for jobs submitted together, or with jobs of this
            # program (or its unlifted family) that run alone now and move in at this boundary.
            # With a floor (``group_capacity``), a job of a program others run opens it alone.
            solos = [] if same else self._adoptable(job)
            if not opens_alone(job.fuse_hint, len(solos), job.shared, self.floor):
                return False
            joining = job.fuse_hint + len(solos)
            capacity = split_capacity(joining, self.streams, self.floor)
            # Measured to cost its members more fused than alone, or never measured and known
            # to lose on this platform (payoff.unmeasured): they run alone.
            if self.measured and FUSION.weigh(key, capacity, min(joining, capacity), None, 0.0,
                                              prior=unmeasured(self.device.platform, job.program.convolves)):
                return False
            group = self._open(job.program, capacity)
        if group is None:
            return False
        # The running jobs that move in share the groups with the joiner, a slot of this one
        # kept for it: 6 jobs left alone by a dissolved group, adopted by a 7th into a group of
        # 4 slots, filled it, the joiner found no slot, and neither it nor the group ever stepped.
        share = _share(1 + len(solos), group.capacity)
        for solo, lifted in solos[:share - 1]:
            self._adopt(solo, group, lifted)
        self._open_with(job.program, solos[share - 1:], group.capacity)
        slot = group.free_slot()
        assert slot is not None  # (grown, opened with room, or found with a free slot)
        try:
            self.device.put(group, job.host_arrays if job.host_arrays is not None else job.initial_arrays(), slot)
        except Exception as err:  # noqa: BLE001 - the job fails, its group goes on
            self.abort(job, f"could not place its state in {group.name}: {short_error(err)}", err)
            if group.members:  # (with the running jobs it adopted: they step on in it)
                self.units.run(group)
            return True
        group.slots[slot] = job
        job.group, job.slot, job.lane, job.host_arrays = group, slot, group.lane, None
        self.recorder.line(job, f"compiled: joined {group.name} (slot {slot} of {group.capacity}, "
                                f"lane {group.lane}; group {group.fused.footprint.describe()})")
        self.admission.start(job)
        self.units.run(group)
        return True

    def gather(self, program: Any, jobs: list, compiled: bool) -> None:
        """The group program of ``jobs`` (stepping alone while it compiled) is ready, or failed
        (``compiled`` False): those still running move into one group at this step boundary if
        at least two do and fusing pays by what was measured (``FUSION``; its compile is paid
        now); the others, and jobs not yet admitted, join as any job would from now."""
        waiting = [job for job in jobs if job.unfused == GROUP_COMPILING]
        for job in waiting:
            job.unfused = None if compiled else "its group's program did not compile"
        movers = [job for job in waiting if compiled and self._can_adopt(job) and job.program.key == program.key]
        if not movers or any(g.program.key == program.key for g in self.groups.values()):
            return  # (a group of the program opened meanwhile: later joiners adopt them)
        if not opens_alone(len(movers), 0, False, self.floor):
            return
        capacity = split_capacity(len(movers), self.streams, self.floor)
        lefts = [job.steps_left for job in movers]
        reason = FUSION.weigh(program.key, capacity, min(len(movers), capacity), None if None in lefts else sum(lefts),
                              0.0, prior=unmeasured(self.device.platform, program.convolves)
                              ) if self.measured else None
        if reason is not None:
            for job in movers:
                job.unfused = reason
                self.recorder.line(job, f"stays alone: {reason}")
            return
        self._open_with(program, [(job, job.lifted) for job in movers], capacity)

    def leave(self, job: Any) -> None:
        """``job`` leaves its slot (it ended, or goes to host memory): the group shrinks if it
        pays, or closes and gives its reservation back once empty."""
        group = job.group
        group.slots[job.slot] = None
        job.group = job.slot = None
        if group.members:
            self._shrink(group)
            return
        self._close(group)

    def dissolve(self, group: Group) -> None:
        """Every member leaves at once (fusing does not pay: they step alone from now, their
        states taken from the stack first) and the group closes, without resizing on the way."""
        for job in group.members:
            group.slots[job.slot] = None
            job.group = job.slot = None
        self._close(group)

    def _close(self, group: Group) -> None:
        # Its last steps' fence records are paired while it can still be found by id: the
        # recorder drains only a few times a second, and records of a unit it cannot find are
        # dropped (a fused run's timeline lost up to its last ~200 ms of group steps).
        self.timeline.drain()
        self.groups.pop(group.id, None)
        self.units.stop(group)
        self.units.leave_lane(group)
        group.arrays = group.ident = None
        self.units.changed = True
        self.admission.release(group.id)

    def get(self, gid: int) -> Group | None:
        return self.groups.get(gid)

    def all(self) -> list[Group]:
        """The open groups (a copy: readers on other threads iterate it safely)."""
        return list(self.groups.values())

    def forget(self, job: Any) -> None:
        """An ending job (the lifecycle's owners): out of its group, if it has one."""
        if job.group is not None:
            self.leave(job)

    # ------------------------------------------------------------------ opening and adopting
    def _adoptable(self, job: Any) -> list:
        """(solo job, its lifted values) of running jobs that can step in ``job``'s program."""
        out = []
        for other in self.units.running.values():
            if other is job or other.is_group or other.unfused is not None or not self._can_adopt(other):
                continue
            if other.program.key == job.program.key:
                out.append((other, other.lifted))
            elif self.sweeps is not None and (lifted := self.sweeps.adoptable(other.traced, job.program)) is not None:
                out.append((other, lifted))
        return out

    @staticmethod
    def _can_adopt(job: Any) -> bool:
        """Whether ``job`` steps alone now, with steps left, and could move into a group."""
        return (job.group is None and job.arrays is not None and job.state is S.RUNNING
                and job.error is None and job.steps_left != 0)

    def _adopt(self, solo: Any, group: Group, lifted: tuple) -> None:
        """Move a job that steps alone into ``group`` at this step boundary: its state (plus
        its constants, if the group's program lifted them) goes into a free slot, and its own
        reservation is released (the group's holds every member)."""
        self.drain()  # its newest state is on the device
        slot = group.free_slot()
        assert slot is not None
        self.device.put(group, list(solo.arrays)[:solo.layout.n_arrays] + list(lifted), slot)
        self.units.stop(solo)
        self.units.leave_lane(solo)
        solo.arrays, solo.program, solo.lifted = None, group.program, tuple(lifted)
        group.slots[slot] = solo
        solo.group, solo.slot, solo.lane = group, slot, group.lane
        self.admission.withdraw(solo)
        self.recorder.line(solo, f"moved into {group.name} (slot {slot} of {group.capacity}) at step "
                                 f"{solo.spec.start_step + solo.steps_done}")
        self.units.changed = True

    def _open_with(self, program: Any, movers: list[tuple[Any, tuple]], capacity: int) -> None:
        """Groups of ``capacity`` slots for running jobs (with their lifted values) that move in
        at this step boundary, as few as hold them, shared out evenly (a group per stream:
        ``parallel_groups``); a share of one stays alone (there is no group of one), and so do
        those left when the arena has no room for another group's reservation."""
        share = _share(len(movers), capacity)
        for first in range(0, len(movers), share):
            chunk = movers[first:first + share]
            if len(chunk) < 2:
                return
            group = self._open(program, capacity)
            if group is None:
                return
            for solo, lifted in chunk:
                self._adopt(solo, group, lifted)
            self.units.run(group)

    def _open(self, program: Any, capacity: int) -> Group | None:
        fused = self.device.program(program, capacity)
        gid = next(self.ids)   # one id space with jobs: fences and the timeline name either
        name = f"group-{self.opened}"
        self.opened += 1
        fp = fused.footprint
        if self.arena.queue or fp.resident + fp.ephemeral > self.arena.free:
            return None  # never overtake the queue for a group; its jobs run (or queue) alone
        placed = self.arena.admit(gid, fp.resident, fp.ephemeral, name=name)
        if not isinstance(placed, Admitted):  # pragma: no cover - checked above
            self.arena.release(gid)
            return None
        group = self.device.open(gid, program, fused, placed.lane_id, name)
        self.groups[gid] = group
        return group

    # ------------------------------------------------------------------ resizing
    def _grow(self, group: Group) -> Group | None:
        """Double a full group's capacity at this step boundary (a new slot for a joiner)."""
        bigger = self.device.program(group.program, 2 * group.capacity)
        if not self._resize(group, bigger):
            return None
        self.drain()  # the stack is rebuilt from the group's newest state
        self.device.regroup(group, list(range(group.capacity)), bigger)
        group.slots += [None] * (bigger.capacity - group.capacity)
        group.fused = bigger
        self.units.changed = True
        return group

    def _shrink(self, group: Group) -> None:
        """Repack a group whose members fit in a quarter of its slots into a smaller one: the
        step then costs what its members need (their slots move; their states do not change)."""
        members = [(i, j) for i, j in enumerate(group.slots) if j is not None]
        if group.in_flight:
            return
        # Compiling the smaller program (here, on the dispatcher) pays only if the members have
        # enough steps left to win that time back (a sweep ending in lockstep does not), and
        # never below the runtime's floor (sched/capacity.py).
        target = shrink_target(len(members), group.capacity, self.floor)
        if target is None:
            return
        if not self.device.cached(group.program, target):
            lefts = [j.steps_left for _, j in members]
            if not shrink_pays(target, group.capacity,
                               steps_left=None if any(x is None for x in lefts) else max(lefts, default=0),
                               step_s=group.step_estimate_s(self.timeline.flops_per_s),
                               compile_s=group.fused.compile_s):
                return
        smaller = self.device.program(group.program, target)
        if not self._resize(group, smaller):
            return
        self.device.regroup(group, [i for i, _ in members], smaller)
        group.slots = [j for _, j in members] + [None] * (target - len(members))
        for slot, job in enumerate(group.slots):
            if job is not None:
                job.slot = slot
        group.fused = smaller
        self.units.changed = True
        self.admission.retry()  # the bytes it gave back may admit a queued job

    def _resize(self, group: Group, fused: Any) -> bool:
        fp = fused.footprint
        return bool(self.arena.resize(group.id, fp.resident, fp.ephemeral))


def _share(jobs: int, capacity: int) -> int:
    """How many of ``jobs`` each group of ``capacity`` slots takes when as few groups as hold
    them share them out evenly (5 in groups of 4: 3 and 2, not 4 and 1)."""
    groups = max(-(-jobs // capacity), 1)
    return max(-(-jobs // groups), 1)


def _unwired(job: Any, cause: str, err: BaseException | None) -> None:
    raise AssertionError(f"Groups.abort is not wired (job {job.name!r}: {cause})")
