"""Lanes on execution streams of their own (``engine/streams.py``): on a CPU backend each lane's
calls carry a stream id of their own, so PJRT runs different lanes' calls side by side; a
lane's calls keep their order, and the results are the plain loop's whatever the streams."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import xshare
from xshare.runtime.engine import streams
from tests.helpers import assert_trees_equal, linreg_data, linreg_state, linreg_step, plain_loop

STEPS = 40


class Recording:
    """The thread's stream id setter, recording each id (and setting it for real)."""

    def __init__(self, real):
        self.real, self.ids = real, []

    def __call__(self, sid: int) -> None:
        self.ids.append(sid)
        self.real(sid)


@pytest.fixture
def recorded(monkeypatch):
    real = streams._setter()
    assert real is not None, "this jaxlib has no execution stream ids"
    rec = Recording(real)
    monkeypatch.setattr(streams, "_setter", lambda: rec)
    return rec


def make(seed: int, steps: int = STEPS):
    return linreg_step.bind(linreg_state(seed=seed), linreg_data(seed=seed), steps=steps, name=f"lin{seed}")


class FakeDevice:
    def __init__(self, platform: str):
        self.platform = platform


def test_ids_per_lane_only_on_a_cpu_and_only_when_they_change(recorded):
    cpu = streams.LaneStreams(FakeDevice("cpu"), streams=2)
    assert cpu.enabled
    assert [cpu.stream_of(lane) for lane in (0, 1, 2, 3, None)] == [1, 2, 1, 2, 1]  # 0: the thread's own
    for lane in (0, 0, 1, 3, 2):
        cpu.enter(lane)
    assert recorded.ids == [1, 2, 1]  # lane 3 is on lane 1's stream: nothing to set
    for off in (streams.LaneStreams(FakeDevice("gpu")), streams.LaneStreams(FakeDevice("cpu"), parallel=False)):
        assert not off.enabled
        off.enter(5)
    assert recorded.ids == [1, 2, 1]


@pytest.mark.parametrize("policy", ["pack", "fair"])
def test_lanes_step_on_streams_of_their_own_and_end_as_the_plain_loop(recorded, policy):
    specs = [make(seed) for seed in range(4)]
    with xshare.Runtime(policy, memory="256MiB", steps_per_call=1) as rt:
        handles = rt.submit_many(specs)
        rt.wait()
        lanes = {h.progress().lane for h in handles}
    assert len(lanes) == 4, lanes  # a lane each: memory is plentiful
    assert len(set(recorded.ids)) == min(4, streams.LaneStreams(jax.devices()[0]).streams)
    for handle, spec in zip(handles, specs):
        assert_trees_equal(handle.result()[0], plain_loop(spec)[0])


@pytest.mark.parametrize("policy, kw", [("pack", {"parallel_lanes": False}), ("fifo", {}),
                                        ("priority", {}), ("srtf", {})])
def test_one_stream_when_asked_and_under_the_policies_that_give_one_job_the_device(recorded, policy, kw):
    # (side by side, the next job's first call would share the cores with the running job's
    # last: under priority, the urgent job's)
    specs = [make(seed) for seed in range(3)]
    with xshare.Runtime(policy, memory="256MiB", **kw) as rt:
        handles = rt.submit_many(specs)
        rt.wait()
    assert recorded.ids == []
    for handle, spec in zip(handles, specs):
        assert_trees_equal(handle.result()[0], plain_loop(spec)[0])


def test_parallel_lanes_must_be_a_bool():
    with pytest.raises(ValueError, match="parallel_lanes='yes' must be True"):
        xshare.Runtime(parallel_lanes="yes")


def test_a_model_batch_runs_on_its_own_lanes_stream_beside_training(recorded):
    from tests.serving.conftest import direct_mlp, mlp_spec

    x = np.random.default_rng(0).normal(size=(3, 16)).astype(np.float32)
    with xshare.Runtime(memory="256MiB") as rt:
        job = rt.submit(make(0, steps=10**7))
        while job.progress().steps_done < 10:
            job.wait(timeout=0.01)
        m = rt.deploy(mlp_spec())
        before = len(recorded.ids)
        got = m.infer({"x": x}, timeout=60)["y"]
        lane = m._m.lane
        rt.cancel(job)
    assert lane != job.progress().lane
    np.testing.assert_array_equal(got, direct_mlp(x)["y"])
    assert streams.LaneStreams(jax.devices()[0]).stream_of(lane) in recorded.ids[before:]
