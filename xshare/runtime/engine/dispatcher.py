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

The parts, one job each, composed into ``Dispatcher``:

* ``units.Units``          the tables: live jobs, running units, lanes' current units;
* ``planner.Planner``      which unit steps next (the policy's View -> Decision -> Plan);
* ``admission.Admission``  the ledger: admit, place, queue, swap to host and back;
* ``groups.Groups``        fusion groups: open, join, adopt, grow, shrink, leave;
* ``lifecycle.Lifecycle``  how jobs end: fail, finish, checkpoint, and ``end``, the one call;
* ``rows.MetricsRows``     metrics rows on their way to the recorder, in batches;

objects that own their state and import no jax (their device effects go through
``placement.Placer``, ``group_device.GroupDevice`` and callables this class passes in); and the
executing parts, objects too, given the parts they use:

* ``source.Feeding``       which batches are made inline and which ahead; is a unit ready;
* ``tiers.Tiers``          when to compile a K-step program, and what became of it;
* ``fusecheck.FuseCheck``  whether a fused group pays; dissolving one that does not;
* ``executor.Executor``    the steps in flight: dispatch, retire, metrics; it makes and runs
  ``multicall.MultiCalls`` (K steps of a solo job per call, promotion) and
  ``multigroup.GroupCalls`` (a fused group's step, one or K per call).

This class keeps the loop (``_iterate``), the events and the controls. See
docs/explanation/architecture.md.

Per step the dispatcher does O(1) work: advance the plan's cursor, take the unit's batch, call
the shared executable, retire the oldest in-flight step. Pipelining: up to ``1 + dispatch_ahead``
steps are in flight, so on an asynchronous device the stream never waits on Python between
steps; on CPU small steps execute inline and retire at once.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
import traceback
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Iterator

from ..._errors import XShareError
from ..causes import short_error
from ..config import RuntimeConfig
from . import evaluation
from .admission import Admission
from .events import Cancel, Control, Pause, Resume, SetPriority
from .executor import Executor
from .multicall import form_fits
from .fusecheck import FuseCheck
from .group_device import GroupDevice
from .groups import Groups
from .lifecycle import Lifecycle
from .placement import Placer, read_state, state_of
from .planner import Planner
from .records import JobRecord, Prepared, now_s
from .rows import MetricsRows
from .shapes import OtherShapes
from .source import Feeding
from .states import Event, JobState, transition
from .streams import parallel_streams
from .tiers import Tiers
from .units import Units

log = logging.getLogger("xshare.runtime")

S = JobState


def debug_ownership_default() -> bool:
    return os.environ.get("XSHARE_DEBUG_OWNERSHIP", "") not in ("", "0")


class Dispatcher:
    def __init__(self, *, policy: Any, arena: Any, device: Any, feeder: Any, recorder: Any,
                 timeline: Any, ring: int | None, t0: float, on_end: Callable[[JobRecord], None],
                 config: RuntimeConfig, capacity_source: str = "", ids: Iterator[int] | None = None,
                 submit: Callable[[Callable[[], Any]], Future] | None = None,
                 compile_estimate: Callable[[], float | None] = lambda: None):
        self.policy, self.arena, self.device = policy, arena, device
        self.feeder, self.recorder, self.timeline, self.ring = feeder, recorder, timeline, ring
        self.config, self.t0 = config, t0
        self.ids = ids if ids is not None else itertools.count()  # shared with jobs: group ids
        clock = now_s
        self.units = units = Units()
        self.feeding = Feeding(feeder, device, prefetch=config.prefetch)
        self.rows = MetricsRows(recorder, enabled=recorder.log_dir is not None)
        self.planner = Planner(units, policy, timeline, quantum=config.quantum, slots=config.slots,
                               t0=t0, clock=clock, ready=self.feeding.ready,
                               owes=functools.partial(evaluation.owes, units),
                               waits=functools.partial(evaluation.waits, units))
        self.admission = Admission(units, arena, Placer(device, ring), recorder,
                                   capacity_source=capacity_source,
                                   staging=self.config.prefetch + self.config.dispatch_ahead, t0=t0, clock=clock,
                                   started=self.feeding.start)
        # Fusion groups (fused runtimes): the admission asks them first (groups.py).
        self.groups = Groups(units, arena, self.admission, recorder,
                             GroupDevice(device, ring, config.staging), floor=config.group_capacity,
                             ids=self.ids, timeline=timeline, drain=self._drain_inflight,
                             measured=config.fuse_measured, streams=parallel_streams(device, config.parallel_lanes))
        if config.fuse:
            self.admission.join = self.groups.join
        # K-step programs promoted in the background (tiers.py, multicall.py).
        self.tiers = Tiers(device=device, submit=submit, max_k=config.steps_per_call,
                           forced=config.steps_forced, compile_estimate=compile_estimate,
                           rtol=config.steps_rtol,
                           call_fits=functools.partial(form_fits, config) if config.preemptive else None)
        self.life = Lifecycle(units, recorder, t0=t0, clock=clock,
                              checkpoint_dir=config.checkpoint_dir, read_state=read_state,
                              keep_results=config.keep_results,
                              forget=(self.admission.forget, functools.partial(evaluation.release, units),
                                      self.groups.forget, self.tiers.forget),
                              release=self.admission.withdraw, flush=self.rows.flush, on_end=on_end)
        self.admission.refuse = self.groups.abort = self.life.abort
        self.fusecheck = FuseCheck(config=config, background=submit, timeline=timeline, tiers=self.tiers,
                                   arena=arena, recorder=recorder, groups=self.groups,
                                   admission=self.admission, drain=self._drain_inflight, device=device, ring=ring)
        self.executor = executor = Executor(
            units=units, planner=self.planner, life=self.life, tiers=self.tiers, rows=self.rows,
            feeding=self.feeding, config=config, recorder=recorder, timeline=timeline, device=device,
            ring=ring, arena=arena, tend=self.fusecheck.tend, cancel_soon=self._cancel_soon,
            shapes=OtherShapes(device=device, arena=arena, staging=config.prefetch + config.dispatch_ahead, recorder=recorder,
                               submit=submit, post=self.post, on_ready=self._shape_ready))
        self.planner.form_step_s = executor.multi.form_step_s  # (the K-step calls exist from here)
        # The executor's hot entry points and its pipeline, bound once (the loop runs per step).
        self._inflight = executor.inflight
        self._dispatch, self._retire_oldest, self._retire = executor.dispatch, executor.retire_oldest, executor.retire
        self._group_depth = executor.group_depth
        self._events: deque = deque()
        self._draining = False
        self._exit = False
        self._idle = False
        self._wake = threading.Event()
        # Deployed models (deployed/hub.py Hub), set by Runtime.deploy; None until a model is
        # deployed, so a training-only runtime pays nothing for serving.
        self.serving: Any = None
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
    def post(self, fn: Callable, *args: Any) -> None:
        """Run ``fn(*args)`` on the dispatcher thread between two steps, unawaited (the compile
        pool's "compiled", a job's arrival, a cancel at the next boundary). An exception it
        raises is a failure of the dispatcher's own work, handled as one in its loop (logged,
        every job failed): set in a future nobody read, an admission's AssertionError once left
        a job "compiling" and a group that never stepped, with nothing in any log."""
        self._events.append((fn, args, None))
        self._wake.set()

    def call(self, fn: Callable, *args: Any, timeout: float | None = 60.0) -> Any:
        """Run ``fn(*args)`` on the dispatcher thread between two steps and return its result
        (or raise its exception) here: the API's controls and reads."""
        if threading.current_thread() is self.thread or not self.thread.is_alive():
            return fn(*args)
        fut: Future = Future()
        self._events.append((fn, args, fut))
        self._wake.set()
        return fut.result(timeout)

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
                for job in list(self.units.jobs.values()):
                    job.in_flight = 0
                    self.life.abort(job, f"the runtime's dispatcher failed: {short_error(err)}", err)

    def _iterate(self) -> None:
        if self.units.reading:
            # Evaluations whose results have reached the host, before the events: an
            # ``on_metrics`` hook that stops its job posts the cancel this iteration applies.
            evaluation.poll(self.executor)
        if self._events:
            self._apply_events()
            if self._exit:
                return
        serving = self.serving
        # A due model batch goes before training, at this iteration boundary (deployed/models.py).
        if serving is not None and not self._draining and serving.serve_due():
            return
        pick = None if self._draining else self.planner.next()
        if pick is not None:
            self._dispatch(pick.unit, pick.lane, pick.pos)
            depth = self._group_depth(pick.unit) if pick.unit.is_group else self.config.dispatch_ahead
            if len(self._inflight) > depth:
                self._retire_oldest(depth)
            return
        if self._inflight:
            self._retire()
            return
        if self.units.reading:  # nothing else can run: wait for the oldest evaluation's results
            evaluation.poll(self.executor, block=True)
            return
        self.rows.flush()
        self._idle = True
        # Re-check after announcing idleness: a batch that landed in between has no one to wake.
        if self._events or (not self._draining and self.planner.next() is not None):
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
        # The events posted by now; those posted while they run wait for the next iteration,
        # after one dispatch. Draining until none were left let a stream of them hold every
        # step back: a sweep's compile thread posts one job every ~0.7 ms, and admitting one
        # (placing its state) takes about as long, so under fifo the first job's first step
        # waited for all 32 jobs of scale.py's N=32 to be prepared and placed (~50 ms, on a
        # run of ~1.5 s), while the device sat idle.
        for _ in range(len(self._events)):
            fn, args, fut = self._events.popleft()
            if fut is None:
                fn(*args)  # (posted: what it raises is the loop's, see post)
                continue
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001 - the caller gets it
                fut.set_exception(err)

    # ------------------------------------------------------------------ what the parts ask
    def _drain_inflight(self) -> None:
        """Retire every step in flight (groups and the fusion check ask before they copy)."""
        self.executor.drain()

    def _shape_ready(self, job: JobRecord) -> None:
        """The program ``job`` waited for (its step on a batch of another shape, shapes.py) is
        compiled: it steps again (a group member is no longer masked)."""
        if job.group is None and job.state is S.RUNNING:
            self.units.run(job)
        self.units.changed = True

    def _cancel_soon(self, job: JobRecord) -> None:
        """Cancel ``job`` at the next step boundary (an ``on_metrics`` hook returned True)."""
        self.post(self.cancel, job)

    # ------------------------------------------------------------------ events: jobs arrive
    def arrived(self, job: JobRecord) -> None:
        """A submitted job: the dispatcher's table holds it from now (its compile is under way)."""
        self.units.jobs[job.id] = job

    def compiled(self, job: JobRecord, prepared: Prepared) -> None:
        """The compile pool is done with ``job``: admit it, queue it, or refuse it."""
        self.owned()
        if job.terminal:
            return
        program = prepared.program
        job.program, job.spec, job.source = program, prepared.spec, prepared.source
        job.layout, job.batch_layout = prepared.layout, prepared.batch_layout
        job.lifted, job.traced, job.fuse_hint = prepared.lifted, prepared.traced, prepared.fuse_hint
        job.shared, job.unfused = prepared.shared, prepared.unfused
        job.eval = prepared.eval
        if prepared.restored_metrics is not None:
            job.restored_metrics = prepared.restored_metrics
        job.compiled_s = now_s() - self.t0
        if program.compiled:  # (a fused job's solo program compiles only if it must run alone)
            job.footprint = program.with_staging(self.config.prefetch + self.config.dispatch_ahead)
        if job.state is S.COMPILING:
            self.admission.admit(job)

    def group_ready(self, program: Any, jobs: list[JobRecord], compiled: bool) -> None:
        """The group program of jobs that stepped alone while it compiled is ready (or failed):
        they move in at this step boundary (``Groups.gather``)."""
        self.owned()
        self.groups.gather(program, [job for job in jobs if not job.terminal], compiled)

    def fail_now(self, job: JobRecord, cause: str, err: BaseException | None) -> None:
        self.owned()
        if not job.terminal:
            self.life.fail(job, cause, err)
            self.life.settle(job)

    def finish_now(self, job: JobRecord, host_state: Any, metrics: dict | None, note: str,
                   spec: Any = None, on_disk: Any = None) -> None:
        """End a job that never runs a step (no batches, or resumed already finished; then
        ``on_disk``, under keep_results=False, says where its final state stays instead)."""
        self.owned()
        if job.terminal:
            return
        if spec is not None:
            job.spec = spec
        job.on_disk = on_disk
        job.host_state, job.restored_metrics = host_state, metrics
        self.recorder.line(job, note)
        self.life.end(job, Event.FINISH)

    # ------------------------------------------------------------------ controls (events)
    def control(self, event: Control) -> None:
        """Apply a caller's control (``events.py``) to its job, between two steps."""
        match event:
            case Pause(job, offload):
                self.pause(job, offload)
            case Resume(job):
                self.resume(job)
            case Cancel(job):
                self.cancel(job)
            case SetPriority(job, priority):
                self.set_priority(job, priority)
            case _:
                raise TypeError(f"not a control event: {event!r}")

    def pause(self, job: JobRecord, offload: bool) -> None:
        self.owned()
        if job.terminal:
            raise _not_live(job, "paused")
        if job.state is S.QUEUED:
            self.admission.unqueue(job)
        if job.state in (S.RUNNING, S.PAUSED, S.COMPILING, S.QUEUED, S.SWAPPED):
            job.state = transition(job.state, Event.PAUSE)
        self.units.stop(job)
        self.units.changed = True  # (a group member is masked from its group's next step)
        if job.in_flight:
            # Its steps already dispatched finish now, so pause() returns with the job still.
            self._drain_inflight()
        if offload and not job.terminal and job.state is S.PAUSED:
            if job.group is not None:
                # A member's state leaves its slot for host memory; its memory was the group's,
                # so nothing is freed in the arena unless the group empties or shrinks.
                job.arrays = state_of(job)
                self.groups.leave(job)
            self.admission.swap_out(job)

    def resume(self, job: JobRecord) -> None:
        self.owned()
        if job.terminal:
            raise _not_live(job, "resumed")
        if job.state is S.PAUSED:
            job.state = transition(job.state, Event.RESUME)
            if job.error is None and job.group is None:
                self.units.run(job)
            self.units.changed = True
            self.life.settle(job)
        elif job.state is S.SWAPPED:
            if job.program is None:
                job.state = transition(job.state, Event.AWAIT_COMPILE)
            else:
                self.admission.swap_in(job)

    def cancel(self, job: JobRecord) -> None:
        self.owned()
        if job.terminal:
            return
        self.units.stop(job)
        if job.in_flight:
            self._drain_inflight()
        self.life.end(job, Event.CANCEL)

    def set_priority(self, job: JobRecord, priority: int) -> None:
        self.owned()
        job.priority = priority
        self.units.changed = True

    def stop(self, checkpoint: bool) -> list[str]:
        """Dispatch nothing new, retire what is in flight, checkpoint every live job.
        Returns the names of jobs that could not be checkpointed."""
        self.owned()
        self._draining = True
        self._drain_inflight()
        missed = []
        if checkpoint and self.config.checkpoint_dir is not None:
            for job in list(self.units.jobs.values()):
                if job.program is None or job.terminal:
                    continue
                try:
                    self.life.save(job, done=False)
                except Exception as err:  # noqa: BLE001 - report, never hang
                    missed.append(job.name)
                    log.warning("job %r: checkpoint on stop failed: %s", job.name, err)
        return missed

    def shutdown(self) -> None:
        """Cancel every live job and end the thread."""
        self.owned()
        self._draining = True
        self._drain_inflight()
        for job in list(self.units.jobs.values()):
            self.life.end(job, Event.CANCEL)
        self._exit = True

    @property
    def peak_in_flight_bytes(self) -> int:
        return self.admission.peak_in_flight_bytes

    @property
    def fused_member_steps(self) -> int:
        """Member steps run in fused groups, ever (the executor's count)."""
        return self.executor.fused_member_steps


def _not_live(job: JobRecord, what: str) -> XShareError:
    return XShareError(f"job {job.name!r} is {job.status}; only live jobs can be {what}")
