"""A fusion group as a unit: several jobs that step as one vmapped executable.

Plain data plus the ``records.Unit`` protocol; no jax (the device arrays it holds are made by
``group_device.GroupDevice``), so the group logic is tested on hand-made groups.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from .records import RECENT, median_step_s, recent_host_s
from .states import JobState


class Group:
    """A fusion group as the dispatcher schedules it: one runnable unit with members (it
    implements ``records.Unit``, as a job does). ``program``/``fused``: the members' program and
    the vmapped one (``compiled.fusion``); ``arrays``: the stacked states; ``ident``: its fence
    id on the device."""

    def __init__(self, gid: int, program: Any, fused: Any, lane: int, arrays: list, ident: Any,
                 zero_batch: list, *, name: str):
        self.id, self.program, self.fused = gid, program, fused
        self.lane, self.ident = lane, ident
        self.arrays: Any = arrays  # the stacked states (None once the group closed)
        self.slots: list[Any] = [None] * fused.capacity
        self.name = name
        self.in_flight = 0
        self.last_seq, self.turn_steps = -1, 0
        self.device_time_s, self.step_time_s, self.steps_recorded = 0.0, None, 0
        self.host_gap_s: float | None = None
        self.step_times: deque = deque(maxlen=256)
        self.steps_run = 0              # group steps dispatched
        self.fused_member_steps = 0     # member steps run fused (for the fusion fraction)
        self.error = None
        self.zero_batch = zero_batch    # what an idle slot is fed (its result is masked away)
        self._batch_bytes = sum(z.nbytes for z in zero_batch)
        self.now: list | None = None    # the members of the step being dispatched (dispatcher)
        self.tier: Any = None           # its K-step program, if promoted (tiers.JobTier)
        self.payoff: Any = None         # whether fusing pays: None, a Future (measuring), True (fusecheck.py)
        self.payoff_k: Any = None       # the same at its K-step form, once it runs one (fusecheck.py)

    # What the policy sees of a group (sched/ docs: a group is one runnable unit).
    is_group = True  # the Unit protocol (records.Unit)

    @property
    def capacity(self) -> int:
        return self.fused.capacity

    @property
    def footprint(self) -> Any:
        """The reservation the group holds (its fused program's, staging included)."""
        return self.fused.footprint

    @property
    def step_batch_bytes(self) -> int:
        """The bytes of one group step's stacked batch."""
        return self.capacity * self._batch_bytes

    @property
    def members(self) -> list[Any]:
        return [j for j in self.slots if j is not None]

    def stepping(self) -> list[tuple[int, Any]]:
        """(slot, member) of the members that take part in the next group step."""
        running = JobState.RUNNING
        return [(i, j) for i, j in enumerate(self.slots)
                if j is not None and j.state is running and j.error is None and j.steps_left != 0
                and j.waiting is None]  # (waiting: for its step on a batch of another shape, shapes.py)

    @property
    def arrival_s(self) -> float:
        return min((j.arrival_s for j in self.members), default=0.0)

    @property
    def priority(self) -> int:
        return max((j.priority for j in self.members), default=0)   # its most urgent member

    @property
    def steps_left(self) -> int | None:
        lefts = [j.steps_left for _, j in self.stepping()]
        if not lefts:
            return 0
        return None if any(x is None for x in lefts) else max(lefts)  # its longest member

    @property
    def dispatched(self) -> int:
        return self.steps_run

    def step_estimate_s(self, flops_per_s: float | None = None) -> float:
        """As ``JobRecord.step_estimate_s``: recent measured steps, else the FLOPs estimate."""
        typical = median_step_s(self.step_times, RECENT)
        if typical is not None:
            return typical
        if self.fused.flops and flops_per_s:
            return max(self.fused.flops / flops_per_s, 1e-6)
        return 1e-3

    def host_estimate_s(self, default: float) -> float:
        return recent_host_s(self.host_gap_s, self.step_times, default)

    def free_slot(self) -> int | None:
        return next((i for i, j in enumerate(self.slots) if j is None), None)
