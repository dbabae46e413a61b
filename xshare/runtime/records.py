"""The runtime's per-job record and the read-only views handed to users (handles, progress)."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .._job import JobSpec
from .compiler import CompiledStep
from .source import BatchSource, Prefetcher

QUEUED, RUNNING, PAUSED, DONE, FAILED, CANCELLED = "queued", "running", "paused", "done", "failed", "cancelled"
TERMINAL = (DONE, FAILED, CANCELLED)


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


@dataclass(eq=False)
class JobRecord:
    """Everything the runtime tracks about one job. Guarded by the runtime's lock, except
    ``state``, which only the job's lane thread touches while the job runs."""

    id: int
    spec: JobSpec
    arrival_s: float
    source: BatchSource | None = None
    compiled: CompiledStep | None = None
    status: str = QUEUED
    priority: int = 0
    lane: int | None = None
    state: Any = None
    prefetcher: Prefetcher | None = None
    # Dispatch bookkeeping (seq/turns drive the policies; in_flight gates memory and moves).
    steps_dispatched: int = 0
    steps_done: int = 0
    in_flight: int = 0
    last_seq: int = -1
    data_done: bool = False
    stop_reason: str | None = None         # set when the job must stop: DONE/FAILED/CANCELLED
    paused: bool = False
    hold_for_checkpoint: int | None = None  # step whose output state must be saved before the next
    offload: bool = False                   # pause(offload=True): move the state to host memory
    swapped: bool = False                   # the state lives in host memory; its P is not charged
    # Results and timing.
    error: str | None = None
    first_metrics: dict[str, float] | None = None
    last_metrics: dict[str, float] | None = None
    host_state: Any = None
    device_time_s: float = 0.0
    steps_recorded: int = 0                # steps seen on the device timeline
    step_time_s: float | None = None       # measured EMA; None until the first step
    started_s: float | None = None
    ended_s: float | None = None
    queue_wait_s: float | None = None      # admission wait: from the end of compile to the start
    compiled_s: float | None = None
    step_times: deque = field(default_factory=lambda: deque(maxlen=256))
    done_event: threading.Event = field(default_factory=threading.Event)
    log_file: Any = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def steps_total(self) -> int | None:
        return self.spec.steps

    @property
    def steps_left(self) -> int | None:
        if self.spec.steps is None:
            return None
        return max(self.spec.steps - self.spec.start_step - self.steps_dispatched, 0)

    def step_estimate_s(self, flops_per_s: float | None = None) -> float:
        if self.step_time_s is not None:
            return self.step_time_s
        return self.compiled.step_time_estimate_s(flops_per_s) if self.compiled else 1e-3

    def steps_per_s(self, now: float) -> float | None:
        if not self.started_s or self.steps_done == 0:
            return None
        end = self.ended_s or now
        return self.steps_done / max(end - self.started_s, 1e-9)

    def progress(self, now: float) -> Progress:
        start = self.arrival_s
        return Progress(
            name=self.name, status=self.status,
            steps_done=self.spec.start_step + self.steps_done, steps_total=self.steps_total,
            metrics=dict(self.last_metrics) if self.last_metrics else None,
            steps_per_s=self.steps_per_s(now), lane=self.lane, error=self.error,
            wall_s=(self.ended_s or now) - start)


def now_s() -> float:
    return time.monotonic()
