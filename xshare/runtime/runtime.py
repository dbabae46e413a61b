"""The runtime: one process owns the device and interleaves the compiled steps of many jobs.

``Runtime`` is a facade over collaborators with narrow interfaces, each in its own module:

  * the compile pool (a small thread pool) traces and compiles through the process-wide
    program cache (``compiler.py``): N jobs of one program cost one XLA compile, and
    ``submit`` returns at once with the job ``compiling``;
  * the arena (``xshare.memory``): the reservation ledger that admits, queues or refuses;
  * the dispatcher (``dispatcher.py``): one thread that owns picking and dispatch and every
    job's device state, event-driven, O(1) host work per step;
  * the feeder (``source.py``): batches made inline by the dispatcher, or, for slow data, by
    two prefetch threads shared by all jobs;
  * the recorder (``recorder.py``): one thread for every file write and the fence timeline;
  * the status server (``server.py``), which reads ``snapshot()`` only.
Threads do not grow with the number of jobs.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, TypeVar

import jax

from .. import ffi, sched
from .._errors import XShareError
from .._job import JobSpec
from .._units import format_bytes
from ..memory import Arena
from ..memory.device import arena_capacity, configure_preallocation
from .compiled.compiler import PROGRAMS
from .config import COLD_COMPILE_S, RuntimeConfig
from .engine.dispatcher import Dispatcher, debug_ownership_default
from .handle import JobHandle
from .observe.recorder import Recorder, check_new_names
from .observe.writers import resolve as resolve_writers
from .controls import Controls
from .deployments import Deployments
from .prepare import Preparation
from .engine.records import JobRecord, Progress, StepRecord, now_s
from .engine.source import LazyFeeder
from .compiled.sweeps import Sweeps
from .engine.states import Event
from .observe.timing import Timeline
from .setup import compilation_cache_dir, fences_wanted
from .view import RuntimeView

log = logging.getLogger("xshare.runtime")
T = TypeVar("T")



class Runtime(Deployments, Controls):
    """Owns one device; admits, places and interleaves jobs under a scheduling policy.

    Args:
      policy: ``fifo`` | ``pack`` | ``srtf`` | ``fair`` | ``priority`` (or a Policy object).
      memory: the arena's size: bytes, a string like ``"4GiB"``, or None for the device's
        preallocated pool (GPU) or half the physical RAM (CPU).
      quantum: steps a job keeps its lane per turn under round-robin policies.
      log_dir: if given, each job writes ``{log_dir}/{name}/metrics.jsonl`` and ``log.txt``.
      prefetch: batches moved to the device ahead of each job's step (charged as staging memory).
      dispatch_ahead: steps kept in flight behind the executing one (0 disables pipelining).
        When the pipeline is full its older half is retired (metrics read, steps counted) with
        one wait: results and failures (a NaN under ``nan_policy="fail"``) are seen up to this
        many steps late, and a newly urgent job waits behind up to this many steps. Default
        (None): 1 under the preemptive policies (srtf, priority), so an urgent job's first step
        begins within a step of its admission; 8 otherwise, where fewer waits buy throughput,
        and up to 32 behind a fused group's step (docs/explanation/architecture.md, "Steps in
        flight", has the measurements).
      fences: compile FFI step fences into every job (default: on unless ``XSHARE_FFI=0``, and
        only once they passed the fence canary on this machine: ``xshare.ffi.canary``, checked
        in a child process and cached; a failed canary means no fences and one warning).
      device: the device to own (default: ``jax.devices()[0]``).
      status_port: serve ``/status`` and ``/metrics`` over HTTP on this port (0 picks a free one)
        for ``xshare top`` and Prometheus; None serves nothing. Binds ``status_host``
        (loopback unless you ask otherwise).
      grpc_port: also serve the deployed models over the Open Inference Protocol's gRPC
        (``GRPCInferenceService``) on this port of ``status_host`` (0 picks a free one; see
        ``rt.grpc_server.address``); None serves none. Needs ``pip install 'xshare[grpc]'``.
      slots: how many jobs ``srtf`` runs at once (the shortest, taking turns).
      max_lanes: at most this many lanes (None: as many as memory allows); jobs then share lanes.
      checkpoint_dir: where each job's Orbax checkpoints ``{name}/checkpoint/{step}/`` go
        (default: ``log_dir``); a plain ``ocp.CheckpointManager`` reads them.
      checkpoint_every: save every N steps (and when a job finishes, and on ``stop()``).
      checkpoint_keep: the newest checkpoints kept per job (Orbax's ``max_to_keep``; default 3).
      writers: where each job's metrics rows go besides ``metrics.jsonl``: ``"tensorboard"``
        (event files with the job's ``meta["params"]`` as HParams, ``pip install
        'xshare[tensorboard]'``) or factories ``job_directory -> xshare.Writer``; needs ``log_dir``.
      resume: continue each submitted job from its checkpoint in ``checkpoint_dir`` if there is
        one (a finished job comes back done at once, with its saved final state).
      compile_workers: threads that trace and compile jobs (cache misses only).
      fuse: run jobs that share a program as fused groups: one vmapped executable steps them
        all, each still its own job (docs/explanation/fusion.md). Off by default. True: where
        fusing pays: a group is measured once (its fused step against its members' own steps,
        on copies) and dissolves, its members stepping alone, if a fused step costs them more;
        a program measured so, or whose group compile its jobs' steps would not repay, opens no
        group (``explain`` says why). "always": every group opens and stays, unmeasured.
      steps_per_call: the most steps one executable call may run (like Keras'
        ``steps_per_execution``). "auto" (default): each job starts one step per call; a K-step
        program (a scan over K stacked batches) compiles in the background where the job's
        remaining steps repay it, and the job moves to it at a step boundary once it is checked
        bit-identical to K single steps and measured faster (docs/explanation/multi-step.md). A
        call never passes a job's last step, evaluation, checkpoint or the reports its
        ``on_metrics`` acts on; under srtf/priority it is capped near 2 ms of device time. An
        int caps K (rounded down to a power of two); 1 runs one step per call.
      compilation_cache: keep XLA's compiled programs on disk, so a relaunch of the same jobs
        (and K-step and fused programs) loads them instead of compiling: True (default) uses
        ``$XSHARE_COMPILATION_CACHE`` or ``~/.cache/xshare/xla`` unless the process already set
        ``jax_compilation_cache_dir`` (then that one is kept); a path uses that directory; False
        leaves JAX's settings alone. This is JAX's own persistent cache (process-wide: the
        process's other ``jax.jit`` programs use it too), as ``xshare launch`` always did.
      group_capacity: with ``fuse``, the slots every fused group has at least (rounded up to a
        power of two): a group opens with room for this many jobs, even for one job of a program
        others run, and never shrinks below it, so a workload that keeps about this many jobs of
        a program running (a study's ``concurrency``: ``xshare.tune.optimize`` sets it) compiles
        one group program per program instead of one per size its membership passes through.
        Empty slots are computed and masked away, and the arena reserves their memory (a group
        that does not fit leaves its jobs to run alone). None (default): groups open for the
        jobs at hand and shrink when three quarters of their slots are empty.
    """

    def __init__(self, policy: str | Any = "pack", memory: int | str | None = None, *,
                 quantum: int = 1, log_dir: str | os.PathLike | None = None, prefetch: int = 2,
                 dispatch_ahead: int | None = None, fences: bool | None = None, device: Any = None,
                 status_port: int | None = None, status_host: str = "127.0.0.1", grpc_port: int | None = None,
                 checkpoint_dir: str | os.PathLike | None = None, checkpoint_every: int | None = None,
                 resume: bool = False, max_lanes: int | None = None, slots: int = 1,
                 compile_workers: int = 1, fuse: bool | str = False, group_capacity: int | None = None,
                 steps_per_call: int | str = "auto", compilation_cache: bool | str | os.PathLike = True,
                 checkpoint_keep: int = 3, writers: Sequence[str | Callable[[Path], Any]] = ()):
        self.policy = sched.get_policy(policy)
        self.config = config = RuntimeConfig.of(
            self.policy, quantum=quantum, slots=slots, prefetch=prefetch, dispatch_ahead=dispatch_ahead,
            compile_workers=compile_workers, log_dir=log_dir, checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every, checkpoint_keep=checkpoint_keep, resume=resume, fuse=fuse,
            group_capacity=group_capacity, steps_per_call=steps_per_call, writers=writers,
            debug_ownership=debug_ownership_default())
        factories = resolve_writers(writers)
        self.compilation_cache = compilation_cache_dir(compilation_cache)
        if self.compilation_cache is not None:
            from .compiled.multistep import VERDICTS
            from .compiled.payoff import FUSION
            VERDICTS.persist(self.compilation_cache)
            FUSION.persist(self.compilation_cache)
        # GPU preallocation must be configured before the backend starts (DESIGN: memory model).
        configure_preallocation()
        self.device = device if device is not None else jax.devices()[0]
        capacity, self.capacity_source = arena_capacity(memory, self.device)
        self.arena = Arena(capacity, max_lanes=max_lanes)
        use_fences = fences_wanted(fences, self.device)
        self._ring = ffi.open_ring() if use_fences else None
        self.t0 = now_s()
        self._all: dict[int, JobRecord] = {}
        self._handles: dict[int, JobHandle] = {}
        self._by_name: dict[str, JobHandle] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()          # guards the job tables above, never held long
        self._ended = threading.Condition()
        # Called (on the dispatcher thread, so: cheap and never raising) as each job ends;
        # xshare.tune's driver wakes on it instead of polling its trials' statuses.
        self._end_listeners: list[Callable[[JobRecord], None]] = []
        self._closed = False
        self.timeline_ = Timeline(self._ring, self._unit)
        self.recorder = Recorder(log_dir=config.log_dir, checkpoint_dir=config.checkpoint_dir, t0=self.t0,
                                 tick=self.timeline_.drain if self._ring is not None else None,
                                 checkpoint_keep=checkpoint_keep, writers=factories)
        # (the feeder's lambda reads the dispatcher when a batch is ready, after it exists)
        self.feeder = LazyFeeder(lambda: self.device, lambda: self._dispatcher.poke)
        self._dispatcher: Dispatcher = Dispatcher(
            policy=self.policy, arena=self.arena, device=self.device, feeder=self.feeder,
            recorder=self.recorder, timeline=self.timeline_, ring=self._ring, t0=self.t0,
            on_end=self._job_ended, config=config, capacity_source=self.capacity_source, ids=self._ids,
            submit=lambda fn: self._tier_pool.submit(fn),
            # a K-step program not in the persistent cache costs a compile: at least what one
            # typically costs (a process whose programs all came from the cache measured only
            # loads, which say nothing of a miss)
            compile_estimate=lambda: max(PROGRAMS.slowest_compile_s, COLD_COMPILE_S))
        self._sweeps = Sweeps(self.device)     # fused runtimes: which program each job runs
        self._dispatcher.groups.sweeps = self._sweeps
        # What the compile pool's threads run (prepare.py): a job to a Prepared event.
        self._prep = Preparation(config=config, device=self.device, recorder=self.recorder,
                                 dispatcher=self._dispatcher, sweeps=self._sweeps, fenced=self._ring is not None)
        self._pool = ThreadPoolExecutor(max_workers=compile_workers, thread_name_prefix="xshare-compile")
        # K-step programs (tiers.py) compile on a thread of their own: a job's first program
        # never queues behind another job's promotion, and close() need not wait for them.
        self._tier_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xshare-tiers")
        self.status_server = self.grpc_server = None
        if status_port is not None or grpc_port is not None:
            from .web.server import start_servers
            try:
                start_servers(self, status_host, status_port, grpc_port)
            except BaseException:
                self.close()
                raise

    # ------------------------------------------------------------------ public API
    @property
    def fences(self) -> bool:
        """Whether this runtime's steps carry FFI fences (device timestamps in ``timeline()``)."""
        return self._ring is not None

    @property
    def peak_in_flight_bytes(self) -> int:
        """The most arena bytes ever reserved by steps in flight at once (persistent + ephemeral)."""
        return self._dispatcher.peak_in_flight_bytes

    @property
    def compiles(self) -> int:
        """XLA compiles run by this process's program cache (shared by every Runtime), fused
        group programs included."""
        return PROGRAMS.compiles

    @property
    def compile_s(self) -> float:
        """Seconds those compiles took (a hit in XLA's persistent cache takes a fraction)."""
        return PROGRAMS.compile_s

    def submit(self, spec: JobSpec) -> JobHandle:
        """Queue ``spec`` for compilation and return its handle at once (status ``compiling``).

        When compiled, the job is placed in a lane, or queued until memory frees up; a job that
        can never fit in the arena ends ``failed`` and its ``result()`` raises AdmissionError
        with the numbers. A job whose step fails to compile ends ``failed`` with the compiler's
        message (see ``handle.error``), like any other failure of one job.

        Returns:
          The job's :class:`JobHandle`.

        Raises:
          XShareError: the runtime is closed.
          ValueError: a job of that name was already submitted to this runtime.
          TypeError: ``spec`` is not a JobSpec.
        """
        return self.submit_many([spec])[0]

    def submit_many(self, specs: Iterable[JobSpec]) -> list[JobHandle]:
        """Submit several jobs; returns their handles at once, in order. Jobs of one program
        compile once; they are admitted in submission order."""
        specs = list(specs)
        jobs: list[JobRecord] = []
        with self._lock:
            if self._closed:
                raise XShareError("this Runtime is closed; create a new one to submit jobs")
            for spec in specs:
                if not isinstance(spec, JobSpec):
                    raise TypeError(f"submit() takes a JobSpec from step.bind(...); got {type(spec).__name__}")
            check_new_names([spec.name for spec in specs], set(self._by_name))
            # Jobs of one step function in one call will most likely share a program: a fused
            # group is opened with room for all of them (it still grows for later arrivals).
            # Closures made by one factory share their code object, so a sweep built by calling
            # make_job N times counts as N, not N times 1.
            same: dict = {}
            for spec in specs:
                same[_step_code(spec)] = same.get(_step_code(spec), 0) + 1
            for spec in specs:
                job = JobRecord(id=next(self._ids), spec=spec, arrival_s=now_s() - self.t0,
                                priority=spec.priority, fuse_hint=same[_step_code(spec)])
                self._all[job.id] = job
                self._dispatcher.post(self._dispatcher.arrived, job)  # before its compiled event
                handle = JobHandle(self, job)
                self._handles[job.id] = handle
                self._by_name[spec.name] = handle
                jobs.append(job)
        if self.config.fuse:
            # Jobs of one step function are prepared together: their programs are chosen
            # together (a sweep over constants becomes one lifted program).
            by_code: dict = {}
            for job in jobs:
                by_code.setdefault(_step_code(job.spec), []).append(job)
            for group in by_code.values():
                self._pool.submit(self._prep.prepare_fused, group)
        else:
            for job in jobs:
                self._pool.submit(self._prep.prepare, job)
        return [self._handles[job.id] for job in jobs]

    def explain(self, specs: Iterable[JobSpec]) -> Any:
        """Which of ``specs`` would run as one fused group in this runtime, and why each other job
        would run alone (a different shape at ``params.Dense_0.kernel``, a constant that decides
        control flow, a host callback): ``FusionPlan(groups, alone)``. Programs are lowered
        and keyed as ``submit`` would, but nothing is compiled or run."""
        from .compiled.sweeps import explain

        return explain(list(specs), self.device, fenced=self.fences)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every submitted job has ended (and its files are written). False on timeout."""
        deadline = None if timeout is None else now_s() + timeout
        with self._ended:
            while any(not j.terminal for j in self._all.values()):
                remaining = None if deadline is None else deadline - now_s()
                if remaining is not None and remaining <= 0:
                    return False
                self._ended.wait(timeout=0.5 if remaining is None else min(remaining, 0.5))
        self.recorder.flush()
        return True

    def add_end_listener(self, listener: Callable[[JobRecord], None]) -> None:
        """Call ``listener(job)`` as each job ends (on the dispatcher thread: it must be cheap; an
        exception is logged and ignored). ``xshare.tune`` wakes on it instead of polling. Adding
        one twice keeps one."""
        if listener not in self._end_listeners:
            self._end_listeners.append(listener)

    def remove_end_listener(self, listener: Callable[[JobRecord], None]) -> None:
        """Stop calling ``listener`` (a no-op if it was not added)."""
        if listener in self._end_listeners:
            self._end_listeners.remove(listener)

    @property
    def address(self) -> str | None:
        """``HOST:PORT`` of this runtime's HTTP server (``/status``, ``/metrics``, ``/v2``
        inference), or None when it was built without ``status_port``."""
        return None if self.status_server is None else self.status_server.address

    @property
    def closed(self) -> bool:
        """Whether ``close()`` (or ``stop()``) has begun: the runtime takes no more work."""
        return self._closed

    def timeline(self) -> list[StepRecord]:
        """Executed steps in start order (a bounded window): device times from the FFI fences,
        host times without them."""
        return self.timeline_.steps()

    def progress(self) -> list[Progress]:
        """Every submitted job's :class:`Progress`, in submission order."""
        now = now_s() - self.t0
        return [h._rec.progress(now) for h in self.jobs]

    def snapshot(self) -> dict[str, Any]:
        """The runtime's state as one JSON-ready dict (``"schema": "xshare.status/v1"``): what
        ``/status``, ``/metrics`` and ``xshare top`` show. Reads without stopping the dispatcher."""
        from .observe.snapshot import snapshot
        return snapshot(self)

    def inspect(self, read: Callable[[RuntimeView], T], *, timeout: float | None = 30.0) -> T:
        """Call ``read(view)`` on the dispatcher thread, between two steps, and return its result.

        ``view`` is a ``RuntimeView`` (``xshare/runtime/view.py``): the runtime's figures, its jobs,
        fused groups and deployed models, all of one instant. The records in it are the engine's
        own: ``read`` must only read them, be quick (no step runs meanwhile) and return plain
        data. ``snapshot()`` is built this way.
        """
        return self._dispatcher.call(lambda: read(self._view()), timeout=timeout)

    def _view(self) -> RuntimeView:
        d = self._dispatcher
        with self._lock:
            jobs = tuple(sorted(self._all.values(), key=lambda j: j.id))
        return RuntimeView(
            t0=self.t0, policy=str(getattr(self.policy, "name", self.policy)), fences=self.fences,
            quantum=int(self.config.quantum), closed=self._closed, compiles=self.compiles,
            capacity_source=str(self.capacity_source), peak_in_flight_bytes=d.peak_in_flight_bytes,
            fused_member_steps=d.fused_member_steps, arena=self.arena, jobs=jobs, groups=tuple(d.groups.all()),
            models=tuple(getattr(d.serving, "models", {}).values()))

    def stop(self, *, checkpoint: bool = True, timeout: float | None = 60.0) -> list[str]:
        """Graceful shutdown: dispatch nothing new, let the steps in flight finish, checkpoint
        every unfinished job (when checkpointing is configured), then close. Nothing done is
        lost: a later ``Runtime(resume=True)`` continues from exactly here. Returns the names of
        jobs that could not be checkpointed within ``timeout`` (reported, not waited for)."""
        missed: list[str] = []
        if not self._closed:
            if self._dispatcher.serving is not None:  # answer every queued request first
                try:
                    self._dispatcher.call(self._dispatcher.serving.drain, timeout=timeout)
                except Exception as err:  # noqa: BLE001
                    log.warning("xshare: stop could not answer every queued request: %s", err)
            try:
                missed = self._dispatcher.call(self._dispatcher.stop, checkpoint, timeout=timeout)
            except Exception as err:  # noqa: BLE001 - stop always returns
                log.warning("xshare: stop could not checkpoint every job: %s", err)
                missed = [j.name for j in self._all.values() if not j.terminal]
        self.close()
        return missed

    def close(self) -> None:
        """Cancel whatever still runs, stop the threads and release the device state."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        try:
            self._dispatcher.call(self._dispatcher.shutdown, timeout=60)
        except Exception as err:  # noqa: BLE001
            log.warning("xshare: the dispatcher did not shut down cleanly: %s", err)
        self._dispatcher.thread.join(timeout=10)
        # After the dispatcher (which may still weigh a promotion as it retires its last steps),
        # and not waited for: a K-step program compiling in the background (tiers.py) for jobs
        # that have ended finishes on its own (into the persistent compilation cache, for the
        # next run) without holding this close().
        self._tier_pool.shutdown(wait=False, cancel_futures=True)
        if self._dispatcher.serving is not None:  # nothing launches now: fail what still waits
            self._dispatcher.serving.close()
        for job in self._all.values():  # anything the dispatcher never saw (compiling)
            if not job.terminal:
                self._dispatcher.life.end(job, Event.CANCEL)
        self.feeder.close()
        self.recorder.close()
        if self._ring is not None:
            self.timeline_.drain()
            ffi.close_ring(self._ring)
            self._ring = self.timeline_.ring = None
        if self.status_server is not None:
            self.status_server.stop()
        if self.grpc_server is not None:
            self.grpc_server.stop()
        with self._ended:
            self._ended.notify_all()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # A clean exit finishes the work (no lost jobs); an exception cancels it.
        if exc_type is None:
            self.wait()
        self.close()

    def _unit(self, unit_id: int) -> Any:
        """A job or fusion group by id (fence records name either)."""
        return self._all.get(unit_id) or self._dispatcher.groups.get(unit_id)

    def _job_ended(self, job: JobRecord) -> None:
        with self._ended:
            self._ended.notify_all()
        for listener in list(self._end_listeners):
            try:
                listener(job)
            except Exception:  # runs on the dispatcher thread: never take it down (logged)
                log.exception("xshare: a job-end listener raised")


def _step_code(spec: JobSpec) -> Any:
    return getattr(spec.fn, "__code__", None) or id(spec.job)


__all__ = ["Runtime", "JobHandle", "Progress", "format_bytes"]
