"""The dispatcher's planner: which unit (job or fused group) steps next.

It builds the policy's frozen ``View`` from the running units, asks the policy (pure, in
``xshare/sched``) for a ``Decision``, and keeps the resulting ``Plan`` (rotations per lane) with a
cursor, so that per step it only advances the cursor and checks that the unit has its batch.
The policy is asked again on events (``_dirty``) and after a few rotations, never per step.
Runs on the dispatcher thread only (``Dispatcher`` composes it).
"""

from __future__ import annotations

import logging


from .. import sched
from . import evaluation
from .fusion import Group
from .plan import Plan
from .records import JobRecord, now_s
from .source import produce
from .states import JobState

log = logging.getLogger("xshare.runtime")

S = JobState


class Planner:
    """Picking: the plan, the policy, and whether a unit is ready to step. A part of ``Dispatcher``:
    its methods run on the dispatcher thread and share the dispatcher's tables."""

    def _next(self) -> tuple[JobRecord, int, int] | None:
        plan = self._plan
        if self._dirty or plan is None or plan.left <= 0:
            plan = self._replan()
        if not plan:
            return None
        li, pos = plan.lane, plan.idx[plan.lane]
        job = plan.job_at(li, pos)
        if self.evaluating and evaluation.owes(self, job) is not None:
            return job, li, pos  # its turn runs an eval batch: no train batch needed
        if isinstance(job, Group):
            if self._group_ready(job, make=True):
                return job, li, pos
        else:
            if not job.batches and job.source is not None:
                # Cheap data is made here, right before the step, as a plain loop would; for
                # fed jobs the feeder is behind (its thread was not scheduled): make it here
                # too rather than idle, unless the feeder is making it right now.
                produce(job, self.device, blocking=not self._fed(job))
            if job.batches:
                return job, li, pos
        if self.policy.exclusive:
            # Exclusive policies give the device to the chosen jobs only: one waiting for its
            # data keeps it (the device idles, as under exclusive allocation).
            return None
        for li, pos in plan.candidates():
            job = plan.job_at(li, pos)
            if self.evaluating and evaluation.owes(self, job) is not None:
                return job, li, pos
            if self._group_ready(job, make=False) if isinstance(job, Group) else job.batches:
                return job, li, pos
        return None

    def _group_ready(self, group: Group, *, make: bool) -> bool:
        """Whether every member that takes part in ``group``'s next step has its batch (making
        the missing ones if ``make``). The members found are kept in ``group.now`` for the
        dispatch that follows at once (one walk over the slots per step, not three)."""
        members = group.stepping()
        group.now = None
        if not members:
            return False
        for _, member in members:
            if not member.batches:
                if make and member.source is not None:
                    produce(member, self.device, blocking=not self._fed(member))
                if not member.batches:
                    return False
        group.now = members
        return True

    def _replan(self) -> Plan:
        if getattr(self.policy, "timing", False):
            self.timeline.drain()  # its decision reads device times: make them current
        flops, host = self.timeline.flops_per_s, self.timeline.host_gap_s or 0.0
        views = []
        for job in self._running.values():
            if job.error is not None or (job.steps_left == 0 and evaluation.owes(self, job) is None):
                continue
            current = self._lane_current.get(job.lane)
            views.append(sched.JobView(
                id=job.id, name=job.name, arrival=job.arrival_s, priority=job.priority,
                steps_done=job.dispatched, steps_left=job.steps_left,
                step_time_s=job.step_estimate_s(flops), device_time_s=job.device_time_s,
                lane=job.lane, last_seq=job.last_seq,
                turn_steps=job.turn_steps if current is job else 0,
                host_s=host if job.host_gap_s is None else job.host_gap_s))
        lanes = tuple(sorted({v.lane for v in views}))
        view = sched.View(now=now_s() - self.t0, jobs=tuple(views), lanes=lanes,
                          quantum=self.quantum, slots=self.slots)
        decision, self._policy_state = self.policy.pick(view, self._policy_state)
        rotations = [[self._running[i] for i in decision.order[lane]] for lane in sorted(decision.run)]
        # Asked again after a few full rotations (and on every event): a View costs O(jobs), so
        # this keeps the policy's share of each step's host time small and flat in N.
        rotation = sum(len(r) for r in rotations) * self.quantum
        period = rotation if getattr(self.policy, "timing", False) else max(4 * rotation, len(views), 256)
        plan = Plan(rotations, self.quantum, period=period)
        plan.start_turns(lambda job: job.turn_steps if self._lane_current.get(job.lane) is job else 0)
        self._plan, self._dirty = plan, False
        return plan

    def _fed(self, job: JobRecord) -> bool:
        """Whether the feeder threads make this job's batches ahead: for data slower than
        ``FEED_ABOVE_S`` a batch on an accelerator; on CPU only for data slower than
        ``FEED_ABOVE_S_CPU`` (I/O, decoding, a sleep), because there the step's own compute
        keeps the cores busy and a feeder thread contends with the dispatcher for them and
        the GIL: measured on 2 cores, a fused 8-MLP sweep whose ~0.1 ms batches were fed ran
        at half the speed of the same sweep with its batches made inline."""
        return job.data_s is not None and job.data_s > self._feed_above

