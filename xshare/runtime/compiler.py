"""Compile once per program: ahead-of-time, donated, fenced executables shared by every job
whose step is the same program.

A *program key* is a fingerprint of what determines the code, never of who calls it: the
unfenced StableHLO of the step over flat leaves, the avals and placement of its state and batch,
donation, device and whether it is fenced. Fence identity (ring, job, lane) is a run-time
operand (``ffi.fenced``), so the fenced executable is the same for every job of a sweep: N
identical jobs cost one XLA compile. (JAX's jit cache cannot do this for us: each job is
lowered separately, and the persistent compilation cache only helps across processes.)

Two levels, because lowering costs tens of milliseconds:
  * the *trace memo*: (the ``Job`` object, avals, device, fenced) -> program, the same rule
    ``jax.jit`` uses (a function object and avals determine its trace), so N specs bound from
    one ``@xshare.job`` step skip tracing altogether;
  * the *program cache*: program key -> compiled program, which catches jobs made by separate
    factory calls (a new closure per job) that still lower to the same program.
Both are process-wide: a second Runtime in the process reuses what the first compiled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import math
import threading
import time
import warnings
import weakref
from concurrent.futures import Future
from typing import Any, Callable

import jax
import numpy as np

from .. import ffi
from ..memory.footprint import Footprint, footprint_from_analysis

# Used to rank jobs (SRTF) before their first measured step, and only until the runtime has
# measured any job: then the FLOP rate achieved by measured jobs replaces it, so a new job is
# estimated on the same scale as the running ones it competes with.
ASSUMED_FLOPS_PER_S = 2e10


class CompiledStep:
    """One program, shared by every job whose step lowers to it. It is lowered (and keyed) at
    once; the XLA compile runs on first use of ``executable``/``footprint``/``flops`` (or
    ``ensure()``), so a fused sweep whose jobs all run in a vmapped group never pays for the
    solo executable it does not run."""

    def __init__(self, *, key: str, metric_names: tuple[str, ...], state_struct: Any, batch_struct: Any,
                 state_def: Any, batch_def: Any, fenced: bool, flat: Callable, lowered: Callable[[], Any],
                 on_compile: Callable[[], None]):
        self.key = key                      # the program key (hex)
        self.metric_names = metric_names    # the packed metrics vector's entries, in order
        self.state_struct, self.batch_struct = state_struct, batch_struct  # ShapeDtypeStruct pytrees
        self.state_def, self.batch_def = state_def, batch_def  # to rebuild pytrees from flat leaves
        self.fenced = fenced
        self.flat = flat                    # the unfenced step over flat leaves (fusion vmaps it)
        self._lowered, self._on_compile = lowered, on_compile
        self._compiled: tuple | None = None
        self._lock = threading.Lock()

    def ensure(self) -> "CompiledStep":
        """Compile now (once); raises what XLA raises."""
        if self._compiled is None:
            with self._lock:
                if self._compiled is None:
                    with warnings.catch_warnings():
                        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
                        lowered = self._lowered()
                        t0 = time.perf_counter()  # XLA's part only (lowering is not compiling)
                        compiled = lowered.compile()
                    self._on_compile(time.perf_counter() - t0)
                    fp = footprint_from_analysis(
                        compiled.memory_analysis(), state_bytes=tree_nbytes(self.state_struct),
                        batch_bytes=tree_nbytes(self.batch_struct), prefetch=0, job=self.key[:12])
                    self._compiled = (compiled, fp, _flops(compiled))
                    self._lowered = None  # the compiled program is all that is needed now
        return self

    @property
    def executable(self) -> Any:
        """(state leaves, batch leaves[, ident]) -> (new state leaves, metrics vector)."""
        return self.ensure()._compiled[0]

    @property
    def footprint(self) -> Footprint:
        """From ``memory_analysis()``; staging = 0: each runtime adds its own prefetch depth."""
        return self.ensure()._compiled[1]

    @property
    def flops(self) -> float | None:
        """Per step, from ``cost_analysis()``; None when unknown (or not compiled yet)."""
        return self._compiled[2] if self._compiled is not None else None

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    def step_time_estimate_s(self, flops_per_s: float | None = None) -> float:
        """Seconds per step from ``cost_analysis()`` FLOPs at ``flops_per_s`` (the rate the
        runtime measured on jobs that already ran, else a generic guess)."""
        if self.flops and self.flops > 0:
            return max(self.flops / (flops_per_s or ASSUMED_FLOPS_PER_S), 1e-6)
        return 1e-3

    def with_staging(self, prefetch: int) -> Footprint:
        """The footprint a runtime charges: the program's plus ``prefetch`` staged batches."""
        return dataclasses.replace(self.footprint, staging=prefetch * tree_nbytes(self.batch_struct))


def tree_nbytes(tree: Any) -> int:
    return int(sum(np.dtype(x.dtype).itemsize * math.prod(x.shape) for x in jax.tree.leaves(tree)))


def abstract(tree: Any, device: Any) -> Any:
    """Shape/dtype/placement of every leaf, without touching its data."""
    sharding = jax.sharding.SingleDeviceSharding(device)

    def one(x: Any) -> jax.ShapeDtypeStruct:
        x = x if hasattr(x, "shape") and hasattr(x, "dtype") else np.asarray(x)
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)

    return jax.tree.map(one, tree)


def _avals(struct: Any) -> tuple:
    leaves, treedef = jax.tree.flatten(struct)
    return treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves)


_HOST_CALLBACK = re.compile(r"custom_call @\w*python\w*callback")


def has_host_callback(stablehlo: str) -> bool:
    """Whether a lowered program calls back into Python (jax.pure_callback, io_callback, ...)."""
    return _HOST_CALLBACK.search(stablehlo) is not None


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
        self.hits = 0

    def get(self, job: Any, state: Any, batch: Any, *, device: Any, fenced: bool,
            compile: bool = True) -> CompiledStep:
        """The program of ``job`` on (``state``, ``batch``): compiled unless ``compile=False``
        (then it is lowered and keyed, and compiles on first use)."""
        program = self._get(job, state, batch, device=device, fenced=fenced)
        return program.ensure() if compile else program

    def _get(self, job: Any, state: Any, batch: Any, *, device: Any, fenced: bool) -> CompiledStep:
        state_struct, batch_struct = abstract(state, device), abstract(batch, device)
        # Keyed by the Job object itself (as in jax.jit's cache, weakly): an entry goes with its
        # job, so another function can never hit it.
        memo_key = (job.fn, _avals(state_struct), _avals(batch_struct), device, fenced)
        with self._lock:
            table = self._memo.get(job)
            if table is None:
                table = self._memo[job] = {}
        fut, owner = self._claim(table, memo_key)
        if not owner:
            return fut.result()
        try:
            result = self._lower_and_compile(job, state_struct, batch_struct, device, fenced)
        except BaseException as err:
            with self._lock:
                del table[memo_key]  # a failed trace is not cached: the next job retries
            fut.set_exception(err)
            raise
        fut.set_result(result)
        return result

    def _lower_and_compile(self, job: Any, state_struct: Any, batch_struct: Any, device: Any,
                           fenced: bool) -> CompiledStep:
        state_leaves, state_def = jax.tree.flatten(state_struct)
        batch_leaves, batch_def = jax.tree.flatten(batch_struct)
        names: list[tuple[str, ...]] = []
        flat = _flat_step(job.fn, state_def, batch_def, names)
        # Both donated, whatever the user's ``donate``: the runtime owns its own copy of the
        # state and every batch it prefetched, and donating the batch makes the begin fence's
        # aliasing zero-copy.
        donate = (0, 1)
        with warnings.catch_warnings():
            # The batch is donated for the fences' sake; when no output can reuse it XLA says so
            # once per compile, which is expected here and not actionable by the user.
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            unfenced = jax.jit(flat, donate_argnums=donate).lower(state_leaves, batch_leaves)
            text = unfenced.as_text()
            digest = hashlib.sha256(text.encode())
            if has_host_callback(text):
                # A host callback appears in the text as an index, not as the Python function it
                # calls: two steps that differ only in their callbacks lower to the same text.
                # Such a program is shared only by jobs of the same step function.
                digest.update(f"callbacks of {id(job.fn)}".encode())
            digest.update(repr((_avals(state_struct), _avals(batch_struct), donate, str(device),
                                fenced)).encode())
            key = digest.hexdigest()
            fut, owner = self._claim(self._programs, key)
            if not owner:
                return fut.result()

            def lower() -> Any:
                if not fenced:
                    return unfenced
                ffi.ensure_loaded()  # the handlers must be registered before XLA compiles
                ident = jax.ShapeDtypeStruct((3,), np.int32, sharding=jax.sharding.SingleDeviceSharding(device))
                return jax.jit(ffi.fenced(flat, donated=True), donate_argnums=donate
                               ).lower(state_leaves, batch_leaves, ident)

            result = CompiledStep(key=key, metric_names=names[0], state_struct=state_struct,
                                  batch_struct=batch_struct, state_def=state_def, batch_def=batch_def,
                                  fenced=fenced, flat=flat, lowered=lower, on_compile=self._count)
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

    def clear(self) -> None:
        with self._lock:
            self._memo.clear()
            self._programs.clear()


PROGRAMS = ProgramCache()


def _flat_step(fn: Callable, state_def: Any, batch_def: Any, names: list) -> Callable:
    """``fn`` over flat lists of leaves, with its metrics packed into one float32 vector.

    Why flat: a call walks its argument pytrees on the host, and model states with custom nodes
    (Flax NNX variables) make that walk cost more than a small step's compute. The runtime
    keeps every job's state as a flat list, so each dispatch passes plain lists of arrays.
    Why packed: the runtime reads every step's metrics, and one small array costs one
    transfer where a dict of scalars costs one per leaf. Neither changes what the state is:
    the same ops run on the same values.
    """
    import jax.numpy as jnp

    def step(state_leaves, batch_leaves):
        state = jax.tree.unflatten(state_def, state_leaves)
        batch = jax.tree.unflatten(batch_def, batch_leaves)
        new_state, metrics = fn(state, batch)
        new_leaves, new_def = jax.tree.flatten(new_state)
        if new_def != state_def:
            raise TypeError(f"the step must return a new state with the structure of the state it "
                            f"was given; got {new_def}, expected {state_def}")
        flat, _ = jax.tree_util.tree_flatten_with_path(metrics)
        names.append(tuple(_key(path) or "value" for path, _ in flat))
        values = [jnp.mean(jnp.asarray(v)).astype(jnp.float32) for _, v in flat]
        return new_leaves, (jnp.stack(values) if values else jnp.zeros((0,), jnp.float32))

    return step


def _key(path: Any) -> str:
    return "/".join(str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path)


def _flops(compiled: Any) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # not every backend implements it
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    flops = (cost or {}).get("flops")
    return float(flops) if flops and flops > 0 else None


def compile_step(fn: Callable, state: Any, batch: Any, *, device: Any, prefetch: int = 0,
                 fenced: bool = False, **_legacy: Any) -> CompiledStep:
    """The program a Runtime would run for ``fn(state, batch)`` (through the shared cache),
    with ``prefetch`` staged batches in its footprint: for tools and tests that want a job's
    footprint or executable without a Runtime. A fenced executable takes a third argument,
    the int32[3] ident (``xshare.ffi.ident``). ``ring_id=`` (the old keyword) means fenced."""
    from .._job import Job

    fenced = fenced or _legacy.get("ring_id") is not None
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
    from .._job import Job

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
