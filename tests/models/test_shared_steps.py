"""A sweep's factory calls share one step function (one trace for the whole sweep), and
sharing it changes nothing a job computes: each job still trains with its own learning rate,
exactly as with an optimizer of its own."""

from __future__ import annotations

import jax
import numpy as np
import optax
from flax import nnx

from tests.helpers import assert_trees_equal, plain_loop
from xshare.models import cnn, mlp, transformer
from xshare.models.common import classification_loss, train_job


def test_sweep_jobs_of_one_shape_share_a_step_and_other_shapes_do_not():
    a, b = mlp.make_job(lr=1e-3, width=16, seed=0), mlp.make_job(lr=3e-1, width=16, seed=1)
    assert a.job is b.job
    assert mlp.make_job(width=32).job is not a.job                 # another shape
    assert cnn.make_job(channels=4, blocks=1).job is cnn.make_job(lr=0.1, channels=4, blocks=1).job
    t1 = transformer.make_job(d_model=16, layers=1, heads=2, seq=8, batch=2)
    assert t1.job is transformer.make_job(lr=0.1, d_model=16, layers=1, heads=2, seq=8, batch=2).job


def test_a_shared_step_trains_each_job_with_its_own_learning_rate_exactly():
    mlp.make_job(lr=1e-4, width=16, seed=0)  # the shared step is built from another job
    spec = mlp.make_job(lr=3e-2, width=16, seed=0, steps=6)
    # The reference: the same model and data with an optimizer (and so a step) of its own.
    model = mlp.MLP(16, 2, rngs=nnx.Rngs(0))
    own_tx = optax.inject_hyperparams(optax.adam)(learning_rate=3e-2)
    own = train_job(classification_loss, name="mlp").bind(
        (model, nnx.Optimizer(model, own_tx, wrt=nnx.Param)), spec.data, steps=6)
    assert own.job is not spec.job
    shared, _ = plain_loop(spec)
    reference, _ = plain_loop(own)
    assert_trees_equal(shared, reference)
    # ... and the learning rate really is the job's: another lr ends elsewhere.
    other, _ = plain_loop(mlp.make_job(lr=1e-4, width=16, seed=0, steps=6))
    gap = max(float(np.abs(np.asarray(x) - np.asarray(y)).max())
              for x, y in zip(jax.tree.leaves(other[0]), jax.tree.leaves(shared[0])))
    assert gap > 1e-4
