"""What a policy sees and what it answers: frozen snapshots, so a policy is a pure function.

The runtime builds a ``View`` under its lock (clock reading, job bookkeeping, lanes) and hands it
to ``Policy.pick``; the policy never reaches back into the runtime. Keeping these as plain frozen
dataclasses lets the same policy run inside the runtime, in a simulator, and in table tests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True, slots=True)
class JobView:
    """One runnable job as the scheduler sees it at one instant."""

    id: int                 # unique job id (runtime-assigned, increasing with submission)
    name: str
    arrival: float          # seconds on the runtime clock when submitted
    priority: int           # larger = more important
    steps_done: int
    steps_left: int | None  # None = unknown (runs until its data ends)
    step_time_s: float      # estimated device seconds per step (cost model until measured; > 0)
    device_time_s: float    # device seconds used so far (from FFI fences)
    lane: int               # lane id the job lives in
    last_seq: int           # global dispatch sequence number of this job's latest step; -1 = never ran
    turn_steps: int         # consecutive steps in its lane's current turn (0 if not the current job)
    host_s: float = 0.0     # measured host seconds per step the device waits (dispatch, data);
                            # ~0 when the host keeps ahead of the device
    call_steps: int = 1     # steps one call of its may run: its K-step program's K (1 without one)
    form_step_s: float | None = None  # seconds a step takes, host and device together, in the
                            # fastest multi-step form it runs or may run, as that form's check
                            # timed it (K steps in one call, over K); None without one


@dataclass(frozen=True, slots=True)
class View:
    """A snapshot of the runtime: the clock is passed in here because policies never read one."""

    now: float                   # runtime clock
    jobs: tuple[JobView, ...]    # only RUNNABLE jobs: admitted, resident, not paused/finished
    lanes: tuple[int, ...]       # ids of open lanes
    quantum: int = 1             # steps per turn for round-robin policies (>= 1)
    slots: int = 1               # jobs that may run at once under srtf (the device's parallelism)

    def __post_init__(self) -> None:
        # Misuse, not an expected outcome: a zero quantum would make round-robin never rotate
        # (pack) or fair's slack zero, silently changing the policy.
        if isinstance(self.quantum, bool) or not isinstance(self.quantum, int) or self.quantum < 1:
            raise ValueError(f"quantum must be an int >= 1, got {self.quantum!r}")
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {self.slots!r}")
        # Accept any iterable from callers, store tuples so the view stays hashable and frozen.
        object.__setattr__(self, "jobs", tuple(self.jobs))
        object.__setattr__(self, "lanes", tuple(self.lanes))


@dataclass(frozen=True, slots=True)
class Decision:
    """Which job each lane steps next: ``run[lane] = job id``; a lane that is absent idles.

    ``order[lane]`` is the lane's rotation from here on: the jobs it steps in turn, ``quantum``
    steps each, starting with ``run[lane]``, until the runtime asks again. The runtime asks on
    events (a job arrives, ends, pauses, changes priority) and after each full rotation, not
    per step: that is what keeps the per-step cost flat in the number of jobs. Policies that
    run one job per lane leave it out (it defaults to ``(run[lane],)``).
    """

    run: Mapping[int, int] = field(default_factory=dict)
    order: Mapping[int, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Copy then wrap read-only: neither the caller nor the runtime can mutate a decision
        # that another thread may still be reading.
        run = dict(self.run)
        order = {lane: tuple(self.order.get(lane, ())) or (job,) for lane, job in run.items()}
        for lane, jobs in order.items():
            if jobs[0] != run[lane]:
                raise ValueError(f"order[{lane}] must start with run[{lane}]={run[lane]}; got {jobs}")
        object.__setattr__(self, "run", MappingProxyType(run))
        object.__setattr__(self, "order", MappingProxyType(order))

    def __hash__(self) -> int:
        return hash(frozenset(self.run.items()))

    def __repr__(self) -> str:
        return f"Decision(run={dict(sorted(self.run.items()))!r})"

    @classmethod
    def of(cls, jobs: Iterable[JobView]) -> Decision:
        """Run each given job in its own lane (callers pass at most one job per lane)."""
        return cls({job.lane: job.id for job in jobs})

    @classmethod
    def rotations(cls, orders: Iterable[list[JobView]]) -> Decision:
        """Each non-empty list is one lane's rotation, first job first."""
        orders = [jobs for jobs in orders if jobs]
        return cls({jobs[0].lane: jobs[0].id for jobs in orders},
                   {jobs[0].lane: tuple(job.id for job in jobs) for jobs in orders})

    @classmethod
    def idle(cls) -> Decision:
        """Every lane idles."""
        return cls({})
