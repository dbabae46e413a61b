"""Evaluation's programs and bind-time checks (``evaluation.py`` runs them).

``check_eval`` refuses at bind what would fail later (types, one-shot iterators, non-scalar
metrics, traced once per function and shapes); ``eval_program`` is the eval step over carried
arrays (``leaves``), compiled through the process-wide program cache and shared by every job
whose evaluation lowers to it, with a vmapped form for fused groups.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from concurrent.futures import Future
from typing import Any, Callable

import jax
import numpy as np

from ..._errors import XShareError
from .compiler import PROGRAMS, _avals, abstract
from .leaves import layout_of
from .program import _key
from ..engine.source import END


class EvalError(XShareError, ValueError):
    """An ``eval_step``/``eval_data``/``eval_every`` the runtime cannot use (raised at bind)."""


# ----------------------------------------------------------------------------- at bind
_SHAPES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_SHAPES_LOCK = threading.Lock()


def check_eval(state: Any, eval_step: Any, eval_data: Any, eval_every: Any) -> None:
    """Refuse at bind what would fail later: the three arguments' types and values, and an
    ``eval_step`` whose metrics are not scalars (traced once per function and shapes)."""
    if eval_step is None:
        given = "eval_data" if eval_data is not None else "eval_every"
        raise EvalError(f"{given} was given without eval_step; pass eval_step=fn(state, batch) -> "
                        "{name: scalar} to evaluate during training")
    if not callable(eval_step):
        raise EvalError(f"eval_step={eval_step!r} must be a function (state, batch) -> {{name: scalar}}")
    if eval_data is None:
        raise EvalError("eval_step was given without eval_data; pass eval_data=[batch, ...] "
                        "(the held-out batches, iterated again at every evaluation)")
    if eval_every is not None and (not isinstance(eval_every, int) or isinstance(eval_every, bool)
                                   or eval_every < 1):
        raise EvalError(f"eval_every={eval_every!r} must be a positive int (evaluate every that "
                        "many steps), or None to evaluate only after the last step")
    try:
        it = iter(eval_data)
    except TypeError:
        raise EvalError(f"eval_data must be a sequence or re-iterable of batches; got "
                        f"{type(eval_data).__name__}") from None
    if it is eval_data:
        raise EvalError(f"eval_data is a one-shot iterator ({type(eval_data).__name__}): the first "
                        "evaluation would use it up; pass a list of batches (or an object whose "
                        "__iter__ starts over)")
    first = next(it, END)
    if first is END:
        raise EvalError("eval_data has no batches; pass at least one held-out batch")
    eval_names(eval_step, state, first)


def eval_names(fn: Callable, state: Any, batch: Any) -> tuple[str, ...]:
    """The metric names of ``fn(state, batch)``, checking that each is a scalar (memoized on
    the function and the shapes, like a jit trace, so a sweep's binds trace it once)."""
    (arrays, layout), (batch_arrays, batch_layout) = layout_of(state), layout_of(batch)
    shapes = (layout.memo_key(), _avals(abstract_host(arrays)), batch_layout.memo_key(),
              _avals(abstract_host(batch_arrays)))
    try:
        with _SHAPES_LOCK:
            memo = _SHAPES.setdefault(fn, {})
            hit = memo.get(shapes)
    except TypeError:  # not weak-referenceable: no memo
        memo, hit = {}, None
    if hit is not None:
        return hit
    # over the carried arrays, as the runtime runs it (static leaves from the layouts)
    out = jax.eval_shape(lambda a, b: fn(layout.merge(a), batch_layout.merge(b)), arrays, batch_arrays)
    names = _scalar_names(out)
    with _SHAPES_LOCK:
        memo[shapes] = names
    return names


def abstract_host(tree: Any) -> Any:
    def one(x: Any) -> Any:
        x = x if hasattr(x, "shape") and hasattr(x, "dtype") else np.asarray(x)
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
    return jax.tree.map(one, tree)


def _scalar_names(metrics: Any) -> tuple[str, ...]:
    flat, _ = jax.tree_util.tree_flatten_with_path(metrics)
    if not flat:
        raise EvalError(f"eval_step returned no metrics ({metrics!r}); return a dict of scalars, "
                        "e.g. {'accuracy': acc, 'loss': loss}")
    names = []
    for path, value in flat:
        name = _key(path) or "value"
        if tuple(np.shape(value)) != ():
            raise EvalError(f"eval_step's metric {name!r} has shape {tuple(np.shape(value))}; each "
                            "metric must be a scalar (e.g. jnp.mean(...) over the batch)")
        names.append(name)
    return tuple(names)


# ----------------------------------------------------------------------------- programs
class EvalProgram:
    """``(state leaves, batch leaves) -> float32[M]`` metrics, shared by every job whose
    evaluation lowers to the same program; ``stacked(capacity)`` is its vmapped form over a
    fusion group's stack (compiled on a thread of its own; None until ready)."""

    def __init__(self, executable: Any, names: tuple[str, ...], key: str = "", flat: Any = None,
                 structs: tuple = ()):
        self.executable, self.names = executable, names
        self.key, self.flat, self.structs = key, flat, structs
        self._stacked: dict[int, Future] = {}
        self._lock = threading.Lock()

    def stacked(self, capacity: int) -> Any:
        """``(stacked state leaves, stacked batch leaves) -> float32[capacity, M]``, or None
        while it compiles (the caller evaluates member by member meanwhile)."""
        with self._lock:
            fut = self._stacked.get(capacity)
            if fut is None:
                fut = self._stacked[capacity] = Future()
                # Not a daemon (as fusion's slot moves): exit waits for a compile in progress.
                threading.Thread(target=self._compile_stacked, args=(fut, capacity),
                                 name="xshare-compile-eval", daemon=False).start()
        if not fut.done() or fut.exception() is not None:
            return None
        return fut.result()

    def _compile_stacked(self, fut: Future, capacity: int) -> None:
        try:
            states, batches = self.structs
            stack = lambda s: jax.ShapeDtypeStruct((capacity, *s.shape), s.dtype, sharding=s.sharding)  # noqa: E731
            lowered = jax.jit(jax.vmap(self.flat)).lower([stack(s) for s in states], [stack(b) for b in batches])
            fut.set_result(PROGRAMS.shared(f"{self.key}:vmap{capacity}", lowered.compile))
        except BaseException as err:  # noqa: BLE001 - member by member then
            fut.set_exception(err)


# (eval fn) -> {(state avals, batch avals, device): EvalProgram}: the trace memo, weak on the
# function (jax.jit's rule: a function and avals determine its trace).
_MEMO: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_MEMO_LOCK = threading.Lock()


def eval_program(fn: Callable, state_leaves_struct: list, state_layout: Any, batch: Any,
                 device: Any) -> EvalProgram:
    """The eval program over carried arrays (``leaves``: typed keys as key data, static leaves
    from the layouts), like the train step's."""
    batch_arrays, batch_layout = layout_of(batch)
    batch_leaves = abstract(batch_arrays, device)
    memo_key = (state_layout.memo_key(), tuple((tuple(s.shape), str(s.dtype)) for s in state_leaves_struct),
                batch_layout.memo_key(), _avals(batch_leaves), device)
    with _MEMO_LOCK:
        table = _MEMO.setdefault(fn, {})
        hit = table.get(memo_key)
    if hit is not None:
        return hit
    names: list[tuple[str, ...]] = []

    def flat(state_leaves, batch_leaves):
        import jax.numpy as jnp
        metrics = fn(state_layout.merge(state_leaves), batch_layout.merge(batch_leaves))
        names.append(_scalar_names(metrics))
        leaves = jax.tree.leaves(metrics)
        return jnp.stack([jnp.asarray(v).astype(jnp.float32) for v in leaves])

    lowered = jax.jit(flat).lower(state_leaves_struct, batch_leaves)  # nothing donated
    text = lowered.as_text()
    digest = hashlib.sha256(text.encode())
    digest.update(repr(("eval", memo_key[1], memo_key[3], str(device))).encode())
    key = digest.hexdigest()
    program = PROGRAMS.shared(key, lambda: EvalProgram(lowered.compile(), names[0], key, flat,
                                                       (list(state_leaves_struct), batch_leaves)))
    with _MEMO_LOCK:
        table[memo_key] = program
    return program


