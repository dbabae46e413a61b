"""(d) An Equinox MLP trained with ``eqx.filter_value_and_grad`` + optax, the state
``(model, opt_state)`` as Equinox's docs write it: its leaves include non-array ones (the MLP's
activation functions), which are static as under ``eqx.filter_jit``. Bit-identical to the same
step under ``eqx.filter_jit``, under every policy, fused, and resumed.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import xshare
from tests.users import harness
from tests.users.test_nnx_tutorial import data

TX = optax.adam(1e-2)


def state(seed: int):
    model = eqx.nn.MLP(6, 3, 32, 2, key=jax.random.key(seed))
    return model, TX.init(eqx.filter(model, eqx.is_array))


def loss_fn(model, batch):
    logits = jax.vmap(model)(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


@xshare.job
def train_step(state, batch):
    model, opt_state = state
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, batch)
    updates, opt_state = TX.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return (eqx.apply_updates(model, updates), opt_state), {"loss": loss}


def spec(seed: int, steps: int = harness.STEPS, batches=None) -> xshare.JobSpec:
    return train_step.bind(state(seed), batches or data(seed), steps=steps, name=f"eqx{seed}")


def reference(seed: int, steps: int = harness.STEPS):
    """The reference way: eqx.filter_jit of the same step, in a plain loop."""
    step, s = eqx.filter_jit(train_step.fn), state(seed)
    for k in range(steps):
        s, _ = step(s, data(seed)(k))
    return s


def test_the_state_has_non_array_leaves():
    leaves = jax.tree.leaves(state(0))
    assert any(callable(x) and not eqx.is_array(x) for x in leaves)
    assert all(eqx.is_array(x) or callable(x) for x in leaves)


def test_the_reference_trains():  # TestUnderTheRuntime compares runs that do something
    first = loss_fn(state(0)[0], data(0)(0))
    last = loss_fn(reference(0, 30)[0], data(0)(0))
    assert float(last) < 0.9 * float(first)
    assert jnp.isfinite(last)


class TestUnderTheRuntime(harness.Checks):
    spec, reference, data = staticmethod(spec), staticmethod(reference), staticmethod(data)
