"""models/inference.py: Poisson requests, latency = step completion - request arrival."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

import xshare
from xshare.models import inference
from tests.helpers import assert_trees_equal


class FakeClock:
    """A clock that only moves when someone sleeps on it (or the test moves it)."""

    def __init__(self, t: float = 100.0):
        self.t = t
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, dt: float) -> None:
        self.slept.append(dt)
        self.t += dt


def fake_requests(batch=4, rate=100.0, seed=0):
    clock = FakeClock()
    inputs = lambda step: np.full((batch, 2), step, np.float32)  # noqa: E731
    return inference.PoissonRequests(inputs, batch=batch, rate=rate, seed=seed, clock=clock,
                                     sleep=clock.sleep), clock


def test_each_batch_waits_for_its_last_request_and_latency_is_done_minus_arrival():
    req, clock = fake_requests(batch=4)
    out = req(0)
    arrivals = req.arrivals(0)
    assert np.all(np.diff(arrivals) > 0) and arrivals[0] > 100.0     # clock started at 100.0
    assert clock.t == pytest.approx(arrivals[-1])                     # slept until the last one
    np.testing.assert_array_equal(out["x"], np.zeros((4, 2)))
    metrics = req.observer(0, {}, t_done=clock.t + 0.010)             # the step took 10 ms
    latencies_ms = 1e3 * (clock.t + 0.010 - arrivals)
    assert metrics["requests"] == 4
    assert metrics["latency_p50_ms"] == pytest.approx(np.percentile(latencies_ms, 50))
    assert metrics["latency_p99_ms"] == pytest.approx(np.percentile(latencies_ms, 99))
    assert metrics["batch_latency_ms"] == pytest.approx(latencies_ms.mean())
    assert metrics["latency_p99_ms"] >= metrics["latency_p50_ms"] >= 10.0


def test_percentiles_cover_all_requests_served_so_far():
    req, clock = fake_requests(batch=3, seed=5)
    all_ms = []
    for step in range(20):
        req(step)
        done = clock.t + 0.001 * (step % 4)                           # uneven service times
        all_ms.extend(1e3 * (done - req.arrivals(step)))
        metrics = req.observer(step, {}, t_done=done)
        assert metrics["requests"] == 3 * (step + 1)
        assert metrics["latency_p50_ms"] == pytest.approx(np.percentile(all_ms, 50))
        assert metrics["latency_p99_ms"] == pytest.approx(np.percentile(all_ms, 99))


def test_arrivals_are_a_seeded_poisson_process_at_the_given_rate():
    req, _ = fake_requests(batch=1000, rate=250.0, seed=1)
    gaps = np.diff(np.concatenate([[0.0], req.arrivals(0) - req.arrivals(0)[0]]))[1:]
    assert gaps.mean() == pytest.approx(1 / 250.0, rel=0.1)
    assert gaps.std() == pytest.approx(1 / 250.0, rel=0.15)            # exponential: std = mean
    again, _ = fake_requests(batch=1000, rate=250.0, seed=1)
    np.testing.assert_array_equal(np.diff(req.arrivals(0)), np.diff(again.arrivals(0)))


def test_a_resumed_job_starts_its_clock_at_the_batch_it_resumes_from():
    req, clock = fake_requests(batch=4, rate=100.0)
    req(50)                                     # no 50 batches' worth of sleep before it
    assert sum(clock.slept) < 1.0


@pytest.mark.parametrize("model", inference.MODELS)
def test_inference_job_under_the_runtime_reports_latency_and_keeps_its_params(model, tmp_path):
    steps, batch = 20, 4
    spec = inference.make_job(model=model, rate=400.0, batch=batch, steps=steps)
    params = jax.device_get(spec.state)
    with xshare.Runtime(policy="pack", memory="1GiB", log_dir=tmp_path) as rt:
        handle = rt.submit(spec)
        rt.wait()
    state, metrics = handle.result()
    assert handle.status() == "done", handle.error
    # The step hands back the donated params: after 20 steps they are the initial ones, exactly.
    assert_trees_equal(state, params)
    assert metrics["requests"] == steps * batch
    assert 0 < metrics["latency_p50_ms"] <= metrics["latency_p99_ms"]
    assert 0 < metrics["batch_latency_ms"]
    assert 0.1 <= metrics["mean_max_prob"] <= 1.0                        # 10 classes
    rows = (tmp_path / spec.name / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == steps and '"latency_p99_ms"' in rows[-1]


def test_make_job_rejects_unknown_models_and_bad_rates():
    with pytest.raises(ValueError, match=re.escape("inference: model='vit'; choose one of mlp, cnn")):
        inference.make_job(model="vit")
    with pytest.raises(ValueError, match=re.escape("inference: rate=0 must be a positive number")):
        inference.make_job(rate=0)
    spec = inference.make_job(steps=3, seed=1)
    assert spec.meta == {"model": "infer-mlp", "rate": 200.0, "batch": 8, "seed": 1}
    assert spec.observer is not None and spec.steps == 3


@pytest.mark.parametrize("model", inference.MODELS)
def test_make_model_deploys_and_answers_like_its_predict(model):
    import jax

    spec = inference.make_model(model=model, max_batch=4, seed=2)
    assert spec.name == f"{model}-s2" and spec.buckets == (1, 4)
    dtype, shape = spec.inputs["x"]
    x = np.random.default_rng(0).normal(size=(3, *shape)).astype(dtype)
    with xshare.Runtime(memory="256MiB") as rt:
        got = rt.deploy(spec).infer({"x": x})
    want = jax.jit(spec.predict)(spec.params, {"x": x})
    np.testing.assert_array_equal(got["probs"], np.asarray(want["probs"]))
    np.testing.assert_array_equal(got["label"], np.asarray(want["label"]))
    assert got["label"].dtype == np.int32 and np.allclose(got["probs"].sum(axis=1), 1, atol=1e-5)
