"""(b) The NNX functional pattern via plain ``xshare.job``: ``graphdef, state =
nnx.split((model, optimizer))`` once, a step that merges, trains and returns ``nnx.state`` (as
Flax's performance guide writes it): bit-identical to the same step under ``jax.jit``, under
every policy, fused, and resumed.
"""

from __future__ import annotations

import jax
import optax
import pytest
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


@pytest.mark.parametrize("policy", xshare.POLICIES)
def test_bit_identical_to_jax_jit_under_every_policy(policy):
    harness.check_policy(policy, [spec(0), spec(1)], [reference(0), reference(1)])


def test_fused_sweep():
    harness.check_fused([spec(0), spec(1)], [reference(0), reference(1)])


def test_checkpointed_and_resumed(tmp_path):
    harness.check_resume(tmp_path, lambda b: spec(0, harness.RESUME_STEPS, b), data(0),
                         reference(0, harness.RESUME_STEPS))


@pytest.mark.parametrize("policies", [("pack", "srtf"), pytest.param(xshare.POLICIES, marks=pytest.mark.slow)],
                         ids=["pack-srtf", "every-policy"])
def test_several_steps_per_call_bit_identical(policies):
    harness.check_multistep(lambda steps: spec(0, steps), reference(0, harness.MULTI_STEPS), policies=policies)
