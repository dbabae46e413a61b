"""One model name at several versions: ``/versions/{v}`` routed (HTTP and gRPC), the default the
highest ready version, and one version undeployed under load losing no request to the others."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import xshare
from tests.serving.conftest import D_IN, mlp_params, mlp_predict, rows
from tests.serving.test_grpc import both  # noqa: F401

_PREDICT = jax.jit(mlp_predict)


def params_of(version: int) -> dict[str, np.ndarray]:
    return {k: (v * version).astype(np.float32) for k, v in mlp_params().items()}


def versioned(version: int) -> xshare.ModelSpec:
    # max_batch=1: every request runs alone, so each answer is predict over its row, whatever the load
    return xshare.model(mlp_predict, params_of(version), inputs={"x": ("float32", (D_IN,))}, name="ver",
                        max_batch=1, version=version)


def want(version: int, x: np.ndarray) -> np.ndarray:
    return np.asarray(_PREDICT(params_of(version), {"x": x})["y"])


def test_versions_are_routed_and_the_default_is_the_highest_ready(both):
    for v in (1, 2):
        both.deploy(versioned(v))
    with pytest.raises(xshare.XShareError, match="already deployed at version 2"):
        both.deploy(versioned(2))
    x = rows(1, seed=3)
    h = httpclient.InferenceServerClient(both.status_server.address)
    g = grpcclient.InferenceServerClient(both.grpc_server.address)
    try:
        assert h.get_model_metadata("ver")["versions"] == ["1", "2"]
        assert h.get_model_config("ver")["version_policy"] == {"specific": {"versions": [1, 2]}}
        assert h.get_model_metadata("ver", model_version="1")["versions"] == ["1"]
        for v, asked in ((1, "1"), (2, "2"), (2, "")):  # "" = the default: the highest
            i = httpclient.InferInput("x", [1, D_IN], "FP32")
            i.set_data_from_numpy(x)
            r = h.infer("ver", [i], model_version=asked)
            assert r.get_response()["model_version"] == str(v)
            np.testing.assert_array_equal(r.as_numpy("y"), want(v, x))
            gi = grpcclient.InferInput("x", [1, D_IN], "FP32")
            gi.set_data_from_numpy(x)
            r = g.infer("ver", [gi], model_version=asked)
            assert r.get_response().model_version == str(v)
            np.testing.assert_array_equal(r.as_numpy("y"), want(v, x))
        assert h.is_model_ready("ver", "1") and not h.is_model_ready("ver", "3") and g.is_model_ready("ver", "2")
        with pytest.raises(InferenceServerException, match="model 'ver' has no version 3 deployed; versions: 1, 2"):
            h.get_model_metadata("ver", model_version="3")
        stats = h.get_inference_statistics("ver")["model_stats"]  # a name's: each version's
        assert [(s["version"], s["inference_count"]) for s in stats] == [("1", 2), ("2", 4)]
        from xshare.runtime.observe import metrics
        from xshare.runtime.observe.schema import validate

        doc = both.snapshot()  # /status and /metrics tell the versions apart
        assert validate(doc) == [] and sorted((m["name"], m["version"]) for m in doc["models"] if m["name"] == "ver") \
            == [("ver", 1), ("ver", 2)]
        text = metrics.exposition(doc).decode()
        assert 'xshare_model_requests_total{model="ver",version="2"} 4.0' in text
        both.undeploy("ver", version=2)
        assert h.get_model_metadata("ver")["versions"] == ["1"]
        i = httpclient.InferInput("x", [1, D_IN], "FP32")
        i.set_data_from_numpy(x)
        assert h.infer("ver", [i]).get_response()["model_version"] == "1"
        with pytest.raises(KeyError, match="model 'ver' has no version 2 deployed; versions: 1"):
            both.undeploy("ver", version=2)
    finally:
        h.close()
        g.close()


def test_undeploying_a_version_under_load_loses_no_request_to_the_others(both):
    for v in (1, 2, 3):
        both.deploy(versioned(v))
    errors: list[str] = []
    answered: list[tuple[str, int, bool]] = []  # (version asked, version answering, sent after the undeploy)
    lock = threading.Lock()
    stop, undeployed = threading.Event(), threading.Event()

    def client(asked: str, seed: int) -> None:
        c = httpclient.InferenceServerClient(both.status_server.address)
        rng = np.random.default_rng(seed)
        try:
            while not stop.is_set():
                x = rng.normal(size=(1, D_IN)).astype(np.float32)
                i = httpclient.InferInput("x", [1, D_IN], "FP32")
                i.set_data_from_numpy(x)
                late = undeployed.is_set()
                try:
                    r = c.infer("ver", [i], model_version=asked)
                except InferenceServerException as err:
                    with lock:
                        errors.append(f"{asked or 'default'}: {err.status()} {err.message()}")
                    continue
                v = int(r.get_response()["model_version"])
                ok = np.array_equal(r.as_numpy("y"), want(v, x))
                with lock:
                    answered.append((asked, v, late))
                    if not ok or (asked and v != int(asked)):
                        errors.append(f"{asked or 'default'}: version {v} answered wrongly")
        finally:
            c.close()

    threads = [threading.Thread(target=client, args=(asked, k)) for k, asked in enumerate(("1", "2", "", ""))]
    for t in threads:
        t.start()
    try:
        while sum(1 for a, v, _ in answered if a == "" and v == 3) < 5:  # the default is version 3 ...
            assert all(t.is_alive() for t in threads), errors
            threading.Event().wait(0.01)
        both.undeploy("ver", version=3)  # ... until it leaves, with requests flowing to every version
        undeployed.set()
        while sum(late for *_, late in answered) < 40:
            assert all(t.is_alive() for t in threads), errors
            threading.Event().wait(0.01)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not any(t.is_alive() for t in threads)  # every request was answered
    assert errors == []
    after = [(a, v) for a, v, late in answered if late]
    assert {v for a, v in after if a == ""} == {2}  # the default moved to version 2
    assert {a for a, _ in after} == {"1", "2", ""}  # and every version kept answering
    assert both.model("ver", 1).stats()["errors_total"] == 0
