"""Whatever pytree jax.jit accepts is a job's state: typed PRNG keys (any impl), ints, bools,
bf16, zero-size leaves, static non-array leaves; keys in batches; swap, checkpoints, fused groups.
The reference is the same step under ``jax.jit`` in a plain loop."""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xshare


def _keys_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
            assert jax.random.key_impl(x) == jax.random.key_impl(y)
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def mixed_state(seed: int = 0, impl: str = "threefry2x32"):
    return {
        "w": jnp.asarray(np.random.default_rng(seed).normal(size=(6, 3)), jnp.bfloat16),
        "count": jnp.zeros((), jnp.int32),
        "seen": jnp.zeros((4,), jnp.bool_),
        "empty": jnp.zeros((0, 3), jnp.float32),
        "key": jax.random.key(seed, impl=impl),
    }


@xshare.job
def mixed_step(state, batch):
    key, sub = jax.random.split(state["key"])
    x = batch["x"].astype(jnp.float32) / 255.0                     # a uint8 batch
    keep = jax.random.bernoulli(sub, 0.8, x.shape)
    w = state["w"].astype(jnp.float32)
    loss, g = jax.value_and_grad(lambda w: jnp.mean((jnp.where(keep, x, 0.0) @ w) ** 2))(w)
    new = {"w": (w - 0.1 * g).astype(jnp.bfloat16), "count": state["count"] + 1,
           "seen": state["seen"] | (batch["tag"] > 0), "empty": state["empty"] * 2.0, "key": key}
    return new, {"loss": loss, "count": state["count"]}


def mixed_data(step: int):
    rng = np.random.default_rng(step)
    return {"x": rng.integers(0, 255, size=(5, 6), dtype=np.uint8), "tag": rng.integers(0, 2, size=(4,))}


def _plain(state, steps, step=mixed_step.fn, data=mixed_data):
    jitted = jax.jit(step)
    for k in range(steps):
        state, _ = jitted(state, data(k))
    return state


@pytest.mark.parametrize("policy", xshare.POLICIES)
def test_keys_ints_bools_bf16_and_empty_leaves_match_jit_under_every_policy(policy):
    specs = [mixed_step.bind(mixed_state(i, impl), mixed_data, steps=30, name=f"m{i}")
             for i, impl in enumerate(["threefry2x32", "rbg", "threefry2x32"])]
    with xshare.Runtime(policy=policy) as rt:
        handles = rt.submit_many(specs)
        rt.wait()
    for h, spec in zip(handles, specs):
        got = h.result()[0]
        assert got["key"].dtype == spec.state["key"].dtype and got["w"].dtype == jnp.bfloat16
        _keys_equal(got, _plain(spec.state, 30))


def test_a_fused_group_vmaps_over_key_data_and_each_member_keeps_its_own_stream():
    specs = [mixed_step.bind(mixed_state(i), mixed_data, steps=25, name=f"f{i}") for i in range(4)]
    with xshare.Runtime(fuse="always") as rt:
        handles = rt.submit_many(specs)
        rt.wait()
        assert rt._dispatcher.fused_member_steps == 4 * 25
    for h, spec in zip(handles, specs):
        got, ref = h.result()[0], _plain(spec.state, 25)
        # PRNG streams and counters are exact under vmap; the bf16 weights within the fused tolerance
        assert np.array_equal(jax.random.key_data(got["key"]), jax.random.key_data(ref["key"]))
        assert int(got["count"]) == 25 and np.array_equal(got["seen"], ref["seen"])
        assert np.max(np.abs(np.asarray(got["w"], np.float32) - np.asarray(ref["w"], np.float32))) < 2e-2


def test_swap_to_host_and_checkpoint_resume_keep_keys_exact(tmp_path):
    def slow(step):  # the pause must land mid-run
        time.sleep(0.002)
        return mixed_data(step)

    # (200 steps of >= 2 ms: the pause lands with ~0.4 s of them left. With 40, the job once
    # ended before the pause did, and resume() refused a done job: CI, jax 0.12, 2026-11-28.)
    spec = mixed_step.bind(mixed_state(3, "rbg"), slow, steps=200, name="ck")
    with xshare.Runtime(log_dir=tmp_path, checkpoint_every=10, dispatch_ahead=1) as rt:
        h = rt.submit(spec)
        while h.progress().steps_done < 12:
            time.sleep(0.001)
        rt.pause(h, offload=True)   # the state (key data included) goes to host memory
        rt.resume(h)
        rt.wait()
    _keys_equal(h.result()[0], _plain(spec.state, 200))
    # A fresh runtime resumes the finished job's checkpoint (key data and impl) exactly.
    from xshare.runtime.observe import checkpoint
    saved = checkpoint.load(tmp_path / "ck" / checkpoint.FILENAME, spec.state, job="ck")
    assert saved.done and jax.random.key_impl(saved.state["key"]) == "rbg"
    _keys_equal(saved.state, _plain(spec.state, 200))


def test_a_resumed_run_continues_to_the_same_final_state(tmp_path):
    def slow(step):  # the stop must land mid-run
        time.sleep(0.002)
        return mixed_data(step)

    spec = mixed_step.bind(mixed_state(5), slow, steps=150, name="rs")  # (the stop lands with ~0.3 s left)
    rt = xshare.Runtime(log_dir=tmp_path, checkpoint_every=5, dispatch_ahead=1)
    h = rt.submit(spec)
    while h.progress().steps_done < 10:
        time.sleep(0.001)
    rt.stop(checkpoint=True)  # mid-run: the checkpoint holds the key data of its step
    rt.close()
    assert h.progress().steps_done < 150
    with xshare.Runtime(log_dir=tmp_path, checkpoint_every=5, resume=True) as rt:
        h = rt.submit(spec)
        rt.wait()
    _keys_equal(h.result()[0], _plain(spec.state, 150))


def test_static_leaves_ride_along_and_python_numbers_the_step_changes_become_arrays():
    def act(x):
        return jnp.tanh(x)

    state = {"w": jnp.ones((3,), jnp.float32), "fn": act, "name": "model-a", "scale": 0.5, "step": 0}

    @xshare.job
    def step(state, batch):
        w = state["w"] - state["scale"] * state["fn"](batch)
        return {**state, "w": w, "step": state["step"] + 1}, {"w0": w[0]}

    data = lambda k: np.full((3,), 0.1 * (k + 1), np.float32)  # noqa: E731
    (got, _), = xshare.run([step.bind(state, data, steps=7)])
    assert got["fn"] is act and got["name"] == "model-a" and got["scale"] == 0.5  # static
    assert int(got["step"]) == 7 and got["step"].dtype == np.int32   # as jax.jit would carry it
    ref = dict(state)
    for k in range(7):
        ref = {**ref, "w": ref["w"] - 0.5 * jnp.tanh(data(k)), "step": ref["step"] + 1}
    np.testing.assert_array_equal(got["w"], ref["w"])


def test_a_key_in_the_batch_is_carried_too():
    @xshare.job
    def step(state, batch):
        return {"x": state["x"] + jax.random.uniform(batch["key"], (2,))}, {"s": state["x"].sum()}

    data = lambda k: {"key": jax.random.key(k)}  # noqa: E731
    state = {"x": jnp.zeros((2,), jnp.float32)}
    (got, _), = xshare.run([step.bind(state, data, steps=5)])
    np.testing.assert_array_equal(got["x"], _plain(state, 5, step.fn, data)["x"])


def _failing(step, state, data):
    with xshare.Runtime() as rt:
        h = rt.submit(step.bind(state, data, steps=3, name="bad"))
        rt.wait()
    assert h.status() == "failed"
    return h.error


def test_a_step_that_changes_a_leaf_dtype_is_refused_naming_the_leaf():
    @xshare.job
    def step(state, batch):
        return {"opt": {"mu": state["opt"]["mu"].astype(jnp.bfloat16)}}, {}

    err = _failing(step, {"opt": {"mu": jnp.ones((4, 4), jnp.float32)}}, lambda k: np.zeros(1))
    assert "state leaf 'opt.mu' changed from float32[4, 4] to bfloat16[4, 4]" in err


def test_metrics_that_are_not_scalars_are_refused_naming_the_metric():
    @xshare.job
    def step(state, batch):
        return state, {"per_example": batch}

    err = _failing(step, {"w": jnp.ones(2)}, lambda k: np.zeros((8,), np.float32))
    assert re.search(r"metric 'per_example' is float32\[8\]; metrics must be scalars", err)
