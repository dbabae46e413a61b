"""The threads one ``Runtime`` runs, built together and stopped in order.

  * the fence ring and timeline (``observe/timing.py``), when steps carry FFI fences;
  * the recorder (``observe/recorder.py``): one thread for every file write;
  * the feeder (``engine/source.py``): prefetch threads for slow data;
  * the dispatcher (``engine/dispatcher.py``): the one thread that owns jobs, groups and the ledger;
  * the compile pool, which runs ``prepare.py`` (a submitted job to a ``Prepared`` event);
  * the K-step compile thread (``engine/tiers.py``), which first makes the CPU's matrix-multiply
    kernels (``compiled/warmup.py``).

The Runtime owns one ``Workers`` and says what to do (prepare these jobs, stop, close); the order
in which the threads stop, and why, is here.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import ffi
from ..memory import Arena
from .compiled.compiler import PROGRAMS
from .compiled.sweeps import Sweeps
from .compiled.warmup import warm_kernels
from .config import COLD_COMPILE_S, RuntimeConfig
from .engine.dispatcher import Dispatcher
from .engine.records import JobRecord
from .engine.source import LazyFeeder
from .engine.states import Event
from .jobtable import JobTable, by_step_code
from .observe.recorder import Recorder
from .observe.timing import Timeline
from .prepare import Preparation

log = logging.getLogger("xshare.runtime")


class Workers:
    """A Runtime's threads: ``timeline``, ``recorder``, ``feeder``, ``dispatcher``, ``pool``
    (compiles), ``tier_pool`` (background K-step compiles); ``ring`` is the fence ring or None."""

    def __init__(self, *, policy: Any, config: RuntimeConfig, arena: Arena, device: Any, capacity_source: str,
                 jobs: JobTable, fenced: bool, writers: list[Any]) -> None:
        self._jobs = jobs
        self.ring = ffi.open_ring() if fenced else None
        self.timeline = Timeline(self.ring, self._unit)
        self.recorder = Recorder(log_dir=config.log_dir, checkpoint_dir=config.checkpoint_dir, t0=jobs.t0,
                                 tick=self.timeline.drain if self.ring is not None else None,
                                 checkpoint_keep=config.checkpoint_keep, writers=writers)
        # (the feeder's lambda reads the dispatcher when a batch is ready, after it exists)
        self.feeder = LazyFeeder(lambda: device, lambda: self.dispatcher.poke)
        self.dispatcher: Dispatcher = Dispatcher(
            policy=policy, arena=arena, device=device, feeder=self.feeder,
            recorder=self.recorder, timeline=self.timeline, ring=self.ring, t0=jobs.t0,
            on_end=jobs.ended, config=config, capacity_source=capacity_source, ids=jobs.ids,
            submit=lambda fn: self.tier_pool.submit(fn),
            # a K-step program not in the persistent cache costs a compile: at least what one
            # typically costs (a process whose programs all came from the cache measured only
            # loads, which say nothing of a miss)
            compile_estimate=lambda: max(PROGRAMS.slowest_compile_s, COLD_COMPILE_S))
        self.sweeps = Sweeps(device)     # fused runtimes: which program each job runs
        self.dispatcher.groups.sweeps = self.sweeps
        # What the compile pool's threads run (prepare.py): a job to a Prepared event.
        self.prep = Preparation(config=config, device=device, recorder=self.recorder,
                                dispatcher=self.dispatcher, sweeps=self.sweeps, fenced=self.ring is not None)
        self._fuse = bool(config.fuse)
        self.pool = ThreadPoolExecutor(max_workers=config.compile_workers, thread_name_prefix="xshare-compile")
        # K-step programs (tiers.py) compile on a thread of their own: a job's first program
        # never queues behind another job's promotion, and close() need not wait for them.
        self.tier_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xshare-tiers")
        # Idle until a job has run a few steps: meanwhile it makes the CPU's matrix-multiply
        # kernels, which the first job's first step would otherwise wait for (warmup.py).
        self.tier_pool.submit(warm_kernels, device)

    def prepare(self, jobs: list[JobRecord]) -> None:
        """Hand new jobs to the compile pool."""
        if self._fuse:
            # Jobs of one step function are prepared together: their programs are chosen
            # together (a sweep over constants becomes one lifted program).
            for group in by_step_code(jobs):
                self.pool.submit(self.prep.prepare_fused, group)
        else:
            for job in jobs:
                self.pool.submit(self.prep.prepare, job)

    def stop(self, checkpoint: bool, timeout: float | None) -> list[str]:
        """Answer the queued requests, let the steps in flight finish and checkpoint every
        unfinished job; the names of the jobs that could not be (within ``timeout``)."""
        d = self.dispatcher
        if d.serving is not None:  # answer every queued request first
            try:
                d.call(d.serving.drain, timeout=timeout)
            except Exception as err:  # noqa: BLE001
                log.warning("xshare: stop could not answer every queued request: %s", err)
        try:
            return d.call(d.stop, checkpoint, timeout=timeout)
        except Exception as err:  # noqa: BLE001 - stop always returns
            log.warning("xshare: stop could not checkpoint every job: %s", err)
            return [j.name for j in self._jobs.unfinished()]

    def close(self) -> None:
        """Cancel whatever still runs and stop every thread (once the job table is closed)."""
        d = self.dispatcher
        self.pool.shutdown(wait=True, cancel_futures=True)
        try:
            d.call(d.shutdown, timeout=60)
        except Exception as err:  # noqa: BLE001
            log.warning("xshare: the dispatcher did not shut down cleanly: %s", err)
        d.thread.join(timeout=10)
        # After the dispatcher (which may still weigh a promotion as it retires its last steps),
        # and not waited for: a K-step program compiling in the background (tiers.py) for jobs
        # that have ended finishes on its own (into the persistent compilation cache, for the
        # next run) without holding this close().
        self.tier_pool.shutdown(wait=False, cancel_futures=True)
        if d.serving is not None:  # nothing launches now: fail what still waits
            d.serving.close()
        for job in self._jobs.unfinished():  # anything the dispatcher never saw (compiling)
            d.life.end(job, Event.CANCEL)
        self.feeder.close()
        self.recorder.close()
        if self.ring is not None:
            self.timeline.drain()
            ffi.close_ring(self.ring)
            self.ring = self.timeline.ring = None

    def _unit(self, unit_id: int) -> Any:
        """A job or fusion group by id (fence records name either)."""
        return self._jobs.records.get(unit_id) or self.dispatcher.groups.get(unit_id)
