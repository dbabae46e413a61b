"""A compiled program and what defines it: the flat step, its lowering, its key.

``CompiledStep`` is one program shared by every job whose step lowers to it; ``flat_step`` is a
user's step over flat lists of carried arrays (``leaves``); ``program_key`` is the one key (the
program cache and the dry run both use it). The cache itself is ``compiler.ProgramCache``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import threading
import warnings
from typing import Any, Callable, Iterator

import jax
import numpy as np

from ... import ffi
from ...memory.footprint import Footprint, footprint_from_analysis
from .leaves import Promote, changed_numbers, describe_aval, is_array, is_key, layout_of, path_name

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
                 state_layout: Any, batch_layout: Any, fenced: bool, flat: Callable,
                 lowered: Callable[[], Any], on_compile: Callable[[float], None], device: Any):
        self.key = key                      # the program key (hex)
        self.metric_names = metric_names    # the packed metrics vector's entries, in order
        # Flat lists of ShapeDtypeStructs: the carried arrays (leaves.py) of state and batch.
        self.state_struct, self.batch_struct = state_struct, batch_struct
        # (shape, dtype) per batch leaf, made once: what every batch of a K-step or group call
        # must match (``multistep.fits``), and what tells a batch of other shapes (``shapes.py``).
        self.batch_signature = tuple((tuple(s.shape), np.dtype(s.dtype)) for s in batch_struct)
        # The layouts of the job that traced this program. A job that shares it (same computed
        # program) may have another layout (other static objects): it keeps its own, on its
        # record; these serve tools that hold only the program (compile_step, the dry run).
        self.state_layout, self.batch_layout = state_layout, batch_layout
        self.fenced = fenced
        self.device = device                # where it runs
        self.flat = flat                    # the unfenced step over flat leaves (fusion vmaps it)
        self._lowered: Callable[[], Any] | None = lowered  # None once compiled
        self._on_compile = on_compile       # called with XLA's compile time (s)
        self._compiled: tuple[Any, Footprint, float | None] | None = None
        self._lock = threading.Lock()
        self.jaxpr: Any = None              # the unfenced step's jaxpr (for constant lifting)
        self.host_callback = False          # whether it calls back into Python
        self._traced: Any = None
        self._convolves: bool | None = None

    @property
    def convolves(self) -> bool:
        """Whether its step convolves (a ``conv_general_dilated`` anywhere in its jaxpr): its
        vmapped form then convolves grouped (``payoff.unmeasured``)."""
        if self._convolves is None:
            self._convolves = self.jaxpr is not None and "conv_general_dilated" in primitives(self.jaxpr)
        return self._convolves

    def traced(self) -> Any:
        """This program's jaxpr read by ``lifting.trace`` (skeleton and constant sites), once."""
        if self._traced is None and self.jaxpr is not None:
            from .lifting import trace
            self._traced = trace(self.jaxpr)
        return self._traced

    def ensure(self) -> "CompiledStep":
        """Compile now (once); raises what XLA raises."""
        if self._compiled is None:
            with self._lock:
                if self._compiled is None:
                    with warnings.catch_warnings():
                        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
                        assert self._lowered is not None  # (dropped only once compiled)
                        compiled, seconds = self._build(self._lowered)
                    self._on_compile(seconds)
                    fp = footprint_from_analysis(
                        compiled.memory_analysis(), state_bytes=tree_nbytes(self.state_struct),
                        batch_bytes=tree_nbytes(self.batch_struct), prefetch=0, job=self.key[:12],
                        hlo=compiled.as_text)
                    self._compiled = (compiled, fp, _flops(compiled))
                    self._lowered = None  # the compiled program is all that is needed now
        return self

    def loads(self) -> bool:
        """Whether this program is ready without an XLA compile: compiled in this process, or
        kept whole beside the compilation cache (``ensure`` then loads it)."""
        if self._compiled is not None:
            return True
        from .executables import EXECUTABLES

        return EXECUTABLES.has_program(("step", self.key), self._args(), fenced=self.fenced, device=self.device)

    def _args(self) -> list:
        """The program's arguments as ShapeDtypeStructs: state, batch[, the fences' ident]."""
        args = [self.state_struct, self.batch_struct]
        if self.fenced:
            sharding = jax.sharding.SingleDeviceSharding(self.device)
            args.append(jax.ShapeDtypeStruct((3,), np.int32, sharding=sharding))
        return args

    def _build(self, lower: Callable[[], Any]) -> tuple[Any, float]:
        """``(compiled, seconds)``: kept whole beside the compilation cache where the runtime
        keeps executables (a later process loads it without lowering), else lowered and
        compiled (``Executables.compile``; seconds: XLA's part only, or a kept one's load)."""
        from .executables import EXECUTABLES

        compiled, seconds, _ = EXECUTABLES.compile_program(("step", self.key), lower, self._args(), fenced=self.fenced,
                                                           device=self.device)
        return compiled, seconds

    @property
    def executable(self) -> Any:
        """(state leaves, batch leaves[, ident]) -> (new state leaves, metrics vector)."""
        return self._done()[0]

    def _done(self) -> tuple[Any, Footprint, float | None]:
        """(executable, footprint, flops), compiling first if needed."""
        compiled = self.ensure()._compiled
        assert compiled is not None  # (ensure compiled it or raised)
        return compiled

    @property
    def footprint(self) -> Footprint:
        """From ``memory_analysis()``; staging = 0: each runtime adds its own prefetch depth."""
        return self._done()[1]

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
    """Bytes of a tree of carried arrays or their ShapeDtypeStructs."""
    return int(sum(np.dtype(x.dtype).itemsize * math.prod(x.shape) for x in jax.tree.leaves(tree)))


def abstract(arrays: Any, device: Any) -> Any:
    """Shape/dtype/placement of every carried array (see ``leaves``), without touching data."""
    sharding = jax.sharding.SingleDeviceSharding(device)

    def one(x: Any) -> jax.ShapeDtypeStruct:
        x = x if hasattr(x, "shape") and hasattr(x, "dtype") else np.asarray(x)
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)

    return jax.tree.map(one, arrays)


def _avals(struct: Any) -> tuple:
    """The flat avals of carried arrays: what XLA sees, with no treedef (a job's treedef and
    static objects decide only how its own leaves unflatten, not the program)."""
    return tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(struct))


def program_key(text: str, *, state_avals: tuple, batch_avals: tuple, keys: tuple, metric_names: tuple,
                donate: tuple, device: Any, fenced: bool, callbacks_of: Any = None) -> str:
    """The one program key (the compiler's and the dry run's): what XLA computes.

    ``text`` is the lowering over carried arrays (fenced or not, as ``fenced`` says); ``keys`` the PRNG impls of the state's
    key leaves; ``callbacks_of`` the step function when the text calls back into Python (a host
    callback lowers to an index, not to the function it calls: such a program is shared only by
    jobs of the same step function)."""
    digest = hashlib.sha256(text.encode())
    if callbacks_of is not None:
        digest.update(f"callbacks of {id(callbacks_of)}".encode())
    digest.update(repr((state_avals, batch_avals, keys, metric_names, donate, str(device), fenced)).encode())
    return digest.hexdigest()


# jax options that decide nothing about a program's code (where its caches live, what it logs;
# ``Executables`` raises the persistent cache's write threshold while it keeps a fresh copy).
_NOT_CODE = ("jax_compilation_cache", "jax_persistent_cache", "jax_log", "jax_logging", "jax_explain_cache",
             "jax_debug_log", "jax_raise_persistent_cache")


def jaxpr_identity(closed: Any) -> str | None:
    """What a step's jaxpr computes, as text to key its program by without lowering it (the
    lowering, ~30 ms for the hook's TrainState net, is then paid only if the program is not
    kept whole: ``executables.py``). The jaxpr's text, every constant's and literal's bytes (inner
    jaxprs' too), the jax options that lowering reads, and jax's version. None where that text
    is not the same in every process (a parameter printed with its address: a function in a
    custom rule) or the step calls back into Python: such a step is keyed by its lowering."""
    text = str(closed.jaxpr)
    if " at 0x" in text or "callback" in text:
        return None
    import jaxlib

    digest = hashlib.sha256(text.encode())
    try:
        _digest_values(digest, closed)
    except Exception:  # noqa: BLE001 - a value numpy cannot read (an opaque constant): lower it
        return None
    digest.update(repr(sorted((k, repr(v)) for k, v in jax.config.values.items()
                              if not k.startswith(_NOT_CODE))).encode())
    digest.update(f"{jax.__version__} {jaxlib.__version__}".encode())
    return f"jaxpr {digest.hexdigest()}"


def _digest_values(digest: Any, closed: Any) -> None:
    """Every constant's and literal's dtype, shape and bytes, in one deterministic walk (a jaxpr's
    text elides array values)."""
    from jax.extend.core import ClosedJaxpr, Literal

    def value(x: Any) -> None:
        if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.extended):
            x = jax.random.key_data(x)  # a typed PRNG key: its impl is in the text, its bits here
        arr = np.asarray(x)
        digest.update(f"{arr.dtype}{list(arr.shape)}".encode())
        digest.update(arr.tobytes())

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            for v in eqn.invars:
                if isinstance(v, Literal):
                    value(v.val)
            for sub in inner_jaxprs(eqn):
                if isinstance(sub, ClosedJaxpr):
                    for c in sub.consts:
                        value(c)
                    walk(sub.jaxpr)
                else:
                    walk(sub)
        for v in jaxpr.outvars:
            if isinstance(v, Literal):
                value(v.val)

    for c in closed.consts:
        value(c)
    walk(closed.jaxpr)


def inner_jaxprs(eqn: Any) -> Iterator[Any]:
    """The jaxprs ``eqn`` holds in its parameters (ClosedJaxprs or Jaxprs: a scan's body, a
    cond's branches, a pjit's callee), in the order of its sorted parameter names."""
    from jax.extend.core import ClosedJaxpr, Jaxpr

    for key in sorted(eqn.params):
        param = eqn.params[key]
        for sub in (param if isinstance(param, (tuple, list)) else (param,)):
            if isinstance(sub, (ClosedJaxpr, Jaxpr)):
                yield sub


def primitives(closed: Any) -> set[str]:
    """The names of the primitives ``closed`` (a ClosedJaxpr) binds, inner jaxprs' included."""
    names: set[str] = set()

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            names.add(eqn.primitive.name)
            for sub in inner_jaxprs(eqn):
                walk(getattr(sub, "jaxpr", sub))  # (a ClosedJaxpr's jaxpr, or the Jaxpr itself)

    walk(closed.jaxpr)
    return names


def trace_unfenced(flat: Callable, state_struct: list, batch_struct: list) -> Any:
    """The jaxpr of ``flat`` over the structs, as ``jax.jit`` traces it, without lowering
    (lowering costs about as much again as tracing: ~40 ms for the digits model on CPU)."""
    return jax.jit(flat, donate_argnums=DONATE).trace(state_struct, batch_struct).jaxpr


def lower_unfenced(flat: Callable, state_struct: list, batch_struct: list) -> Any:
    """The lowering of ``flat`` over the structs: the program an unfenced runtime runs."""
    with warnings.catch_warnings():
        # The batch is donated for the fences' sake; when no output can reuse it XLA says so
        # once per compile, which is expected here and not actionable by the user.
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        return jax.jit(flat, donate_argnums=DONATE).lower(state_struct, batch_struct)


def lower_fenced(flat: Callable, state_struct: list, batch_struct: list, device: Any) -> Any:
    """The lowering of ``flat`` between the fences (``ffi.fenced``): the program a fenced
    runtime runs, its identity (ring, job, lane) a trailing int32[3] operand."""
    ffi.ensure_loaded()  # the handlers must be registered before XLA compiles
    ident = jax.ShapeDtypeStruct((3,), np.int32, sharding=jax.sharding.SingleDeviceSharding(device))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        fenced = ffi.fenced(flat, donated=True, outputs=getattr(flat, "outputs", None))
        return jax.jit(fenced, donate_argnums=DONATE).lower(state_struct, batch_struct, ident)


def replay(closed: Any, n_state: int) -> Callable:
    """The step over flat leaves as ``closed`` (its jaxpr, from ``trace_unfenced``) computes it,
    for the programs built on a step after its first trace: the fenced program, its K-step
    scans, a fused group's vmap. Each would otherwise run the user's Python again (Flax modules,
    optax chains: tens of ms per trace, on the compile thread before the first step). The same
    primitives bind with the same parameters, so the programs are the ones a trace would give."""
    from jax.extend.core import jaxpr_as_fun

    fun = jaxpr_as_fun(closed)

    def step(state_arrays: list, batch_arrays: list) -> tuple[list, Any]:
        outs = fun(*state_arrays, *batch_arrays)
        return list(outs[:n_state]), outs[n_state]

    # What it returns, known without tracing it (``ffi.fenced`` would trace it again to learn).
    step.outputs = (list(closed.out_avals[:n_state]), closed.out_avals[n_state])  # type: ignore[attr-defined]
    return step


# Both donated, whatever the user's ``donate``: the runtime owns its own copy of the state and
# every batch it prefetched, and donating the batch makes the begin fence's aliasing zero-copy.
DONATE = (0, 1)


_HOST_CALLBACK = re.compile(r"custom_call @\w*python\w*callback")


def has_host_callback(stablehlo: str) -> bool:
    """Whether a lowered program calls back into Python (jax.pure_callback, io_callback, ...)."""
    return _HOST_CALLBACK.search(stablehlo) is not None


def flat_step(fn: Callable, state_layout: Any, batch_layout: Any, names: list) -> Callable:
    """``fn`` over flat lists of carried arrays (``leaves``), with its metrics packed into one
    float32 vector.

    Why flat: a call walks its argument pytrees on the host, and model states with custom nodes
    (Flax NNX variables) make that walk cost more than a small step's compute. The runtime
    keeps every job's state as a flat list, so each dispatch passes plain lists of arrays.
    Typed PRNG keys are carried as key data and wrapped again here; static leaves come from the
    layout. Why packed: the runtime reads every step's metrics, and one small array costs one
    transfer where a dict of scalars costs one per leaf. Neither changes what the state is:
    the same ops run on the same values.
    """
    import jax.numpy as jnp

    def step(state_arrays, batch_arrays):
        state = state_layout.merge(state_arrays)
        batch = batch_layout.merge(batch_arrays)
        out = fn(state, batch)
        if not isinstance(out, tuple) or len(out) != 2:
            raise TypeError(f"the step must return (new_state, metrics); it returned {_kind(out)}")
        new_state, metrics = out
        new_arrays, new_layout = layout_of(new_state)
        promote = changed_numbers(state_layout, new_layout)
        if promote:
            raise Promote(promote)
        why = state_layout.difference(new_layout)
        if why is None:
            for path, new, old in zip(state_layout.array_paths(), new_arrays, state_arrays):
                if tuple(new.shape) != tuple(old.shape) or np.dtype(new.dtype) != np.dtype(old.dtype):
                    why = f"state leaf {path!r} changed from {describe_aval(old)} to {describe_aval(new)}"
                    break
        if why is not None:
            raise TypeError(f"the step must return a new state with the structure, dtypes and shapes "
                            f"of the state it was given: {why}")
        flat, _ = jax.tree_util.tree_flatten_with_path(metrics)
        values = []
        for path, v in flat:
            if is_key(v) or not (is_array(v) or isinstance(v, (int, float, bool))) or np.size(v) != 1:
                raise TypeError(f"metric {path_name(path) if path else 'value'!r} is "
                                f"{describe_aval(v) if hasattr(v, 'dtype') else type(v).__name__}; "
                                "metrics must be scalars (e.g. {'loss': loss}; reduce arrays with .mean())")
            values.append(jnp.asarray(v).reshape(()).astype(jnp.float32))
        names.append(tuple(_key(path) or "value" for path, _ in flat))
        return new_arrays, (jnp.stack(values) if values else jnp.zeros((0,), jnp.float32))

    return step


def _kind(x: Any) -> str:
    return f"a tuple of {len(x)}" if isinstance(x, tuple) else type(x).__name__


def _key(path: Any) -> str:
    return "/".join(str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path)


def _flops(compiled: Any) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    flops = (cost or {}).get("flops")
    return float(flops) if flops and flops > 0 else None


