"""Admission and the lifecycle wired as the dispatcher wires them, over hand-made jobs."""

from __future__ import annotations

from typing import Any

from xshare.memory import Arena
from xshare.runtime.engine.admission import Admission
from xshare.runtime.engine.lifecycle import Lifecycle
from xshare.runtime.engine.units import Units

from . import fakes

MIB = 1 << 20


class Parts:
    def __init__(self, capacity_mib: float, *, broken: tuple[str, ...] = (), checkpoint_dir: Any = None,
                 read_state: Any = None, join: Any = None):
        self.units, self.recorder, self.placer = Units(), fakes.Recorder(), fakes.Placer(broken)
        self.arena = Arena(int(capacity_mib * MIB))
        self.started: list[str] = []
        self.ended: list[tuple[str, str]] = []
        self.forgot: list[str] = []
        self.admission = Admission(self.units, self.arena, self.placer, self.recorder,
                                   capacity_source="a test arena", staging=2, t0=0.0, clock=lambda: 1.0,
                                   join=join, started=lambda job: self.started.append(job.name))
        self.life = Lifecycle(self.units, self.recorder, t0=0.0, clock=lambda: 2.0,
                              checkpoint_dir=checkpoint_dir,
                              read_state=read_state or (lambda job: {"leaves": list(job.arrays or [])}),
                              forget=(self.admission.forget, lambda job: self.forgot.append(job.name)),
                              release=self.admission.withdraw, flush=lambda: None,
                              on_end=lambda job: self.ended.append((job.name, job.state.value)))
        self.admission.refuse = self.life.abort

    def submit(self, *jobs: Any) -> None:
        for j in jobs:
            self.units.jobs[j.id] = j
            self.admission.admit(j)

    def ledger(self) -> set:
        return {lane_job for lane in self.arena.lanes() for lane_job in lane.jobs} | set(self.arena.queue)
