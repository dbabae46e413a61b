"""SRTF: shortest remaining time first, preemptive at iteration boundaries.

Minimises mean completion time when remaining times are known (Salus §4 uses it for that).
Each ``pick`` re-evaluates from scratch, so a shorter job that arrives between two steps wins
the very next pick: preemption costs one step boundary, not a checkpoint.

``view.slots`` jobs run at once (default 1, Salus's single device): the shortest ones, in
distinct lanes, taking turns step by step (multi-server SRTF).
"""

from __future__ import annotations

import math
from typing import Any

from .base import pick_best
from .steps import SRTF_QUANTUM_S
from .view import Decision, JobView, View


def remaining_s(job: JobView) -> float:
    """Estimated seconds left: steps left times what a step holds the device for (its device
    time plus the host time the device waits for it: on a host-bound CPU small steps are mostly
    the latter, and ranking by device time alone put a long cheap job ahead of a short costly
    one), or what a step costs in its multi-step form (``form_step_s``) where that is less.

    Why the lesser: a job's own figures come from the steps it ran, and a job preempted early
    ran them one per call, beside other jobs' compiles; they are not updated while it waits.
    The jct trace's 4,056-step job ran 104 steps one per call in its first 0.3 s (1.3 ms of
    host time a step then, with three arrivals being compiled), was preempted, and ranked at
    5.6 s left for the rest of the run, last of all: at K=32 its steps take 87 us (0.35 s
    left), and it finished at 8.0 s against its oracle's 3.6. A job of unknown length
    (``steps_left=None``) sorts last."""
    if job.steps_left is None:
        return math.inf
    per_step = job.step_time_s + job.host_s
    if job.form_step_s is not None and 0 < job.form_step_s < per_step:
        per_step = job.form_step_s
    return job.steps_left * per_step


class Srtf:
    name = "srtf"
    exclusive = True
    preemptive = True  # a newly urgent job takes over at the next step boundary
    quantum_s = SRTF_QUANTUM_S  # the device time the calls in flight may take (steps.py: why)

    def init(self) -> Any:
        return None

    def pick(self, view: View, state: Any) -> tuple[Decision, Any]:
        key = lambda job: (remaining_s(job), job.arrival, job.id)  # noqa: E731
        return pick_best(view, key, view.slots), state
