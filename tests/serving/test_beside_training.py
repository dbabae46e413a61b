"""Models next to training: a job beside busy models ends bit-identical to the same job alone;
models come and go while requests flow, and no answer is wrong or lost."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.helpers import assert_trees_equal, linreg_data, linreg_state, linreg_step, plain_loop
from tests.serving.conftest import (affine_spec, direct_mlp, infer_mlp, mlp_spec, rows,  # noqa: F401
                                    served)


class Load:
    """A client thread asking model ``name`` until stopped; checks every answer against predict."""

    def __init__(self, address: str, name: str = "mlp"):
        self.address, self.name = address, name
        self.answers, self.wrong, self.errors = 0, [], []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        c = httpclient.InferenceServerClient(self.address)
        k = 0
        try:
            while not self._stop.is_set():
                x = rows(1 + k % 5, seed=k)
                try:
                    got = infer_mlp(c, x)
                except InferenceServerException as err:
                    self.errors.append(str(err))
                    continue
                if not np.array_equal(got["y"], direct_mlp(x)["y"]):  # one client: each batch is its own
                    self.wrong.append(k)
                self.answers += 1
                k += 1
        finally:
            c.close()

    def __enter__(self) -> "Load":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.thread.join(60)


def test_a_training_job_beside_busy_models_ends_bit_identical_to_running_alone(served):
    spec = linreg_step.bind(linreg_state(seed=3), linreg_data(seed=3), steps=400, name="train")
    want_state, want_metrics = plain_loop(spec)
    with Load(served.status_server.address) as load:
        handle = served.submit(linreg_step.bind(linreg_state(seed=3), linreg_data(seed=3), steps=400,
                                                name="train"))
        state, metrics = handle.result()
    assert load.answers > 0 and load.wrong == [] and load.errors == []
    assert_trees_equal(state, want_state)
    assert_trees_equal(metrics, want_metrics)


def test_models_deploy_and_undeploy_while_requests_flow(served):
    import xshare

    with Load(served.status_server.address) as load:
        for round_ in range(3):
            h = served.deploy(affine_spec(name=f"extra{round_}"))
            a = np.ones((2, 3), np.float32)
            b = np.full((2, 3), round_, np.int32)
            np.testing.assert_array_equal(h.infer({"a": a, "b": b})["output"], a * np.arange(1, 4) + round_)
            served.undeploy(f"extra{round_}")
            assert f"extra{round_}" not in served.models
            with pytest.raises(xshare.InferError, match="is gone"):
                h.infer({"a": a, "b": b})
        seen = load.answers
        while load.answers < seen + 3:  # still answering after the churn
            load.thread.join(0.05)
    assert load.wrong == [] and load.errors == []
    s = served.snapshot()
    from xshare.runtime.observe import schema as status_mod

    assert status_mod.validate(s) == []
    assert [m["name"] for m in s["models"]] == ["mlp", "affine"]
    # every undeployed model gave its bytes back: the lanes hold the two deployed models only
    assert sorted(n for lane in s["lanes"] for n in lane["jobs"]) == ["model:affine", "model:mlp"]


def test_a_due_batch_goes_before_training_even_under_an_exclusive_policy(tmp_path):
    # fifo gives the device to one job until it ends; a model's batch still runs at the next
    # iteration boundary, and the job, which never stops, keeps stepping after it.
    import xshare

    with xshare.Runtime(policy="fifo", memory="128MiB") as rt:
        job = rt.submit(linreg_step.bind(linreg_state(), linreg_data(), steps=10**7, name="hog"))
        while job.progress().steps_done < 10:
            job.wait(timeout=0.01)
        m = rt.deploy(mlp_spec())
        for n in (1, 3):
            np.testing.assert_array_equal(m.infer({"x": rows(n)}, timeout=60)["y"], direct_mlp(rows(n))["y"])
        before = job.progress().steps_done
        while job.progress().steps_done <= before:
            job.wait(timeout=0.01)
        assert job.status() == "running"
        rt.cancel(job)


def test_stop_answers_every_queued_request_before_it_closes():
    import xshare

    rt = xshare.Runtime(memory="128MiB")
    m = rt.deploy(mlp_spec(max_delay_ms=600_000))  # not due for ten minutes
    waiting = [m.submit({"x": rows(2, seed=k)}) for k in range(3)]
    assert not any(f.done() for f in waiting)
    rt.stop()
    # answered as one batch: the three requests' 6 rows, in arrival order, in the 16-row bucket
    batch = direct_mlp(np.concatenate([rows(2, seed=k) for k in range(3)]), bucket=16)["y"]
    for k, f in enumerate(waiting):
        np.testing.assert_array_equal(f.result(0)["y"], batch[2 * k:2 * k + 2])
    with pytest.raises(xshare.InferError, match="takes no requests"):
        m.infer({"x": rows(1)})


def test_a_model_made_from_a_finished_jobs_final_state():
    import jax

    import xshare

    def predict(state, inputs):  # the trained linear model, served
        return {"y": inputs["x"] @ state["w"]}

    with xshare.Runtime(memory="128MiB") as rt:
        state, _ = rt.submit(linreg_step.bind(linreg_state(), linreg_data(), steps=50, name="fit")).result()
        want_state, _ = plain_loop(linreg_step.bind(linreg_state(), linreg_data(), steps=50))
        m = rt.deploy(xshare.model(predict, {"w": state["w"]}, inputs={"x": ("float32", (8,))}, name="fitted",
                                   max_batch=8))
        x = np.random.default_rng(0).normal(size=(5, 8)).astype(np.float32)
        got = m.infer({"x": x})["y"]
    assert_trees_equal(state, want_state)  # the job's final state, as a plain loop ends
    # Exactly predict over the rows as they ran: the request's 5, zero-padded to the 8-row bucket.
    padded = np.concatenate([x, np.zeros((3, 8), np.float32)])
    np.testing.assert_array_equal(got, np.asarray(jax.jit(predict)({"w": want_state["w"]}, {"x": padded})["y"])[:5])
    # Over the 5 rows alone XLA:CPU picks another kernel for this matrix-vector product: 1 ulp apart.
    np.testing.assert_allclose(got, np.asarray(jax.jit(predict)({"w": want_state["w"]}, {"x": x})["y"]),
                               rtol=1e-6, atol=1e-6)
