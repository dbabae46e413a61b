"""The runtime: one process owns the device and interleaves the compiled steps of many jobs.

``Runtime`` is a facade over collaborators it owns, each with a narrow interface in its own
module; its public methods are thin and delegate:

  * the job table (``jobtable.py``): every submitted job's record and handle, by id and name;
  * the controls (``controls.py``): pause, resume, cancel, reprioritize, as dispatcher events;
  * the deployments (``deployments.py``): models served next to the jobs;
  * the workers (``workers.py``), the threads, built together and stopped in order: the compile
    pool (``prepare.py``, through the process-wide program cache: N jobs of one program cost
    one XLA compile, and ``submit`` returns at once with the job ``compiling``); the dispatcher
    (``engine/dispatcher.py``), one thread that owns picking and dispatch and every job's device
    state, event-driven, O(1) host work per step; the feeder (``engine/source.py``); the
    recorder (``observe/recorder.py``), one thread for every file write and the fence timeline;
  * the arena (``xshare.memory``): the reservation ledger that admits, queues or refuses;
  * the status server (``web/server.py``), which reads ``snapshot()`` only, itself built from
    ``inspect``'s view (``view.py``).
Threads do not grow with the number of jobs.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, TypeVar

import jax

from .. import sched
from .._job import JobSpec
from .._units import format_bytes
from ..memory import Arena
from ..memory.device import arena_capacity, configure_preallocation
from .compiled.compiler import PROGRAMS
from .config import RuntimeConfig
from .engine.dispatcher import debug_ownership_default
from .handle import JobHandle
from .observe.writers import resolve as resolve_writers
from .controls import Controls
from .deployments import Deployments
from .engine.records import JobRecord, Progress, StepRecord, now_s
from .engine.streams import parallel_streams
from .jobtable import JobTable
from .setup import compilation_cache_dir, fences_wanted
from .view import RuntimeView
from .workers import Workers

log = logging.getLogger("xshare.runtime")
T = TypeVar("T")


class Runtime:
    """Owns one device; admits, places and interleaves jobs under a scheduling policy.

    Args:
      policy: ``fifo`` | ``pack`` | ``srtf`` | ``fair`` | ``priority`` (or a Policy object).
      memory: the arena's size: bytes, a string like ``"4GiB"``, or None for the device's
        preallocated pool (GPU) or half the physical RAM (CPU).
      quantum: turns a job keeps its lane under round-robin policies. A turn is one call of
        its program: one step, K steps of its K-step program, or a *run* of up to 16 calls of
        its one-step program (about 2 ms of its steps; a job whose steps take longer runs one
        per turn), never past a boundary (docs/explanation/multi-step.md, "Runs").
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
      keep_results: True (default): each done job's final state stays in memory for
        ``result()`` (and ``rt.handle(name).result()``) as long as the runtime lives. False: it
        stays only in the job's final checkpoint, released from memory once that is written
        (a checkpoint that could not be written releases nothing), and ``result()`` reads it
        back from there; needs ``checkpoint_dir``. For a runtime that runs jobs without end,
        as ``xshare serve`` does (docs/how-to/service.md): it would otherwise hold every final
        state it ever made.
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
      steps_per_call_rtol: None (default): a K-step program is kept only if it is bit-identical
        to K single steps. A float opts into a tolerance: a form whose state and metrics differ
        from K single steps by at most this much, relative to each leaf's largest magnitude, is
        kept too (its ints, bools and PRNG keys must still match exactly); ``explain`` says how
        far apart it was. For steps whose scan XLA compiles differently (convolutions on CPU).
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
      parallel_lanes: on a CPU backend, each lane's executable calls go to an execution stream
        of its own, so jobs in different lanes compute side by side on the machine's cores (the
        memory for that is what lanes reserve); a lane's own calls stay in order. False: every
        call on one stream, one at a time, as always under the policies that give one job the
        device (fifo, priority, srtf). With ``fuse``, jobs submitted together open a fused group
        per stream (docs/explanation/fusion.md); False keeps them in one. No effect on a GPU
        (one compute stream per device).
        Results are the same either way: the same programs on the same states.
    """

    def __init__(self, policy: str | Any = "pack", memory: int | str | None = None, *,
                 quantum: int = 1, log_dir: str | os.PathLike | None = None, prefetch: int = 2,
                 dispatch_ahead: int | None = None, fences: bool | None = None, device: Any = None,
                 status_port: int | None = None, status_host: str = "127.0.0.1", grpc_port: int | None = None,
                 checkpoint_dir: str | os.PathLike | None = None, checkpoint_every: int | None = None,
                 resume: bool = False, max_lanes: int | None = None, slots: int = 1,
                 compile_workers: int = 1, fuse: bool | str = False, group_capacity: int | None = None,
                 steps_per_call: int | str = "auto", compilation_cache: bool | str | os.PathLike = True,
                 checkpoint_keep: int = 3, writers: Sequence[str | Callable[[Path], Any]] = (),
                 steps_per_call_rtol: float | None = None, parallel_lanes: bool = True,
                 keep_results: bool = True):
        self.policy = sched.get_policy(policy)
        self.config = config = RuntimeConfig.of(
            self.policy, quantum=quantum, slots=slots, prefetch=prefetch, dispatch_ahead=dispatch_ahead,
            compile_workers=compile_workers, log_dir=log_dir, checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every, checkpoint_keep=checkpoint_keep, resume=resume,
            keep_results=keep_results, fuse=fuse,
            group_capacity=group_capacity, steps_per_call=steps_per_call,
            steps_per_call_rtol=steps_per_call_rtol, writers=writers,
            debug_ownership=debug_ownership_default(), parallel_lanes=parallel_lanes)
        factories = resolve_writers(writers)
        self.compilation_cache = compilation_cache_dir(compilation_cache)
        if self.compilation_cache is not None:
            from .compiled.executables import EXECUTABLES
            from .compiled.history import HISTORY
            from .compiled.multistep import VERDICTS
            from .compiled.payoff import FUSION
            from .compiled.promotions import PROMOTIONS
            VERDICTS.persist(self.compilation_cache)
            FUSION.persist(self.compilation_cache)
            PROMOTIONS.persist(self.compilation_cache)  # one trace per step, not two (promotions.py)
            EXECUTABLES.persist(self.compilation_cache)  # a fused group's first step unlowered (executables.py)
            HISTORY.persist(self.compilation_cache)  # how often each program ran here (history.py)
        # GPU preallocation must be configured before the backend starts (DESIGN: memory model).
        configure_preallocation()
        self.device = device if device is not None else jax.devices()[0]
        capacity, self.capacity_source = arena_capacity(memory, self.device)
        self.arena = Arena(capacity, max_lanes=max_lanes)
        self.t0 = now_s()
        self._jobs = JobTable(self.t0)         # the submitted jobs, by id and name
        self._workers = w = Workers(policy=self.policy, config=config, arena=self.arena, device=self.device,
                                    capacity_source=self.capacity_source, jobs=self._jobs,
                                    fenced=fences_wanted(fences, self.device), writers=factories)
        # the workers' parts that the rest of the package (and its tests) reach by these names
        self.timeline_, self.recorder, self.feeder = w.timeline, w.recorder, w.feeder
        self._dispatcher, self._pool, self._tier_pool = w.dispatcher, w.pool, w.tier_pool
        self._controls = Controls(self._jobs, self._dispatcher)
        self._deployments = Deployments(self._dispatcher, self.device, lambda: self.closed)
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
        return self._workers.ring is not None

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
        jobs = self._jobs.add(list(specs), self, lambda job: self._dispatcher.post(self._dispatcher.arrived, job))
        self._workers.prepare(jobs)
        return [self._jobs.handles[job.id] for job in jobs]

    def explain(self, specs: Iterable[JobSpec]) -> Any:
        """Which of ``specs`` would run fused in this runtime (one list of names per program),
        and why each other job would run alone (a different shape at ``params.Dense_0.kernel``,
        a constant that decides control flow, a host callback): ``FusionPlan(groups, alone,
        split)``, ``split`` saying per program how many groups of how many slots its jobs open
        (one per core on a CPU whose lanes run side by side). Programs are lowered and keyed as
        ``submit`` would, but nothing is compiled or run."""
        from .compiled.sweeps import explain

        # (one spec, a name or a handle: the check below names what it got)
        specs = [specs] if isinstance(specs, (JobSpec, str)) or not isinstance(specs, Iterable) else list(specs)
        for spec in specs:
            if not isinstance(spec, JobSpec):
                raise TypeError(f"explain() takes the JobSpecs you would submit (from step.bind(...)), "
                                f"not a job's name or handle; got {spec!r}")
        return explain(specs, self.device, fenced=self.fences,
                       streams=parallel_streams(self.device, self.config.parallel_lanes), staging=self.config.staging)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every submitted job has ended (and its files are written). False on timeout."""
        if not self._jobs.wait(timeout):
            return False
        self.recorder.flush()
        return True

    def add_end_listener(self, listener: Callable[[JobRecord], None]) -> None:
        """Call ``listener(job)`` as each job ends (on the dispatcher thread: it must be cheap; an
        exception is logged and ignored). ``xshare.tune`` wakes on it instead of polling. Adding
        one twice keeps one."""
        if listener not in self._jobs.end_listeners:
            self._jobs.end_listeners.append(listener)

    def remove_end_listener(self, listener: Callable[[JobRecord], None]) -> None:
        """Stop calling ``listener`` (a no-op if it was not added)."""
        if listener in self._jobs.end_listeners:
            self._jobs.end_listeners.remove(listener)

    @property
    def address(self) -> str | None:
        """``HOST:PORT`` of this runtime's HTTP server (``/status``, ``/metrics``, ``/v2``
        inference), or None when it was built without ``status_port``."""
        return None if self.status_server is None else self.status_server.address

    @property
    def closed(self) -> bool:
        """Whether ``close()`` (or ``stop()``) has begun: the runtime takes no more work."""
        return self._jobs.closed

    def timeline(self) -> list[StepRecord]:
        """Executed steps in start order (a bounded window): device times from the FFI fences,
        host times without them."""
        return self.timeline_.steps()

    def progress(self) -> list[Progress]:
        """Every submitted job's :class:`Progress`, in submission order."""
        now = now_s() - self.t0
        return [h._rec.progress(now) for h in self.jobs]

    # ------------------------------------------------------------------ job controls (controls.py)
    @property
    def jobs(self) -> list[JobHandle]:
        """The handles of every job submitted to this runtime, in submission order."""
        return self._controls.jobs

    def handle(self, job: str | int | JobHandle) -> JobHandle:
        """A job's handle by name, id or handle; ``KeyError`` naming the known jobs otherwise."""
        return self._controls.handle(job)

    def pause(self, job: str | int | JobHandle, *, offload: bool = False) -> None:
        """Stop dispatching the job's steps; ``resume`` continues exactly where it stopped.

        With ``offload=True`` the job's state also moves to host memory (``pinned_host`` where
        the device has it) once its in-flight steps finish, and its persistent bytes go back to
        the arena, so a queued job can be admitted in its place. ``resume`` moves it back as
        soon as its lane has room again; the job's results are unchanged by the round trip.
        """
        self._controls.pause(job, offload=offload)

    def resume(self, job: str | int | JobHandle) -> None:
        """Let a paused job step again (after its state is back on the device, if offloaded)."""
        self._controls.resume(job)

    def cancel(self, job: str | int | JobHandle) -> None:
        """End the job after its in-flight steps; its memory goes to the next queued job."""
        self._controls.cancel(job)

    def set_priority(self, job: str | int | JobHandle, priority: int) -> None:
        """Change a job's priority (larger runs first under ``priority``; ties by arrival).

        Raises:
          ValueError: ``priority`` is not an int.
        """
        self._controls.set_priority(job, priority)

    # ------------------------------------------------------------------ deployed models (deployments.py)
    def deploy(self, spec: Any) -> Any:
        """Deploy a model (``xshare.model(...)``) next to the jobs.

        Compiles ``predict`` for each padded batch size on this thread, admits the model by
        memory (params persistent, the largest bucket ephemeral), puts the params on the device
        once, and from then on the dispatcher runs its batches between training steps. HTTP:
        ``POST /v2/models/{name}/infer``.

        Returns:
          The model's :class:`ModelHandle`.

        Raises:
          AdmissionError: the model does not fit in the arena now (it does not wait in the job
            queue); the message names its ``P + E`` and what is free.
          TypeError: ``spec`` is not from ``xshare.model``.
        """
        return self._deployments.deploy(spec)

    def undeploy(self, name: str, version: int | None = None) -> None:
        """Stop taking requests for model ``name`` (every version, or only ``version``), answer
        those queued, free its memory; requests to its other versions go on meanwhile.
        ``KeyError`` naming the deployed models (or versions) if there is none."""
        self._deployments.undeploy(name, version)

    @property
    def models(self) -> dict[str, Any]:
        """The deployed models' handles, by name (each follows its name's default version)."""
        return self._deployments.models

    def model(self, name: str, version: int | None = None) -> Any:
        """A deployed model's handle: ``version``, or (None) whichever version is the name's
        default at each call, the highest ready one. ``KeyError`` naming what is deployed otherwise."""
        return self._deployments.model(name, version)

    def model_versions(self, name: str) -> list[Any]:
        """Each deployed version of ``name`` (lowest first), as handles of that version."""
        return self._deployments.model_versions(name)

    # ------------------------------------------------------------------ observation
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
        return RuntimeView(
            t0=self.t0, policy=str(getattr(self.policy, "name", self.policy)), fences=self.fences,
            quantum=int(self.config.quantum), closed=self.closed, compiles=self.compiles,
            capacity_source=str(self.capacity_source), peak_in_flight_bytes=d.peak_in_flight_bytes,
            fused_member_steps=d.fused_member_steps, arena=self.arena, jobs=self._jobs.jobs(), groups=tuple(d.groups.all()),
            models=tuple(getattr(d.serving, "models", {}).values()))

    def stop(self, *, checkpoint: bool = True, timeout: float | None = 60.0) -> list[str]:
        """Graceful shutdown: dispatch nothing new, let the steps in flight finish, checkpoint
        every unfinished job (when checkpointing is configured), then close. Nothing done is
        lost: a later ``Runtime(resume=True)`` continues from exactly here. Returns the names of
        jobs that could not be checkpointed within ``timeout`` (reported, not waited for)."""
        missed = [] if self.closed else self._workers.stop(checkpoint, timeout)
        self.close()
        return missed

    def close(self) -> None:
        """Cancel whatever still runs, stop the threads and release the device state."""
        if not self._jobs.close():
            return
        self._workers.close()
        if self.status_server is not None:
            self.status_server.stop()
        if self.grpc_server is not None:
            self.grpc_server.stop()
        self._jobs.wake()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # A clean exit finishes the work (no lost jobs); an exception cancels it.
        if exc_type is None:
            self.wait()
        self.close()


__all__ = ["Runtime", "JobHandle", "Progress", "format_bytes"]
