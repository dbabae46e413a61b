"""(b) The NNX functional pattern via plain ``xshare.job``: ``graphdef, state =
nnx.split((model, optimizer))`` once, a step that merges, trains and returns ``nnx.state`` (as
Flax's performance guide writes it): bit-identical to the same step under ``jax.jit``, under
every policy, fused, and resumed.
"""

from __future__ import annotations

import jax
import optax
from flax import nnx

import xshare
from tests.helpers import plain_loop
from tests.users import harness
from tests.users.test_nnx_tutorial import Net, data, loss_fn

TX = optax.adam(1e-2)


def split(seed: int):
    model = Net(rngs=nnx.Rngs(seed))
    return nnx.split((model, nnx.Optimizer(model, TX, wrt=nnx.Param)))


GRAPHDEF = split(0)[0]  # one structure for every seed


@xshare.job
def train_step(state, batch):
    model, optimizer = nnx.merge(GRAPHDEF, state)
    (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), {"loss": loss}


def spec(seed: int, steps: int = harness.STEPS, batches=None) -> xshare.JobSpec:
    return train_step.bind(split(seed)[1], batches or data(seed), steps=steps, name=f"fn{seed}")


def reference(seed: int, steps: int = harness.STEPS):
    """jax.jit of the same step (donated), in a plain loop."""
    return plain_loop(spec(seed, steps))[0]


def test_the_structure_is_shared_and_holds_typed_keys():
    assert split(1)[0] == GRAPHDEF
    assert any(jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key) for x in jax.tree.leaves(split(0)[1]))


class TestUnderTheRuntime(harness.Checks):
    spec, reference, data = staticmethod(spec), staticmethod(reference), staticmethod(data)
