"""What every model job shares: its train step and optimizer, over the public ``xshare.nnx``.

A model is a Flax NNX module trained in place, as the NNX tutorial writes it:
``step(model, optimizer, batch)`` computes the loss and its gradients and updates both objects;
``xshare.nnx.job`` makes that a job (any NNX state rides along: batch statistics, RNG streams).
What is model-specific here is only the loss and the optimizer.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import xshare

# One xshare.nnx job per (loss, name): jobs a sweep's factory builds (one call per learning
# rate or seed) then share it, and xshare.nnx shares one pure step among binds of one object
# structure, so the runtime traces the step once for the whole sweep (its trace memo is keyed
# like ``jax.jit``: by function), instead of once per job (~50 ms of Flax tracing each, the
# larger part of a small fused sweep's start). Bounded by the code: one entry per loss.
_STEPS: dict[tuple, Any] = {}


def train_job(loss_fn: Callable[[nnx.Module, Any], tuple[jax.Array, dict[str, jax.Array]]],
              *, name: str) -> "xshare.nnx.NnxJob":
    """The ``xshare.nnx`` job for one optimizer step on ``loss_fn(model, batch) -> (loss,
    extra_metrics)``; the step reports ``loss`` and the extras. Bind it to ``(model,
    optimizer)``: ``train_job(loss, name="mlp").bind((model, adam(model, lr)), data, ...)``."""
    key = (loss_fn, name)
    job = _STEPS.get(key)
    if job is None:
        def step(model: nnx.Module, optimizer: nnx.Optimizer, batch: Any) -> dict[str, jax.Array]:
            (loss, extra), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
            optimizer.update(model, grads)
            return {"loss": loss, **extra}

        step.__name__ = name
        job = _STEPS[key] = xshare.nnx.job(step, name=name)
    return job


# Adam with every hyperparameter in its state (inject_hyperparams), one transformation object
# for every job: ``nnx.Optimizer`` keeps its ``tx`` in the object structure (the graphdef), so
# jobs built with one ``tx`` object and equal models have one structure, share one pure step
# and fuse. ``optax.adam(lr)`` would bake ``lr`` into the program as a constant: a learning-rate
# sweep would then be one program per job, none fusing (``Runtime(fuse=True)``).
_ADAM = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)


# Held-out batches: a factory's data is a function of (seed, step), and no job trains this far.
HELD_OUT_STEP = 1 << 40
_EVALS: dict[tuple, Callable] = {}


def eval_kwargs(loss_fn: Callable, data: Callable[[int], Any], eval_every: Any, *, name: str,
                batches: int = 4) -> dict[str, Any]:
    """``bind`` arguments that evaluate ``loss_fn`` (its loss and extras, as ``eval/<name>``) on
    ``batches`` held-out batches of the job's own ``data`` every ``eval_every`` steps and at the
    end (``eval_step(model, batch)``, run by ``xshare.nnx`` on the model in eval mode); ``{}``
    when ``eval_every`` is None. One eval function per (loss, name), shared by a sweep's jobs."""
    if eval_every is None:
        return {}
    if not isinstance(eval_every, int) or isinstance(eval_every, bool) or eval_every < 1:
        raise HyperparameterError(f"{name}: eval_every={eval_every!r} must be a positive int (or None: no evaluation)")
    fn = _EVALS.get((loss_fn, name))
    if fn is None:
        def eval_step(model: nnx.Module, batch: Any) -> dict[str, jax.Array]:
            loss, extra = loss_fn(model, batch)
            return {"loss": loss, **extra}

        eval_step.__name__ = f"{name}_eval"
        fn = _EVALS[(loss_fn, name)] = eval_step
    return {"eval_step": fn, "eval_data": [data(HELD_OUT_STEP + k) for k in range(batches)],
            "eval_every": eval_every}


def adam(model: nnx.Module, lr: float) -> nnx.Optimizer:
    """An ``nnx.Optimizer`` over ``model``'s parameters: Adam with learning rate ``lr``, which
    lives in the optimizer state (exactly what ``inject_hyperparams(adam)(learning_rate=lr)``
    would hold), not in the program."""
    optimizer = nnx.Optimizer(model, _ADAM, wrt=nnx.Param)
    rate = optimizer.opt_state.hyperparams["learning_rate"]
    rate[...] = jnp.asarray(lr, dtype=rate[...].dtype)
    return optimizer


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
