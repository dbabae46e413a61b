"""PACK: fill every lane, round-robin within a lane (Salus's default packing policy).

Lanes run side by side (their memory never overlaps); jobs inside one lane share its ephemeral
region, so they take turns of ``view.quantum`` steps. Turns are derived from the runtime's
``last_seq``/``turn_steps`` rather than from counting ``pick`` calls, because several lane
threads may ask for a decision per dispatched step.
"""

from __future__ import annotations

from typing import Any

from .base import by_lane
from .view import Decision, JobView, View


def next_in_lane(jobs: list[JobView], quantum: int) -> JobView:
    """The job a lane steps next: the current one until its turn is used up, then the most
    starved (least recently run; never-run jobs have ``last_seq == -1`` and go first)."""
    current = max(jobs, key=lambda job: (job.last_seq, -job.id))
    if current.last_seq >= 0 and current.turn_steps < quantum:
        return current
    # A lone job whose turn ended is also the least recently run, so it simply continues.
    return min(jobs, key=lambda job: (job.last_seq, job.arrival, job.id))


class Pack:
    name = "pack"
    exclusive = False
    preemptive = False

    def init(self) -> Any:
        return None

    def pick(self, view: View, state: Any) -> tuple[Decision, Any]:
        return Decision.rotations(rotation(jobs, view.quantum) for jobs in by_lane(view).values()), state


def rotation(jobs: list[JobView], quantum: int) -> list[JobView]:
    """The lane's turns from now: the job ``next_in_lane`` picks, then the others from the most
    starved on (the order ``next_in_lane`` would pick them in, turn after turn)."""
    first = next_in_lane(jobs, quantum)
    rest = sorted((job for job in jobs if job.id != first.id),
                  key=lambda job: (job.last_seq, job.arrival, job.id))
    return [first, *rest]
