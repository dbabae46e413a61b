"""The planner: which unit (job or fused group) steps next.

It builds the policy's frozen ``View`` from the running units, asks the policy (pure, in
``xshare/sched``) for a ``Decision``, and keeps the resulting ``Plan`` (rotations per lane) with a
cursor, so that per step it only advances the cursor and asks whether the unit has its batch.
The policy is asked again when the running set changes (``Units.changed``) and after a few
rotations, never per step.

No jax here: whether a unit is ready (its batches made, an evaluation owed) is asked through
two callables the dispatcher passes in, so the planner is tested on hand-made units
(``tests/runtime/engine/test_planner.py``). Owned by the dispatcher thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ... import sched
from .plan import Plan
from .units import Units


@dataclass(frozen=True)
class Pick:
    """The unit to step now, and where it sits in the plan (for ``Planner.stepped``)."""

    unit: Any
    lane: int
    pos: int


class Planner:
    """Picking: the plan, the policy's state, and which ready unit steps next.

    ``ready(unit, make)``: whether every member stepping in ``unit``'s next step has its batch
    (``make``: make a missing one now, as a plain loop would). ``owes(unit)``: the evaluation
    batch ``unit`` owes, or None; a unit that owes one is ready without a train batch.
    ``form_step_s(unit, data_s)``: seconds a step of ``unit`` takes in its fastest multi-step
    form, as that form's check timed it, with ``data_s`` to make its batch (its own measured
    time, ``JobRecord.data_s``, or a typical unit's), or None
    (``JobView.form_step_s``; the dispatcher sets it once the K-step calls exist:
    ``MultiCalls.form_step_s``).
    """

    def __init__(self, units: Units, policy: Any, timeline: Any, *, quantum: int, slots: int,
                 t0: float, clock: Callable[[], float],
                 ready: Callable[[Any, bool], bool], owes: Callable[[Any], Any],
                 form_step_s: Callable[[Any, float | None], float | None] = lambda unit, data_s: None,
                 waits: Callable[[Any], bool] = lambda unit: False):
        self.units, self.policy, self.timeline = units, policy, timeline
        self.quantum, self.slots, self.t0, self.clock = quantum, slots, t0, clock
        self.ready, self.owes, self.form_step_s, self.waits = ready, owes, form_step_s, waits
        self.state = policy.init()
        self.plan: Plan | None = None
        # Timed policies read device times at each decision: make them current first, and ask
        # again after every rotation (policies declare it: ``sched.base.Policy.timing``).
        self.timed = bool(getattr(policy, "timing", False))

    def next(self) -> Pick | None:
        """The unit to step now, or None if no running unit is ready."""
        plan = self.plan
        if self.units.changed or plan is None or plan.left <= 0:
            plan = self.replan()
        if not plan:
            return None
        li, pos = plan.lane, plan.idx[plan.lane]
        unit = plan.job_at(li, pos)
        if self._ready(unit, make=True):
            return Pick(unit, li, pos)
        if self.policy.exclusive:
            # Exclusive policies give the device to the chosen units only: one waiting for its
            # data keeps it (the device idles, as under exclusive allocation).
            return None
        # The others are only checked (their batches made ahead, or an evaluation owed); but a
        # unit that waits for its evaluation's results is skipped as if absent, and the next in
        # the rotation makes its batch as the current one would. Checked only, a job whose
        # batches are made inline never stepped while another evaluated: under pack the
        # dispatcher sat waiting for those results after all.
        make = bool(self.units.reading) and self.waits(unit)
        for li, pos in plan.candidates():
            unit = plan.job_at(li, pos)
            if self._ready(unit, make=make):
                return Pick(unit, li, pos)
            if make and not self.waits(unit):
                make = False  # (it was asked to make its batch: the rest are only checked)
        return None

    def stepped(self, pick: Pick) -> None:
        """``pick.unit`` was dispatched: move the cursor on."""
        assert self.plan is not None
        self.plan.stepped(pick.lane, pick.pos)

    def _ready(self, unit: Any, *, make: bool) -> bool:
        if self.units.reading and self.waits(unit):
            return False  # its evaluation's results are on their way: not past them
        if self.units.evaluating and self.owes(unit) is not None:
            return True  # its turn runs an eval batch: no train batch needed
        return self.ready(unit, make)

    def replan(self) -> Plan:
        """Ask the policy for a decision over the running units and start its rotations."""
        units = self.units
        if self.timed:
            self.timeline.drain()  # its decision reads device times: make them current
        flops, host = self.timeline.flops_per_s, self.timeline.host_gap_s or 0.0
        form_step_s = self.form_step_s
        # A unit that has not made a batch yet is ranked with a typical one's cost (as its host
        # time defaults to the runtime's): without it, a job that had not run ranked ahead of
        # one that had by the price of its batches alone (its own measured on its first call).
        made = sorted(u.data_s for u in units.running.values() if getattr(u, "data_s", None))
        typical_data_s = made[len(made) // 2] if made else None
        views = []
        for unit in units.running.values():
            if unit.error is not None or (unit.steps_left == 0 and self.owes(unit) is None):
                continue
            views.append(sched.JobView(
                id=unit.id, name=unit.name, arrival=unit.arrival_s, priority=unit.priority,
                steps_done=unit.dispatched, steps_left=unit.steps_left,
                step_time_s=unit.step_estimate_s(flops), device_time_s=unit.device_time_s,
                lane=unit.lane, last_seq=unit.last_seq,
                turn_steps=units.turn_steps(unit),
                host_s=unit.host_estimate_s(host),
                call_steps=unit.tier.multi.k if unit.tier is not None and unit.tier.multi is not None else 1,
                form_step_s=form_step_s(unit, getattr(unit, "data_s", None) or typical_data_s)))
        lanes = tuple(sorted({v.lane for v in views}))
        view = sched.View(now=self.clock() - self.t0, jobs=tuple(views), lanes=lanes,
                          quantum=self.quantum, slots=self.slots)
        decision, self.state = self.policy.pick(view, self.state)
        rotations = [[units.running[i] for i in decision.order[lane]] for lane in sorted(decision.run)]
        # Asked again after a few full rotations (and on every change): a View costs O(units),
        # so this keeps the policy's share of each step's host time small and flat in N.
        rotation = sum(len(r) for r in rotations) * self.quantum
        period = rotation if self.timed else max(4 * rotation, len(views), 256)
        plan = Plan(rotations, self.quantum, period=period)
        plan.start_turns(units.turn_steps)
        self.plan, units.changed = plan, False
        return plan
