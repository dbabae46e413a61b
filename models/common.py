"""What every model job shares: a Flax NNX model split into a pure (graphdef, state) step.

xshare jobs are pure functions over pytrees, so each model is split once with ``nnx.split``
and the train step merges it back inside the traced function. The job's state is
``{"params": nnx.State, "opt": optax state, "step": int32}``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import xshare


def train_job(model: nnx.Module, tx: optax.GradientTransformation,
              loss_fn: Callable[[nnx.Module, Any], tuple[jax.Array, dict[str, jax.Array]]],
              *, name: str) -> tuple[xshare.Job, dict[str, Any]]:
    """(the xshare job for one optimizer step, its initial state) for ``model`` and ``tx``.

    ``loss_fn(model, batch) -> (loss, extra_metrics)``; the step reports ``loss`` and the extras.
    """
    graphdef, params = nnx.split(model, nnx.Param)
    # Anything that is not a Param (e.g. batch-norm statistics) would need threading through the
    # state; the zoo's models keep only parameters, and this checks it.
    rest = nnx.state(model, nnx.Not(nnx.Param))
    if jax.tree.leaves(rest):
        raise ValueError(f"{name}: models/common.train_job supports parameter-only models")

    def step(state, batch):
        def objective(p):
            loss, extra = loss_fn(nnx.merge(graphdef, p), batch)
            return loss, extra

        (loss, extra), grads = jax.value_and_grad(objective, has_aux=True)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt, "step": state["step"] + 1}, {"loss": loss, **extra}

    step.__name__ = name
    state = {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    return xshare.job(step, name=name), state


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
