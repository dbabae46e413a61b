"""Batches of other shapes than a job's first (engine/shapes.py): a short last batch, every
epoch's, runs as ``jax.jit`` runs it (it traces the step again for the new shapes), so a job
ends in exactly the plain loop's state, every step's metrics included, under every policy, on
K-step forms and in fused groups; a batch the job's memory cannot take fails that job alone,
with the reason."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import xshare
from tests.helpers import assert_trees_equal, loss_recorders, run_until_k_steps
from tests.reliability.test_random_sweeps import train_step  # (the Flax docs' step)

ROWS, BATCH, EPOCHS = 200, 32, 3  # 7 batches an epoch, the last of 8 rows
X = np.random.default_rng(0).normal(size=(ROWS, 6)).astype(np.float32)
Y = (X[:, :3].sum(1) > 0).astype(np.int32) + (X[:, 3] > 0.5)


def epochs(seed: int, epochs: int = EPOCHS):
    """The loop a user writes: shuffled each epoch, the remainder not dropped."""
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        order = rng.permutation(ROWS)
        for i in range(0, ROWS, BATCH):
            idx = order[i:i + BATCH]
            yield {"x": X[idx], "y": Y[idx]}


STEPS = EPOCHS * -(-ROWS // BATCH)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.Dense(16)(x)))


NET = MLP()


@functools.cache
def adam(lr: float):
    """One optimizer per learning rate, as a script makes it once (a TrainState's ``tx`` is
    part of its tree structure)."""
    return optax.adam(lr)


def trainstate(seed: int, lr: float = 1e-2) -> train_state.TrainState:
    params = NET.init(jax.random.key(seed), jnp.zeros((1, 6)))["params"]
    return train_state.TrainState.create(apply_fn=NET.apply, params=params, tx=adam(lr))


JOB = xshare.job(train_step)


def plain(seed: int, lr: float = 1e-2):
    """The user's loop: the same step under jax.jit, its losses step by step."""
    step = jax.jit(train_step)
    state, losses = trainstate(seed, lr), []
    for batch in epochs(seed):
        state, metrics = step(state, batch)
        losses.append(np.asarray(metrics["loss"]))
    return state, losses


@pytest.mark.parametrize("policy", ["fifo", "pack", "srtf", "priority"])
def test_short_last_batches_run_as_under_jax_jit_under_every_policy(policy):
    seen, observer = loss_recorders(3)
    with xshare.Runtime(policy=policy, memory="256MiB") as rt:
        handles = [rt.submit(JOB.bind(trainstate(i), epochs(i), steps=STEPS, name=f"r{i}", observer=observer(i)))
                   for i in range(3)]
        rt.wait()
    for i, handle in enumerate(handles):
        assert handle.status() == "done", handle.error
        want_state, want_losses = plain(i)
        assert_trees_equal(handle.result()[0], want_state)
        assert [s for s, _ in seen[i]] == list(range(STEPS))
        assert [loss for _, loss in seen[i]] == want_losses


def test_a_job_on_its_k_step_form_takes_its_short_batches_between_k_step_calls():
    """The short batch bounds a K-step call (it cannot be stacked with the others); the job
    steps it on its program for that shape and goes back to its K-step form after."""
    def make():
        return JOB.bind(trainstate(5), epochs(5, epochs=12), steps=12 * 7, name="k")

    handle = run_until_k_steps(4, make, memory="256MiB", steps_per_call=4)
    assert handle.status() == "done", handle.error
    assert handle._rec.tier.steps_at.get(4, 0) >= 16, handle._rec.tier.steps_at
    step, state = jax.jit(train_step), trainstate(5)
    for batch in epochs(5, epochs=12):
        state, _ = step(state, batch)
    assert_trees_equal(handle.result()[0], state)


def test_members_of_a_fused_group_step_their_short_batches_alone_and_the_others_step_on():
    """A sweep written with ``optax.adam(lr)`` baked in (one program, constants lifted): its
    short batches are stepped by each member alone, out of and back into its slot, and every
    member's state is the plain loop's (to fusion's tolerance: vmap may reorder reductions)."""
    lrs = [1e-2, 3e-3, 1e-3]
    with xshare.Runtime(policy="pack", memory="256MiB", fuse="always") as rt:
        handles = rt.submit_many([JOB.bind(trainstate(i, lr), epochs(i), steps=STEPS, name=f"f{i}")
                                  for i, lr in enumerate(lrs)])
        rt.wait()
        fused = rt.snapshot()["runtime"]["fused_member_steps"]
    for i, (handle, lr) in enumerate(zip(handles, lrs)):
        assert handle.status() == "done", handle.error
        got, want = handle.result()[0], plain(i, lr)[0]
        gap = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
        assert gap < 1e-4, gap
        assert handle.progress().steps_done == STEPS
    assert fused >= 3 * (STEPS - EPOCHS) * 0.9, fused  # (the full batches stepped fused)


def growing():
    """A job whose first batches are the short ones."""
    yield {"x": X[:8], "y": Y[:8]}
    yield {"x": X[:8], "y": Y[:8]}
    yield {"x": X, "y": Y}  # 200 rows where the first had 8


def test_a_batch_larger_than_the_first_grows_the_jobs_reservation_where_the_arena_has_room():
    with xshare.Runtime(policy="fifo", memory="256MiB") as rt:
        handle = rt.submit(JOB.bind(trainstate(0), growing(), steps=3, name="grows"))
        rt.wait()
    assert handle.status() == "done", handle.error
    step, state = jax.jit(train_step), trainstate(0)
    for batch in growing():
        state, _ = step(state, batch)
    assert_trees_equal(handle.result()[0], state)
    first = handle._rec.program.with_staging(1)
    assert handle._rec.footprint.ephemeral > first.ephemeral  # (charged for the larger program)


def test_a_batch_larger_than_the_arena_has_room_for_fails_its_job_alone_and_says_why():
    """Admitted for its first batch's memory in an arena too small for its larger batch: that
    job fails at that batch (the message names the shapes and the fix); the job beside it ends
    exact."""
    with xshare.Runtime(policy="fifo", memory="64KiB") as rt:
        bad = rt.submit(JOB.bind(trainstate(0), growing(), steps=3, name="grows"))
        good = rt.submit(JOB.bind(trainstate(1), epochs(1), steps=STEPS, name="fine"))
        rt.wait()
    assert bad.status() == "failed"
    assert bad.error.startswith("batch 2 does not match the compiled step: expected {"), bad.error
    assert "the arena has no room for more now; make the first batch the largest" in bad.error, bad.error
    assert bad.progress().steps_done == 2
    assert good.status() == "done", good.error
    assert_trees_equal(good.result()[0], plain(1)[0])


def test_a_batch_of_another_structure_still_fails_with_the_compiled_one():
    def renamed():
        yield {"x": X[:8], "y": Y[:8]}
        yield {"inputs": X[:8], "y": Y[:8]}

    with xshare.Runtime(memory="256MiB") as rt:
        handle = rt.submit(JOB.bind(trainstate(0), renamed(), steps=2, name="renamed"))
        rt.wait()
    assert handle.status() == "failed"
    assert "does not match the compiled step" in handle.error, handle.error


def test_the_nnx_tutorials_step_takes_short_batches_as_nnx_jit_does():
    """The NNX tutorial's in-place step (BatchNorm, Dropout, typed keys) via ``xshare.nnx.job``,
    every seventh batch short: the objects end as ``nnx.jit``'s, bit for bit."""
    from flax import nnx

    from tests.users import harness, test_nnx_tutorial as tut

    def short(seed):
        full = tut.data(seed)
        return lambda k: ({key: v[:5] for key, v in full(k).items()} if k % 7 == 6 else full(k))

    steps = 30
    with xshare.Runtime(memory="256MiB", steps_per_call=4) as rt:
        handle = rt.submit(tut.spec(3, steps=steps, batches=short(3)))
        rt.wait()
    assert handle.status() == "done", handle.error
    model, optimizer = tut.objects(3)
    step = nnx.jit(tut.train_step.fn)
    for k in range(steps):
        step(model, optimizer, short(3)(k))
    harness.assert_states_equal(tut.canon(handle.result()[0]), nnx.state((model, optimizer)), what="short")
