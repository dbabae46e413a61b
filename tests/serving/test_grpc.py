"""tritonclient.grpc, unmodified, against a runtime serving over the Open Inference Protocol's
gRPC beside HTTP: readiness, metadata, answers bit-identical to predict computed directly, gRPC
and HTTP requests sharing one batch, and every refusal with its gRPC status code."""

from __future__ import annotations

import functools
import sys
import threading

import grpc
import jax
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

import xshare
from tests.serving.conftest import (AFFINE_PARAMS, D_IN, D_OUT, affine_predict, direct_mlp, infer_input,
                                    mlp_spec, rows, send_request, serving_runtime)
from tests.serving.test_oip import raising_predict


@pytest.fixture
def both(tmp_path, monkeypatch):
    """A runtime serving HTTP and gRPC on free loopback ports, with both models deployed."""
    yield from serving_runtime(tmp_path, monkeypatch, status_port=0, grpc_port=0)


@pytest.fixture
def gclient(both):
    c = grpcclient.InferenceServerClient(both.grpc_server.address)
    yield c
    c.close()


def grpc_mlp(client, x: np.ndarray, model: str = "mlp") -> dict[str, np.ndarray]:
    r = client.infer(model, [infer_input(grpcclient, x)], outputs=[grpcclient.InferRequestedOutput(n) for n in ("y", "argmax")])
    return {n: np.array(r.as_numpy(n)) for n in ("y", "argmax")}


def code_of(call) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value.status(), info.value.message()


def test_readiness_and_metadata_over_grpc(both, gclient):
    assert gclient.is_server_live() and gclient.is_server_ready()
    assert gclient.is_model_ready("mlp") and gclient.is_model_ready("affine")
    assert not gclient.is_model_ready("ghost")
    meta = gclient.get_model_metadata("mlp", as_json=True)  # protobuf's JSON: int64 as strings
    assert meta["name"] == "mlp" and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": ["-1", str(D_IN)]}]
    assert meta["outputs"] == [{"name": "argmax", "datatype": "INT32", "shape": ["-1"]},
                               {"name": "y", "datatype": "FP32", "shape": ["-1", str(D_OUT)]}]
    server = gclient.get_server_metadata()
    assert server.name == "xshare" and "statistics" in server.extensions


def test_answers_equal_predict_on_the_same_padded_batch_in_every_bucket(both, gclient):
    for n in (1, 2, 3, 4, 5, 16):  # buckets 1, 4, 4, 4, 16, 16
        x = rows(n, seed=n)
        got, want = grpc_mlp(gclient, x), direct_mlp(x)
        assert got["y"].shape == (n, D_OUT) and got["y"].dtype == np.float32 and got["argmax"].dtype == np.int32
        np.testing.assert_array_equal(got["y"], want["y"])  # bit for bit
        np.testing.assert_array_equal(got["argmax"], want["argmax"])
    a = np.random.default_rng(1).normal(size=(3, 3)).astype(np.float32)
    b = np.arange(9, dtype=np.int32).reshape(3, 3)
    ins = [grpcclient.InferInput("a", [3, 3], "FP32"), grpcclient.InferInput("b", [3, 3], "INT32")]
    ins[0].set_data_from_numpy(a)
    ins[1].set_data_from_numpy(b)
    got = gclient.infer("affine", ins)
    padded = {k: np.concatenate([v, np.zeros((1, 3), v.dtype)]) for k, v in (("a", a), ("b", b))}  # bucket 4
    np.testing.assert_array_equal(got.as_numpy("output"),
                                  np.asarray(jax.jit(affine_predict)(AFFINE_PARAMS, padded))[:3])


def test_typed_contents_from_the_generated_stub(both):
    # tritonclient always sends raw bytes; the protocol's typed contents are what other clients
    # (and Triton's own examples) send: the stub generated from the same proto sends them here.
    x = rows(2, seed=4)
    with grpc.insecure_channel(both.grpc_server.address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        req = service_pb2.ModelInferRequest(model_name="mlp", id="req-7")
        t = req.inputs.add(name="x", datatype="FP32", shape=[2, D_IN])
        t.contents.fp32_contents.extend(x.ravel().tolist())
        resp = stub.ModelInfer(req, timeout=30)
    assert resp.id == "req-7" and resp.model_name == "mlp"
    outs = {o.name: (o, raw) for o, raw in zip(resp.outputs, resp.raw_output_contents)}
    y = np.frombuffer(outs["y"][1], np.float32).reshape(list(outs["y"][0].shape))
    np.testing.assert_array_equal(y, direct_mlp(x)["y"])


def test_grpc_and_http_requests_share_one_batch(both):
    # Both protocols go through the same queue: two rows by gRPC and two by HTTP fill the 4-row
    # batch of a model that waits ten minutes for a full one; it runs once, for all four.
    both.deploy(mlp_spec(name="shared", max_batch=4, max_delay_ms=600_000, buckets=(4,)))
    xs = [rows(2, seed=20), rows(2, seed=21)]
    got: list = [None, None]

    def by_grpc():
        c = grpcclient.InferenceServerClient(both.grpc_server.address)
        try:
            got[0] = grpc_mlp(c, xs[0], "shared")["y"]
        finally:
            c.close()

    def by_http():
        c = httpclient.InferenceServerClient(both.status_server.address)
        try:
            i = httpclient.InferInput("x", [2, D_IN], "FP32")
            i.set_data_from_numpy(xs[1])
            got[1] = np.array(c.infer("shared", [i]).as_numpy("y"))
        finally:
            c.close()

    threads = [threading.Thread(target=by_grpc), threading.Thread(target=by_http)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stats = both.model("shared").stats()
    assert stats["batches_total"] == 1 and stats["requests_total"] == 2
    for i in (0, 1):  # each its own rows of predict over the four rows, wherever they sat
        batch = np.concatenate([xs[i], xs[1 - i]])
        np.testing.assert_array_equal(got[i], direct_mlp(batch, bucket=4)["y"][:2])


def test_refusals_map_to_grpc_status_codes_and_the_models_serve_on(both, gclient):
    send = functools.partial(send_request, gclient, grpcclient)

    code, msg = code_of(lambda: send(name="z"))
    assert code == "StatusCode.INVALID_ARGUMENT" and "unknown input 'z'" in msg and "['x']" in msg
    code, msg = code_of(lambda: send(dtype="FP64", x=rows(2).astype(np.float64)))
    assert code == "StatusCode.INVALID_ARGUMENT" and "datatype 'FP64'" in msg and "takes FP32" in msg
    code, msg = code_of(lambda: send(x=rows(17)))
    assert code == "StatusCode.INVALID_ARGUMENT" and "a batch of 17 rows" in msg and "1..16" in msg
    code, msg = code_of(lambda: send(dtype="BYTES", x=np.array([[b"a"] * D_IN], dtype=np.object_)))
    assert code == "StatusCode.INVALID_ARGUMENT" and "BYTES tensors are not accepted" in msg
    code, msg = code_of(lambda: send(model="ghost"))
    assert code == "StatusCode.NOT_FOUND" and "no model 'ghost'" in msg
    code, msg = code_of(lambda: gclient.get_model_metadata("ghost"))
    assert code == "StatusCode.NOT_FOUND"
    out = [grpcclient.InferRequestedOutput("nope")]
    i = grpcclient.InferInput("x", [1, D_IN], "FP32")
    i.set_data_from_numpy(rows(1))
    code, msg = code_of(lambda: gclient.infer("mlp", [i], outputs=out))
    assert code == "StatusCode.INVALID_ARGUMENT" and "unknown output 'nope'" in msg

    m = both.deploy(mlp_spec(name="tight", max_batch=4, max_queue=4, max_delay_ms=600_000))
    waiting = m.submit({"x": rows(3)})  # 3 of 4 rows wait ten minutes: the queue holds 1 more
    code, msg = code_of(lambda: send(model="tight"))
    assert code == "StatusCode.UNAVAILABLE" and "max_queue=4" in msg
    both.undeploy("tight")
    np.testing.assert_array_equal(waiting.result(30)["y"], direct_mlp(rows(3))["y"])

    both.deploy(xshare.model(raising_predict, {"s": np.float32(2)}, inputs={"x": ("float32", (2,))},
                             name="fragile", max_batch=4, max_delay_ms=0))
    code, msg = code_of(lambda: send(model="fragile", x=np.full((1, 2), 666, np.float32)))
    assert code == "StatusCode.INTERNAL" and "poisoned row" in msg
    assert both.model("mlp").stats()["errors_total"] == 0  # refusals never reached a batch
    np.testing.assert_array_equal(grpc_mlp(gclient, rows(3))["y"], direct_mlp(rows(3))["y"])


def test_a_missing_extra_is_named(monkeypatch):
    from xshare.runtime.web.grpc_server import require_grpc

    monkeypatch.setitem(sys.modules, "grpc", None)  # as if grpcio were not installed
    with pytest.raises(xshare.XShareError, match=r"pip install 'xshare\[grpc\]'"):
        require_grpc()
    with pytest.raises(xshare.XShareError, match=r"pip install 'xshare\[grpc\]'"):
        xshare.Runtime(memory="64MiB", grpc_port=0)


def test_a_port_in_use_is_refused_with_the_fix(both):
    port = int(both.grpc_server.address.rsplit(":", 1)[1])
    with pytest.raises(xshare.XShareError, match=rf"cannot listen on 127\.0\.0\.1:{port}; pick another --grpc-port"):
        xshare.Runtime(memory="64MiB", grpc_port=port)


def test_the_stream_answers_each_request_by_id_and_a_refusal_alone(both, gclient):
    # tritonclient's stream (ModelStreamInfer): four requests in one stream; the two rows of
    # "pair" batch together (max_batch 2, waiting ten minutes for a full batch), so answers
    # come back when their batches complete, each by its id; a bad request is its own error.
    both.deploy(mlp_spec(name="pair", max_batch=2, max_delay_ms=600_000, buckets=(2,)))
    got, errors, done = {}, {}, threading.Event()

    def callback(result, error):
        if error is not None:
            errors[len(errors)] = error.message()
        else:
            got[result.get_response().id] = np.array(result.as_numpy("y"))
        if len(got) + len(errors) == 4:
            done.set()

    xs = {f"r{k}": rows(1, seed=40 + k) for k in range(3)}
    gclient.start_stream(callback=callback)
    try:
        for rid, model in (("r0", "pair"), ("r1", "mlp"), ("r2", "pair")):
            i = grpcclient.InferInput("x", [1, D_IN], "FP32")
            i.set_data_from_numpy(xs[rid])
            gclient.async_stream_infer(model, [i], request_id=rid)
        bad = grpcclient.InferInput("z", [1, D_IN], "FP32")
        bad.set_data_from_numpy(rows(1))
        gclient.async_stream_infer("mlp", [bad], request_id="bad")
        assert done.wait(60)
    finally:
        gclient.stop_stream()
    assert sorted(got) == ["r0", "r1", "r2"] and list(errors.values()) == [
        "unknown input 'z'; model 'mlp' takes ['x']"]
    np.testing.assert_array_equal(got["r1"], direct_mlp(xs["r1"])["y"])
    pair = np.concatenate([xs["r0"], xs["r2"]])  # one batch of two, in arrival order
    np.testing.assert_array_equal(np.concatenate([got["r0"], got["r2"]]), direct_mlp(pair, bucket=2)["y"])
    assert both.model("pair").stats()["batches_total"] == 1
