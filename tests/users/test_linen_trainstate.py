"""(c) A Linen ``TrainState`` subclass with ``batch_stats`` and a dropout key made by
``jax.random.key(seed)`` (the Flax Linen guide's pattern): bit-identical to the same step under
``jax.jit``, under every policy, fused, and resumed.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax.training import train_state

import xshare
from tests.helpers import plain_loop
from tests.users import harness
from tests.users.test_nnx_tutorial import data


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(32, use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.Dropout(0.2, deterministic=not train)(nn.relu(x))
        return nn.Dense(3)(x)


class TrainState(train_state.TrainState):
    batch_stats: Any
    key: jax.Array


# One model and one optimizer for every job, as a script has them (apply_fn and tx are the
# TrainState's static fields: a bound method of another Net() would be another tree structure).
NET, TX = Net(), optax.adam(1e-2)


def state(seed: int) -> TrainState:
    key, init_key = jax.random.split(jax.random.key(seed))
    variables = NET.init(init_key, jnp.zeros((1, 6)), train=False)
    return TrainState.create(apply_fn=NET.apply, params=variables["params"], tx=TX,
                             batch_stats=variables["batch_stats"], key=key)


@xshare.job
def train_step(state: TrainState, batch):
    dropout_key = jax.random.fold_in(state.key, state.step)

    def loss_fn(params):
        logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats},
                                         batch["x"], train=True, rngs={"dropout": dropout_key},
                                         mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, updates

    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads).replace(batch_stats=updates["batch_stats"])
    return state, {"loss": loss}


def spec(seed: int, steps: int = harness.STEPS, batches=None) -> xshare.JobSpec:
    return train_step.bind(state(seed), batches or data(seed), steps=steps, name=f"linen{seed}")


def reference(seed: int, steps: int = harness.STEPS):
    return plain_loop(spec(seed, steps))[0]


def test_the_state_holds_a_typed_key_and_batch_stats():
    s = state(0)
    assert jnp.issubdtype(s.key.dtype, jax.dtypes.prng_key) and jax.tree.leaves(s.batch_stats)


class TestUnderTheRuntime(harness.Checks):
    spec, reference, data = staticmethod(spec), staticmethod(reference), staticmethod(data)

    @pytest.mark.parametrize("policies", [xshare.POLICIES], ids=["every-policy"])
    def test_several_steps_per_call_bit_identical(self, policies):  # every policy, not only when slow
        super().test_several_steps_per_call_bit_identical(policies)
