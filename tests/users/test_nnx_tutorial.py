"""(a) The NNX tutorial's in-place step, with BatchNorm and Dropout, via ``xshare.nnx.job``:
bit-identical to the same step under ``nnx.jit``, under every policy, fused, and resumed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import xshare
from tests.users import harness


class Net(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(6, 32, use_bias=False, rngs=rngs)
        self.norm = nnx.BatchNorm(32, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.out = nnx.Linear(32, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(self.dropout(nnx.relu(self.norm(self.hidden(x)))))


def loss_fn(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), logits


@xshare.nnx.job
def train_step(model, optimizer, batch):
    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
    optimizer.update(model, grads)
    return {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}


def data(seed: int):
    def batch(step: int):
        x = np.random.default_rng((seed, step)).normal(size=(16, 6)).astype(np.float32)
        return {"x": x, "y": (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 1).astype(np.int32)}

    return batch


TX = optax.adam(1e-2)


def objects(seed: int):
    model = Net(rngs=nnx.Rngs(seed))
    return model, nnx.Optimizer(model, TX, wrt=nnx.Param)


def spec(seed: int, steps: int = harness.STEPS, batches=None) -> xshare.JobSpec:
    return train_step.bind(objects(seed), batches or data(seed), steps=steps, name=f"tut{seed}")


def reference(seed: int, steps: int = harness.STEPS):
    model, optimizer = objects(seed)
    step = nnx.jit(train_step.fn)
    for k in range(steps):
        step(model, optimizer, data(seed)(k))
    return nnx.state((model, optimizer))


def canon(result):
    return nnx.state(result)


def test_the_state_holds_typed_keys():  # what makes this case need the runtime's key support
    leaves = [x for x in jax.tree.leaves(spec(0).state) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key)]
    assert leaves, "no typed key in the state: this case would not test key support"


class TestUnderTheRuntime(harness.Checks):
    spec, reference, data = staticmethod(spec), staticmethod(reference), staticmethod(data)
    canon = staticmethod(canon)
