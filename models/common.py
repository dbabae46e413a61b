"""What every model job shares: a Flax NNX model split into a pure (graphdef, state) step.

xshare jobs are pure functions over pytrees, so each model is split once with ``nnx.split``
and the train step merges it back inside the traced function. The job's state is
``{"params": nnx.State, "opt": optax state, "step": int32}``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import xshare


# One step function per (model structure, optimizer kind, loss, name): jobs a sweep's factory
# builds (one call per learning rate or seed) then share one ``Job`` object, so the runtime
# traces the step once for the whole sweep (its trace memo is keyed like ``jax.jit``: by
# function), instead of once per job (~50 ms of Flax tracing each, the larger part of a small
# fused sweep's start). Bounded: a service that builds many model shapes does not keep them all.
_SHARED_STEPS: OrderedDict[tuple, xshare.Job] = OrderedDict()
_SHARED_STEPS_MAX = 32


def train_job(model: nnx.Module, tx: optax.GradientTransformation,
              loss_fn: Callable[[nnx.Module, Any], tuple[jax.Array, dict[str, jax.Array]]],
              *, name: str, tx_key: Any = None) -> tuple[xshare.Job, dict[str, Any]]:
    """(the xshare job for one optimizer step, its initial state) for ``model`` and ``tx``.

    ``loss_fn(model, batch) -> (loss, extra_metrics)``; the step reports ``loss`` and the extras.
    ``tx_key``: a hashable name for ``tx``'s *update rule* when it reads every hyperparameter
    from its state (``adam()`` below gives ``ADAM``): jobs with equal model structure, ``tx_key``,
    ``loss_fn`` and ``name`` then share one step function. Leave it None for a ``tx`` with
    compile-time constants (its step is then this job's own).
    """
    graphdef, params = nnx.split(model, nnx.Param)
    # Anything that is not a Param (e.g. batch-norm statistics) would need threading through the
    # state; the zoo's models keep only parameters, and this checks it.
    rest = nnx.state(model, nnx.Not(nnx.Param))
    if jax.tree.leaves(rest):
        raise ValueError(f"{name}: models/common.train_job supports parameter-only models")
    state = {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    if tx_key is None:
        return _step_job(graphdef, tx, loss_fn, name), state
    key = (graphdef, tx_key, loss_fn, name)
    job = _SHARED_STEPS.get(key)
    if job is None:
        # (safe to keep this job's tx: with tx_key, its update reads lr etc. from the state)
        job = _SHARED_STEPS[key] = _step_job(graphdef, tx, loss_fn, name)
        while len(_SHARED_STEPS) > _SHARED_STEPS_MAX:
            _SHARED_STEPS.popitem(last=False)
    else:
        _SHARED_STEPS.move_to_end(key)
    return job, state


# Held-out batches: a factory's data is a function of (seed, step), and no job trains this far.
HELD_OUT_STEP = 1 << 40
_SHARED_EVALS: OrderedDict[tuple, Callable] = OrderedDict()


def eval_kwargs(model: nnx.Module, loss_fn: Callable, data: Callable[[int], Any], eval_every: Any, *,
                name: str, batches: int = 4) -> dict[str, Any]:
    """``bind`` arguments that evaluate ``loss_fn`` (its loss and extras, as ``eval/<name>``) on
    ``batches`` held-out batches of the job's own ``data`` every ``eval_every`` steps and at the
    end; ``{}`` when ``eval_every`` is None. One eval function per (model structure, loss, name),
    shared by a sweep's jobs like their step."""
    if eval_every is None:
        return {}
    if not isinstance(eval_every, int) or isinstance(eval_every, bool) or eval_every < 1:
        raise HyperparameterError(f"{name}: eval_every={eval_every!r} must be a positive int (or None: no evaluation)")
    graphdef = nnx.split(model, nnx.Param)[0]
    key = (graphdef, loss_fn, name)
    fn = _SHARED_EVALS.get(key)
    if fn is None:
        def eval_step(state, batch):
            loss, extra = loss_fn(nnx.merge(graphdef, state["params"]), batch)
            return {"loss": loss, **extra}

        fn = _SHARED_EVALS[key] = eval_step
        while len(_SHARED_EVALS) > _SHARED_STEPS_MAX:
            _SHARED_EVALS.popitem(last=False)
    return {"eval_step": fn, "eval_data": [data(HELD_OUT_STEP + k) for k in range(batches)],
            "eval_every": eval_every}


def _step_job(graphdef: Any, tx: optax.GradientTransformation, loss_fn: Callable, name: str) -> xshare.Job:
    def step(state, batch):
        def objective(p):
            loss, extra = loss_fn(nnx.merge(graphdef, p), batch)
            return loss, extra

        (loss, extra), grads = jax.value_and_grad(objective, has_aux=True)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt, "step": state["step"] + 1}, {"loss": loss, **extra}

    step.__name__ = name
    return xshare.job(step, name=name)


# tx_key of adam(): inject_hyperparams keeps lr, b1, b2, eps in the optimizer state, so the
# update rule is the same function for every learning rate.
ADAM = "optax.inject_hyperparams(optax.adam)"


def adam(lr: float) -> optax.GradientTransformation:
    """Adam with its learning rate kept in the optimizer state, not baked into the program.

    ``optax.adam(lr)`` makes ``lr`` a compile-time constant: jobs of a learning-rate sweep are
    then different programs and cannot share an executable or fuse (``Runtime(fuse=True)``).
    ``inject_hyperparams`` stores it as an array in the state, so the whole sweep is one program.
    """
    return optax.inject_hyperparams(optax.adam)(learning_rate=lr)


def accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return jnp.mean(jnp.argmax(logits, -1) == labels)


def classification_loss(model: nnx.Module, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Softmax cross-entropy on ``batch["x"]`` -> ``batch["y"]`` (int labels), plus accuracy."""
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"accuracy": accuracy(logits, batch["y"])}


class HyperparameterError(xshare.SpecError, ValueError):
    """A factory's hyperparameter has the wrong type or value; raised before anything is traced
    or compiled. A SpecError (``xshare launch`` exits 2 naming it) and a ValueError."""


def check_positive_ints(model: str, **values: Any) -> None:
    """Reject sizes that are not positive ints, naming the model, the parameter and the value."""
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise HyperparameterError(f"{model}: {key}={value!r} must be a positive int")


def check_common(model: str, *, lr: Any = None, seed: Any = 0, steps: Any = None, name: Any = None) -> None:
    """The hyperparameters every factory takes: ``lr`` a finite number >= 0 (0 is the control run
    of "does the loss fall"), ``seed`` an
    int >= 0, ``steps`` a positive int or None, ``name`` a string or None."""
    import math

    if lr is not None and (not isinstance(lr, (int, float)) or isinstance(lr, bool)
                           or not math.isfinite(lr) or lr < 0):
        raise HyperparameterError(f"{model}: lr={lr!r} must be a number >= 0 (e.g. lr=1e-3)")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise HyperparameterError(f"{model}: seed={seed!r} must be an int >= 0")
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
        raise HyperparameterError(f"{model}: steps={steps!r} must be a positive int (or None: until the data ends)")
    if name is not None and not isinstance(name, str):
        raise HyperparameterError(f"{model}: name={name!r} must be a string")
