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
from .view import Decision, JobView, View


def remaining_s(job: JobView) -> float:
    """Estimated seconds left: steps left times what a step holds the device for (its device
    time plus the host time the device waits for it: on a host-bound CPU small steps are mostly
    the latter, and ranking by device time alone put a long cheap job ahead of a short costly
    one). A job of unknown length (``steps_left=None``) sorts last."""
    if job.steps_left is None:
        return math.inf
    return job.steps_left * (job.step_time_s + job.host_s)


class Srtf:
    name = "srtf"
    exclusive = True
    preemptive = True  # a newly urgent job takes over at the next step boundary

    def init(self) -> Any:
        return None

    def pick(self, view: View, state: Any) -> tuple[Decision, Any]:
        key = lambda job: (remaining_s(job), job.arrival, job.id)  # noqa: E731
        return pick_best(view, key, view.slots), state
