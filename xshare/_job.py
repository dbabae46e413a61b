"""``@xshare.job``: a plain JAX train step that the runtime can compile, place and interleave.

The decorated step keeps working on its own (``train_step(state, batch)`` is ``jax.jit`` with
the state donated), and ``train_step.bind(...)`` packages it with its initial state and data
into a :class:`JobSpec` that a :class:`xshare.Runtime` runs.
"""

from __future__ import annotations

import functools
import itertools
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import jax

_unique = itertools.count()


@dataclass(frozen=True, eq=False)
class JobSpec:
    """Everything the runtime needs to run one job. Made by :meth:`Job.bind`; treat as read-only.

    ``data`` is either an iterable of batches or a callable ``step -> batch``; a callable lets
    a resumed job continue at any step without replaying the data before it.
    """

    job: "Job"
    state: Any
    data: Iterable[Any] | Callable[[int], Any]
    steps: int | None
    name: str
    priority: int = 0
    start_step: int = 0
    nan_policy: str = "ignore"
    meta: Mapping[str, Any] = field(default_factory=dict)
    observer: Callable[[int, Mapping[str, float], float], Mapping[str, float] | None] | None = None
    # Applied by ``JobHandle.result`` to the final host state: adapters whose users think in
    # other objects than a pytree (``xshare.nnx`` rebuilds NNX modules) turn it back into them.
    # The runtime never calls it: it steps, swaps and checkpoints the plain pytree.
    result_transform: Callable[[Any], Any] | None = None
    # Evaluation during training (``xshare/runtime/engine/evaluation.py``): ``eval_step(state, batch)
    # -> metrics`` over every batch of ``eval_data`` every ``eval_every`` steps and at the end.
    eval_step: Callable[[Any, Any], Any] | None = None
    eval_data: Iterable[Any] | None = None
    eval_every: int | None = None
    # Called on the dispatcher thread with ``(steps_done, metrics)`` after each step retires and
    # after each evaluation (``eval/<name>`` keys); returning True cancels the job at that step
    # boundary: nothing is dispatched after it (the calls already in flight behind that step
    # still run and count). Must be cheap: ``xshare.tune`` uses it to report and prune trials.
    # Raising fails the job at that step (no step after it counts).
    on_metrics: Callable[[int, Mapping[str, float]], bool | None] | None = None
    # The steps whose metrics ``on_metrics`` acts on (a study reports every N steps): the runtime
    # may run several steps per call (docs/explanation/multi-step.md) but never past one of them,
    # so a True from the hook still cancels at that step. None: every step; 0: only after
    # evaluations (it acts on ``eval/<name>`` only).
    on_metrics_every: int | None = None

    @property
    def fn(self) -> Callable:
        """The step function the job runs (the undecorated ``(state, batch) -> (state, metrics)``)."""
        return self.job.fn

    def replace(self, **changes: Any) -> "JobSpec":
        """A copy with some fields changed (used by checkpoint resume and the launcher)."""
        fields = {f: getattr(self, f) for f in self.__dataclass_fields__}
        fields.update(changes)
        return JobSpec(**fields)


_NAN_POLICIES = ("ignore", "fail")


class Job:
    """A step function ``(state, batch) -> (new_state, metrics)`` made shareable."""

    def __init__(self, fn: Callable, *, name: str | None = None, donate: bool = True):
        if not callable(fn):
            raise TypeError(f"@xshare.job wraps a function (state, batch) -> (state, metrics); got {fn!r}")
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "job")
        self.donate = donate
        self._jit = jax.jit(fn, donate_argnums=(0,) if donate else ())
        functools.update_wrapper(self, fn)

    def __call__(self, state: Any, batch: Any) -> tuple[Any, Any]:
        """Run one step directly: ``jax.jit`` with ``state`` donated (when ``donate=True``).

        Like any donated jit call, the ``state`` you pass in is consumed; use the returned one.
        """
        return self._jit(state, batch)

    def bind(
        self,
        state: Any,
        data: Iterable[Any] | Callable[[int], Any],
        *,
        steps: int | None = None,
        name: str | None = None,
        priority: int = 0,
        nan_policy: str = "ignore",
        meta: Mapping[str, Any] | None = None,
        observer: Callable[[int, Mapping[str, float], float], Mapping[str, float] | None] | None = None,
        eval_step: Callable[[Any, Any], Any] | None = None,
        eval_data: Iterable[Any] | None = None,
        eval_every: int | None = None,
    ) -> JobSpec:
        """Package this step with its initial state and data into a job a Runtime can run.

        ``bind`` does **not** take ownership of ``state``: when the job is admitted the runtime
        places its own copy on the device and donates that copy step after step, so the arrays
        you pass stay valid and unchanged. (The copy costs the state's size once, at admission.)

        Args:
          state: pytree of arrays: params, optimizer state, step counters.
          data: an iterable of batches, or a callable ``step -> batch`` (preferred: it makes
            resume exact without replaying data). Batches are pytrees of numpy/jax arrays.
          steps: how many iterations; ``None`` runs until ``data`` is exhausted.
          name: job name, unique within a runtime (default: the step's name plus a number).
          priority: larger runs first under the ``priority`` policy.
          nan_policy: ``"ignore"`` or ``"fail"`` (fail the job when a metric turns non-finite).
          meta: free-form labels (e.g. the launch parameters), shown in status and summaries.
          observer: called on the host after each step completes as
            ``observer(step, metrics, t_done)`` (``t_done`` on ``time.monotonic()``'s clock); the
            mapping it returns is merged into that step's metrics. Inference jobs use it to turn
            request arrival times into latency percentiles.
          eval_step: ``eval_step(state, batch) -> metrics`` (a dict of scalars), compiled beside
            the step; it never changes the state. Run over every batch of ``eval_data`` every
            ``eval_every`` steps and after the last step; the mean over the batches is recorded
            as ``eval/<name>`` (progress, metrics.jsonl, status, ``/metrics``).
          eval_data: the held-out batches: a sequence, or any iterable that can be iterated
            again for each evaluation (not a one-shot iterator or generator).
          eval_every: evaluate every this many steps (a positive int); None: only at the end.

        Returns:
          A :class:`JobSpec` for ``Runtime.submit``, ``submit_many`` or ``xshare.run``.

        Raises:
          ValueError: ``steps`` is not a non-negative int (or None), a callable ``data`` without
            ``steps``, a ``priority`` that is not an int, an unknown ``nan_policy``, or an
            inconsistent evaluation (``eval_step`` without ``eval_data`` or the reverse,
            ``eval_every`` not a positive int, empty or one-shot ``eval_data``).
          TypeError: ``data`` is neither an iterable nor a callable.
        """
        if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 0):
            raise ValueError(f"steps={steps!r} must be a non-negative int, or None to run until data ends")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority={priority!r} must be an int (larger runs first)")
        if nan_policy not in _NAN_POLICIES:
            raise ValueError(f"nan_policy={nan_policy!r}; choose one of {', '.join(_NAN_POLICIES)}")
        if steps is None and callable(data) and not _is_iterable(data):
            raise ValueError("data is a callable step -> batch, so steps must be given (it never runs out)")
        if not callable(data) and not _is_iterable(data):
            raise TypeError(f"data must be an iterable of batches or a callable step -> batch; got {type(data).__name__}")
        _refuse_nnx_objects(state)
        if eval_step is not None or eval_data is not None or eval_every is not None:
            from .runtime.engine.evaluation import check_eval
            check_eval(state, eval_step, eval_data, eval_every)
        return JobSpec(
            job=self,
            state=state,
            data=data,
            steps=steps,
            name=name or f"{self.name}-{next(_unique)}",
            priority=priority,
            nan_policy=nan_policy,
            meta=dict(meta or {}),
            observer=observer,
            eval_step=eval_step,
            eval_data=eval_data,
            eval_every=eval_every,
        )

    def __repr__(self) -> str:
        return f"xshare.job({self.name})"


def _refuse_nnx_objects(state: Any) -> None:
    """Live Flax NNX objects as state are the in-place NNX style, which has its own entry point.
    (No NNX object can exist unless ``flax.nnx`` was imported: otherwise nothing to check, and
    ``xshare.job`` never imports flax.)"""
    nnx = sys.modules.get("flax.nnx")
    graph_object = getattr(nnx, "Pytree", None) or getattr(nnx, "Object", None)
    if graph_object is None:
        return
    found = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, graph_object))
             if isinstance(x, graph_object)]
    if found:
        raise TypeError(
            f"the state given to bind holds a live Flax NNX object ({type(found[0]).__name__}); "
            f"xshare.job runs pure steps (state, batch) -> (new_state, metrics). For an NNX step "
            f"that changes its objects in place, step(model, optimizer, batch) -> metrics, use "
            f"@xshare.nnx.job and bind((model, optimizer), data, ...); for the functional "
            f"pattern pass the state of graphdef, state = nnx.split((model, optimizer))")


def _is_iterable(obj: Any) -> bool:
    try:
        iter(obj)
    except TypeError:
        return False
    return True


def job(fn: Callable | None = None, *, name: str | None = None,
        donate: bool = True) -> "Job | Callable[[Callable], Job]":
    """Make a step function ``(state, batch) -> (new_state, metrics)`` a job that a Runtime can run.

    Used bare (``@xshare.job``) or with arguments (``@xshare.job(name="mlp", donate=True)``).
    The step is plain JAX: no ``jax.jit`` needed. ``metrics`` is a pytree of scalars (e.g.
    ``{"loss": loss}``). The decorated step is still callable: one step under ``jax.jit`` with
    the state donated.

    Args:
      fn: the step function (when used bare).
      name: the default job-name prefix (default: the function's name).
      donate: donate the state to each step (default True: the runtime's memory model assumes
        it; XLA then updates the state in place).

    Returns:
      The :class:`Job`; with only keyword arguments, a decorator that makes one.

    Raises:
      TypeError: ``fn`` is not callable.

    Example:
        ```python
        @xshare.job
        def train_step(state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(state, batch)
            return jax.tree.map(lambda p, g: p - 0.01 * g, state, grads), {"loss": loss}

        spec = train_step.bind(state, data, steps=100)
        ```
    """
    if fn is None:
        return lambda f: Job(f, name=name, donate=donate)
    return Job(fn, name=name, donate=donate)
