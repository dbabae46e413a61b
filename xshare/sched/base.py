"""The policy Protocol and the few helpers every policy shares.

A policy is a small pure object (like optax's ``GradientTransformation``): ``init()`` makes its
state and ``pick(view, state) -> (decision, state)`` threads it explicitly. The runtime asks
on events and once per rotation (``Decision.order``), so a policy must derive turns from
``JobView.last_seq``/``turn_steps``, never from counting calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from .view import Decision, JobView, View


@runtime_checkable
class Policy(Protocol):
    name: str
    exclusive: bool  # True = at most one job runs device-wide at a time
    # Optional ``preemptive = True``: a newly urgent job takes over at the next step boundary, so
    # the runtime keeps few steps in flight and caps the steps per call (sched/steps.py) to about
    # ``quantum_s`` seconds of device time in flight (optional; default ``steps.QUANTUM_S``).
    # Optional ``timing = True``: the decision depends on measured device time, so the runtime
    # asks again after every rotation (default: after a few rotations, and on every event).

    def init(self) -> Any:
        """Initial policy state."""
        ...

    def pick(self, view: View, state: Any) -> tuple[Decision, Any]:
        """Which job each lane steps next, and the new state."""
        ...


def by_lane(view: View) -> dict[int, list[JobView]]:
    """Runnable jobs grouped by open lane, in ``view.lanes`` order; lanes without jobs are left out.

    Jobs whose lane is not open are dropped: a decision may only name open lanes.
    """
    groups: dict[int, list[JobView]] = {lane: [] for lane in view.lanes}
    for job in view.jobs:
        if job.lane in groups:
            groups[job.lane].append(job)
    return {lane: jobs for lane, jobs in groups.items() if jobs}


def runnable(view: View) -> list[JobView]:
    """Jobs that can be picked: runnable and living in an open lane."""
    open_lanes = set(view.lanes)
    return [job for job in view.jobs if job.lane in open_lanes]


def pick_one(view: View, key: Callable[[JobView], Any]) -> Decision:
    """Exclusive policies: run only the job with the smallest ``key`` device-wide.

    Every key ends in ``job.id`` (unique), so the choice never depends on the order of
    ``view.jobs``.
    """
    jobs = runnable(view)
    if not jobs:
        return Decision.idle()
    return Decision.of([min(jobs, key=key)])


def pick_best(view: View, key: Callable[[JobView], Any], slots: int) -> Decision:
    """Run the ``slots`` best jobs by ``key`` that live in distinct lanes (a lane steps one job
    at a time). With ``slots=1`` this is :func:`pick_one`."""
    chosen: dict[int, JobView] = {}
    for job in sorted(runnable(view), key=key):
        if len(chosen) == slots:
            break
        chosen.setdefault(job.lane, job)
    return Decision.of(chosen.values())
