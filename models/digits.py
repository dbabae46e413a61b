"""A digits classifier on real data: scikit-learn's ``load_digits`` (8x8 handwritten digits, 1797
images bundled with scikit-learn: no download), with a fixed train/validation split.

Written the way a user writes a training loop, on purpose: a Flax Linen MLP with dropout,
``optax.adamw(lr, weight_decay=...)`` with its hyperparameters as Python floats (baked into the
program as constants), and an ``eval_step`` on the held-out images every ``eval_every`` steps
(``eval/accuracy``, ``eval/loss``). Each distinct (lr, weight_decay, dropout) is therefore its own
program until the runtime lifts baked-in constants. The dropout key is a raw ``uint32[2]``
``jax.random.PRNGKey`` in the state, split every step.

Batch ``k`` depends only on ``(seed, k)`` (sampled with replacement from the training split), so
runs are reproducible and resumable bit for bit. Needs ``pip install 'xshare[tune]'``.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import xshare

from .common import HyperparameterError, check_common, check_positive_ints

CLASSES, FEATURES = 10, 64
VAL_SIZE, VAL_BATCH = 360, 120  # the last 360 images of a fixed shuffle; 3 eval batches


@functools.lru_cache(maxsize=1)
def split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_val, y_val): float32 pixels in [0, 1], int32 labels; fixed."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:  # pragma: no cover - the extra is missing
        raise ImportError("xshare.models.digits needs scikit-learn: pip install 'xshare[tune]'") from err
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    return x[:-VAL_SIZE], y[:-VAL_SIZE], x[-VAL_SIZE:], y[-VAL_SIZE:]


class MLP(nn.Module):
    width: int
    depth: int
    dropout: float

    @nn.compact
    def __call__(self, x, *, train: bool):
        for _ in range(self.depth):
            x = nn.relu(nn.Dense(self.width)(x))
            x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return nn.Dense(CLASSES)(x)


class RateMLP(nn.Module):
    """``MLP`` with the dropout rate a call argument (an array in the state), not an attribute
    baked into the program: for ``make_job(..., hparams_in_state=True)``."""

    width: int
    depth: int

    @nn.compact
    def __call__(self, x, rate, *, train: bool):
        for _ in range(self.depth):
            x = nn.relu(nn.Dense(self.width)(x))
            if train:  # inverted dropout, as nn.Dropout computes it
                keep = 1.0 - rate
                mask = jax.random.bernoulli(self.make_rng("dropout"), keep, x.shape)
                x = jnp.where(mask, x / keep, jnp.zeros_like(x))
        return nn.Dense(CLASSES)(x)


class TrainData:
    """``step -> {"x", "y"}``: batch ``k`` is ``batch`` training images drawn by ``(seed, k)``."""

    def __init__(self, batch: int, seed: int):
        self.x, self.y, _, _ = split()
        self.batch, self.seed = batch, seed

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        idx = np.random.default_rng((self.seed, int(step))).integers(0, len(self.x), self.batch)
        return {"x": self.x[idx], "y": self.y[idx]}


def val_batches() -> list[dict[str, np.ndarray]]:
    """The validation split as equal batches (one eval program)."""
    _, _, x, y = split()
    return [{"x": x[i:i + VAL_BATCH], "y": y[i:i + VAL_BATCH]} for i in range(0, VAL_SIZE, VAL_BATCH)]


@functools.lru_cache(maxsize=32)
def _eval_step(width: int, depth: int):
    """One eval function per model shape (dropout is off in eval): a sweep's jobs share it."""
    model = MLP(width, depth, 0.0)

    def eval_step(state, batch):
        logits = model.apply(state["params"], batch["x"], train=False)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"]), "loss": loss}

    return eval_step


def make_job(lr: float = 1e-3, width: int = 64, depth: int = 2, dropout: float = 0.0,
             weight_decay: float = 1e-4, batch: int = 64, steps: int = 300, seed: int = 0,
             eval_every: int | None = 50, name: str | None = None,
             hparams_in_state: bool = False) -> xshare.JobSpec:
    """A bound digits training job: AdamW(lr, weight_decay) on a ``depth`` x ``width`` MLP with
    ``dropout``, evaluated on the validation split every ``eval_every`` steps and at the end.

    ``hparams_in_state=True``: the same training with lr, weight_decay and the dropout rate kept
    as arrays in the state (``optax.inject_hyperparams``), so every job of one model shape is
    one program with one shared step function (one compile; they fuse). The default is the way
    users write it: the floats are compile-time constants."""
    check_common("digits", lr=lr, seed=seed, steps=steps, name=name)
    check_positive_ints("digits", width=width, depth=depth, batch=batch)
    if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0 <= dropout < 1:
        raise HyperparameterError(f"digits: dropout={dropout!r} must be a number in [0, 1)")
    if not isinstance(weight_decay, (int, float)) or isinstance(weight_decay, bool) or weight_decay < 0:
        raise HyperparameterError(f"digits: weight_decay={weight_decay!r} must be a number >= 0")
    lr, dropout, weight_decay = float(lr), float(dropout), float(weight_decay)
    if hparams_in_state:
        return _in_state_job(lr, width, depth, dropout, weight_decay, batch, steps, seed, eval_every, name)
    model = MLP(width, depth, dropout)
    key, init_key = jax.random.split(jax.random.PRNGKey(seed))
    params = model.init(init_key, jnp.zeros((1, FEATURES), jnp.float32), train=False)
    tx = optax.adamw(lr, weight_decay=weight_decay)

    def train_step(state, batch):
        key, dropout_key = jax.random.split(state["key"])

        def loss_fn(params):
            logits = model.apply(params, batch["x"], train=True, rngs={"dropout": dropout_key})
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
            return loss, jnp.mean(jnp.argmax(logits, -1) == batch["y"])

        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return ({"params": params, "opt": opt, "key": key, "step": state["step"] + 1},
                {"loss": loss, "accuracy": acc})

    state = {"params": params, "opt": tx.init(params), "key": key, "step": jnp.zeros((), jnp.int32)}
    step = xshare.job(train_step, name="digits")
    return step.bind(state, TrainData(batch, seed), steps=steps,
                     name=name or f"digits-w{width}-d{depth}-s{seed}",
                     eval_step=_eval_step(width, depth), eval_data=val_batches(), eval_every=eval_every,
                     meta={"model": "digits", "lr": lr, "width": width, "depth": depth,
                           "dropout": dropout, "weight_decay": weight_decay, "batch": batch, "seed": seed})


@functools.lru_cache(maxsize=32)
def _in_state_step(width: int, depth: int) -> xshare.Job:
    """One step function per model shape: every hyperparameter comes from the state."""
    model = RateMLP(width, depth)
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, weight_decay=0.0)  # values: state

    def train_step(state, batch):
        key, dropout_key = jax.random.split(state["key"])

        def loss_fn(params):
            logits = model.apply(params, batch["x"], state["dropout"], train=True, rngs={"dropout": dropout_key})
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
            return loss, jnp.mean(jnp.argmax(logits, -1) == batch["y"])

        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return ({**state, "params": params, "opt": opt, "key": key, "step": state["step"] + 1},
                {"loss": loss, "accuracy": acc})

    def eval_step(state, batch):
        logits = model.apply(state["params"], batch["x"], state["dropout"], train=False)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"]), "loss": loss}

    job = xshare.job(train_step, name="digits")
    job.eval_step = eval_step  # (kept with its step: one eval function per shape too)
    return job


def _in_state_job(lr, width, depth, dropout, weight_decay, batch, steps, seed, eval_every, name):
    job = _in_state_step(width, depth)
    key, init_key = jax.random.split(jax.random.PRNGKey(seed))
    params = RateMLP(width, depth).init(init_key, jnp.zeros((1, FEATURES), jnp.float32), 0.0, train=False)
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=lr, weight_decay=weight_decay)
    state = {"params": params, "opt": tx.init(params), "key": key, "step": jnp.zeros((), jnp.int32),
             "dropout": jnp.float32(dropout)}
    return job.bind(state, TrainData(batch, seed), steps=steps,
                    name=name or f"digits-w{width}-d{depth}-s{seed}",
                    eval_step=job.eval_step, eval_data=val_batches(), eval_every=eval_every,
                    meta={"model": "digits", "lr": lr, "width": width, "depth": depth, "dropout": dropout,
                          "weight_decay": weight_decay, "batch": batch, "seed": seed, "hparams_in_state": True})
