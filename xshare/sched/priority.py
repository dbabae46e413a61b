"""PRIORITY: strict priority, preemptive at iteration boundaries, ties by arrival.

Like kube-scheduler's PrioritySort queue order: larger ``priority`` first, then earlier arrival.
Strict means a low-priority job starves while a higher one is runnable; that is the point
(an interactive or deadline job owns the device the moment it is submitted or bumped).
"""

from __future__ import annotations

from typing import Any

from .base import pick_one
from .steps import QUANTUM_S
from .view import Decision, View


class Priority:
    name = "priority"
    exclusive = True
    preemptive = True  # a newly urgent job takes over at the next step boundary
    quantum_s = QUANTUM_S  # the device time the calls in flight may take (steps.py: why)

    def init(self) -> Any:
        return None

    def pick(self, view: View, state: Any) -> tuple[Decision, Any]:
        return pick_one(view, key=lambda job: (-job.priority, job.arrival, job.id)), state
