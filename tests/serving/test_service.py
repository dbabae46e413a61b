"""``xshare serve --model`` end to end, in a subprocess: tritonclient against two models deployed
at start, ``xshare deploy`` / ``xshare undeploy`` with the token, per-model /metrics, SIGTERM."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.service.conftest import Served
from tests.serving.conftest import D_IN, direct_mlp, infer_mlp, rows


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    s = Served(tmp_path_factory.mktemp("serving"),
               "--model", "xshare.models.inference:make_model", "--set", "max_batch=8", "--set", "name=zoo",
               "--model", "tests.serving.factories:make_mlp", "--grpc-port", "0")
    yield s
    s.stop()


def test_models_deployed_at_start_answer_tritonclient_bit_identically(service):
    from xshare.models import inference

    c = httpclient.InferenceServerClient(service.address)
    try:
        assert c.is_server_ready() and c.is_model_ready("zoo") and c.is_model_ready("mlp")
        meta = c.get_model_metadata("zoo")
        assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 32]}]
        x = np.random.default_rng(5).normal(size=(3, 32)).astype(np.float32)
        i = httpclient.InferInput("x", [3, 32], "FP32")
        i.set_data_from_numpy(x)
        r = c.infer("zoo", [i])
        got = {n: np.array(r.as_numpy(n)) for n in ("probs", "label")}
        spec = inference.make_model(max_batch=8)  # the same factory, computed directly here,
        padded = np.concatenate([x, np.zeros((1, 32), np.float32)])  # over the 4-row bucket it ran in
        want = jax.jit(spec.predict)(spec.params, {"x": padded})
        np.testing.assert_array_equal(got["probs"], np.asarray(want["probs"])[:3])
        np.testing.assert_array_equal(got["label"], np.asarray(want["label"])[:3])
        for n in (1, 5, 16):
            np.testing.assert_array_equal(infer_mlp(c, rows(n, seed=n))["y"], direct_mlp(rows(n, seed=n))["y"])
    finally:
        c.close()


def test_deploy_and_undeploy_need_the_token_and_work_from_the_cli(service):
    code, doc = service.http("POST", "/models", b'{"entry": "tests.serving.factories:make_mlp"}', token=None)
    assert code == 401
    code, doc = service.http("POST", "/models", b'{"entry": "tests.serving.factories:make_mlp"}', token="wrong")
    assert code == 401
    code, doc = service.http("DELETE", "/models/mlp", token=None)
    assert code == 401
    code, doc = service.http("POST", "/models", b'{"entry": "tests.serving.factories:nope"}')
    assert code == 422 and "has no function 'nope'" in doc["error"]
    code, doc = service.http("POST", "/models", b'{"entry": "tests.serving.factories:make_mlp"}')
    assert code == 409 and "already deployed" in doc["error"]

    done = service.cli("deploy", "tests.serving.factories:make_mlp", "--set", "max_batch=4", "--name", "extra")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "extra"
    c = httpclient.InferenceServerClient(service.address)
    try:
        assert c.is_model_ready("extra")
        i = httpclient.InferInput("x", [5, D_IN], "FP32")
        i.set_data_from_numpy(rows(5))
        with pytest.raises(InferenceServerException, match="1..4"):  # its own max_batch
            c.infer("extra", [i])
        np.testing.assert_array_equal(infer_mlp_named(c, "extra", rows(4)), direct_mlp(rows(4))["y"])
        done = service.cli("undeploy", "extra")
        assert done.returncode == 0 and done.stdout.strip() == "extra: undeployed", done.stderr
        assert not c.is_model_ready("extra")
        done = service.cli("undeploy", "extra")
        assert done.returncode == 1 and "no model 'extra' is deployed" in done.stderr
    finally:
        c.close()


def test_the_same_models_answer_tritonclient_grpc_on_the_grpc_port(service):
    import json

    import tritonclient.grpc as grpcclient

    address = json.loads((service.run_dir / "service.json").read_text())["grpc_address"]
    g = grpcclient.InferenceServerClient(address)
    try:
        assert g.is_server_ready() and g.is_model_ready("zoo") and g.is_model_ready("mlp")
        for n in (1, 3, 16):
            x = rows(n, seed=30 + n)
            i = grpcclient.InferInput("x", list(x.shape), "FP32")
            i.set_data_from_numpy(x)
            np.testing.assert_array_equal(g.infer("mlp", [i]).as_numpy("y"), direct_mlp(x)["y"])
        config = g.get_model_config("mlp", as_json=True)["config"]
        assert config["max_batch_size"] == 16 and config["input"] == [{"name": "x", "data_type": "TYPE_FP32",
                                                                      "dims": [str(D_IN)]}]
    finally:
        g.close()


def test_a_second_version_deploys_beside_the_first_and_undeploys_alone(service):
    done = service.cli("deploy", "tests.serving.factories:make_mlp", "--set", "max_batch=4", "--version", "2")
    assert done.returncode == 0 and done.stdout.strip() == "mlp", done.stderr
    c = httpclient.InferenceServerClient(service.address)
    try:
        assert c.get_model_metadata("mlp")["versions"] == ["1", "2"]
        i = httpclient.InferInput("x", [2, D_IN], "FP32")
        i.set_data_from_numpy(rows(2))
        assert c.infer("mlp", [i]).get_response()["model_version"] == "2"  # the highest ready
        assert c.get_model_config("mlp", model_version="2")["max_batch_size"] == 4
        assert c.get_model_config("mlp", model_version="1")["max_batch_size"] == 16
        done = service.cli("undeploy", "mlp", "--version", "2")
        assert done.returncode == 0 and done.stdout.strip() == "mlp version 2: undeployed", done.stderr
        assert c.get_model_metadata("mlp")["versions"] == ["1"]
        np.testing.assert_array_equal(infer_mlp(c, rows(3))["y"], direct_mlp(rows(3))["y"])
        done = service.cli("undeploy", "mlp", "--version", "2")
        assert done.returncode == 1 and "model 'mlp' has no version 2 deployed; versions: 1" in done.stderr
    finally:
        c.close()


def infer_mlp_named(c, name: str, x: np.ndarray) -> np.ndarray:
    i = httpclient.InferInput("x", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    return np.array(c.infer(name, [i]).as_numpy("y"))


def test_metrics_count_each_models_requests_and_sigterm_stops_cleanly(service):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    c = httpclient.InferenceServerClient(service.address)
    try:
        for k in range(3):
            infer_mlp(c, rows(2, seed=k))
    finally:
        c.close()
    with urllib.request.urlopen(f"http://{service.address}/metrics", timeout=30) as resp:
        fams = {f.name: f for f in text_string_to_metric_families(resp.read().decode())}
    counts = {s.labels["model"]: s.value for s in fams["xshare_model_requests"].samples
              if s.name == "xshare_model_requests_total"}
    assert counts["mlp"] >= 3 and "zoo" in counts
    assert fams["xshare_model_request_seconds"].type == "histogram"
    top = service.cli("top", "--once", "--address", service.address)
    assert top.returncode == 0, top.stderr
    assert "Models (Open Inference Protocol" in top.stdout
    row = next(line for line in top.stdout.splitlines() if line.strip("│┃ ").startswith("mlp "))
    assert "ready" in row
    rc, out, err = service.terminate()
    assert rc == 0, err


@pytest.mark.slow
def test_resume_deploys_again_the_models_that_were_deployed(tmp_path):
    first = Served(tmp_path, "--model", "tests.serving.factories:make_mlp")
    try:
        assert first.cli("deploy", "tests.serving.factories:make_mlp", "--name", "kept").returncode == 0
        assert first.cli("deploy", "tests.serving.factories:make_mlp", "--name", "dropped").returncode == 0
        assert first.cli("undeploy", "dropped").returncode == 0
        assert first.cli("deploy", "tests.serving.factories:make_mlp", "--name", "kept", "--version", "3").returncode == 0
        rc, _, err = first.terminate()
        assert rc == 0, err
    finally:
        first.stop()
    second = Served(tmp_path, "--resume", "--model", "tests.serving.factories:make_mlp")
    try:
        c = httpclient.InferenceServerClient(second.address)
        try:
            assert c.is_model_ready("mlp") and c.is_model_ready("kept") and not c.is_model_ready("dropped")
            assert c.get_model_metadata("kept")["versions"] == ["1", "3"]  # every version comes back
            np.testing.assert_array_equal(infer_mlp_named(c, "kept", rows(3)), direct_mlp(rows(3))["y"])
        finally:
            c.close()
    finally:
        second.stop()
