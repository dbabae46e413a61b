"""One job's failure never takes down another: the cause names the job, the others finish intact."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xshare
from tests.helpers import assert_trees_equal, linreg_data, linreg_state, linreg_step, plain_loop

STEPS = 40


def _healthy(n=2):
    return [linreg_step.bind(linreg_state(seed=i), linreg_data(seed=i), steps=STEPS, name=f"ok{i}")
            for i in range(n)]


def _run_with(bad_spec, policy="pack"):
    healthy = _healthy()
    with xshare.Runtime(policy=policy, memory="256MiB") as rt:
        handles = rt.submit_many([healthy[0], bad_spec, healthy[1]])
        rt.wait()
    ok = [handles[0], handles[2]]
    for spec, h in zip(healthy, ok):
        assert h.status() == "done", h.error
        assert_trees_equal(h.result()[0], plain_loop(spec)[0])
    return handles[1]


def _data_raising_at(k):
    data = linreg_data(seed=7)

    def gen():
        for i in range(STEPS):
            if i == k:
                raise RuntimeError("disk read failed")
            yield data(i)

    return gen()


@pytest.mark.parametrize("policy", ["pack", "fifo"])
def test_data_iterator_raising_on_5th_batch_fails_that_job_alone(policy):
    bad = linreg_step.bind(linreg_state(), _data_raising_at(4), steps=STEPS, name="bad-data")
    h = _run_with(bad, policy)
    assert h.status() == "failed"
    assert h.error == "its data raised while producing batch 4: RuntimeError: disk read failed"
    assert h.progress().steps_done == 4
    with pytest.raises(xshare.JobFailed, match=re.escape("job 'bad-data' failed: its data raised")):
        h.result()


def test_batch_with_wrong_shape_on_5th_step_fails_that_job_alone():
    data = linreg_data(seed=3)

    def bad_data(step):
        batch = data(step)
        if step == 4:
            batch = {"x": batch["x"][:, :5], "y": batch["y"]}
        return batch

    h = _run_with(linreg_step.bind(linreg_state(), bad_data, steps=STEPS, name="bad-shape"))
    assert h.status() == "failed"
    assert h.error.startswith("batch 4 does not match the compiled step: expected {'x': 'float32[16, 8]'")
    assert "got {'x': 'float32[16, 5]'" in h.error
    assert h.progress().steps_done == 4


def _raise_on_fifth(n):
    if int(n) == 4:
        raise ValueError("label out of range in batch 5")
    return np.zeros((), np.float32)


@xshare.job
def step_raising_on_5th(state, batch):
    # A host callback that raises inside the compiled step: the error appears on the device side,
    # when the step executes, not when it is dispatched.
    check = jax.pure_callback(_raise_on_fifth, jax.ShapeDtypeStruct((), jnp.float32), state["n"])
    new_state, metrics = linreg_step.fn(state, batch)
    return new_state, {"loss": metrics["loss"] + check}


def test_step_raising_on_its_5th_batch_fails_that_job_alone():
    h = _run_with(step_raising_on_5th.bind(linreg_state(), linreg_data(), steps=STEPS, name="raiser"))
    assert h.status() == "failed"
    assert h.error.startswith("step 4 raised: ")
    assert "label out of range in batch 5" in h.error
    assert h.progress().steps_done == 4


def test_a_run_that_raises_at_retirement_names_its_failing_step_and_keeps_the_steps_before_it():
    """A run (one-step calls back to back, ``Executor.run``) whose 3rd call raised on the
    device, found when the run retires (how the test above fails when the callback's error comes
    back after the run was dispatched: CI once saw "steps 0-7 raised"): the job fails naming step
    2, and steps 0 and 1, which completed, retire with their metrics."""
    from types import SimpleNamespace

    from xshare.runtime.engine.executor import Executor

    class Raises:
        def __array__(self, dtype=None, copy=None):
            raise RuntimeError("INTERNAL: CpuCallback error: label out of range")

    retired, failed = [], []
    fake = SimpleNamespace(retired_many=lambda job, step, values, t, t_end: retired.append((step, values)),
                           life=SimpleNamespace(fail=lambda job, cause, err: failed.append(cause)))
    rows = [np.array([1.0], np.float32), np.array([2.0], np.float32), Raises(), np.array([4.0], np.float32)]
    Executor._fail_call(fake, "job", 10, rows, 4, 0, 1, RuntimeError("the run as a whole"))
    assert [(step, values.tolist()) for step, values in retired] == [(10, [[1.0], [2.0]])]
    assert failed == ["step 12 raised: RuntimeError: INTERNAL: CpuCallback error: label out of range"]
    # A K-step call is one executable: it names its steps.
    failed.clear()
    Executor._fail_call(fake, "job", 16, np.zeros((4, 1)), 4, 0, 1, RuntimeError("boom"))
    assert failed == ["steps 16-19 raised: RuntimeError: boom"]


def test_a_fused_groups_run_that_raises_at_retirement_names_its_group_step_and_keeps_the_steps_before_it():
    """The same for a fused group's run (``GroupCalls.run``): its 3rd group call raised, found
    when the run retires. Every member fails (the call donated the whole stack), each naming its
    own step of that call, and the two group steps before it retire for every member, with
    their rows' metrics. A K-step group call is one executable: it names its steps."""
    from types import SimpleNamespace

    from xshare.runtime.engine.executor import Executor

    class Raises:
        def __array__(self, dtype=None, copy=None):
            raise RuntimeError("INTERNAL: CpuCallback error: label out of range")

    retired, failed, settled = [], [], []
    fake = SimpleNamespace(ring=0, life=SimpleNamespace(
        fail=lambda job, cause, err: failed.append((job.name, cause)), settle=lambda job: settled.append(job.name)))
    fake.retired = lambda job, step, values, t_end, finite: retired.append((job.name, step, values.tolist(), finite))
    fake._fail_group_call = lambda *a: Executor._fail_group_call(fake, *a)
    fake._retire_group_rows = lambda *a: Executor._retire_group_rows(fake, *a)
    fake._counted = lambda job, rows: False  # (each row through retired, as with an observer)

    def members():
        a, b = (SimpleNamespace(name=n, in_flight=1, error=None) for n in ("a", "b"))
        return SimpleNamespace(in_flight=1), {0: (a, 10), 2: (b, 30)}, (a, b)

    group, steps, (a, b) = members()
    row = lambda v: np.array([[v], [0.0], [v + 0.5]], np.float32)  # noqa: E731 - (capacity 3, 1 metric)
    Executor._retire_group(fake, group, steps, [row(1.0), row(2.0), Raises(), row(4.0)], 0, 1, 4)
    assert retired == [("a", 10, [1.0], True), ("b", 30, [1.5], True), ("a", 11, [2.0], True), ("b", 31, [2.5], True)]
    cause = "RuntimeError: INTERNAL: CpuCallback error: label out of range"
    assert failed == [("a", f"fused group step 12 raised: {cause}"), ("b", f"fused group step 32 raised: {cause}")]
    assert (a.in_flight, b.in_flight, group.in_flight, settled) == (0, 0, 0, ["a", "b"])

    retired.clear(), failed.clear()
    group, steps, _ = members()
    Executor._retire_group(fake, group, steps, Raises(), 0, 1, 4)
    assert retired == []
    assert failed == [("a", f"fused group steps 10-13 raised: {cause}"), ("b", f"fused group steps 30-33 raised: {cause}")]


def test_nan_policy_fail_stops_the_job_with_the_metric_named():
    @xshare.job
    def nan_at_3(state, batch):
        new_state, m = linreg_step.fn(state, batch)
        return new_state, {"loss": jnp.where(state["n"] == 3, jnp.nan, m["loss"])}

    h = _run_with(nan_at_3.bind(linreg_state(), linreg_data(), steps=STEPS, name="nan", nan_policy="fail"))
    assert h.status() == "failed"
    assert h.error == "non-finite metric loss=nan at step 3 (nan_policy='fail')"


@pytest.mark.parametrize("how", ["nan", "observer", "on_metrics"])
@pytest.mark.parametrize("dispatch_ahead", [None, 8])
def test_a_step_whose_own_metrics_fail_the_job_is_its_last_no_step_in_flight_behind_it_counts(how, dispatch_ahead):
    """The job fails at step 20 (a non-finite loss under nan_policy="fail", its observer or its
    on_metrics hook raising there); the steps dispatched behind it (later calls of its pipeline, later rows of
    its runs) completed on the device, but a plain loop that checked each step stopped at 20:
    none of them is observed, logged or counted."""
    @xshare.job
    def nan_at_20(state, batch):
        new_state, m = linreg_step.fn(state, batch)
        return new_state, {"loss": jnp.where(state["n"] == 20, jnp.nan, m["loss"])}

    seen: list[int] = []

    def observer(step, metrics, t_done):
        seen.append(step)
        if how == "observer" and step == 20:
            raise ValueError("stop here")

    def on_metrics(steps_done, metrics):
        if steps_done == 21:
            raise ValueError("stop here")

    step = nan_at_20 if how == "nan" else linreg_step
    spec = step.bind(linreg_state(), linreg_data(), steps=400, name="bad", observer=observer,
                     nan_policy="fail" if how == "nan" else "ignore")
    if how == "on_metrics":  # (a field xshare.tune sets: a study's pruner acts on the metrics)
        spec = dataclasses.replace(spec, on_metrics=on_metrics)
    with xshare.Runtime(policy="fifo", memory="256MiB", dispatch_ahead=dispatch_ahead) as rt:
        handle = rt.submit(spec)
        rt.wait()
    assert handle.status() == "failed"
    assert handle.error == {"nan": "non-finite metric loss=nan at step 20 (nan_policy='fail')",
                            "observer": "its observer raised at step 20: ValueError: stop here",
                            "on_metrics": "its on_metrics hook raised after step 21: ValueError: stop here"}[how]
    assert seen == list(range(21))
    assert handle.progress().steps_done == 21


def test_step_that_fails_to_trace_fails_alone_at_submit():
    @xshare.job
    def broken(state, batch):
        return state["missing"], {}

    h = _run_with(broken.bind(linreg_state(), linreg_data(), steps=STEPS, name="broken"))
    assert h.status() == "failed"
    assert h.error.startswith("could not compile its step: KeyError")


def test_a_job_end_listener_that_raises_takes_down_no_job():
    """Job-end listeners run on the dispatcher thread (xshare.tune's driver wakes on one): a
    listener's error is logged, and every job still ends as it would."""
    from tests.helpers import linreg_data, linreg_state, linreg_step

    heard = []

    def broken(job):
        heard.append(job.name)
        raise RuntimeError("listener bug")

    with xshare.Runtime(memory="64MiB") as rt:
        rt.add_end_listener(broken)
        handles = rt.submit_many([linreg_step.bind(linreg_state(seed=i), linreg_data(seed=i), steps=20,
                                                   name=f"l{i}") for i in range(3)])
        assert rt.wait(timeout=60), "a raising listener stopped the dispatcher"
    assert [h.status() for h in handles] == ["done"] * 3, [h.error for h in handles]
    assert sorted(heard) == ["l0", "l1", "l2"]


def test_a_failing_event_of_the_runtimes_own_threads_fails_the_jobs_loudly_instead_of_hanging(caplog):
    """What the compile pool posts (a job compiled, a group's program ready) nobody awaits: an
    exception there is a failure of the dispatcher's own work. It once landed in a future nobody
    read, and left a job "compiling" and a group that never stepped, with nothing in any log; now
    it is logged and every job ends failed, as for a failure in the dispatcher's loop."""
    import logging
    spec = linreg_step.bind(linreg_state(), linreg_data(), steps=1_000_000, name="long")
    with caplog.at_level(logging.ERROR, logger="xshare.runtime"), xshare.Runtime(memory="64MiB") as rt:
        handle = rt.submit(spec)

        def broken() -> None:  # (on the dispatcher thread)
            raise AssertionError("an admission bug")

        rt._dispatcher.post(broken)
        assert handle.wait(timeout=60), "the job kept running past a failed event"
    assert handle.status() == "failed" and "an admission bug" in handle.error
    assert "an admission bug" in caplog.text
