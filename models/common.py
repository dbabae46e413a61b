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


def check_positive_ints(model: str, **values: Any) -> None:
    """Reject sizes that are not positive ints, naming the model, the parameter and the value."""
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{model}: {key}={value!r} must be a positive int")
