"""The runtime's per-job record and the read-only views handed to users (progress, steps).

Ownership: the dispatcher thread is the only writer of a record's run-time fields (state,
step counters, batches); other threads read single attributes (atomic under the GIL) for
status and progress, and change a job only by posting an event to the dispatcher.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from typing import TYPE_CHECKING

from .states import TERMINAL, JobState

if TYPE_CHECKING:  # (annotations only: the engine's pure parts import this module without jax)
    from ..._job import JobSpec
    from ..compiled.compiler import CompiledStep


@dataclass(frozen=True)
class Progress:
    """A job's progress as the launcher and ``xshare top`` show it."""

    name: str
    status: str
    steps_done: int
    steps_total: int | None
    metrics: dict[str, float] | None
    steps_per_s: float | None
    lane: int | None
    error: str | None
    wall_s: float


@dataclass(frozen=True)
class StepRecord:
    """One executed step on the device timeline (FFI fence times, or host times without fences)."""

    job: int
    lane: int
    step: int
    t_begin_ns: int
    t_end_ns: int


@runtime_checkable
class Unit(Protocol):
    """What the planner and the executor ask of a runnable unit: a job, or a fusion group
    (``group.Group``). Both implement it with these meanings; nothing else is shared."""

    id: int                  # unique among jobs and groups (one id space)
    is_group: bool           # a fused group (its step runs its members' steps stacked)
    now: Any                 # the members ready for its next step (set by source.Feeding.ready)
    lane: int | None
    priority: int
    last_seq: int            # the dispatcher's sequence number of its latest step
    turn_steps: int          # steps in its current turn
    device_time_s: float
    host_gap_s: float | None
    error: str | None

    @property
    def arrival_s(self) -> float: ...

    @property
    def steps_left(self) -> int | None: ...

    @property
    def dispatched(self) -> int: ...

    def step_estimate_s(self, flops_per_s: float | None = None) -> float: ...

    def host_estimate_s(self, default: float) -> float: ...

    def stepping(self) -> list[tuple[int | None, Any]]:
        """(slot, job) of the jobs taking part in its next step."""


RECENT_MIN, RECENT = 3, 33  # measured steps an estimate needs, and how many policies look back on


def median_step_s(step_times: Any, last: int | None = None) -> float | None:
    """The median of ``step_times`` (the ``last`` of them, or all kept), the first two ever left
    out: a program's first runs pay one-time costs, which an EMA over a handful of steps still
    carries. None with fewer than ``RECENT_MIN`` such."""
    times = list(step_times)[2:]
    if last is not None:
        times = times[-last:]
    if len(times) < RECENT_MIN:
        return None
    times.sort()
    return times[len(times) // 2]


def recent_host_s(host_gap_s: float | None, step_times: Any, default: float) -> float:
    """A unit's measured host gap once it has run a few steps past its first two (whose gaps
    are one-time costs too, as in ``median_step_s``), else ``default`` (the runtime's)."""
    if host_gap_s is None or len(step_times) < 2 + RECENT_MIN:
        return default
    return host_gap_s


@dataclass(frozen=True)
class Prepared:
    """What the compile pool found for a job, handed to the dispatcher thread (which alone
    writes the job's record): its program, its spec (resumed: the checkpoint's state and step),
    layouts, data source, and for fused runtimes its lifted constants and expected group."""

    program: Any
    spec: Any
    layout: Any
    batch_layout: Any
    source: Any
    restored_metrics: dict[str, float] | None = None
    lifted: tuple = ()
    traced: Any = None
    fuse_hint: int = 1
    shared: bool = False                  # other jobs run its program (sweeps.Choice.shared)
    eval: Any = None                      # its Evaluation (evaluation.py), compiled beside the step
    choice: Any = None                    # its family's program, matched before lowering (prepare._covering)
    unfused: str | None = None            # why it runs alone although it could fuse (fusing does not pay)


@dataclass(eq=False)
class JobRecord:
    id: int
    spec: JobSpec
    arrival_s: float
    state: JobState = JobState.COMPILING
    priority: int = 0
    program: CompiledStep | None = None
    # This job's own layouts (leaves.py): how its state and batches map to the carried arrays
    # the program takes. Set on the compile pool before the job reaches the dispatcher.
    layout: Any = None
    batch_layout: Any = None
    # Values of the constants its fused program takes as operands (``lifting``), appended to
    # its state's carried arrays; () for a job running a program of its own.
    lifted: tuple = ()
    traced: Any = None                    # its own program read as data (lifting.Traced), fused runtimes
    footprint: Any = None                 # the program's footprint plus this runtime's staging
    source: Any = None                    # BatchSource, made on the compile pool
    lane: int | None = None
    in_ledger: bool = False               # admitted or queued in the arena
    # Device state: flat leaves on the device while resident; on the host while swapped (or
    # before it is first placed, when it is None and the spec's state is placed).
    arrays: Any = None
    host_arrays: Any = None
    ident: Any = None                     # int32[3] (ring, job, lane) on the device, for the fences
    batches: deque = field(default_factory=deque)   # prefetched device batches (and END/DataError)
    feed_lock: threading.Lock = field(default_factory=threading.Lock)  # one producer at a time
    prefetch_depth: int = 2
    data_s: float | None = None           # measured time to make one batch (EMA)
    eval: Any = None                      # its Evaluation (evaluation.py), if it has an eval_step
    group: Any = None                     # the fusion group it steps in (fuse=True), and its slot
    slot: int | None = None
    fuse_hint: int = 1                    # jobs of its submit_many call with the same step
    shared: bool = False                  # other jobs of its family run its program (fused runtimes)
    unfused: str | None = None            # why it never fuses (fusing does not pay: compiled/payoff.py)
    tier: Any = None                      # its K-step program, if promoted (tiers.JobTier)
    # Its step compiled for batches of other shapes than its first (shapes.py), by signature,
    # and the compile it waits for now (None: it is not waiting).
    other_programs: dict | None = None
    waiting: Any = None
    # Counters (the dispatcher's).
    dispatched: int = 0                   # steps dispatched since start_step
    steps_done: int = 0                   # steps completed since start_step
    in_flight: int = 0
    last_seq: int = -1
    turn_steps: int = 0
    data_done: bool = False               # the data ran out: no step beyond `dispatched`
    # Results and timing.
    error: str | None = None
    exception: BaseException | None = None
    failed_at: int | None = None          # the step whose metrics failed it (Lifecycle.fail): none after it counts
    last_values: Any = None               # the newest metrics vector (numpy), names in program
    extra_metrics: dict[str, float] | None = None  # an observer's additions to the last step
    restored_metrics: dict[str, float] | None = None
    host_state: Any = None                # the final state (host pytree) of a done job
    on_disk: Any = None                   # ... or where it is once released (observe/released.py)
    device_time_s: float = 0.0
    steps_recorded: int = 0
    step_time_s: float | None = None      # measured EMA; None until the first step
    host_gap_s: float | None = None       # measured host seconds the device waits per step (timing.py)
    started_s: float | None = None
    ended_s: float | None = None
    queue_wait_s: float | None = None
    compiled_s: float | None = None
    step_times: deque = field(default_factory=lambda: deque(maxlen=256))
    done_event: threading.Event = field(default_factory=threading.Event)
    now: Any = None                       # [(None, self)] when ready to step (the Unit protocol)
    is_group: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return self.spec.name

    def stepping(self) -> list[tuple[int | None, Any]]:
        """The Unit protocol: a job alone steps itself."""
        return [(None, self)]

    def initial_arrays(self) -> list:
        """The carried arrays its program starts from: its spec's state (the user's arrays, not
        consumed: the caller copies them) plus its lifted constants."""
        return self.layout.split(self.spec.state) + list(self.lifted)

    def user_state(self, arrays: list) -> Any:
        """The user's pytree from carried arrays (host or device), lifted constants dropped."""
        return self.layout.merge(list(arrays)[:self.layout.n_arrays])

    @property
    def status(self) -> str:
        return self.state.public

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def steps_total(self) -> int | None:
        return self.spec.steps

    @property
    def steps_left(self) -> int | None:
        """Steps not yet dispatched; None when the job runs until its data ends."""
        if self.data_done:
            return 0
        if self.spec.steps is None:
            return None
        return max(self.spec.steps - self.spec.start_step - self.dispatched, 0)

    @property
    def last_metrics(self) -> dict[str, float] | None:
        if self.last_values is None:
            if self.eval is not None and self.eval.last:
                return {**(self.restored_metrics or {}), **self.eval.last}
            return self.restored_metrics
        assert self.program is not None  # (values come from its steps)
        out = dict(zip(self.program.metric_names, self.last_values.tolist()))
        if self.extra_metrics:
            out.update(self.extra_metrics)
        if self.eval is not None and self.eval.last:
            out.update(self.eval.last)  # the newest evaluation's eval/<name>, between evaluations too
        return out

    def step_estimate_s(self, flops_per_s: float | None = None) -> float:
        """Seconds per step, as the policies rank it: the median of its recent measured steps,
        its first two left out, else the program's estimate (FLOPs at the measured rate), as for
        a job that has not started. Not the EMA: a job's first steps pay one-time costs (ms), and
        under srtf a job preempted after two steps kept that estimate, ranked as the longest job
        and waited for every other (the jct trace's 1155-step job: 1.7 s of its 2.0 s JCT)."""
        typical = median_step_s(self.step_times, RECENT)
        if typical is not None:
            return typical
        return self.program.step_time_estimate_s(flops_per_s) if self.program else 1e-3

    def host_estimate_s(self, default: float) -> float:
        """Host seconds per step the device waits for, as the policies rank it: its own once it
        has run a few steps (``step_estimate_s``: its first gaps are one-time costs too)."""
        return recent_host_s(self.host_gap_s, self.step_times, default)

    def steps_per_s(self, now: float) -> float | None:
        if not self.started_s or self.steps_done == 0:
            return None
        end = self.ended_s or now
        return self.steps_done / max(end - self.started_s, 1e-9)

    def progress(self, now: float) -> Progress:
        return Progress(
            name=self.name, status=self.status,
            steps_done=self.spec.start_step + self.steps_done, steps_total=self.steps_total,
            metrics=self.last_metrics, steps_per_s=self.steps_per_s(now), lane=self.lane,
            error=self.error, wall_s=(self.ended_s or now) - self.arrival_s)


def now_s() -> float:
    return time.monotonic()
