"""The dispatcher's fusion-group lifecycle: open, join, adopt, grow, shrink, leave.

A group (``fusion.Group``) is one runnable unit to the planner and one reservation in the arena;
its members stay jobs. There is no group of one: a group opens for jobs submitted together, or
when a later job finds running jobs of its program (or of its constant-lifted family, see
``sweeps``) that it can adopt at a step boundary. Under a runtime's ``group_capacity`` (a floor,
``sched/capacity.py``) groups open with at least that many slots, a lone job of a program others
run opens one, and a group never shrinks below it. Runs on the dispatcher thread only.
"""

from __future__ import annotations

import logging
from typing import Any

import jax

from ... import ffi
from ...memory import Admitted
from ...sched.capacity import open_capacity, opens_alone, shrink_pays, shrink_target
from ..compiled import fusion
from ..causes import short_error
from ..compiled.fusion import Group
from .records import JobRecord
from .source import own
from .states import JobState

log = logging.getLogger("xshare.runtime")

S = JobState


class Groups:
    """Fusion groups: the lifecycle of the units that hold several jobs. A part of ``Dispatcher``:
    its methods run on the dispatcher thread and share the dispatcher's tables."""

    def _join_group(self, job: JobRecord) -> bool:
        """Put ``job`` in a slot of a group of its program (growing the group, or opening one,
        if memory allows). False: it runs on its own (no room for a group)."""
        self.owned()
        key = job.program.key
        same = [g for g in self.groups.values() if g.program.key == key]
        group = next((g for g in same if g.free_slot() is not None), None)
        if group is None and same:
            group = self._grow(same[0])
        solos: list = []
        if group is None and not same:
            # No group of one: a group opens for jobs submitted together, or with jobs of this
            # program (or its unlifted family) that run alone now and move in at this boundary.
            # With a floor (``group_capacity``), a job of a program others run opens it alone.
            solos = self._adoptable(job)
            floor = self.config.group_capacity
            if not opens_alone(job.fuse_hint, len(solos), job.shared, floor):
                return False
            group = self._open_group(job.program, open_capacity(job.fuse_hint + len(solos), floor))
        if group is None:
            return False
        for solo, lifted in solos:
            if group.free_slot() is not None:
                self._adopt(solo, group, lifted)
        slot = group.free_slot()
        try:
            leaves = job.host_arrays if job.host_arrays is not None else job.initial_arrays()
            group.arrays = fusion.put(group.fused, group.arrays, leaves, slot)
        except Exception as err:  # noqa: BLE001
            self.life.abort(job, f"could not place its state in {group.name}: {short_error(err)}", err)
            return True
        group.slots[slot] = job
        job.group, job.slot, job.lane, job.host_arrays = group, slot, group.lane, None
        self.recorder.line(job, f"compiled: joined {group.name} (slot {slot} of {group.capacity}, "
                                f"lane {group.lane}; group {group.fused.footprint.describe()})")
        self.admission.start(job)
        self.units.run(group)
        return True

    def _adoptable(self, job: JobRecord) -> list:
        """(solo job, its lifted values) of running jobs that can step in ``job``'s program."""
        out = []
        for other in self.units.running.values():
            if other.is_group or other.group is not None or other.arrays is None or other is job:
                continue
            if other.state is not S.RUNNING or other.error is not None or other.steps_left == 0:
                continue
            if other.program.key == job.program.key:
                out.append((other, other.lifted))
            elif (lifted := self.sweeps.adoptable(other.traced, job.program)) is not None:
                out.append((other, lifted))
        return out

    def _adopt(self, solo: JobRecord, group: Group, lifted: tuple) -> None:
        """Move a job that steps alone into ``group`` at this step boundary: its state (plus
        its constants, if the group's program lifted them) goes into a free slot, and its own
        reservation is released (the group's holds every member)."""
        self._drain_inflight()  # its newest state is on the device
        slot = group.free_slot()
        arrays = list(solo.arrays)[:solo.layout.n_arrays] + list(lifted)
        group.arrays = fusion.put(group.fused, group.arrays, arrays, slot)
        self.units.stop(solo)
        self.units.leave_lane(solo)
        solo.arrays, solo.program, solo.lifted = None, group.program, tuple(lifted)
        group.slots[slot] = solo
        solo.group, solo.slot, solo.lane = group, slot, group.lane
        if solo.in_ledger:
            solo.in_ledger = False
            self.admission.release(solo.id)
        self.recorder.line(solo, f"moved into {group.name} (slot {slot} of {group.capacity}) at step "
                                 f"{solo.spec.start_step + solo.steps_done}")
        self.units.changed = True

    def _open_group(self, program: Any, capacity: int) -> Group | None:
        fused = fusion.fused_program(program, capacity, self.device, fenced=self.ring is not None,
                                     **self._staging())
        gid = next(self.ids)   # one id space with jobs: fences and the timeline name either
        self._groups_opened += 1
        fp = fused.footprint
        if self.arena.queue or fp.resident + fp.ephemeral > self.arena.free:
            return None  # never overtake the queue for a group; its jobs run (or queue) alone
        placed = self.arena.admit(gid, fp.resident, fp.ephemeral, name=f"group-{self._groups_opened - 1}")
        if not isinstance(placed, Admitted):  # pragma: no cover - checked above
            self.arena.release(gid)
            return None
        arrays = fusion.host_stack(program, capacity)
        ident = (jax.device_put(ffi.ident(self.ring, gid, placed.lane_id), self.device)
                 if self.ring is not None else None)
        group = Group(gid, program, fused, placed.lane_id, arrays, ident, name=f"group-{self._groups_opened - 1}")
        self.groups[gid] = group
        return group

    def _grow(self, group: Group) -> Group | None:
        """Double a full group's capacity at this step boundary (a new slot for a joiner)."""
        bigger = fusion.fused_program(group.program, 2 * group.capacity, self.device,
                                      fenced=self.ring is not None, **self._staging())
        if not self._resize(group, bigger):
            return None
        self._drain_inflight()  # the stack is rebuilt from the group's newest state
        group.arrays = fusion.regroup(group.arrays, list(range(group.capacity)), bigger.capacity)
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
        fenced = self.ring is not None
        # Compiling the smaller program (here, on the dispatcher) pays only if the members have
        # enough steps left to win that time back (a sweep ending in lockstep does not), and
        # never below the runtime's floor (sched/capacity.py).
        target = shrink_target(len(members), group.capacity, self.config.group_capacity)
        if target is None:
            return
        if not fusion.cached(group.program, target, fenced=fenced, **self._staging()):
            lefts = [j.steps_left for _, j in members]
            if not shrink_pays(target, group.capacity,
                               steps_left=None if any(x is None for x in lefts) else max(lefts, default=0),
                               step_s=group.step_estimate_s(self.timeline.flops_per_s),
                               compile_s=group.fused.compile_s):
                return
        smaller = fusion.fused_program(group.program, target, self.device, fenced=fenced, **self._staging())
        if not self._resize(group, smaller):
            return
        group.arrays = fusion.regroup(group.arrays, [i for i, _ in members], target)
        group.slots = [j for _, j in members] + [None] * (target - len(members))
        for slot, job in enumerate(group.slots):
            if job is not None:
                job.slot = slot
        group.fused = smaller
        self.units.changed = True
        self.admission.retry()  # the bytes it gave back may admit a queued job

    def _staging(self) -> dict:
        """What a fused program's footprint charges beyond its states: staged and in-flight batches."""
        return self.config.staging

    def _resize(self, group: Group, fused: Any) -> bool:
        fp = fused.footprint
        return self.arena.resize(group.id, fp.resident, fp.ephemeral)

    def _leave_group(self, job: JobRecord) -> None:
        self.owned()
        group = job.group
        group.slots[job.slot] = None
        job.group = job.slot = None
        with job.feed_lock:
            # Its queued batches were made for stacking, not copied (source.produce): it may
            # step alone next, and a solo step donates its batch, so they are owned now.
            queued = list(job.batches)
            job.batches.clear()
            job.batches.extend(own(b, self.device) if isinstance(b, list) else b for b in queued)
        if group.members:
            self._shrink(group)
            return
        self.groups.pop(group.id, None)
        self.units.stop(group)
        self.units.leave_lane(group)
        group.arrays = group.ident = None
        self.units.changed = True
        self.admission.release(group.id)
