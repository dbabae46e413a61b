"""The dispatcher: one thread that owns device work and every job's run-time state.

Threads and what they own::

    caller threads ──submit──▶ compile pool ──post(compiled, job, Prepared)──┐
    (Runtime API, HTTP server, ──post(pause/resume/cancel/priority/stop)──────┤
     Runtime.close)                                                           ▼
    feeder threads ──job.batches (under job.feed_lock), poke()──▶ DISPATCHER THREAD
                                                                  owns: job records' run-time
                                                                  fields, fusion groups, the
                                                                  arena's ledger, the pipeline
    recorder thread ◀──metrics rows, log lines, checkpoints (host copies)──┘
    readers (status, top, handles, service) ◀── Runtime.snapshot(): copies built by
                                                 the dispatcher thread (``call``)

Everything that changes a job arrives as an event through ``post``; the dispatcher applies
events between steps, so no lock is held on the hot path. With ``debug_ownership`` (the test
suite turns it on, ``XSHARE_DEBUG_OWNERSHIP=1``), the parts' entry points assert that they run on
this thread.

The parts, one job each, composed into ``Dispatcher`` (they share its tables):

* ``planner.Planner``     which unit steps next (the policy's View -> Decision -> Plan);
* ``executor.Executor``   steps in flight: dispatch, retire, metrics rows;
* ``groups.Groups``       fusion groups: open, join, adopt, grow, shrink, leave;
* ``admission.Admission`` the ledger: admit, place, queue, swap to host and back;
* ``lifecycle.Lifecycle`` how jobs end: fail, finish, checkpoint, finalize.

Per step the dispatcher does O(1) work: advance the plan's cursor, take the unit's batch, call
the shared executable, retire the oldest in-flight step. Pipelining: up to ``1 + dispatch_ahead``
steps are in flight, so on an asynchronous device the stream never waits on Python between
steps; on CPU small steps execute inline and retire at once.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import traceback
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from .admission import Admission
from .causes import short_error
from .executor import Executor
from .fusion import Group
from .groups import Groups
from .lifecycle import Lifecycle
from .multicall import MultiCalls
from .multigroup import GroupCalls
from .tiers import Tiers
from .planner import Planner
from .plan import Plan
from .records import JobRecord
from .source import FEED_ABOVE_S, FEED_ABOVE_S_CPU
from .states import Event, JobState, transition

log = logging.getLogger("xshare.runtime")

S = JobState


@dataclass(frozen=True)
class DispatchConfig:
    """The dispatcher's settings (from ``Runtime``'s arguments), in one place."""

    quantum: int = 1                 # steps per turn
    slots: int = 1                   # jobs srtf runs at once
    dispatch_ahead: int = 8          # steps in flight behind a job's
    group_ahead: int | None = None   # ... behind a fused group's (None: dispatch_ahead)
    prefetch: int = 2                # batches staged per job (charged to its footprint)
    checkpoint_every: int | None = None
    checkpoint_dir: Any = None
    capacity_source: str = ""        # where the arena's size came from (for refusals)
    fuse: bool = False
    steps_per_call: int = 1          # the most steps one call may run (1: one step per call)
    steps_forced: bool = False       # the user named K: no payback weighing (tiers.py)
    preemptive: bool = False         # the policy preempts at step boundaries (caps K: sched/steps.py)
    group_capacity: int | None = None  # fused groups' floor (sched/capacity.py); None: none
    ids: Iterator[int] = field(default_factory=itertools.count)  # shared with jobs: group ids
    debug_ownership: bool = False


def debug_ownership_default() -> bool:
    return os.environ.get("XSHARE_DEBUG_OWNERSHIP", "") not in ("", "0")


class Dispatcher(Planner, Executor, MultiCalls, GroupCalls, Groups, Admission, Lifecycle):
    def __init__(self, *, policy: Any, arena: Any, device: Any, feeder: Any, recorder: Any,
                 timeline: Any, ring: int | None, t0: float, on_end: Callable[[JobRecord], None],
                 config: DispatchConfig, submit: Callable[[Callable[[], Any]], Future] | None = None,
                 compile_estimate: Callable[[], float | None] = lambda: None):
        self.policy, self.arena, self.device = policy, arena, device
        self.feeder, self.recorder, self.timeline, self.ring = feeder, recorder, timeline, ring
        self.config, self.t0, self._on_end = config, t0, on_end
        self.quantum, self.slots, self.ahead, self.prefetch = (config.quantum, config.slots,
                                                               config.dispatch_ahead, config.prefetch)
        self.group_ahead = config.dispatch_ahead if config.group_ahead is None else config.group_ahead
        self.checkpoint_every, self.checkpoint_dir = config.checkpoint_every, config.checkpoint_dir
        self.capacity_source, self.fuse = config.capacity_source, config.fuse
        self.preemptive = config.preemptive
        # K-step programs promoted in the background (tiers.py, multicall.py).
        self.tiers = Tiers(device=device, submit=submit, max_k=config.steps_per_call,
                           forced=config.steps_forced,
                           compile_estimate=compile_estimate)
        self.jobs: dict[int, JobRecord] = {}          # every live job, by id
        self._running: dict[int, Any] = {}            # RUNNING jobs and groups: what the policy sees
        self._swap_waiting: list[JobRecord] = []      # resumed, state on the host, no room yet
        self._events: deque = deque()
        self._inflight: deque = deque()
        self._lane_current: dict[int, Any] = {}
        self._policy_state = policy.init()
        self._plan: Plan | None = None
        self._dirty = True
        self._seq = 0
        self._draining = False
        self._exit = False
        self._idle = False
        self._wake = threading.Event()
        self.peak_in_flight_bytes = 0
        self.fused_member_steps = 0                    # member steps run in fused groups, ever
        self.groups: dict[int, Group] = {}            # fusion groups, by id
        self._groups_opened = 0
        self.sweeps: Any = None                        # the runtime's Sweeps (fused runtimes)
        self._log = recorder.log_dir is not None
        self._last_retire_ns = 0
        self._feed_above = FEED_ABOVE_S_CPU if device.platform == "cpu" else FEED_ABOVE_S
        self._rows: list = []
        # Deployed models (runtime/hub.py Hub), set by Runtime.deploy; None until a model is
        # deployed, so a training-only runtime pays nothing for serving.
        self.serving: Any = None
        self.evaluating: dict[int, JobRecord] = {}    # jobs owing an evaluation (evaluation.py)
        self.thread = threading.Thread(target=self._main, name="xshare-dispatcher", daemon=True)
        self.thread.start()

    def owned(self) -> None:
        """With ``debug_ownership``: assert that the caller runs on the dispatcher thread (the
        only writer of job records' run-time fields, groups and the ledger)."""
        if self.config.debug_ownership and threading.current_thread() is not self.thread \
                and self.thread.is_alive():
            raise AssertionError(f"dispatcher state touched from {threading.current_thread().name!r}; "
                                 "post an event instead")

    # ------------------------------------------------------------------ from other threads
    def post(self, fn: Callable, *args: Any) -> Future:
        """Run ``fn(*args)`` on the dispatcher thread between two steps; its result or
        exception lands in the returned future."""
        fut: Future = Future()
        self._events.append((fn, args, fut))
        self._wake.set()
        return fut

    def call(self, fn: Callable, *args: Any, timeout: float | None = 60.0) -> Any:
        if threading.current_thread() is self.thread or not self.thread.is_alive():
            return fn(*args)
        return self.post(fn, *args).result(timeout)

    def poke(self) -> None:
        """A batch landed: wake the dispatcher if it waits for one."""
        if self._idle:
            self._wake.set()

    # ------------------------------------------------------------------ the loop
    def _main(self) -> None:
        while not self._exit:
            try:
                self._iterate()
            except BaseException as err:  # noqa: BLE001 - a bug must not hang every job
                log.error("xshare dispatcher: %s", "".join(traceback.format_exception(err)))
                self._inflight.clear()
                for job in list(self.jobs.values()):
                    self._fail(job, f"the runtime's dispatcher failed: {short_error(err)}", err)
                    job.in_flight = 0
                    self._finalize(job, Event.FAIL)

    def _iterate(self) -> None:
        if self._events:
            self._apply_events()
            return
        serving = self.serving
        # A due model batch goes before training, at this iteration boundary (models.py).
        if serving is not None and not self._draining and serving.serve_due():
            return
        pick = None if self._draining else self._next()
        if pick is not None:
            self._dispatch(*pick)
            depth = self._group_depth(pick[0]) if isinstance(pick[0], Group) else self.ahead
            if len(self._inflight) > depth:
                self._retire_oldest(depth)
            return
        if self._inflight:
            self._retire()
            return
        if self._rows:
            self._flush_rows()
        self._idle = True
        # Re-check after announcing idleness: a batch that landed in between has no one to wake.
        if self._events or (not self._draining and self._next() is not None):
            self._idle = False
            return
        wait = 0.05
        if serving is not None and not self._draining:
            wait = serving.wait_s(wait)  # sleep until the oldest waiting request falls due
            if wait <= 0:
                self._idle = False
                return
        self._wake.wait(wait)
        self._wake.clear()
        self._idle = False

    def _apply_events(self) -> None:
        while self._events:
            fn, args, fut = self._events.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001 - the caller gets it
                fut.set_exception(err)

    # ------------------------------------------------------------------ controls (events)
    def pause(self, job: JobRecord, offload: bool) -> None:
        self.owned()
        if job.terminal:
            raise _not_live(job, "paused")
        if job.state is S.QUEUED:
            if job in self._swap_waiting:
                self._swap_waiting.remove(job)
            elif job.in_ledger:  # leave the queue; resume queues it again
                job.in_ledger = False
                self._admitted(self.arena.release(job.id))
        if job.state in (S.RUNNING, S.PAUSED, S.COMPILING, S.QUEUED, S.SWAPPED):
            job.state = transition(job.state, Event.PAUSE)
        self._running.pop(job.id, None)
        self._dirty = True  # (a group member is masked from its group's next step)
        if job.in_flight:
            # Its steps already dispatched finish now, so pause() returns with the job still.
            self._drain_inflight()
        if offload and job.state is S.PAUSED:
            if not job.terminal and job.state is S.PAUSED:
                self._swap_out(job)

    def resume(self, job: JobRecord) -> None:
        self.owned()
        if job.terminal:
            raise _not_live(job, "resumed")
        if job.state is S.PAUSED:
            job.state = transition(job.state, Event.RESUME)
            if job.error is None and job.group is None:
                self._running[job.id] = job
            self._dirty = True
            self._settle(job)
        elif job.state is S.SWAPPED:
            if job.program is None:
                job.state = transition(job.state, Event.AWAIT_COMPILE)
            elif not job.in_ledger:
                self._admit(job)
            elif self.arena.swap_in(job.id):
                self._place(job, job.lane)
                self.recorder.line(job, "state back on the device")
            else:
                job.state = transition(job.state, Event.QUEUE)
                self._swap_waiting.append(job)

    def cancel(self, job: JobRecord) -> None:
        self.owned()
        if job.terminal:
            return
        if self._running.pop(job.id, None) is not None:
            self._dirty = True
        if job.in_flight:
            self._drain_inflight()
        self._finalize(job, Event.CANCEL)

    def set_priority(self, job: JobRecord, priority: int) -> None:
        self.owned()
        job.priority = priority
        self._dirty = True

    def stop(self, checkpoint: bool) -> list[str]:
        """Dispatch nothing new, retire what is in flight, checkpoint every live job.
        Returns the names of jobs that could not be checkpointed."""
        self.owned()
        self._draining = True
        self._drain_inflight()
        missed = []
        if checkpoint and self.checkpoint_dir is not None:
            for job in list(self.jobs.values()):
                if job.program is None or job.terminal:
                    continue
                try:
                    self._save(job, done=False)
                except Exception as err:  # noqa: BLE001 - report, never hang
                    missed.append(job.name)
                    log.warning("job %r: checkpoint on stop failed: %s", job.name, err)
        return missed

    def shutdown(self) -> None:
        """Cancel every live job and end the thread."""
        self.owned()
        self._draining = True
        self._drain_inflight()
        for job in list(self.jobs.values()):
            self._finalize(job, Event.CANCEL)
        self._exit = True


def _not_live(job: JobRecord, what: str):
    from .._errors import XShareError
    return XShareError(f"job {job.name!r} is {job.status}; only live jobs can be {what}")

