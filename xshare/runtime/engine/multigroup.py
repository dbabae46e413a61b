"""Fused groups' steps: one group step (every stepping member's batch, stacked, idle slots
masked), and K group steps in one executable call.

The same tiers as a solo job's (``tiers.py``, ``multicall.py``), for a group's program at its
capacity: after its warm-up steps the group's K-step program compiles in the background, is
checked against K single group steps from one copy of the stack (bit for bit) and measured,
and the group moves to it at a step boundary. A call runs K steps of every member that steps
in it (one mask for all K), so K never passes any stepping member's boundary or the batches it
has ready. A group that grows or shrinks (another capacity) starts again at one step per call.
``GroupCalls`` runs them on the executor's pipeline (``executor.Executor``, which makes it;
dispatcher thread only).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from ...sched import steps as ksteps
from . import evaluation, fusecheck
from ..compiled import fusion, multistep
from ..causes import short_error
from ..config import RuntimeConfig
from .group import Group
from ..compiled.multistep import MultiStep, Verdict
from ..compiled.payoff import group_key
from .lifecycle import Lifecycle
from .multicall import MultiCalls, _done, call, call_cap, chain, compare, run_steps, scratch_ident, state_copy
from .records import JobRecord
from .source import END, DataError, Feeding, owned
from .tiers import WARM_STEPS, Candidate, Tiers, typical_step_s
from .units import Units

if TYPE_CHECKING:  # (the executor makes this part and hands itself in: a cycle for types only)
    from .executor import Executor


class GroupCalls:
    """Fused groups' steps, one or K per call, and their promotion. ``pipeline``: the executor
    whose steps in flight they join; ``multi``: the solo jobs' K-step calls (each member's
    boundaries and ready batches)."""

    def __init__(self, pipeline: Executor, multi: MultiCalls, *, units: Units, life: Lifecycle,
                 tiers: Tiers, feeding: Feeding, config: RuntimeConfig, recorder: Any, timeline: Any,
                 device: Any, ring: int | None, arena: Any):
        self.pipeline, self.multi, self.units, self.life, self.tiers = pipeline, multi, units, life, tiers
        self.feeder, self._fed = feeding.feeder, feeding.fed
        self.config, self.recorder, self.timeline = config, recorder, timeline
        self.device, self.ring, self.arena = device, ring, arena

    def turn(self, group: Group, li: int, pos: int) -> None:
        """A group's turn at one step per call: a run of group steps (``run``), or one."""
        n = self.run_length(group)
        if n > 1:
            self.run(group, li, pos, n)
        else:
            self.step(group, li, pos)

    def run_length(self, group: Group) -> int:
        """How many group steps a run makes (``Executor.run_length``'s rule for a solo job:
        about ``RUN_S`` of the group's measured steps, never past a stepping member's boundary
        or its batches ready); 1 on an accelerator, before the group's steps are measured, and
        while its fusion is still being measured (``fusecheck``: it times single steps)."""
        if not self.pipeline.runs_free or group.payoff is not fusecheck.SETTLED or group.steps_run < WARM_STEPS:
            return 1
        step_s = self.pipeline.measured_step_s(group)
        if step_s is None:
            return 1
        want = run_steps(step_s)
        return 1 if want < 2 else self.steps_this_call(group, tuple(range(1, want + 1)))

    def run(self, group: Group, li: int, pos: int, n: int) -> None:
        """``n`` group steps in one turn, each a call of the group's one-step program with the
        same members and mask: the calls ``n`` turns would make, so the members end as they
        would (``Executor.run`` for a solo job). A call that raises fails every member, as in
        ``step``; the group steps before it count."""
        taken, stacked, mask = self.take_batches(group, n)
        group.now = None
        if fusion.on_host(group.arrays):  # its first step: the stack its members joined goes over
            group.arrays = jax.device_put(group.arrays, self.device)
        t = time.monotonic_ns()
        group.arrays, rows, failed = chain(group.fused.executable, group.arrays, group.ident, self.pipeline.host_copy,
                                           (([leaf[i] for leaf in stacked], mask) for i in range(n)))
        if rows:
            self._stepped(group, li, pos, taken, rows if len(rows) > 1 else rows[0], t, len(rows), per_call=1)
        if failed is not None:  # as in step(): the donated stack is gone, every member fails
            err = failed[1]
            for job in group.members:
                self.life.fail(job, f"fused step of {group.name} raised: {short_error(err)}", err)
                self.life.settle(job)
            return
        self.pipeline.after_run()

    def step(self, group: Group, li: int, pos: int) -> None:
        """One fused step: every stepping member's own batch, stacked; idle slots masked.

        Members whose next item is not a batch the step can take (their data ended or raised,
        or a batch of another shape) are dealt with first, and only then are the slots and
        the capacity read: such a member may end and leave its slot, and the last to leave may
        shrink the group (``Groups.leave``), which moves the members left to other slots of a
        smaller program. Read before, they stacked the step at the old capacity for the new
        program, and every member failed (a random sweep with ``dispatch_ahead=0``)."""
        members, group.now = group.now or group.stepping(), None
        aside: set[JobRecord] = set()  # members that stepped a batch of another shape alone just now
        while self._end_unsteppable(group, members, aside):
            members = group.stepping()  # who is left, in which slots (the group may have shrunk)
        if aside:
            members = [(slot, job) for slot, job in members if job not in aside]
        taken: dict[int, tuple[JobRecord, int, list]] = {}
        for slot, job in members:
            if self._fed(job):
                self.feeder.request(job)
            taken[slot] = (job, job.spec.start_step + job.dispatched, job.batches.popleft())
        if not taken:
            self.units.changed = True
            return
        capacity = group.capacity
        mask = np.zeros((capacity,), np.bool_)
        mask[list(taken)] = True
        stacked = [np.stack([taken[s][2][i] if s in taken else zero for s in range(capacity)])
                   for i, zero in enumerate(group.zero_batch)]
        if fusion.on_host(group.arrays):  # its first step: the stack its members joined goes over
            group.arrays = jax.device_put(group.arrays, self.device)
        t = time.monotonic_ns()
        try:
            args = (group.arrays, (stacked, mask)) + ((group.ident,) if group.ident is not None else ())
            outs = group.fused.executable(*args)
        except Exception as err:  # noqa: BLE001 - an error inside the fused step
            # The step's donated inputs, the whole stack, are gone with it: every member fails,
            # the paused ones too (their slots were in the stack). The group dissolves as the
            # last one leaves (Lifecycle.end -> Groups.leave).
            for job in group.members:
                self.life.fail(job, f"fused step of {group.name} raised: {short_error(err)}", err)
                self.life.settle(job)
            return
        group.arrays = outs[0]
        group.steps_run += 1
        group.fused_member_steps += len(taken)
        self.pipeline.fused_member_steps += len(taken)
        group.in_flight += 1
        steps = {}
        for slot, (job, step, _) in taken.items():
            job.dispatched += 1
            job.in_flight += 1
            if job.eval is not None:
                evaluation.due(self.units, job, step)
            # (A member whose last step this is stays masked in later group steps, so its
            # final state can be read from its slot whenever it is retired: see placement.state_of.)
            steps[slot] = (job, step)
        self.pipeline.took_turn(group, li, pos)
        self.pipeline.inflight.append((group, steps, outs[1], t, 1))
        if self.pipeline.host_copy:
            outs[1].copy_to_host_async()  # (Executor.host_copy)
        self.pipeline.checkpoint_members(steps, 1)

    def _end_unsteppable(self, group: Group, members: list, aside: set) -> bool:
        """Take the next item of each of ``members`` that cannot step in the group (the end of
        its data, a data error, a batch of another structure: it ends or fails; a batch of other
        shapes: a step alone, ``side_step``, then it sits this group step out, in ``aside``);
        True if any did (the group's members, slots and capacity may have changed since
        ``members`` was read)."""
        ended = False
        for _, job in members:
            if job in aside:
                continue
            batch = job.batches[0]  # (``Feeding.ready`` found one for every stepping member)
            if batch is END or isinstance(batch, DataError):
                self.pipeline.dispatch_marker(job, job.batches.popleft())
                ended = True
                continue
            bad = _shape_mismatch(batch, group.zero_batch)
            if bad and self.pipeline.shapes.differs(job, batch):
                self.side_step(group, job)
                aside.add(job)
                ended = True
            elif bad:
                job.batches.popleft()
                self.life.fail(job, f"batch {job.spec.start_step + job.dispatched} does not match the "
                                    f"compiled step: {bad}")
                self.life.settle(job)
                ended = True
        return ended

    def side_step(self, group: Group, job: JobRecord) -> None:
        """One step of a member on a batch of other shapes than its group's (a short last
        batch): its state out of its slot, its step compiled for those shapes (``shapes.py``),
        the new state back into the slot; the group's steps around it are the member's steps
        before and after. While that program compiles the member waits, masked (``job.waiting``),
        and the others step on."""
        batch, step = job.batches[0], job.spec.start_step + job.dispatched
        try:
            program = self.pipeline.shapes.program(job, batch, step)
        except ValueError as err:
            job.batches.popleft()
            self.life.fail(job, str(err), err)
            self.life.settle(job)
            return
        if program is None:
            return  # compiling: masked from the group's steps until it is (its batch stays first)
        job.batches.popleft()
        n, slot = job.layout.n_arrays, job.slot
        assert slot is not None  # (a member: it has a slot)
        leaves = list(fusion.take(group.fused, group.arrays, slot))
        scratch = scratch_ident(group, self.ring, self.device)
        t = time.monotonic_ns()
        try:
            outs = program.executable(leaves[:n], owned(batch, self.device),
                                      *(() if scratch is None else (scratch,)))
        except Exception as err:  # noqa: BLE001 - its step raised: it fails alone
            self.life.fail(job, f"step {step} raised: {short_error(err)}", err)
            self.life.settle(job)
            return
        group.arrays = fusion.put(group.fused, group.arrays, list(outs[0]) + leaves[n:], slot)
        job.dispatched += 1
        job.in_flight += 1
        self.pipeline.inflight.append((job, step, outs[1], t, 1))  # (retired as a solo step)
        if job.eval is not None:
            evaluation.due(self.units, job, step)
        self.pipeline.checkpoint_members({slot: (job, step)}, 1)

    def tier_turn(self, group: Group, li: int, pos: int) -> bool:
        """A group's turn at its tiers: True if this turn's steps ran here."""
        tier = group.tier
        if tier.capacity != group.capacity:  # grown or shrunk: another program
            group.tier = None
            return False
        if tier.pending is not None and tier.pending.done() and self.promote(group, li, pos):
            return True  # (the check ran this turn's steps; a form adopted without one runs now)
        if tier.multi is not None:
            k = self.steps_this_call(group, tier.available(), tier.upto())
            if k > 1:
                self.dispatch(group, li, pos, k)
                return True
        return False

    def steps_this_call(self, group: Group, available: tuple[int, ...], upto: int = 1) -> int:
        members = group.stepping()
        if not members:
            return 1
        cap = None
        if self.config.preemptive:
            step_s = group.step_time_s if group.step_time_s is not None else group.tier.step_s
            cap = call_cap(self.config, step_s)
        k = max(max(available), upto)
        for _, job in members:
            k = min(k, ksteps.steps_per_call(self.multi.bounds_under(job, cap), available, upto))
            if k == 1:
                return 1
        for _, job in members:
            ready = self.multi.ready_batches(job, k)
            if ready < k:
                k = ksteps.steps_per_call(ksteps.Bounds(ready=ready), available, upto)
                if k == 1:
                    return 1
        return k

    def take_batches(self, group: Group, k: int, rows: int | None = None) -> tuple[dict, list, np.ndarray]:
        """Every stepping member's next ``k`` batches, stacked (k, capacity, ...) per leaf (padded
        with zero steps to ``rows``: a rolled program's K, for a call of fewer steps), with
        the slot mask. Called right after ``steps_this_call`` answered at least ``k`` in the same
        turn: that counted, for each member, the batches that fit the group's program
        (``ready_batches``; a batch of other shapes stops the count, so the call stops before
        it and the one-step path deals with it), and they are these."""
        members = group.stepping()
        taken = {}
        for slot, job in members:
            taken[slot] = (job, job.spec.start_step + job.dispatched, [job.batches.popleft() for _ in range(k)])
            if self._fed(job):
                self.feeder.request(job, k)
        capacity = group.capacity
        mask = np.zeros((capacity,), np.bool_)
        mask[list(taken)] = True
        # Per leaf, one ``np.array`` of its k * capacity rows in (step, slot) order (an idle
        # slot's rows are zeros): one copy of each, ~20% less of the dispatcher's time than a
        # row assigned at a time (44 against 54 us a call, K=16 x 4 slots of the hook's batch).
        batches = [taken[slot][2] if slot in taken else None for slot in range(capacity)]
        steps = max(k, rows or k)
        stacked = []
        for leaf, zero in enumerate(group.zero_batch):
            items = [zero if b is None else b[i][leaf] for i in range(k) for b in batches]
            if steps > k:
                items += [zero] * ((steps - k) * capacity)
            stacked.append(np.array(items).reshape((steps, capacity) + zero.shape))
        return taken, stacked, mask

    def dispatch(self, group: Group, li: int, pos: int, k: int) -> None:
        """K steps of ``group`` in one call of its K-step program."""
        multi = group.tier.multi
        taken, stacked, mask = self.take_batches(group, k, multi.k)
        group.now = None
        t = time.monotonic_ns()
        try:
            outs = call(multi.executable, group.arrays, multi.arg((stacked, mask), k), group.ident)
        except Exception as err:  # noqa: BLE001 - as a fused step's error: its stack is gone
            for job in group.members:
                self.life.fail(job, f"fused steps of {group.name} raised: {short_error(err)}", err)
                self.life.settle(job)
            return
        group.arrays = outs[0]
        if self.pipeline.host_copy:
            outs[1].copy_to_host_async()  # (Executor.host_copy; the check's rows are on the host already)
        self._stepped(group, li, pos, taken, outs[1], t, k)
        group.tier.steps_at[k] = group.tier.steps_at.get(k, 0) + k

    def _stepped(self, group: Group, li: int, pos: int, taken: dict, rows: Any, t: int, k: int,
                 per_call: int | None = None) -> None:
        """Account ``k`` dispatched group steps of the members in ``taken`` (``per_call``: the
        steps each call ran, if not ``k``: 1 for a run)."""
        group.steps_run += k
        group.fused_member_steps += k * len(taken)
        self.pipeline.fused_member_steps += k * len(taken)
        group.in_flight += 1
        steps = {}
        for slot, (job, step, _) in taken.items():
            job.dispatched += k
            job.in_flight += 1
            calls = k if per_call is None else per_call
            if calls > 1 or job.tier is not None:  # each member's steps per call (status, RESULTS)
                member = self.tiers.tier(job)
                member.steps_at[calls] = member.steps_at.get(calls, 0) + k
                if group.tier is not None and group.tier.note:
                    member.note = f"in {group.name}: {group.tier.note}"
            if job.eval is not None:
                evaluation.due(self.units, job, step + k - 1)
            steps[slot] = (job, step)
        self.pipeline.took_turn(group, li, pos)
        self.pipeline.inflight.append((group, steps, rows, t, k))
        self.pipeline.checkpoint_members(steps, k)

    # ------------------------------------------------------------------ promotion
    def consider(self, group: Group) -> None:
        members = [job for _, job in group.stepping()]
        if not members:
            return
        program, capacity, device = group.program, group.capacity, self.device
        lefts = [job.steps_left for job in members]
        periods = [p for p in (self.multi.period(job) for job in members) if p is not None]
        tier = self.tiers.tier(group)
        if tier.capacity is None:
            tier.capacity = capacity
        self.tiers.consider(tier, Candidate(
            key=_group_key(group),
            compile=lambda form: multistep.compile_group_multi(program, capacity, form, device),
            built=lambda form: multistep.built_group_multi(program, capacity, form),
            begun=lambda form: multistep.begun_group_multi(program, capacity, form),
            steps_done=group.steps_run, step_s=typical_step_s(group),
            steps_left=None if any(x is None for x in lefts) else max(lefts),
            gap_s=group.host_gap_s if group.host_gap_s is not None else self.timeline.host_gap_s,
            period=min(periods) if periods else None, group=True))

    def promote(self, group: Group, li: int, pos: int) -> bool:
        multi = self.tiers.take(group)
        if multi is None:
            return False
        key = _group_key(group)
        known = multistep.VERDICTS.get(key, multi.form)
        if known is not None and not known.recheck:  # (a recheck: checked below)
            keep = self.tiers.keeps(known)
            self.multi.settled(self.tiers.settle(group.tier, key, multi, None if keep else known,
                                                  self._group_room(group, multi) if keep else False))
            return False
        k = multi.k
        if self.steps_this_call(group, (1, k)) < k:
            group.tier.pending = _done(multi)  # no room for K steps at this turn: at a later one
            return False
        self.pipeline.drain()
        if not group.stepping() or self.steps_this_call(group, (1, k)) < k:
            group.tier.pending = _done(multi)
            return False
        verdict = self._check(group, li, pos, multi, *self.take_batches(group, k))
        keep = self.tiers.keeps(verdict)
        self.multi.settled(self.tiers.settle(group.tier, key, multi, verdict,
                                              self._group_room(group, multi) if keep else False))
        for job in group.members:
            self.recorder.line(job, f"programs of {group.name}: {group.tier.note}")
        return True

    def _check(self, group: Group, li: int, pos: int, multi: MultiStep, taken: dict,
                     stacked: list, mask: np.ndarray) -> Verdict:
        k = multi.k
        copies = [state_copy(group.arrays) for _ in range(2)]
        scratch = scratch_ident(group, self.ring, self.device)
        arrays, rows = group.arrays, []
        t = time.monotonic_ns()
        t0 = time.perf_counter()
        for i in range(k):
            arrays, vec = call(group.fused.executable, arrays, ([x[i] for x in stacked], mask), group.ident)
            rows.append(vec)
        jax.block_until_ready(arrays)
        single_s = (time.perf_counter() - t0) / k
        group.arrays = arrays
        values = np.stack([np.asarray(v) for v in rows])
        self._stepped(group, li, pos, taken, values, t, k)
        group.tier.steps_at[1] = group.tier.steps_at.get(1, 0) + k
        def singles(state: list) -> list:
            for i in range(k):
                state = call(group.fused.executable, state, ([x[i] for x in stacked], mask), scratch)[0]
            return state

        verdict = compare(multi, copies, (stacked, mask), scratch, arrays, values, singles)
        return dataclasses.replace(verdict, single_step_s=verdict.single_step_s or single_s)

    def _group_room(self, group: Group, multi: MultiStep) -> bool:
        """Reserve the group's K-step ephemeral bytes in its lane (False: it does not fit)."""
        fp = group.fused.footprint
        ephemeral = max(fp.ephemeral, multi.footprint.ephemeral)
        if ephemeral == fp.ephemeral:
            return True
        return bool(self.arena.resize(group.id, fp.resident, ephemeral))


def _group_key(group: Group) -> str:
    return group_key(group.program.key, group.capacity)


def _shape_mismatch(batch: list, like: list) -> str | None:
    """Why a member's batch cannot be stacked with its group's (None if it can)."""
    # Per member per group step: the common case (arrays of exactly the compiled shape and
    # dtype) is decided by comparing attributes, without numpy's shape/dtype conversions.
    if len(batch) == len(like) and all(
            getattr(x, "shape", None) == z.shape and getattr(x, "dtype", None) == z.dtype
            for x, z in zip(batch, like)):
        return None
    for i, (x, z) in enumerate(zip(batch, like)):
        if np.shape(x) != z.shape or np.dtype(getattr(x, "dtype", None)) != z.dtype:
            return (f"leaf {i} is {np.dtype(getattr(x, 'dtype', None))}{list(np.shape(x))}, "
                    f"expected {z.dtype}{list(z.shape)}")
    return None
