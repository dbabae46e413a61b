"""``xshare.nnx``: Flax NNX steps that change their objects in place, run as xshare jobs.

The NNX tutorial's step ``train_step(model, optimizer, batch) -> metrics`` mutates ``model`` and
``optimizer``; the runtime runs pure steps ``(state, batch) -> (new_state, metrics)``. ``bind``
does what Flax's own functional loop does (``docs_nnx/guides/performance.md``): ``nnx.split``
the live objects once, and a pure step merges them inside the trace, calls the user's step and
returns ``nnx.state`` of the same objects. Every NNX variable type rides along (``Param``,
``BatchStat``, ``RngKey``/``RngCount``, optimizer state and step). What ``bind`` returns is an
ordinary :class:`xshare.JobSpec` over an ordinary :class:`xshare.Job`, so the runtime knows
nothing of NNX; the spec's ``result_transform`` turns the final state back into NNX objects.

    @xshare.nnx.job
    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return {"loss": loss}

    spec = train_step.bind((model, optimizer), data, steps=500)
    (model2, optimizer2), metrics = rt.submit(spec).result()   # new objects, final state
    xshare.nnx.update((model, optimizer), (model2, optimizer2))  # or write it into yours
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections import OrderedDict
from typing import Any, Callable, Iterable, Mapping

import jax
from flax import nnx

from ._errors import XShareError
from ._job import Job, JobSpec

__all__ = ["job", "NnxJob", "NnxStepError", "update"]

# Pure steps kept per job, one per object structure (graphdef). Bounded: a service that binds
# many structures does not keep every one's step.
_PURE_STEPS_MAX = 32


class NnxJob:
    """An NNX step ``step(*objects, batch) -> metrics`` that changes ``objects`` in place.

    Calling it runs the step under ``nnx.jit`` (the objects are updated, as in the tutorial);
    :meth:`bind` packages it with live objects and data into a job a Runtime can run.
    """

    def __init__(self, fn: Callable, *, name: str | None = None, donate: bool = True):
        if not callable(fn):
            raise TypeError(f"@xshare.nnx.job wraps a function step(model, optimizer, batch) -> metrics; "
                            f"got {fn!r}")
        self.fn = fn
        self.name: str = name or str(getattr(fn, "__name__", "nnx_job"))
        self.donate = donate
        self._checked = _checked_step(fn, self.name)
        self._jit = nnx.jit(self._checked)
        # graphdef -> the pure Job. Binds of objects of one structure share one Job object, so
        # the runtime traces the step once for a whole sweep (its trace memo is keyed by Job,
        # as jax.jit's is by function), and their programs fuse.
        self._pure: OrderedDict[Any, Job] = OrderedDict()
        self._evals: OrderedDict[tuple, Callable] = OrderedDict()   # (graphdef, eval_step) -> pure eval
        self._lock = threading.Lock()  # a service may bind from several request threads
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any) -> Any:
        """One step now, under ``nnx.jit``: the objects passed in are updated in place."""
        return self._jit(*args)

    def bind(
        self,
        objects: Any,
        data: Iterable[Any] | Callable[[int], Any],
        *,
        steps: int | None = None,
        name: str | None = None,
        priority: int = 0,
        nan_policy: str = "ignore",
        meta: Mapping[str, Any] | None = None,
        observer: Callable | None = None,
        eval_step: Callable | None = None,
        **more: Any,
    ) -> JobSpec:
        """A job over the live NNX ``objects`` (a tuple such as ``(model, optimizer)``, or one
        object): the step is called as ``step(*objects, batch)``.

        The objects are split once, here, and are not changed by the job (their current values
        are its initial state, as ``xshare.job``'s ``bind`` copies its state). ``handle.result()``
        returns ``(objects, metrics)`` with *new* objects holding the final state (one object, not
        a tuple, if one was bound); :func:`update` writes that state into the objects you hold.
        The other arguments are :meth:`xshare.Job.bind`'s. ``eval_step(model, batch) -> metrics``
        is called on the first object, in eval mode (``model.eval()``: dropout off, running
        batch statistics), and changes nothing.
        """
        single = not isinstance(objects, (tuple, list))
        nodes = (objects,) if single else tuple(objects)
        _check_objects(self, nodes)
        graphdef, state = nnx.split(nodes)
        # nnx.split's state holds the very Variable objects of the model: rebuild its containers
        # so that a later in-place change of the user's objects does not reach this job.
        state = jax.tree.map(lambda x: x, state)
        pure = self._pure_job(graphdef)
        kwargs = dict(more)
        if eval_step is not None:
            kwargs["eval_step"] = self._pure_eval(graphdef, eval_step)
        spec = pure.bind(state, data, steps=steps, name=name,
                         priority=priority, nan_policy=nan_policy, meta=meta, observer=observer,
                         **kwargs)
        _probe(pure, state, data)
        return spec.replace(result_transform=_Rebuild(graphdef, single))

    def _pure_eval(self, graphdef: Any, eval_step: Callable) -> Callable:
        """One pure eval function per (structure, eval_step), like the pure step: a sweep's
        binds share it, so its evaluation traces once (the eval memo is keyed by function)."""
        try:
            hash(graphdef)
        except TypeError:
            return _pure_eval(graphdef, eval_step)
        with self._lock:
            fn = self._evals.get((graphdef, eval_step))
            if fn is None:
                fn = self._evals[(graphdef, eval_step)] = _pure_eval(graphdef, eval_step)
                while len(self._evals) > _PURE_STEPS_MAX:
                    self._evals.popitem(last=False)
            return fn

    def _pure_job(self, graphdef: Any) -> Job:
        try:
            hash(graphdef)
        except TypeError:  # an unhashable static attribute: this structure gets its own step
            return Job(_pure_step(self._checked, graphdef), name=self.name, donate=self.donate)
        with self._lock:
            job = self._pure.get(graphdef)
            if job is None:
                job = self._pure[graphdef] = Job(_pure_step(self._checked, graphdef), name=self.name,
                                                 donate=self.donate)
                while len(self._pure) > _PURE_STEPS_MAX:
                    self._pure.popitem(last=False)
            else:
                self._pure.move_to_end(graphdef)
        return job

    def __repr__(self) -> str:
        return f"xshare.nnx.job({self.name})"


def job(fn: Callable | None = None, *, name: str | None = None, donate: bool = True):
    """Decorator: ``@xshare.nnx.job`` or ``@xshare.nnx.job(name="cnn")``, on a Flax NNX step
    ``step(model, optimizer, batch) -> metrics`` that changes its objects in place."""
    if fn is None:
        return lambda f: NnxJob(f, name=name, donate=donate)
    return NnxJob(fn, name=name, donate=donate)


def update(objects: Any, result: Any) -> Any:
    """Write a finished NNX job's final state into ``objects`` (the ones given to ``bind``, or
    any of the same structure) and return them.

    ``result`` is the job's handle, its ``handle.result()`` pair, or the rebuilt objects.
    """
    if hasattr(result, "result") and callable(result.result):
        result = result.result()
    if isinstance(result, tuple) and len(result) == 2 and _is_objects(result[0]) \
            and not _is_objects(result[1]):
        result = result[0]  # (objects, metrics)
    single = not isinstance(objects, (tuple, list))
    nodes = (objects,) if single else tuple(objects)
    new = (result,) if single else tuple(result) if isinstance(result, (tuple, list)) else None
    if new is None or len(new) != len(nodes):
        raise TypeError(f"xshare.nnx.update: the result holds {_describe(result)}, which does not "
                        f"match the {len(nodes)} object(s) to update")
    nnx.update(nodes, nnx.state(new))
    return objects


class NnxStepError(XShareError, TypeError):
    """An ``xshare.nnx.job`` step returned something other than its metrics."""


def _probe(pure: Job, state: Any, data: Any) -> None:
    """Once per structure, at bind: trace the step abstractly on batch 0 (``jax.eval_shape``, no
    compile), so that a step returning its model is refused here, not when the job compiles.
    Only with step-indexed data (an iterable cannot be peeked without consuming it); only that
    refusal is raised here: anything else the trace hits is left to the runtime, which fails
    the job with its context (the batch, the step)."""
    if getattr(pure, "_nnx_probed", False) or not callable(data) or hasattr(data, "__iter__"):
        return
    try:
        jax.eval_shape(pure.fn, state, data(0))
    except NnxStepError:
        raise  # (and not marked: every bind of this step is refused alike)
    except Exception:  # noqa: BLE001 - reported by the runtime, as for any job
        pass
    pure._nnx_probed = True  # type: ignore[attr-defined]  # a mark on the shared Job, read above


# ------------------------------------------------------------------------------ the pure parts
def _pure_step(checked: Callable, graphdef: Any) -> Callable:
    @functools.wraps(checked)
    def pure(state: Any, batch: Any) -> tuple[Any, Any]:
        nodes = nnx.merge(graphdef, state)
        metrics = checked(*nodes, batch)
        return nnx.state(nodes), metrics

    return pure


def _pure_eval(graphdef: Any, eval_step: Callable) -> Callable:
    name = getattr(eval_step, "__name__", "eval_step")

    def pure_eval(state: Any, batch: Any) -> Any:
        model = nnx.merge(graphdef, state)[0]
        model.eval()  # a fresh copy inside the trace: the training state keeps its modes
        return _metrics_only(eval_step(model, batch), name)

    return pure_eval


def _checked_step(fn: Callable, name: str) -> Callable:
    @functools.wraps(fn)
    def checked(*args: Any) -> Any:
        return _metrics_only(fn(*args), name)

    return checked


def _metrics_only(out: Any, name: str) -> Any:
    """The step's metrics; None (a step that keeps its metrics in an ``nnx.Metric`` it updates)
    is no metrics. An NNX object among them is the usual slip of returning the model, as a
    functional step would: refused, since flattening it would report every parameter."""
    if out is None:
        return {}
    found = [x for x in jax.tree.leaves(out, is_leaf=_is_node) if _is_node(x)]
    if found:
        raise NnxStepError(
            f"the xshare.nnx.job step {name!r} returned {_describe(out)}: an NNX step changes its "
            f"objects in place and returns only its metrics, e.g. {{'loss': loss}} (or None); "
            f"return the metrics, not the {type(found[0]).__name__}")
    return out


class _Rebuild:
    """``JobSpec.result_transform`` of an NNX job: the final host state -> new NNX objects."""

    def __init__(self, graphdef: Any, single: bool):
        self.graphdef, self.single = graphdef, single

    def __call__(self, state: Any) -> Any:
        # Device arrays, as the objects given to bind held: the objects keep working under
        # nnx.jit and in-place updates exactly as the originals do. ``device_put``, not
        # ``jnp.asarray``: in jax 0.10 the latter stages a small program per leaf shape and
        # dtype (8 for the zoo MLP, ~90 ms of cache loads in a fresh process, the sweep's last
        # step to its results); a transfer compiles nothing and gives the same arrays.
        nodes = nnx.merge(self.graphdef, jax.device_put(state))
        return nodes[0] if self.single else nodes


# ------------------------------------------------------------------------------ checks
def _check_objects(job: NnxJob, nodes: tuple) -> None:
    for i, node in enumerate(nodes):
        if not _is_node(node):
            raise TypeError(
                f"{job!r}.bind takes the live NNX objects the step changes, e.g. (model, "
                f"optimizer); object {i} is a {type(node).__name__}. For a pure step over a "
                f"pytree state (state, batch) -> (new_state, metrics), use xshare.job")
    try:
        inspect.signature(job.fn).bind(*nodes, None)
    except TypeError as err:
        raise TypeError(f"{job!r} is called as {job.name}(*objects, batch) with the {len(nodes)} "
                        f"object(s) given to bind plus the batch, which its signature does not "
                        f"accept: {err}") from None
    except ValueError:  # no signature (a builtin or C callable): let the call decide
        pass


def _is_node(x: Any) -> bool:
    """An NNX graph object (Module, Optimizer, Rngs, Metric...), not a Variable."""
    return isinstance(x, _PYTREE)


def _is_objects(x: Any) -> bool:
    return _is_node(x) or (isinstance(x, (tuple, list)) and bool(x) and all(_is_node(n) for n in x))


def _describe(x: Any) -> str:
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of ({', '.join(type(v).__name__ for v in x)})"
    return f"a {type(x).__name__}"


_PYTREE = getattr(nnx, "Pytree", None) or nnx.Object  # Object before flax 0.12
