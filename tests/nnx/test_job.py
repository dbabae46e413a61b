"""``xshare.nnx.job``: the NNX tutorial's in-place step runs as a job and ends bit-identical to
the same step under ``nnx.jit``, under every policy, fused, and resumed from a checkpoint; the
result is new NNX objects; misuse is refused with the fix named.

The model here has parameters and batch statistics but no RNG streams (no Dropout), so these
check the adapter on plain arrays; ``tests/users/test_nnx_tutorial.py`` is the same with
Dropout (typed PRNG keys in the state).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import xshare
from tests.users import harness


class BNNet(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        # No bias before BatchNorm (it would cancel it): its gradient would be rounding noise,
        # which Adam scales up to full-size steps, so the smallest reordering shows.
        self.hidden = nnx.Linear(6, 16, use_bias=False, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.norm(self.hidden(x))))


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
        rng = np.random.default_rng((seed, step))
        x = rng.normal(size=(16, 6)).astype(np.float32)
        return {"x": x, "y": (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 1).astype(np.int32)}

    return batch


TX = optax.adam(1e-2)


def objects(seed: int, tx=TX):
    model = BNNet(rngs=nnx.Rngs(seed))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def spec(seed: int, steps: int = harness.STEPS, batches=None, **kw) -> xshare.JobSpec:
    return train_step.bind(objects(seed), batches or data(seed), steps=steps, name=f"bn{seed}", **kw)


def reference(seed: int, steps: int = harness.STEPS):
    """The reference way: the same step under nnx.jit, in place, in a plain loop."""
    model, optimizer = objects(seed)
    step = nnx.jit(train_step.fn)
    for k in range(steps):
        step(model, optimizer, data(seed)(k))
    return nnx.state((model, optimizer))


def canon(result):
    return nnx.state(result)


@pytest.mark.parametrize("policy", xshare.POLICIES)
def test_bit_identical_to_nnx_jit_under_every_policy(policy):
    harness.check_policy(policy, [spec(0), spec(1)], [reference(0), reference(1)], canon)


def test_a_sweep_of_one_structure_shares_one_step_and_fuses():
    specs = [spec(i) for i in range(3)]
    assert specs[0].job is specs[1].job is specs[2].job  # one trace for the sweep
    harness.check_fused(specs, [reference(i) for i in range(3)], canon)


def test_checkpointed_mid_run_and_resumed_ends_as_if_uninterrupted(tmp_path):
    harness.check_resume(tmp_path, lambda batches: spec(0, harness.RESUME_STEPS, batches), data(0),
                         reference(0, harness.RESUME_STEPS), canon)


def test_result_is_new_objects_and_update_writes_them_into_the_users():
    model, optimizer = objects(0)
    before = jax.tree.map(np.asarray, nnx.state((model, optimizer)))
    with xshare.Runtime(memory="256MiB") as rt:
        h = rt.submit(train_step.bind((model, optimizer), data(0), steps=harness.STEPS, name="u"))
    (model2, optimizer2), metrics = h.result()
    assert isinstance(model2, BNNet) and isinstance(optimizer2, nnx.Optimizer)
    assert model2 is not model and int(optimizer2.step[...]) == harness.STEPS
    assert set(metrics) == {"loss", "accuracy"}
    harness.assert_states_equal(nnx.state((model2, optimizer2)), reference(0))
    # The objects given to bind are unchanged, like any job's state ...
    harness.assert_states_equal(jax.tree.map(np.asarray, nnx.state((model, optimizer))), before)
    # ... until update writes the final state into them.
    assert xshare.nnx.update((model, optimizer), h) == (model, optimizer)
    harness.assert_states_equal(nnx.state((model, optimizer)), reference(0))
    # The rebuilt objects are live NNX objects: they keep training in place under nnx.jit.
    train_step(model2, optimizer2, data(0)(harness.STEPS))
    assert int(optimizer2.step[...]) == harness.STEPS + 1


def test_objects_changed_after_bind_do_not_change_the_job():
    model, optimizer = objects(0)
    bound = train_step.bind((model, optimizer), data(0), steps=harness.STEPS, name="early")
    train_step(model, optimizer, data(0)(0))  # the user trains on in place after bind
    (model2, optimizer2), _ = xshare.run([bound])[0]
    harness.assert_states_equal(nnx.state((model2, optimizer2)), reference(0))


def test_one_object_binds_and_returns_one_object():
    @xshare.nnx.job
    def decay(model, batch):
        model.out.kernel[...] = model.out.kernel[...] * 0.5 + batch["x"][0, :3].sum()
        return {"norm": jnp.sum(model.out.kernel[...] ** 2)}

    model = BNNet(rngs=nnx.Rngs(0))
    (result, metrics), = xshare.run([decay.bind(model, data(0), steps=3)])
    ref = BNNet(rngs=nnx.Rngs(0))
    for k in range(3):
        out = decay(ref, data(0)(k))
    assert isinstance(result, BNNet)
    harness.assert_states_equal(nnx.state(result), nnx.state(ref))
    assert metrics["norm"] == float(out["norm"])


def test_a_step_that_keeps_its_metrics_in_an_nnx_metric_may_return_none():
    @xshare.nnx.job
    def step(model, optimizer, metrics, batch):
        (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        optimizer.update(model, grads)
        metrics.update(loss=loss, logits=logits, labels=batch["y"])

    def fresh():
        model, optimizer = objects(0)
        return model, optimizer, nnx.MultiMetric(loss=nnx.metrics.Average("loss"),
                                                  accuracy=nnx.metrics.Accuracy())

    (_, _, metrics), last = xshare.run([step.bind(fresh(), data(0), steps=5)])[0]
    ref = fresh()
    for k in range(5):
        step(*ref, data(0)(k))
    assert last == {}
    assert {k: float(v) for k, v in metrics.compute().items()} == \
        {k: float(v) for k, v in ref[2].compute().items()}


def test_a_step_that_returns_its_model_is_refused_at_bind_or_when_it_compiles():
    @xshare.nnx.job
    def returns_model(model, optimizer, batch):
        train_step.fn(model, optimizer, batch)
        return model, {"loss": 0.0}

    message = "the xshare.nnx.job step 'returns_model' returned a tuple of (BNNet, dict)"
    # Step-indexed data: bind traces the step abstractly on batch 0 and refuses it.
    with pytest.raises(xshare.nnx.NnxStepError, match=re.escape(message)) as err:
        returns_model.bind(objects(0), data(0), steps=2)
    assert "returns only its metrics" in str(err.value)
    # An iterable cannot be peeked at bind: the job fails when it compiles, saying the same.
    with xshare.Runtime(memory="64MiB") as rt:
        handle = rt.submit(returns_model.bind(objects(0), [data(0)(k) for k in range(2)]))
        rt.wait()
    assert handle.status() == "failed" and message in handle.error
    with pytest.raises(TypeError, match=re.escape("return the metrics, not the BNNet")):
        returns_model(*objects(0), data(0)(0))  # called directly too


def test_xshare_job_given_nnx_objects_names_xshare_nnx_job():
    @xshare.job
    def step(state, batch):
        return state, {}

    with pytest.raises(TypeError, match=re.escape("holds a live Flax NNX object (BNNet)")) as err:
        step.bind(objects(0), data(0), steps=1)
    assert "use @xshare.nnx.job" in str(err.value)
    # The functional pattern (the split state, no live objects) is a plain pytree: accepted.
    step.bind(nnx.split(objects(0))[1], data(0), steps=1)


def test_bind_refuses_what_is_not_an_nnx_object_and_a_step_of_another_arity():
    with pytest.raises(TypeError, match=re.escape("object 1 is a dict. For a pure step over a pytree")):
        train_step.bind((BNNet(rngs=nnx.Rngs(0)), {"w": jnp.ones(3)}), data(0), steps=1)
    model, optimizer = objects(0)
    with pytest.raises(TypeError, match=re.escape("with the 1 object(s) given to bind plus the batch")):
        train_step.bind(model, data(0), steps=1)  # train_step takes (model, optimizer, batch)
    with pytest.raises(ValueError, match=re.escape("steps=-1 must be a non-negative int")):
        train_step.bind((model, optimizer), data(0), steps=-1)  # Job.bind's own checks apply


def test_result_rebuilds_the_objects_without_compiling_anything():
    """The final state goes back into new NNX objects by transfer: ``jnp.asarray`` staged one
    small program per leaf shape (in a fresh process, ~90 ms of compiles or cache loads before
    a zoo sweep's results). Shapes no other test uses, so nothing is in jax's caches yet."""
    class Odd(nnx.Module):
        def __init__(self, *, rngs):
            self.a = nnx.Linear(7, 13, rngs=rngs)
            self.b = nnx.Linear(13, 5, rngs=rngs)

        def __call__(self, x):
            return self.b(nnx.relu(self.a(x)))

    @xshare.nnx.job
    def odd_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(batch["x"]) - 1.0) ** 2))(model)
        optimizer.update(model, grads)
        return {"loss": loss}

    model = Odd(rngs=nnx.Rngs(3))
    bound = odd_step.bind((model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)),
                          lambda k: {"x": np.full((4, 7), k % 3, np.float32)}, steps=6, name="odd")
    traced: list[str] = []

    def listen(event: str, seconds: float, **_: object) -> None:
        if event.endswith("jaxpr_trace_duration"):
            traced.append(event)

    with xshare.Runtime(memory="256MiB") as rt:
        handle = rt.submit(bound)
        rt.wait()
        jax.monitoring.register_event_duration_secs_listener(listen)
        try:
            (model2, _), _ = handle.result()
        finally:
            jax.monitoring.unregister_event_duration_listener(listen)
    assert traced == []
    assert isinstance(model2, Odd) and model2.a.kernel[...].shape == (7, 13)


def test_a_finished_job_keeps_its_result_not_what_only_its_steps_read():
    # A long-lived runtime (xshare serve, a study) keeps every finished job's record for its
    # handle: an NNX job's layouts (its graph, its variables' paths and metadata) went with it,
    # ~25 KiB a job of the zoo MLP, +1.5 MiB per round of 64 in the soak.
    with xshare.Runtime(memory="256MiB") as rt:
        h = rt.submit(spec(3, steps=20))
        rt.wait()
        rec = h._rec
        assert rec.layout is None and rec.batch_layout is None and rec.traced is None and rec.lifted is None
        progress, snap = h.progress(), rt.snapshot()
    assert progress.status == "done" and progress.steps_done == 20
    assert [j["steps_done"] for j in snap["jobs"]] == [20]
    harness.assert_states_equal(canon(h.result()[0]), reference(3, steps=20), what="the result after its record let go")
