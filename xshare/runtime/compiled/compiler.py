"""Compile once per program: ahead-of-time, donated, fenced executables shared by every job
whose step is the same program.

A *program key* is a fingerprint of what determines the code, never of who calls it: the jaxpr
of the step over flat leaves (``program.jaxpr_identity``: its text, constants and the jax
options lowering reads; the StableHLO of the program that runs where that text is not
reproducible), the avals and placement of its state and batch, donation, device and whether it
is fenced (then the program runs between the fences). Fence identity (ring, job, lane) is a run-time
operand (``ffi.fenced``), so the fenced executable is the same for every job of a sweep: N
identical jobs cost one XLA compile. (JAX's jit cache cannot do this for us: each job is
lowered separately, and the persistent compilation cache only helps across processes.)

Two levels, because tracing costs tens of milliseconds:
  * the *trace memo*: (the ``Job`` object, avals, device, fenced) -> program, the same rule
    ``jax.jit`` uses (a function object and avals determine its trace), so N specs bound from
    one ``@xshare.job`` step skip tracing altogether;
  * the *program cache*: program key -> compiled program, which catches jobs made by separate
    factory calls (a new closure per job) that still lower to the same program.
Both are process-wide: a second Runtime in the process reuses what the first compiled.
"""

from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any, Callable, NamedTuple, TypeVar

import jax
import numpy as np

from ...memory.footprint import Footprint
from .leaves import Promote, layout_of
from .promotions import PROMOTIONS, fingerprint
from .program import (  # noqa: F401 - re-exported: the compiler's public names
    ASSUMED_FLOPS_PER_S, DONATE, CompiledStep, _avals, _flops, abstract, flat_step, has_host_callback,
    jaxpr_identity, lower_fenced, lower_unfenced, program_key, replay, trace_unfenced, tree_nbytes)


T = TypeVar("T")


class Traced(NamedTuple):
    """A step traced over carried arrays (``ProgramCache.trace``): its jaxpr, the state leaves
    its trace promoted (Python numbers it changes), and its metrics' names."""

    jaxpr: Any
    promote: frozenset
    names: tuple


def _promoting(job: Any, state: Any, attempt: Callable[[frozenset], T],
               traced: Callable[[T], tuple[Any, Any]]) -> T:
    """``attempt(promote)`` until its trace keeps every Python number it changes carried as an
    array: each ``Promote`` adds the numbers it found (as ``jax.jit`` would trace them; each
    round adds at least one leaf). The first attempt starts from what an earlier process found
    for this step and state shape (``promotions.PROMOTIONS``: one trace instead of two), and
    falls back to none if that hint fails or names a number the step passes through unchanged
    (``traced(result)``: its jaxpr and state layout), so the result is the hint-free one."""
    key = fingerprint(job.fn, state)
    hint = PROMOTIONS.hint(key, state)
    promote = hint
    while True:
        try:
            out = attempt(promote)
        except Promote as more:
            promote = promote | more.indices
            continue
        except Exception:
            if not hint:
                raise
            hint = promote = frozenset()  # the hint misled this trace: the hint-free path
            continue
        if hint and _passes_through(*traced(out), hint):
            hint = promote = frozenset()
            continue
        PROMOTIONS.learn(key, promote)
        return out


def _passes_through(closed: Any, layout: Any, indices: frozenset) -> bool:
    """Whether the step returns any of the state leaves at ``indices`` unchanged (its output is
    its input in ``closed``, the step's jaxpr over carried arrays: state leaves first)."""
    if closed is None:
        return False
    jaxpr = closed.jaxpr
    return any(jaxpr.outvars[pos] is jaxpr.invars[pos] for pos, i in enumerate(layout.carried()) if i in indices)


class ProgramCache:
    """Process-wide cache of compiled programs; thread-safe; concurrent requests for one key
    compile once (the others wait on the same future)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # job -> {(fn, avals, device, fenced): CompiledStep}, weak on the job: a job the user and
        # the runtime have let go of (finished, its handle dropped) does not keep its step
        # function, and what its closure holds (a model's graph), for the life of the process.
        self._memo: weakref.WeakKeyDictionary[Any, dict[tuple, Future]] = weakref.WeakKeyDictionary()
        self._programs: dict[str, Future] = {}    # program key -> CompiledStep
        self.compiles = 0                         # XLA compiles this cache ran (misses)
        self.compile_s = 0.0                      # their total time (a persistent-cache hit is quick)
        # The longest one: what a program that is not in the persistent cache may cost (the
        # mean would be a cache hit's, on a relaunch; tiers.py weighs compiles by this).
        self.slowest_compile_s = 0.0
        self.hits = 0

    def get(self, job: Any, state: Any, batch: Any, *, device: Any, fenced: bool,
            compile: bool = True, traced: Traced | None = None) -> CompiledStep:
        """The program of ``job`` on (``state``, ``batch``): compiled unless ``compile=False``
        (then it is lowered and keyed, and compiles on first use). ``traced``: what ``trace``
        returned for these very arguments, so the step is not traced again."""
        return self.get_promoting(job, state, batch, device=device, fenced=fenced, compile=compile,
                                  traced=traced)[0]

    def get_promoting(self, job: Any, state: Any, batch: Any, *, device: Any, fenced: bool,
                      compile: bool = True, traced: Traced | None = None) -> tuple[CompiledStep, frozenset]:
        """``(get's program, the state leaves this state's trace promoted)``: Python numbers the
        step changes, which the job carries as arrays. They belong to this request, not to the
        program: jobs whose states differ there (``TrainState.step`` a Python ``0`` in one, an
        array in another: a restored state) trace to one program, and each carries its own."""
        if traced is not None:  # (its promotions already settled by trace's own _promoting)
            program = self._get_layout(job, state, batch, traced.promote, device=device, fenced=fenced,
                                       traced=traced)
            promote = traced.promote
        else:
            program, promote = _promoting(job, state, lambda promote: (self._get_layout(
                job, state, batch, promote, device=device, fenced=fenced), promote),
                lambda out: (out[0].jaxpr, layout_of(state, out[1])[1]))
        return (program.ensure() if compile else program), promote

    def trace(self, job: Any, state: Any, batch: Any, *, device: Any) -> Traced:
        """``Traced(jaxpr, promoted, metric names)`` of ``job``'s step over carried arrays: traced as
        ``get`` traces it (Python numbers the step changes promoted to arrays), not lowered, not
        keyed, not cached. What a fused runtime needs to match a job to a family program that
        already covers it (``sweeps.Sweeps.covering``) without paying for its own lowering; a
        job it does not cover passes it to ``get``, which then lowers without tracing again."""
        def attempt(promote: frozenset) -> Traced:
            state_arrays, state_layout = layout_of(state, promote)
            batch_arrays, batch_layout = layout_of(batch)
            names: list[tuple[str, ...]] = []
            flat = flat_step(job.fn, state_layout, batch_layout, names)
            jaxpr = trace_unfenced(flat, abstract(state_arrays, device), abstract(batch_arrays, device))
            return Traced(jaxpr, promote, names[0])

        return _promoting(job, state, attempt, lambda out: (out[0], layout_of(state, out[1])[1]))

    def _get_layout(self, job: Any, state: Any, batch: Any, promote: frozenset, *, device: Any,
                    fenced: bool, traced: Traced | None = None) -> CompiledStep:
        state_arrays, state_layout = layout_of(state, promote)
        batch_arrays, batch_layout = layout_of(batch)
        state_struct, batch_struct = abstract(state_arrays, device), abstract(batch_arrays, device)
        # Keyed by the Job object itself (as in jax.jit's cache, weakly): an entry goes with its
        # job, so another function can never hit it. The layouts' memo keys hold the treedefs
        # and static values: what, with the avals, decides the trace.
        memo_key = (job.fn, state_layout.memo_key(), _avals(state_struct), batch_layout.memo_key(),
                    _avals(batch_struct), device, fenced, promote)
        with self._lock:
            table = self._memo.get(job)
            if table is None:
                table = self._memo[job] = {}
        fut, owner = self._claim(table, memo_key)
        if not owner:
            return fut.result()
        try:
            result = self._lower_and_compile(job, state_struct, batch_struct, state_layout,
                                             batch_layout, device, fenced, promote, traced)
        except Promote as more:
            # Kept: the trace is decided by the memo key, so every later job of the step would
            # trace only to learn the same thing (a TrainState's ``step`` int: one wasted trace,
            # tens of ms, per job of a sweep). Its waiters and successors re-raise it at once.
            fut.set_exception(more)
            raise
        except BaseException as err:
            with self._lock:
                del table[memo_key]  # a failed trace is not cached: the next job retries
            fut.set_exception(err)
            raise
        fut.set_result(result)
        return result

    def _lower_and_compile(self, job: Any, state_struct: list, batch_struct: list, state_layout: Any,
                           batch_layout: Any, device: Any, fenced: bool, promote: frozenset,
                           traced: Traced | None = None) -> CompiledStep:
        names: list[tuple[str, ...]] = []
        if traced is not None:  # traced already (prepare._covering), on these very layouts
            jaxpr, names = traced.jaxpr, [traced.names]
        else:
            flat = flat_step(job.fn, state_layout, batch_layout, names)
            # The user's step traced once; every program built on it from here (fenced, K-step,
            # fused) replays its jaxpr rather than tracing the user's step again.
            jaxpr = trace_unfenced(flat, state_struct, batch_struct)
        replayed = replay(jaxpr, len(state_struct))

        def lower() -> Any:
            # The program that runs: between the fences when fenced (the fences' identity is an
            # operand, so it is the same for every job).
            if fenced:
                return lower_fenced(replayed, state_struct, batch_struct, device)
            return lower_unfenced(replayed, state_struct, batch_struct)

        # Keyed by what the jaxpr computes, and lowered only when it compiles: a program kept
        # whole (executables.py) then loads without any lowering (~30 ms of a ~0.17 s start for
        # the hook's TrainState net). A jaxpr whose text is not the same in every process, or
        # that calls back into Python, is keyed by its lowering, as before.
        identity, callbacks, build = jaxpr_identity(jaxpr), False, lower
        if identity is None:
            lowered = lower()
            identity = lowered.as_text()
            callbacks = has_host_callback(identity)
            build = lambda: lowered  # noqa: E731 - lowered once, for its key
        key = program_key(identity, state_avals=_avals(state_struct), batch_avals=_avals(batch_struct),
                          keys=state_layout.keys_of() + batch_layout.keys_of(), metric_names=names[0],
                          donate=DONATE, device=device, fenced=fenced,
                          callbacks_of=job.fn if callbacks else None)
        fut, owner = self._claim(self._programs, key)
        if not owner:
            return fut.result()
        flat = replayed

        result = CompiledStep(key=key, metric_names=names[0], state_struct=state_struct,
                              batch_struct=batch_struct, state_layout=state_layout,
                              batch_layout=batch_layout, fenced=fenced, flat=flat, lowered=build,
                              on_compile=self._count, device=device)
        # What constant lifting reads (sweeps.py): the jaxpr, and whether it calls the host.
        result.jaxpr, result.host_callback = jaxpr, callbacks
        fut.set_result(result)
        return result

    def lifted(self, ref: CompiledStep, traced: Any, positions: list[int], *, device: Any) -> CompiledStep:
        """The program of ``ref`` with the constants at ``positions`` (sites of ``traced``, its
        jaxpr read by ``lifting.trace``) taken as trailing state operands: one per sweep family
        and set of positions, shared process-wide like every program."""
        from .lifting import lifted_step

        n = len(ref.state_struct)
        sharding = jax.sharding.SingleDeviceSharding(device)
        extra = [jax.ShapeDtypeStruct(np.shape(traced.values[p]), traced.values[p].dtype, sharding=sharding)
                 for p in positions]
        state_struct = list(ref.state_struct) + extra
        key = program_key(f"lifted {traced.skeleton} at {list(positions)}", state_avals=_avals(state_struct),
                          batch_avals=_avals(ref.batch_struct), keys=ref.state_layout.keys_of(),
                          metric_names=ref.metric_names, donate=DONATE, device=device, fenced=ref.fenced)
        fut, owner = self._claim(self._programs, key)
        if not owner:
            return fut.result()
        try:
            flat = lifted_step(traced, positions, n)
            batch_struct = ref.batch_struct

            def lower() -> Any:
                if ref.fenced:
                    return lower_fenced(flat, state_struct, batch_struct, device)
                return jax.jit(flat, donate_argnums=DONATE).lower(state_struct, batch_struct)

            result = CompiledStep(key=key, metric_names=ref.metric_names, state_struct=state_struct,
                                  batch_struct=batch_struct, state_layout=ref.state_layout,
                                  batch_layout=ref.batch_layout, fenced=ref.fenced, flat=flat,
                                  lowered=lower, on_compile=self._count, device=device)
            result.jaxpr, result.host_callback = None, False
            result._convolves = ref.convolves  # (it computes what ref does: payoff.unmeasured)
        except BaseException as err:
            with self._lock:
                del self._programs[key]
            fut.set_exception(err)
            raise
        fut.set_result(result)
        return result

    def shared(self, key: str, build: Callable[[], Any]) -> Any:
        """What ``build()`` compiles, cached under ``key`` with the step programs (for programs
        other than a job's step, e.g. its evaluation: ``evaluation.py``); built once, counted
        as one compile, and shared by every job that asks for the same key."""
        fut, owner = self._claim(self._programs, key)
        if not owner:
            return fut.result()
        t0 = time.perf_counter()
        try:
            result = build()
        except BaseException as err:
            with self._lock:
                del self._programs[key]  # a failed build is not cached: the next job retries
            fut.set_exception(err)
            raise
        self._count(time.perf_counter() - t0)
        fut.set_result(result)
        return result

    def built(self, key: str) -> Any:
        """What ``shared`` built under ``key`` in this process, or None (not asked for yet,
        still compiling, or failed): a caller with a thread of its own to compile on uses it
        at once instead."""
        with self._lock:
            fut = self._programs.get(key)
        if fut is None or not fut.done() or fut.exception() is not None:
            return None
        return fut.result()

    def begun(self, key: str) -> bool:
        """Whether ``shared(key, ...)`` has begun in this process and not failed: built, or
        building now (its compile paid, or being paid, whoever asked for it first)."""
        with self._lock:
            fut = self._programs.get(key)
        return fut is not None and not (fut.done() and fut.exception() is not None)

    def _claim(self, table: dict, key: Any) -> tuple[Future, bool]:
        """The future for ``key`` in ``table``, and whether the caller must fill it (the first
        to ask computes; the others wait on its future)."""
        with self._lock:
            fut = table.get(key)
            if fut is not None:
                self.hits += 1
                return fut, False
            fut = table[key] = Future()
            return fut, True

    def _count(self, seconds: float) -> None:
        with self._lock:
            self.compiles += 1
            self.compile_s += seconds
            self.slowest_compile_s = max(self.slowest_compile_s, seconds)

    def clear(self) -> None:
        with self._lock:
            self._memo.clear()
            self._programs.clear()


PROGRAMS = ProgramCache()


def compile_step(fn: Callable, state: Any, batch: Any, *, device: Any, prefetch: int = 0,
                 fenced: bool = False) -> _Staged:
    """The program a Runtime would run for ``fn(state, batch)`` (through the shared cache),
    with ``prefetch`` staged batches in its footprint: for tools and tests that want a job's
    footprint or executable without a Runtime. The executable takes flat lists of carried
    arrays (``program.state_layout.split(state)``); a fenced one takes a third argument, the
    int32[3] ident (``xshare.ffi.ident``)."""
    from ..._job import Job

    job = fn if isinstance(fn, Job) else _job_for(fn)
    program = PROGRAMS.get(job, state, batch, device=device, fenced=fenced)
    return _Staged(program, program.with_staging(prefetch))


class _Staged:
    """A program seen with one runtime's staging in its footprint (for compile_step)."""

    def __init__(self, program: CompiledStep, footprint: Footprint):
        self._program, self.footprint = program, footprint

    def __getattr__(self, name: str) -> Any:
        return getattr(self._program, name)


_JOBS: dict[Any, Any] = {}


def _job_for(fn: Callable) -> Any:
    """One Job per plain function, so repeated calls hit the trace memo."""
    from ..._job import Job

    job = _JOBS.get(fn)
    if job is None:
        job = _JOBS[fn] = Job(fn)
    return job


def persistent_cache_dir(path: str | None = None) -> str:
    """Where ``xshare launch`` keeps XLA's persistent compilation cache: ``path``, else
    ``$XSHARE_COMPILATION_CACHE``, else ``$XDG_CACHE_HOME/xshare/xla`` (``~/.cache/xshare/xla``)."""
    import os

    if path:
        return str(path)
    if os.environ.get("XSHARE_COMPILATION_CACHE"):
        return os.environ["XSHARE_COMPILATION_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "xshare", "xla")


def enable_persistent_cache(path: str | None = None) -> str:
    """Turn on JAX's persistent compilation cache in ``persistent_cache_dir(path)``, for every
    program however quickly it compiles (a sweep's step compiles in well under JAX's default
    1 s threshold), so a relaunch of the same jobs compiles nothing. Returns the directory."""
    directory = persistent_cache_dir(path)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return directory
