"""The engine's tables of units: every live job, the units the policy sees, and who holds each lane.

A unit is a job stepping alone or a fused group (``records.Unit``: both answer the same
questions, so no part tells them apart). The planner reads these tables; admission, groups and
the lifecycle change them through the methods here, which also mark the plan stale, so "the
running set changed" is said in one place. Plain data, no jax: the parts that use it are
unit-tested on hand-made units (``tests/runtime/engine``). Owned by the dispatcher thread.
"""

from __future__ import annotations

from typing import Any


class Units:
    """Live jobs by id; the running units (what the policy sees); each lane's current unit."""

    def __init__(self) -> None:
        self.jobs: dict[int, Any] = {}          # every live job, by id
        self.running: dict[int, Any] = {}       # RUNNING jobs and groups, by unit id
        self.lane_current: dict[Any, Any] = {}  # the unit whose turn a lane is in
        self.evaluating: dict[int, Any] = {}    # jobs owing an evaluation (evaluation.py)
        self.reading: dict[int, Any] = {}       # job id -> its evaluation's results on their way
        self.changed = True                     # the running set changed since the last plan

    def run(self, unit: Any) -> None:
        """``unit`` steps from now: the policy sees it at the next plan."""
        self.running[unit.id] = unit
        self.changed = True

    def stop(self, unit: Any) -> bool:
        """``unit`` leaves the rotation (paused, failed, ended, moved into a group). True if it
        was in it."""
        if self.running.pop(unit.id, None) is None:
            return False
        self.changed = True
        return True

    def leave_lane(self, unit: Any) -> None:
        """``unit`` no longer holds its lane's turn (it ended or left the rotation for good)."""
        lane = unit.lane
        if self.lane_current.get(lane) is unit:
            del self.lane_current[lane]

    def forget(self, unit: Any) -> None:
        """A unit that ended: out of every table."""
        self.stop(unit)
        self.leave_lane(unit)
        self.jobs.pop(unit.id, None)
        self.changed = True

    def turn_steps(self, unit: Any) -> int:
        """Steps ``unit`` has had in its lane's current turn (0 unless the turn is its)."""
        steps: int = unit.turn_steps
        return steps if self.lane_current.get(unit.lane) is unit else 0
