"""A policy's decision turned into a rotation the dispatcher walks in O(1) per step.

The policy (pure, in ``xshare.sched``) is asked on events and after each full rotation; in
between, the dispatcher only advances a cursor: lanes take turns step by step, and within a
lane each job of its rotation runs ``quantum`` steps, then the next. That keeps the host's
work per step flat in the number of jobs (a View over N jobs is built once per ~N steps).
"""

from __future__ import annotations

from typing import Any, Callable


class Plan:
    def __init__(self, lanes: list[list[Any]], quantum: int, *, period: int):
        # lanes: each a rotation of job records, first job first.
        self.lanes = [lane for lane in lanes if lane]
        self.quantum = quantum
        self.idx = [0] * len(self.lanes)     # each lane's current job in its rotation
        self.used = [0] * len(self.lanes)    # steps the current job has had this turn
        self.lane = 0                        # the lane that steps next
        self.left = max(period, 1)           # steps until the policy is asked again

    def __bool__(self) -> bool:
        return bool(self.lanes)

    def start_turns(self, turn_steps: Callable[[Any], int]) -> None:
        """Continue the current turns: a lane's first job may already be inside its quantum."""
        for i, lane in enumerate(self.lanes):
            self.used[i] = min(turn_steps(lane[0]), self.quantum - 1) if len(lane) > 1 else 0

    def current(self) -> Any:
        return self.lanes[self.lane][self.idx[self.lane]]

    def candidates(self):
        """Jobs in the order the rotation would reach them, starting with ``current()``:
        (lane index, position) pairs, used to skip jobs whose next batch is not there yet."""
        n = len(self.lanes)
        for k in range(n):
            li = (self.lane + k) % n
            lane = self.lanes[li]
            for j in range(len(lane)):
                yield li, (self.idx[li] + j) % len(lane)

    def job_at(self, li: int, pos: int) -> Any:
        return self.lanes[li][pos]

    def stepped(self, li: int, pos: int) -> None:
        """Account one dispatched step of the job at (li, pos) and move the cursor on."""
        if pos != self.idx[li]:          # a skip: that job takes over the lane's turn
            self.idx[li], self.used[li] = pos, 0
        self.used[li] += 1
        if self.used[li] >= self.quantum:
            self.idx[li] = (pos + 1) % len(self.lanes[li])
            self.used[li] = 0
        self.lane = (li + 1) % len(self.lanes)
        self.left -= 1
