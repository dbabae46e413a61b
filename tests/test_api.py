"""The public API contract (docs/reference/api.md): names, shapes, ownership, errors."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xshare
from tests.helpers import assert_trees_equal, linreg_data, linreg_state, linreg_step, plain_loop


def test_public_names_exist():
    for name in ("job", "Runtime", "JobHandle", "run", "AdmissionError", "JobFailed", "POLICIES"):
        assert hasattr(xshare, name), name
    assert xshare.POLICIES == ("fifo", "pack", "srtf", "fair", "priority")


def test_decorated_step_is_callable_directly_and_donates_state():
    state = linreg_state()
    batch = linreg_data()(0)
    new_state, metrics = linreg_step(state, batch)
    assert int(new_state["n"]) == 1 and np.isfinite(float(metrics["loss"]))
    assert state["w"].is_deleted(), "the direct call is jit with the state donated"


def test_decorator_with_arguments():
    @xshare.job(name="custom", donate=False)
    def step(state, batch):
        return state + batch, {"s": state.sum()}

    x = jnp.ones(3)
    step(x, jnp.ones(3))
    assert step.name == "custom" and not x.is_deleted()


def test_bind_does_not_take_ownership_of_the_state_it_is_given():
    state = linreg_state()
    before = jax.device_get(state)
    spec = linreg_step.bind(state, linreg_data(), steps=10, name="own")
    with xshare.Runtime(memory="64MiB") as rt:
        h = rt.submit(spec)
    final, _ = h.result()
    # The caller's arrays are intact and usable; the runtime stepped its own copy.
    assert not state["w"].is_deleted()
    assert_trees_equal(jax.device_get(state), before)
    assert_trees_equal(final, plain_loop(spec)[0])


def test_bind_does_not_consume_device_batches_the_user_holds():
    batches = [jax.device_put(linreg_data()(k)) for k in range(5)]
    spec = linreg_step.bind(linreg_state(), batches, name="iter")
    (final, metrics), = xshare.run([spec], memory="64MiB")
    assert not any(b["x"].is_deleted() for b in batches)
    assert int(final["n"]) == 5


def test_run_returns_results_in_order_and_reports_failures():
    specs = [linreg_step.bind(linreg_state(seed=i), linreg_data(seed=i), steps=5, name=f"r{i}")
             for i in range(2)]
    results = xshare.run(specs, policy="srtf", memory="64MiB")
    assert [int(s["n"]) for s, _ in results] == [5, 5]

    def broken(step):
        raise OSError("gone")

    bad = linreg_step.bind(linreg_state(), broken, steps=5, name="bad")
    with pytest.raises(xshare.JobFailed, match=re.escape("job 'bad' failed: its data raised")):
        xshare.run([bad], memory="64MiB")
    out = xshare.run([bad.replace(name="bad2"), specs[0].replace(name="good")], memory="64MiB",
                     return_exceptions=True)
    assert isinstance(out[0], xshare.JobFailed) and int(out[1][0]["n"]) == 5


def test_zero_steps_is_done_with_the_initial_state():
    spec = linreg_step.bind(linreg_state(), linreg_data(), steps=0, name="zero")
    (state, metrics), = xshare.run([spec], memory="64MiB")
    assert metrics is None and int(state["n"]) == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(steps=-1), "steps=-1 must be a non-negative int, or None to run until data ends"),
    (dict(steps=None), "data is a callable step -> batch, so steps must be given (it never runs out)"),
    (dict(steps=3, priority="high"), "priority='high' must be an int (larger runs first)"),
    (dict(steps=3, nan_policy="skip"), "nan_policy='skip'; choose one of ignore, fail"),
])
def test_bind_rejects_bad_arguments_with_the_value_and_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        linreg_step.bind(linreg_state(), linreg_data(), **kwargs)


def test_runtime_rejects_bad_arguments():
    with pytest.raises(ValueError, match=re.escape("unknown policy 'lifo'; choose one of: fifo, pack, srtf, fair, priority")):
        xshare.Runtime(policy="lifo")
    with pytest.raises(ValueError, match=re.escape("cannot read memory size '4 gigs'")):
        xshare.Runtime(memory="4 gigs")
    with pytest.raises(ValueError, match=re.escape("quantum=0 must be an int >= 1")):
        xshare.Runtime(quantum=0)


def test_duplicate_job_names_are_refused():
    spec = linreg_step.bind(linreg_state(), linreg_data(), steps=2, name="dup")
    with xshare.Runtime(memory="64MiB") as rt:
        rt.submit(spec)
        with pytest.raises(ValueError, match=re.escape("a job named 'dup' was already submitted")):
            rt.submit(spec)


def test_a_job_that_can_never_fit_raises_admission_error_with_the_numbers():
    spec = linreg_step.bind({"w": jnp.zeros((1024, 1024)), "n": jnp.zeros((), jnp.int32)},
                            lambda k: {"x": np.zeros((16, 1024), np.float32), "y": np.zeros((16, 1), np.float32)},
                            steps=2, name="huge")
    with xshare.Runtime(memory="1MiB") as rt:
        h = rt.submit(spec)  # returns at once: the footprint is known once it is compiled
        rt.wait()
        assert h.status() == "failed" and rt.arena.queue == () and rt.arena.lanes() == ()
        with pytest.raises(xshare.AdmissionError, match=r"job 'huge' needs .* but the arena holds 1\.0 MiB"):
            h.result()


def test_a_job_with_no_state_and_no_metrics_still_runs():
    @xshare.job
    def count_nothing(state, batch):
        return state, {}

    (state, metrics), = xshare.run([count_nothing.bind({}, lambda k: {}, steps=3, name="empty")], memory="1MiB")
    assert state == {} and metrics == {}
