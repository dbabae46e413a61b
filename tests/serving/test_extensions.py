"""Triton's model configuration and statistics extensions, read by tritonclient's own calls
(``get_model_config``, ``get_inference_statistics``) over HTTP and gRPC: one document, two wires."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

import xshare
from tests.serving.conftest import D_IN, D_OUT, infer_mlp, rows
from tests.serving.test_grpc import both, gclient  # noqa: F401
from tests.serving.test_oip import raising_predict


@pytest.fixture
def hclient(both):
    c = httpclient.InferenceServerClient(both.status_server.address)
    yield c
    c.close()


def _ints(doc):
    """protobuf's JSON writes 64-bit ints as strings: read them back as ints to compare."""
    if isinstance(doc, dict):
        return {k: v if k == "string_value" else _ints(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_ints(v) for v in doc]
    return int(doc) if isinstance(doc, str) and doc.lstrip("-").isdigit() else doc


def test_model_config_names_batch_size_tensors_and_the_batchers_settings(both, hclient, gclient):
    config = hclient.get_model_config("mlp")
    assert config["name"] == "mlp" and config["max_batch_size"] == 16 and config["backend"] == "xshare"
    assert config["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [D_IN]}]
    assert config["output"] == [{"name": "argmax", "data_type": "TYPE_INT32", "dims": []},
                                {"name": "y", "data_type": "TYPE_FP32", "dims": [D_OUT]}]
    assert config["dynamic_batching"] == {"max_queue_delay_microseconds": 20_000}  # max_delay_ms=20
    assert config["parameters"]["xshare.buckets"] == {"string_value": "1,4,16"}
    over_grpc = _ints(gclient.get_model_config("mlp", as_json=True)["config"])
    # protobuf's JSON leaves out empty fields (the argmax output's dims [])
    assert over_grpc["output"][0] == {"name": "argmax", "data_type": "TYPE_INT32"}
    over_grpc["output"][0]["dims"] = []
    assert over_grpc == config
    with pytest.raises(Exception, match="no model 'ghost'"):
        hclient.get_model_config("ghost")


def test_statistics_count_requests_batches_and_durations(both, hclient, gclient):
    for n in (1, 3, 5):
        infer_mlp(hclient, rows(n, seed=n))
    i = grpcclient.InferInput("x", [2, D_IN], "FP32")
    i.set_data_from_numpy(rows(2))
    gclient.infer("mlp", [i])
    doc = hclient.get_inference_statistics("mlp")
    (s,) = doc["model_stats"]
    assert s["name"] == "mlp" and s["version"] == "1"
    assert s["inference_count"] == 1 + 3 + 5 + 2 and s["execution_count"] == 4  # lone requests: a batch each
    st = s["inference_stats"]
    assert st["success"]["count"] == 4 and st["fail"] == {"count": 0, "ns": 0}
    for key in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert st[key]["count"] == 4 and st[key]["ns"] > 0, key
    # a request's time in the server covers its queue and compute times
    assert st["success"]["ns"] >= st["queue"]["ns"] + st["compute_infer"]["ns"]
    assert sorted(b["batch_size"] for b in s["batch_stats"]) == [1, 2, 3, 5]
    assert all(b["compute_infer"]["count"] == 1 for b in s["batch_stats"])
    assert s["last_inference"] > 0
    assert _ints(gclient.get_inference_statistics("mlp", as_json=True))["model_stats"][0]["inference_count"] == 11
    every = hclient.get_inference_statistics()  # no name: every deployed model's
    assert [m["name"] for m in every["model_stats"]] == ["affine", "mlp"]
    assert [m["name"] for m in _ints(gclient.get_inference_statistics(as_json=True))["model_stats"]] == ["affine", "mlp"]


def test_a_failed_batch_counts_as_fail(both, hclient):
    both.deploy(xshare.model(raising_predict, {"s": np.float32(2)}, inputs={"x": ("float32", (2,))},
                             name="fragile", max_batch=4, max_delay_ms=0))
    i = httpclient.InferInput("x", [1, 2], "FP32")
    i.set_data_from_numpy(np.full((1, 2), 666, np.float32))
    with pytest.raises(Exception, match="poisoned row"):
        hclient.infer("fragile", [i])
    st = hclient.get_inference_statistics("fragile")["model_stats"][0]["inference_stats"]
    assert st["fail"]["count"] == 1 and st["fail"]["ns"] > 0 and st["success"]["count"] == 0
