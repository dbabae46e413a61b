"""Hand-made units and the engine's collaborators, for testing its pure parts without jax.

The jobs are real ``JobRecord``s (the engine's own record, importable without jax) over a small
spec; the arena is the real ``memory.Arena`` (pure). Only what touches a device is fake: the
placer, and the recorder that writes files on its own thread in a runtime.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

from xshare.memory import Footprint
from xshare.runtime.engine.records import JobRecord

_ids = itertools.count()


@dataclass(frozen=True)
class Spec:
    """The fields of ``JobSpec`` the engine's pure parts read."""

    name: str
    steps: int | None = 10
    start_step: int = 0
    job: Any = None
    state: Any = None
    data: Any = None
    observer: Any = None
    eval_step: Any = None
    eval_data: Any = None
    on_metrics: Any = None

    def replace(self, **kw: Any) -> "Spec":
        return replace(self, **kw)


def job(name: str, *, steps: int | None = 10, mib: int = 1, arrival: float = 0.0, priority: int = 0,
        step_s: float = 1e-3) -> JobRecord:
    rec = JobRecord(next(_ids), Spec(name, steps), arrival, priority=priority)
    rec.footprint = Footprint(persistent=mib << 20, ephemeral=mib << 19)
    rec.step_time_s = step_s
    rec.step_times.extend([step_s] * 8)  # measured: what the policies rank it by
    rec.state_leaves = [f"{name}-state"]  # what the fake placer "puts on the device"
    return rec


class Recorder:
    log_dir = None

    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []
        self.closed: list[str] = []
        self.checkpoints: list[tuple[str, int, Any, bool]] = []
        self.releasing: list[str] = []  # jobs whose checkpoint, once written, holds their state alone

    def line(self, job: Any, text: str) -> None:
        self.lines.append((job.name, text))

    def close_job(self, job: Any) -> None:
        self.closed.append(job.name)

    def checkpoint(self, job: Any, step: int, host: Any, metrics: Any, *, done: bool, data_state: Any,
                   release: bool = False) -> None:
        self.checkpoints.append((job.name, step, host, done))
        if release:
            self.releasing.append(job.name)

    def said(self, name: str) -> list[str]:
        return [t for n, t in self.lines if n == name]


class Placer:
    """Puts a job's state "on the device" (a list standing for its arrays); fails for names in
    ``broken``."""

    device = "FakeDevice(0)"

    def __init__(self, broken: tuple[str, ...] = ()) -> None:
        self.broken = broken
        self.put_calls: list[tuple[str, int]] = []

    def put(self, job: Any, lane: int) -> None:
        if job.name in self.broken:
            raise RuntimeError(f"RESOURCE_EXHAUSTED: out of memory placing {job.name}")
        self.put_calls.append((job.name, lane))
        job.arrays = job.host_arrays if job.host_arrays is not None else list(job.state_leaves)

    def to_host(self, job: Any) -> None:
        job.host_arrays, job.arrays = list(job.arrays), None


class Timeline:
    flops_per_s = None
    host_gap_s = None

    def __init__(self) -> None:
        self.drains = 0

    def drain(self) -> None:
        self.drains += 1
