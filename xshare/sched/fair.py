"""FAIR: equal device time for every runnable job (Salus's fairness policy).

Device time comes from the FFI fences, so a job with slow steps gets fewer steps, not more
device. Within a lane the job with least device time goes next; across lanes, a lane whose
best job is already ahead of the most-starved job by more than one turn idles so that the
starved job catches up.
"""

from __future__ import annotations

from typing import Any

from .base import by_lane
from .view import Decision, View


class Fair:
    name = "fair"
    exclusive = False
    preemptive = False
    # Its decision depends on measured device time, which moves every step: the runtime asks it
    # again after every rotation rather than every few (an O(jobs) view per O(jobs) steps).
    timing = True

    def init(self) -> Any:
        return None

    def pick(self, view: View, state: Any) -> tuple[Decision, Any]:
        lanes = {lane: sorted(jobs, key=_least_served) for lane, jobs in by_lane(view).items()}
        if not lanes:
            return Decision.idle(), state
        candidates = [jobs[0] for jobs in lanes.values()]
        # Every runnable job is in some lane, and each lane's candidate is its minimum, so the
        # global minimum is the minimum over the candidates.
        least = min(job.device_time_s for job in candidates)
        # Why the slack: with a strict "only the minimum runs" rule, two lanes holding one job
        # each would alternate (whoever just stepped is ahead by one step) and never overlap,
        # wasting the parallelism lanes exist for. Allowing a lead of up to one turn
        # (quantum steps of the candidate's own step time) keeps such lanes running together,
        # while a lane ahead by more than a turn idles until the starved job catches up. The
        # job holding the minimum always qualifies, so the device never idles entirely.
        chosen = [
            job for job in candidates
            if job.device_time_s <= least + _turn_s(job, view.quantum)
        ]
        # Within a chosen lane the least-served job runs until it would catch up with the next
        # one (as many turns as the gap holds of its own steps, at most _CATCH_UP), then the
        # rest go from least to most served; the runtime asks again after that rotation, with
        # the device times measured meanwhile.
        return Decision.rotations(_catch_up(lanes[job.lane], view.quantum) for job in chosen), state


_CATCH_UP = 32  # turns one decision may give a starved job (more would outlive the measurement)


def _catch_up(jobs: list, quantum: int) -> list:
    first = jobs[0]
    if len(jobs) == 1:
        return jobs
    gap = jobs[1].device_time_s - first.device_time_s
    turns = 1 + min(int(gap / max(_turn_s(first, quantum), 1e-12)), _CATCH_UP - 1)
    return [first] * turns + jobs[1:]


def _turn_s(job: Any, quantum: int) -> float:
    """The device time one turn of ``job`` may take: ``quantum`` calls of up to its K steps each.
    (Counted in single steps, a starved job with a K=16 program was given 16x the turns its gap
    held: measured, two equal jobs' device time in a run's first 200 steps differed 2.5x.)"""
    return quantum * job.call_steps * job.step_time_s


def _least_served(job):
    return (job.device_time_s, job.last_seq, job.arrival, job.id)
