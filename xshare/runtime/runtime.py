"""The runtime: one process owns the device and interleaves the compiled steps of many jobs.

Threads and what they own:
  * the caller of ``submit``: compiles the job (ahead of time, outside the lock) and asks the
    arena for a lane;
  * one worker thread per lane: asks the policy which job of its lane steps next, dispatches
    that job's compiled executable, and retires finished steps. On CPU each thread is its own
    PJRT execution stream, so lanes run in parallel; within a lane steps are serialized;
  * one prefetch thread per running job: moves batches to the device ahead of the step.
All bookkeeping is under one lock (``self._cv``); device calls and blocking happen outside it.

Pipelining: a lane keeps up to ``1 + dispatch_ahead`` steps dispatched (one executing, the
next already queued behind it), so the device never waits on Python between steps, which is
what makes a job switch cost no more than a step boundary in a plain loop.
"""

from __future__ import annotations

import logging
import os
import threading
import traceback
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import jax
import numpy as np

from .. import ffi, sched
from .._errors import AdmissionError, XShareError
from .._job import JobSpec
from .._units import format_bytes
from ..memory import Admitted, Arena
from ..memory.device import arena_capacity
from . import checkpoint
from .causes import dispatch_error, short_error
from .compiler import compile_step
from .handle import JobHandle
from .joblog import JobLogMixin, safe_name
from .offload import OffloadMixin
from .timing import TimingMixin
from .records import (CANCELLED, DONE, FAILED, PAUSED, QUEUED, RUNNING, TERMINAL, JobRecord,
                      Progress, StepRecord, now_s)
from .source import END, BatchMismatch, BatchSource, DataError, Prefetcher

log = logging.getLogger("xshare.runtime")

_DRAIN_EVERY = 8  # completed steps between reads of the fence ring


@dataclass
class _InFlight:
    job: JobRecord
    step: int                 # absolute step index (start_step + k)
    outputs: Any              # (new_state, metrics) futures
    t_dispatch_ns: int


class Runtime(OffloadMixin, TimingMixin, JobLogMixin):
    """Owns one device; admits, places and interleaves jobs under a scheduling policy.

    Args:
      policy: ``fifo`` | ``pack`` | ``srtf`` | ``fair`` | ``priority`` (or a Policy object).
      memory: the arena's size: bytes, a string like ``"4GiB"``, or None for the device's
        preallocated pool (GPU) or half the physical RAM (CPU).
      quantum: steps a job keeps its lane per turn under round-robin policies.
      log_dir: if given, each job writes ``{log_dir}/{name}/metrics.jsonl`` and ``log.txt``.
      prefetch: batches moved to the device ahead of each job's step (charged as staging memory).
      dispatch_ahead: steps queued on a lane behind the executing one (0 disables pipelining).
      fences: compile FFI step fences into every job (default: on unless ``XSHARE_FFI=0``).
      device: the device to own (default: ``jax.devices()[0]``).
      status_port: serve ``/status`` and ``/metrics`` over HTTP on this port (0 picks a free one)
        for ``xshare top`` and Prometheus; None serves nothing. Binds ``status_host``
        (loopback unless you ask otherwise).
      slots: how many jobs ``srtf`` runs at once (the shortest, in distinct lanes): 1 is
        Salus's single-device SRTF; on a multi-core CPU, where lanes run in parallel, the number
        of cores keeps every core busy.
      max_lanes: at most this many lanes (None: as many as memory allows). Lanes run in
        parallel; beyond the device's parallelism (CPU cores) they only contend, so jobs then
        share lanes and take turns.
      checkpoint_dir: where each job's ``{name}/checkpoint.msgpack`` goes (default: ``log_dir``).
      checkpoint_every: save every N steps (and when a job finishes, and on ``stop()``).
      resume: continue each submitted job from its checkpoint in ``checkpoint_dir`` if there is
        one (a finished job comes back done at once, with its saved final state).
    """

    def __init__(self, policy: str | Any = "pack", memory: int | str | None = None, *,
                 quantum: int = 1, log_dir: str | os.PathLike | None = None, prefetch: int = 2,
                 dispatch_ahead: int = 2, fences: bool | None = None, device: Any = None,
                 status_port: int | None = None, status_host: str = "127.0.0.1",
                 checkpoint_dir: str | os.PathLike | None = None, checkpoint_every: int | None = None,
                 resume: bool = False, max_lanes: int | None = None, slots: int = 1):
        if not isinstance(quantum, int) or quantum < 1:
            raise ValueError(f"quantum={quantum!r} must be an int >= 1 (steps per turn)")
        if not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"prefetch={prefetch!r} must be an int >= 1 (batches staged ahead)")
        if not isinstance(dispatch_ahead, int) or dispatch_ahead < 0:
            raise ValueError(f"dispatch_ahead={dispatch_ahead!r} must be an int >= 0")
        self.policy = sched.get_policy(policy)
        self.device = device if device is not None else jax.devices()[0]
        capacity, self.capacity_source = arena_capacity(memory, self.device)
        self.arena = Arena(capacity, max_lanes=max_lanes)
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise ValueError(f"slots={slots!r} must be an int >= 1 (jobs srtf runs at once)")
        self.quantum = quantum
        self.slots = slots
        self.prefetch = prefetch
        self.dispatch_ahead = dispatch_ahead
        self.log_dir = Path(log_dir) if log_dir is not None else None
        if checkpoint_every is not None and (not isinstance(checkpoint_every, int) or checkpoint_every < 1):
            raise ValueError(f"checkpoint_every={checkpoint_every!r} must be an int >= 1 (steps), or None")
        ckpt = checkpoint_dir if checkpoint_dir is not None else log_dir
        if (checkpoint_every is not None or resume) and ckpt is None:
            raise ValueError("checkpoint_every/resume need a checkpoint_dir (or log_dir) to keep checkpoints in")
        self.checkpoint_dir = Path(ckpt) if ckpt is not None and (checkpoint_every or resume) else None
        self.checkpoint_every = checkpoint_every
        self._resume = resume
        self._draining = False
        use_fences = ffi.enabled() if fences is None else bool(fences)
        if use_fences and not ffi.available():
            raise XShareError("fences=True but the xshare FFI library is not available: "
                              f"{ffi.unavailable_reason()}")
        self._ring = ffi.open_ring() if use_fences else None
        self._cv = threading.Condition()
        self._policy_state = self.policy.init()
        self._jobs: dict[int, JobRecord] = {}
        self._handles: dict[int, JobHandle] = {}
        self._names: set[str] = set()
        self._workers: dict[int, threading.Thread] = {}
        self._lane_in_flight: dict[int, int] = {}
        self._lane_turn: dict[int, tuple[int, int]] = {}   # lane -> (job id, steps this turn)
        self._open_begins: dict[int, int] = {}             # job id -> t_ns of an unmatched begin
        self._timeline: deque[StepRecord] = deque(maxlen=200_000)
        self._host_times: dict[int, int] = {}               # lane -> t_ns of its last completion
        self._next_id = 0
        self._seq = 0
        self._completions = 0
        self._flops_per_s: float | None = None  # achieved FLOP rate of measured steps (SRTF estimates)
        self._closed = False
        self.peak_in_flight_bytes = 0
        self.t0 = now_s()
        self.status_server = None
        if status_port is not None:
            from .server import StatusServer
            self.status_server = StatusServer(self, host=status_host, port=status_port)
            try:
                self.status_server.start()
            except BaseException:
                if self._ring is not None:
                    ffi.close_ring(self._ring)
                raise

    # ------------------------------------------------------------------ public API
    @property
    def fences(self) -> bool:
        return self._ring is not None

    def submit(self, spec: JobSpec) -> JobHandle:
        """Compile ``spec``'s step, then place it in a lane or queue it. Returns at once after
        compiling. Raises AdmissionError if the job can never fit in the arena. A job whose step
        fails to compile is returned already ``failed`` (see ``handle.error``), like any other
        failure of one job."""
        return self.submit_many([spec])[0]

    def submit_many(self, specs: Iterable[JobSpec]) -> list[JobHandle]:
        """Submit several jobs that start together: all are compiled first, then admitted in
        order, so no job gets a head start from the others' compile time. If one can never fit,
        AdmissionError is raised and none of them is submitted."""
        jobs: list[JobRecord] = []
        try:
            for spec in specs:
                jobs.append(self._register(spec))
            for job in jobs:
                self._compile(job)
            with self._cv:
                for job in jobs:
                    if job.compiled is not None:
                        self._check_fits(job)
                placed = [(job, self._admit(job)) for job in jobs if job.compiled is not None]
        except BaseException:
            for job in jobs:
                self._forget(job)
            raise
        for job, where in placed:
            if isinstance(where, Admitted):
                self._start(job, where.lane_id)
        return [self._handles[job.id] for job in jobs]

    def _register(self, spec: JobSpec) -> JobRecord:
        if not isinstance(spec, JobSpec):
            raise TypeError(f"submit() takes a JobSpec from step.bind(...); got {type(spec).__name__}")
        with self._cv:
            if self._closed:
                raise XShareError("this Runtime is closed; create a new one to submit jobs")
            if spec.name in self._names:
                raise ValueError(f"a job named {spec.name!r} was already submitted to this runtime; "
                                 "give each job a unique name")
            self._names.add(spec.name)
            job = JobRecord(id=self._next_id, spec=spec, arrival_s=now_s() - self.t0,
                            priority=spec.priority)
            self._next_id += 1
            self._jobs[job.id] = job
            self._handles[job.id] = JobHandle(self, job)
        try:
            saved = self._restore(job) if self._resume else None
        except BaseException:
            self._forget(job)
            raise
        self._open_log(job)
        if saved is not None and saved.done:
            with self._cv:
                job.host_state, job.last_metrics, job.stop_reason = saved.state, saved.metrics, DONE
                self._log(job, f"resumed: already done at step {saved.step}")
                self._finalize(job)
        return job

    def _restore(self, job: JobRecord) -> checkpoint.Checkpoint | None:
        """Continue ``job`` from its checkpoint: its spec starts at the saved step and state."""
        saved = checkpoint.load(checkpoint.path_for(self.checkpoint_dir, safe_name(job.name)),
                                job.spec.state, job=job.name)
        if saved is not None and not saved.done:
            job.spec = job.spec.replace(state=saved.state, start_step=saved.step)
            job.last_metrics = saved.metrics
        return saved

    def _compile(self, job: JobRecord) -> None:
        """Compile a registered job; a job that cannot compile (or has no data) ends at once."""
        spec = job.spec
        if job.status in TERMINAL:  # resumed as already done
            return
        try:
            job.source = BatchSource(spec.data, start=spec.start_step, stop=spec.steps)
            first = job.source.peek()
        except Exception as err:  # noqa: BLE001
            with self._cv:
                self._fail(job, f"its data raised while producing batch {spec.start_step}: "
                                f"{short_error(err)}", err)
                self._finalize(job)
            return
        try:
            if first is END:
                self._finish_empty(job)
                return
            job.compiled_s = None
            job.compiled = compile_step(spec.fn, spec.state, first, device=self.device, name=spec.name,
                                        job_id=job.id, ring_id=self._ring, prefetch=self.prefetch)
            job.compiled_s = now_s() - self.t0
        except XShareError:
            raise
        except Exception as err:  # noqa: BLE001 - a broken job fails alone
            with self._cv:
                self._fail(job, f"could not compile its step: {short_error(err)}", err)
                self._finalize(job)

    def _check_fits(self, job: JobRecord) -> None:
        fp = job.compiled.footprint
        if fp.resident + fp.ephemeral > self.arena.capacity:
            raise AdmissionError(
                f"job {job.name!r} needs {format_bytes(fp.resident + fp.ephemeral)} ({fp.describe()}) "
                f"but the arena holds {format_bytes(self.arena.capacity)} ({self.capacity_source}); "
                "lower its batch size or model size, or give the runtime more memory (--memory)")

    def _admit(self, job: JobRecord):
        """Ask the arena for a lane (lock held)."""
        fp = job.compiled.footprint
        # A job that truly holds nothing (no state, no batch, no metrics) still takes a lane;
        # the arena refuses zero-byte footprints (zero is how unknown looks), so charge 1 byte.
        ephemeral = fp.ephemeral if fp.resident + fp.ephemeral > 0 else 1
        placed = self.arena.admit(job.id, fp.resident, ephemeral, name=job.name,
                                  in_flight=self._in_flight_jobs())
        self._log(job, f"compiled: {fp.describe()}; "
                  + (f"lane {placed.lane_id}" if isinstance(placed, Admitted) else f"queued: {placed.reason}"))
        return placed

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every submitted job has ended. False on timeout."""
        deadline = None if timeout is None else now_s() + timeout
        with self._cv:
            while not all(j.status in TERMINAL for j in self._jobs.values()):
                remaining = None if deadline is None else deadline - now_s()
                if remaining is not None and remaining <= 0:
                    return False
                self._cv.wait(timeout=0.25 if remaining is None else min(remaining, 0.25))
        return True

    @property
    def jobs(self) -> list[JobHandle]:
        with self._cv:
            return list(self._handles.values())

    def handle(self, job: str | int | JobHandle) -> JobHandle:
        """A job's handle by name, id or handle; ``KeyError`` naming the known jobs otherwise."""
        if isinstance(job, JobHandle):
            return job
        with self._cv:
            for h in self._handles.values():
                if job == h.name or (isinstance(job, int) and job == h.id):
                    return h
            names = ", ".join(sorted(self._names)) or "(none)"
        raise KeyError(f"no job {job!r} in this runtime; jobs: {names}")

    def pause(self, job: str | int | JobHandle, *, offload: bool = False) -> None:
        """Stop dispatching the job's steps; ``resume`` continues exactly where it stopped.

        With ``offload=True`` the job's state also moves to host memory (``pinned_host`` where
        the device has it) once its in-flight steps finish, and its persistent bytes go back to
        the arena, so a queued job can be admitted in its place. ``resume`` moves it back as
        soon as its lane has room again; the job's results are unchanged by the round trip.
        """
        rec = self.handle(job)._rec
        with self._cv:
            if rec.status in TERMINAL:
                raise XShareError(f"job {rec.name!r} is {rec.status}; only live jobs can be paused")
            rec.paused = True
            rec.offload = rec.offload or offload
            if rec.status == RUNNING:
                rec.status = PAUSED
            self._cv.notify_all()

    def resume(self, job: str | int | JobHandle) -> None:
        """Let a paused job step again (after its state is back on the device, if offloaded)."""
        rec = self.handle(job)._rec
        with self._cv:
            if rec.status in TERMINAL:
                raise XShareError(f"job {rec.name!r} is {rec.status}; only live jobs can be resumed")
            rec.paused = False
            rec.offload = False
            if rec.status == PAUSED and not rec.swapped:
                rec.status = RUNNING
            self._cv.notify_all()
        self._swap_in_waiting()

    def cancel(self, job: str | int | JobHandle) -> None:
        """End the job after its in-flight steps; its memory goes to the next queued job."""
        rec = self.handle(job)._rec
        started = []
        with self._cv:
            if rec.status in TERMINAL:
                return
            if rec.stop_reason is None:
                rec.stop_reason = CANCELLED
            if rec.status == QUEUED or rec.in_flight == 0:
                started = self._finalize(rec)
            self._cv.notify_all()
        self._start_all(started)

    def set_priority(self, job: str | int | JobHandle, priority: int) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority={priority!r} must be an int")
        rec = self.handle(job)._rec
        with self._cv:
            rec.priority = priority
            self._cv.notify_all()

    def timeline(self) -> list[StepRecord]:
        """Executed steps in start order: device times from the FFI fences (host times without)."""
        with self._cv:
            self._drain_fences()
            return sorted(self._timeline, key=lambda r: r.t_begin_ns)

    def stop(self, *, checkpoint: bool = True, timeout: float | None = None) -> None:
        """Graceful shutdown: dispatch nothing new, let the steps in flight finish, checkpoint
        every unfinished job (when checkpointing is configured), then close. Nothing done is lost:
        a later ``Runtime(resume=True)`` continues from exactly here."""
        with self._cv:
            self._draining = True
            self._cv.notify_all()
            deadline = None if timeout is None else now_s() + timeout
            while any(self._lane_in_flight.values()) or any(j.hold_for_checkpoint is not None
                                                            for j in self._jobs.values()):
                if deadline is not None and now_s() > deadline:
                    break
                self._cv.wait(timeout=0.1)
            live = [j for j in self._jobs.values()
                    if j.status not in TERMINAL and j.state is not None and j.in_flight == 0]
        if checkpoint and self.checkpoint_dir is not None:
            for job in live:
                self._save_checkpoint(job, job.spec.start_step + job.steps_done, job.state, done=False)
        self.close()

    def close(self) -> None:
        """Cancel whatever still runs, stop the workers and release the device state."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            for job in self._jobs.values():
                if job.status not in TERMINAL and job.stop_reason is None:
                    job.stop_reason = CANCELLED
                if job.status == QUEUED:
                    self._finalize(job)
            self._cv.notify_all()
            workers = list(self._workers.values())
        for w in workers:
            w.join()
        with self._cv:
            for job in self._jobs.values():
                if job.status not in TERMINAL:
                    self._finalize(job)
        if self._ring is not None:
            ffi.close_ring(self._ring)
            self._ring = None
        if self.status_server is not None:
            self.status_server.stop()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # A clean exit finishes the work (no lost jobs); an exception cancels it.
        if exc_type is None:
            self.wait()
        self.close()

    # ------------------------------------------------------------------ lifecycle
    def _start(self, job: JobRecord, lane: int) -> None:
        """Put an admitted job's state on the device and let its lane run it."""
        try:
            # The runtime keeps the state as flat leaves (see compiler._flat_step).
            state = jax.device_put(jax.tree.leaves(job.spec.state), self.device, may_alias=False)
        except Exception as err:  # noqa: BLE001
            with self._cv:
                self._fail(job, f"could not place its state on {self.device}: {err}", err)
                started = self._finalize(job)
            self._start_all(started)
            return
        prefetcher = Prefetcher(job.source, self.device, depth=self.prefetch, name=job.name,
                                on_ready=self._notify, treedef=job.compiled.batch_def)
        with self._cv:
            if job.stop_reason is not None:  # cancelled while being placed
                started = self._finalize(job)
            else:
                job.state, job.prefetcher, job.lane = state, prefetcher, lane
                job.status = PAUSED if job.paused else RUNNING
                job.started_s = now_s() - self.t0
                job.queue_wait_s = job.started_s - (job.compiled_s if job.compiled_s is not None else job.arrival_s)
                if self._ring is not None:
                    ffi.set_lane(job.id, lane)
                prefetcher.start()
                self._ensure_worker(lane)
                self._cv.notify_all()
                started = []
        self._start_all(started)

    def _start_all(self, admitted: Iterable[Admitted]) -> None:
        """Start newly admitted jobs (lock not held); then, since memory may have been freed,
        bring back resumed jobs whose state waits in host memory."""
        for placed in admitted:
            self._start(self._jobs[placed.job_id], placed.lane_id)
        if self._waiting_swap_in():
            self._swap_in_waiting()

    def _ensure_worker(self, lane: int) -> None:
        if lane not in self._workers:
            self._lane_in_flight.setdefault(lane, 0)
            t = threading.Thread(target=self._lane_main, args=(lane,), name=f"xshare-lane-{lane}",
                                 daemon=True)
            self._workers[lane] = t
            t.start()

    def _finish_empty(self, job: JobRecord) -> None:
        """A job with no batches (steps=0 or empty data) is done at once with its initial state."""
        with self._cv:
            job.host_state = jax.device_get(job.spec.state)
            job.stop_reason = DONE
            self._finalize(job)

    def _forget(self, job: JobRecord) -> None:
        with self._cv:
            self._jobs.pop(job.id, None)
            self._handles.pop(job.id, None)
            self._names.discard(job.name)
        if job.log_file is not None:
            job.log_file.close()

    def _fail(self, job: JobRecord, cause: str, err: BaseException | None = None) -> None:
        """Record a job's failure (lock held). Its in-flight steps drain, then it is finalized."""
        if job.stop_reason in (FAILED,):
            return
        job.stop_reason = FAILED
        job.error = cause
        log.warning("job %r failed: %s", job.name, cause)
        self._log(job, f"FAILED: {cause}")
        if err is not None:
            self._log(job, "".join(traceback.format_exception(err)))

    def _finalize(self, job: JobRecord) -> list[Admitted]:
        """Move a stopping job with nothing in flight to its terminal state (lock held); frees
        its memory and returns the queued jobs that now fit (the caller starts them, unlocked)."""
        if job.status in TERMINAL:
            return []
        reason = job.stop_reason or CANCELLED
        if job.prefetcher is not None:
            job.prefetcher.close()
        job.status = reason
        job.ended_s = now_s() - self.t0
        job.state = None  # drop the device buffers (the host copy was taken for DONE jobs)
        admitted: list[Admitted] = []
        if job.compiled is not None and (self.arena.lane_of(job.id) is not None or job.id in self.arena.queue):
            admitted = self.arena.release(job.id, in_flight=self._in_flight_jobs())
        self._log(job, f"{reason} after {job.steps_done} steps")
        if job.log_file is not None:
            job.log_file.close()
            job.log_file = None
        job.done_event.set()
        self._cv.notify_all()
        return admitted

    # ------------------------------------------------------------------ lane workers
    def _lane_main(self, lane: int) -> None:
        in_flight: deque[_InFlight] = deque()
        while True:
            # One lock round trip per iteration: jobs to end, states to offload, else the next
            # step to dispatch; the device work itself happens after the lock is released.
            with self._cv:
                chores = self._chores(lane)
                offloads = [] if chores else self._offloads(lane)
                pick = None
                if not chores and not offloads:
                    if len(in_flight) <= self.dispatch_ahead and not self._closed:
                        pick = self._pick(lane)
                    if pick is None and not in_flight:
                        if self._closed or not self._lane_open(lane):
                            self._workers.pop(lane, None)
                            self._cv.notify_all()
                            return
                        self._cv.wait(timeout=0.5)
                        continue
            if chores:
                self._finish(chores)
            elif offloads:
                self._swap_out(offloads)
            elif pick is not None:
                self._dispatch(lane, *pick, in_flight)
            else:
                self._complete(lane, in_flight.popleft())

    def _lane_open(self, lane: int) -> bool:
        return any(info.id == lane for info in self.arena.lanes())

    def _chores(self, lane: int) -> list[JobRecord]:
        """Jobs of this lane that have nothing in flight and must end (lock held)."""
        return [j for j in self._jobs.values()
                if j.lane == lane and j.status not in TERMINAL and j.in_flight == 0
                and (j.stop_reason is not None or j.data_done or j.steps_left == 0)]

    def _finish(self, jobs: list[JobRecord]) -> None:
        """End jobs with nothing in flight: fetch a finished job's state to the host (outside the
        lock: it is a device-to-host copy), free their memory, start what the memory admits."""
        for job in jobs:
            if job.stop_reason is None:
                try:
                    host = jax.tree.unflatten(job.compiled.state_def, jax.device_get(job.state))
                except Exception as err:  # noqa: BLE001 - the last step failed on the device
                    with self._cv:
                        self._fail(job, f"its final state could not be read: {short_error(err)}", err)
                else:
                    if self.checkpoint_dir is not None:
                        self._save_checkpoint(job, job.spec.start_step + job.steps_done, host, done=True)
                    with self._cv:
                        job.host_state = host
                        if job.stop_reason is None:
                            job.stop_reason = DONE
            with self._cv:
                started = self._finalize(job)
            self._start_all(started)

    def _in_flight_jobs(self) -> frozenset[int]:
        return frozenset(j.id for j in self._jobs.values() if j.in_flight > 0)

    def _live(self, job: JobRecord) -> bool:
        """Whether the job may step at all now (lock held): running, not paused/held/stopping."""
        return not (job.status != RUNNING or job.paused or job.stop_reason is not None or job.data_done
                    or job.hold_for_checkpoint is not None or self._draining or job.prefetcher is None)

    def _ready(self, job: JobRecord) -> bool:
        """Whether a live job's next batch is on the device (lock held). Consumes the END and
        DataError markers as it meets them, ending the job through its lane's chores."""
        if not job.prefetcher.ready():
            return False
        head = job.prefetcher._head
        if head is END or isinstance(head, DataError):
            job.prefetcher.take()
            if head is END:
                job.data_done = True
            elif isinstance(head.error, BatchMismatch):
                self._fail(job, str(head.error))
            else:
                self._fail(job, f"its data raised while producing batch {head.step}: "
                                f"{short_error(head.error)}", head.error)
            self._cv.notify_all()  # the job's lane worker ends it (see _chores)
            return False
        return True

    def _view(self) -> sched.View:
        jobs = []
        # Exclusive policies decide which one job owns the device: a job waiting for its next
        # batch keeps it (the device idles, as under exclusive allocation) rather than letting a
        # lower-ranked job slip in. Sharing policies only consider jobs that can step at once.
        ready_only = not self.policy.exclusive
        for job in self._jobs.values():
            if job.lane is None or not self._live(job):
                continue
            if not self._ready(job) and (ready_only or not self._live(job)):
                continue
            current, turn = self._lane_turn.get(job.lane, (-1, 0))
            jobs.append(sched.JobView(
                id=job.id, name=job.name, arrival=job.arrival_s, priority=job.priority,
                steps_done=job.steps_dispatched, steps_left=job.steps_left,
                step_time_s=job.step_estimate_s(self._flops_per_s), device_time_s=job.device_time_s,
                lane=job.lane, last_seq=job.last_seq,
                turn_steps=turn if current == job.id else 0))
        lanes = tuple(sorted(self._workers))
        return sched.View(now=now_s() - self.t0, jobs=tuple(jobs), lanes=lanes, quantum=self.quantum,
                          slots=self.slots)

    def _pick(self, lane: int) -> tuple[JobRecord, Any] | None:
        """Ask the policy what this lane runs next and take that job's batch (lock held)."""
        view = self._view()
        decision, self._policy_state = self.policy.pick(view, self._policy_state)
        job_id = decision.run.get(lane)
        if job_id is None:
            return None
        if self.policy.exclusive and any(n for other, n in self._lane_in_flight.items()
                                         if other != lane and other not in decision.run):
            # Exclusive policies run exactly the jobs they chose: a newly chosen lane starts
            # once the displaced lanes' in-flight steps have drained.
            return None
        job = self._jobs[job_id]
        if not job.prefetcher.ready():
            return None  # the chosen job waits for its data; a prefetch wakes this lane
        batch = job.prefetcher.take()
        step = job.spec.start_step + job.steps_dispatched
        job.steps_dispatched += 1
        if self.checkpoint_every and (step + 1) % self.checkpoint_every == 0 and job.steps_left:
            # Its next step would consume (donate) this step's output state: hold the job until
            # the state is copied out for the checkpoint. Other jobs keep the device busy.
            job.hold_for_checkpoint = step
        job.in_flight += 1
        self._seq += 1
        job.last_seq = self._seq
        current, turn = self._lane_turn.get(lane, (-1, 0))
        self._lane_turn[lane] = (job.id, turn + 1 if current == job.id else 1)
        self._lane_in_flight[lane] = self._lane_in_flight.get(lane, 0) + 1
        self._account_peak()
        return job, step, batch

    def _account_peak(self) -> None:
        """The runtime's own record of device memory that may be in use now (lock held), from
        its job records rather than the arena's books, so it checks the admissions: every job
        whose state is on the device holds its persistent + staged bytes; every lane with steps
        in flight holds the largest ephemeral need among them (its steps run one at a time)."""
        resident = 0
        lane_e: dict[int, int] = {}
        for job in self._jobs.values():
            if job.compiled is None or job.state is None or job.swapped or job.status in TERMINAL:
                continue
            fp = job.compiled.footprint
            resident += fp.resident
            if job.in_flight > 0:
                lane_e[job.lane] = max(lane_e.get(job.lane, 0), fp.ephemeral)
        self.peak_in_flight_bytes = max(self.peak_in_flight_bytes, resident + sum(lane_e.values()))

    def _dispatch(self, lane: int, job: JobRecord, step: int, batch: Any, in_flight: deque) -> None:
        t = _host_ns()  # CLOCK_MONOTONIC, the fences' clock too (steady_clock on Linux)
        try:
            outputs = job.compiled.executable(job.state, batch)
        except Exception as err:  # noqa: BLE001 - e.g. a batch that does not match the compile
            cause = dispatch_error(job, step, batch, err)
            with self._cv:
                job.in_flight -= 1
                self._lane_in_flight[lane] -= 1
                self._fail(job, cause, err)
            return
        job.state = outputs[0]
        in_flight.append(_InFlight(job, step, outputs, t))

    def _complete(self, lane: int, item: _InFlight) -> None:
        """Wait for the oldest in-flight step of this lane and account for it."""
        job = item.job
        metrics, err = None, None
        try:
            # A sync point by design: the lane's pipeline is full, so the host waits here while
            # the next step (already dispatched) keeps the device busy.
            values = np.asarray(item.outputs[1])
            metrics = dict(zip(job.compiled.metric_names, values.tolist()))
        except Exception as e:  # noqa: BLE001 - a step that fails on the device fails its job
            err = e
        t_end = _host_ns()
        with self._cv:
            job.in_flight -= 1
            self._lane_in_flight[lane] -= 1
            if err is not None:
                self._fail(job, f"step {item.step} raised: {short_error(err)}", err)
            else:
                # A step that completed counts even if the job failed after it was dispatched
                # (a later batch was bad): its work is real and its metrics are logged.
                job.steps_done += 1
                if job.spec.observer is not None:
                    metrics = self._observe(job, item.step, metrics, t_end)
                job.last_metrics = metrics
                if job.first_metrics is None:
                    job.first_metrics = metrics
                self._write_metrics(job, item.step, metrics)
                bad = [k for k, v in metrics.items() if not np.isfinite(v)]
                if bad and job.spec.nan_policy == "fail":
                    self._fail(job, f"non-finite metric {bad[0]}={metrics[bad[0]]} at step {item.step} "
                                    "(nan_policy='fail')")
            timing_changed = True
            if self._ring is not None:
                # Fence records are paired in batches: a drain per step would cost more host
                # time than a small step takes. Device time is at most a few steps stale.
                self._completions += 1
                timing_changed = self._completions % _DRAIN_EVERY == 0 or job.in_flight == 0
                if timing_changed:
                    self._drain_fences()
            else:
                self._host_timing(lane, job, item, t_end)
            started = self.arena.retry(in_flight=self._in_flight_jobs()) if self.arena.queue else []
            save = job.hold_for_checkpoint == item.step and err is None and job.stop_reason is None
            # Wake the other lanes only when what they wait on may have changed: device times
            # (fair, srtf), a lane that drained (exclusive policies wait for it), a job that
            # must end, or memory given to a queued job. Waking every idle lane thread after
            # every step costs the host more than a small step takes.
            if (timing_changed or self._lane_in_flight[lane] == 0 or started or save
                    or job.stop_reason is not None or job.data_done or job.steps_left == 0):
                self._cv.notify_all()
        if save:
            self._save_checkpoint(job, item.step + 1, item.outputs[0], done=False)
        if job.hold_for_checkpoint == item.step:
            with self._cv:
                job.hold_for_checkpoint = None
                self._cv.notify_all()
        self._start_all(started)

    def _observe(self, job: JobRecord, step: int, metrics: dict[str, float], t_end_ns: int) -> dict[str, float]:
        """Run the job's observer (lock held: observers must be quick); its failure fails the job."""
        try:
            extra = job.spec.observer(step, metrics, t_end_ns / 1e9)
        except Exception as err:  # noqa: BLE001
            self._fail(job, f"its observer raised at step {step}: {short_error(err)}", err)
            return metrics
        return {**metrics, **{k: float(v) for k, v in (extra or {}).items()}}

    # ------------------------------------------------------------------ notify
    def _notify(self) -> None:
        with self._cv:
            self._cv.notify_all()

def _host_ns() -> int:
    import time
    return time.monotonic_ns()


def run(specs: Iterable[JobSpec], *, policy: str = "pack", memory: int | str | None = None,
        return_exceptions: bool = False, **runtime_kwargs: Any) -> list[tuple[Any, Any] | BaseException]:
    """Run ``specs`` in one Runtime and return each job's ``(state, metrics)``, in order.

    If a job fails, its JobFailed is raised after every job has ended (so the others' work is
    not lost), unless ``return_exceptions=True``, which puts the exception in its slot instead.
    """
    with Runtime(policy=policy, memory=memory, **runtime_kwargs) as rt:
        handles = rt.submit_many(specs)
        rt.wait()
    results: list[Any] = []
    for h in handles:
        try:
            results.append(h.result())
        except XShareError as err:
            if not return_exceptions:
                raise
            results.append(err)
    return results


__all__ = ["Runtime", "JobHandle", "run", "Progress", "format_bytes"]
