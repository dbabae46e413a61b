"""tritonclient.http, unmodified, against a runtime serving two models over the Open Inference
Protocol: answers bit-identical to predict computed directly, requests that batch together each
getting their own rows, metadata, readiness, and every bad request with its status code."""

from __future__ import annotations

import functools
import http.client
import json
import re
import threading
import weakref

import jax
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import xshare
from xshare.serving.oip import INFER_MAX_BODY_BYTES

from tests.serving.conftest import (AFFINE_PARAMS, D_IN, D_OUT, HIDDEN, affine_predict, client,  # noqa: F401
                                    direct_mlp, infer_input, infer_mlp, mlp_params, mlp_predict, mlp_spec, rows,
                                    send_request, served)


def post(address: str, path: str, body: bytes, headers: dict[str, str] | None = None):
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def status_of(call) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value.status(), info.value.message()


# ------------------------------------------------------------------------------ answers

@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_single_requests_equal_predict_computed_directly_in_every_bucket(served, client, binary):
    before = served.model("mlp").stats()["batches_total"]
    for n in (1, 2, 3, 4, 5, 9, 16):  # buckets 1, 4, 4, 4, 16, 16, 16: padded but for 1, 4, 16
        x = rows(n, seed=n)
        got = infer_mlp(client, x, binary=binary)
        want = direct_mlp(x)  # over the rows as they ran: padded to the request's bucket
        np.testing.assert_allclose(got["y"], direct_mlp(x, bucket=n)["y"], rtol=1e-5, atol=1e-5)  # unpadded
        assert got["y"].shape == (n, D_OUT) and got["argmax"].shape == (n,)  # no padded row leaks
        assert got["y"].dtype == np.float32 and got["argmax"].dtype == np.int32
        np.testing.assert_array_equal(got["y"], want["y"])  # bit for bit
        np.testing.assert_array_equal(got["argmax"], want["argmax"])
    assert served.model("mlp").stats()["batches_total"] == before + 7


def test_a_model_with_two_inputs_and_one_array_output(served, client):
    a = np.random.default_rng(1).normal(size=(3, 3)).astype(np.float32)
    b = np.arange(9, dtype=np.int32).reshape(3, 3)
    ins = [httpclient.InferInput("a", [3, 3], "FP32"), httpclient.InferInput("b", [3, 3], "INT32")]
    ins[0].set_data_from_numpy(a)
    ins[1].set_data_from_numpy(b)
    got = np.array(client.infer("affine", ins).as_numpy("output"))
    np.testing.assert_array_equal(got, np.asarray(jax.jit(affine_predict)(AFFINE_PARAMS, {"a": a, "b": b})))


def test_concurrent_requests_batch_together_and_each_gets_its_own_rows(served):
    # A batch is due only when max_batch rows wait (the delay is ten minutes): the four requests,
    # sent at once from four clients, run as exactly one execution of the 8-row bucket.
    served.deploy(mlp_spec(name="batcher", max_batch=8, max_delay_ms=600_000, buckets=(1, 4, 8)))
    sizes = [1, 2, 1, 4]
    xs = [rows(n, seed=10 + i) for i, n in enumerate(sizes)]
    answers: list = [None] * len(sizes)

    def one(i):
        c = httpclient.InferenceServerClient(served.status_server.address)
        try:
            answers[i] = np.array(c.infer("batcher", [infer_input(httpclient, xs[i])]).as_numpy("y"))
        finally:
            c.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(sizes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stats = served.model("batcher").stats()
    assert stats["batches_total"] == 1 and stats["requests_total"] == 4 and stats["batch_fill"] == 1.0
    # Arrival order decides the rows each request had in the batch; whatever it was, every
    # answer is its own rows of predict over the 8 rows as they were stacked, bit for bit.
    assert [a.shape for a in answers] == [(n, D_OUT) for n in sizes]
    for i, x in enumerate(xs):
        # predict computed directly over these 8 rows (this request's first, the others after):
        # this request's rows are bit-identical to it, wherever they sat in the batch.
        others = [y for j, y in enumerate(xs) if j != i]
        np.testing.assert_array_equal(answers[i], direct_mlp(np.concatenate([x, *others]), bucket=8)["y"][:len(x)])
        # Over this request's rows alone XLA:CPU may use another kernel (a 1-row product is a
        # gemv; jax 0.12 also changes kernels between row counts): rounding, not bits.
        np.testing.assert_allclose(answers[i], direct_mlp(x, bucket=len(x))["y"], rtol=1e-5, atol=1e-5)


def test_in_process_handle_batches_like_http(served):
    m = served.deploy(mlp_spec(name="local", max_batch=4, max_delay_ms=600_000, buckets=(4,)))
    xs = rows(4, seed=3)
    futures = [m.submit({"x": xs[i:i + 1]}) for i in range(4)]
    got = np.concatenate([f.result(30)["y"] for f in futures])
    np.testing.assert_array_equal(got, direct_mlp(xs)["y"])
    assert m.stats()["batches_total"] == 1


# ----------------------------------------------------------------------- metadata, health

def test_metadata_readiness_and_health(served, client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("mlp") and client.is_model_ready("affine")
    assert not client.is_model_ready("ghost")
    meta = client.get_model_metadata("mlp")
    assert meta["name"] == "mlp" and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, D_IN]}]
    assert meta["outputs"] == [{"name": "argmax", "datatype": "INT32", "shape": [-1]},  # sorted, as pytrees
                               {"name": "y", "datatype": "FP32", "shape": [-1, D_OUT]}]
    meta = client.get_model_metadata("affine")
    assert [i["datatype"] for i in meta["inputs"]] == ["FP32", "INT32"]
    assert meta["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 3]}]
    assert status_of(lambda: client.get_model_metadata("ghost"))[0] == "404"


# ------------------------------------------------------------------------------ bad input

def test_every_bad_request_gets_its_status_code_and_the_models_serve_on(served, client):
    addr = served.status_server.address

    send = functools.partial(send_request, client, httpclient)

    code, msg = status_of(lambda: send(name="z"))
    assert code == "400" and "unknown input 'z'" in msg and "['x']" in msg
    code, msg = status_of(lambda: send(dtype="FP64", x=rows(2).astype(np.float64)))
    assert code == "400" and "datatype 'FP64'" in msg and "FP32" in msg
    code, msg = status_of(lambda: send(x=rows(2)[:, :D_IN - 1]))
    assert code == "400" and f"[batch, {D_IN}]" in msg
    code, msg = status_of(lambda: send(x=rows(17)))
    assert code == "400" and "a batch of 17 rows" in msg and "1..16" in msg
    code, msg = status_of(lambda: send(model="ghost"))
    assert code == "404" and "ghost" in msg

    code, _, body = post(addr, "/v2/models/mlp/infer", b"{not json")
    assert code == 400 and "not JSON" in json.loads(body)["error"]
    short = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, D_IN], "data": [1.0] * 5}]}
    code, _, body = post(addr, "/v2/models/mlp/infer", json.dumps(short).encode())
    assert code == 400 and "needs 32" in json.loads(body)["error"]
    words = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, D_IN], "data": ["a"] * D_IN}]}
    code, _, body = post(addr, "/v2/models/mlp/infer", json.dumps(words).encode())
    assert code == 400 and "not FP32 values" in json.loads(body)["error"]
    listed = {"inputs": [{"name": ["x"], "datatype": "FP32", "shape": [1, D_IN], "data": [1.0] * D_IN}]}
    code, _, body = post(addr, "/v2/models/mlp/infer", json.dumps(listed).encode())  # unhashable: was a 500
    assert code == 400 and "unknown input ['x']" in json.loads(body)["error"]
    # an oversized body is refused on its declared length, before it is read
    code, _, body = post(addr, "/v2/models/mlp/infer", b"{",
                         {"Content-Length": str(INFER_MAX_BODY_BYTES + 1)})
    assert code == 400 and f"limit is {INFER_MAX_BODY_BYTES}" in json.loads(body)["error"]
    code, _, body = post(addr, "/v2/models/mlp/ready", b"")
    assert code == 405

    assert served.model("mlp").stats()["errors_total"] == 0  # refusals never reach a batch
    np.testing.assert_array_equal(infer_mlp(client, rows(3))["y"], direct_mlp(rows(3))["y"])


def test_a_full_queue_is_503_with_retry_after_and_undeploy_answers_what_waits(served):
    m = served.deploy(mlp_spec(name="tight", max_batch=4, max_queue=4, max_delay_ms=600_000))
    waiting = m.submit({"x": rows(3)})  # 3 of 4 rows: not due for ten minutes
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, D_IN], "data": rows(2).ravel().tolist()}]}
    code, headers, body = post(served.status_server.address, "/v2/models/tight/infer", json.dumps(doc).encode())
    assert code == 503 and headers["retry-after"] == "1" and "max_queue=4" in json.loads(body)["error"]
    assert m.stats()["rejected_total"] == 1 and not waiting.done()
    served.undeploy("tight")  # answers the queued request before it goes
    np.testing.assert_array_equal(waiting.result(30)["y"], direct_mlp(rows(3))["y"])
    code, _, _ = post(served.status_server.address, "/v2/models/tight/infer", json.dumps(doc).encode())
    assert code == 404
    with pytest.raises(xshare.InferError, match="is gone"):
        m.infer({"x": rows(1)})


def _poison_check(x):
    if (x == 666).any():
        raise ValueError("a poisoned row")
    return x


def raising_predict(params, inputs):
    x = jax.pure_callback(_poison_check, jax.ShapeDtypeStruct(inputs["x"].shape, inputs["x"].dtype), inputs["x"])
    return {"y": x * params["s"]}


def test_a_predict_that_raises_fails_its_batch_only(served, client):
    served.deploy(xshare.model(raising_predict, {"s": np.float32(2)}, inputs={"x": ("float32", (2,))},
                               name="fragile", max_batch=4, max_delay_ms=1))

    def send(x):
        return np.array(client.infer("fragile", [infer_input(httpclient, x)]).as_numpy("y"))

    code, msg = status_of(lambda: send(np.full((2, 2), 666, np.float32)))
    assert code == "500" and "predict failed for this batch" in msg and "poisoned row" in msg
    np.testing.assert_array_equal(send(np.ones((3, 2), np.float32)), np.full((3, 2), 2, np.float32))
    stats = served.model("fragile").stats()
    assert stats["errors_total"] == 1 and stats["requests_total"] == 1
    np.testing.assert_array_equal(infer_mlp(client, rows(2))["y"], direct_mlp(rows(2))["y"])


# -------------------------------------------------------------------------------- specs

def test_model_specs_refuse_nonsense_with_the_fix():
    p = {"w": np.zeros((2, 2), np.float32)}
    with pytest.raises(ValueError, match="must be 1-128 characters"):
        xshare.model(lambda p, i: i["x"], p, inputs={"x": ("float32", (2,))}, name="a/b")
    with pytest.raises(ValueError, match=r"inputs\['x'\] has dtype 'float8'; choose one of bool, uint8"):
        xshare.model(lambda p, i: i["x"], p, inputs={"x": ("float8", (2,))}, name="m")
    with pytest.raises(ValueError, match=r"max_batch=0 must be an int >= 1"):
        xshare.model(lambda p, i: i["x"], p, inputs={"x": ("float32", (2,))}, name="m", max_batch=0)
    with pytest.raises(ValueError, match=r"whose largest is max_batch=8"):
        xshare.model(lambda p, i: i["x"], p, inputs={"x": ("float32", (2,))}, name="m", max_batch=8, buckets=(1, 4))
    spec = xshare.model(lambda p, i: i["x"], p, inputs={"x": ("float32", [2])}, name="m", max_batch=64)
    assert spec.buckets == (1, 4, 16, 64) and spec.inputs == {"x": ("float32", (2,))} and spec.max_queue == 512


def test_deploy_refuses_a_second_model_of_one_name_and_one_that_cannot_fit(served):
    with pytest.raises(xshare.XShareError, match="already deployed"):
        served.deploy(mlp_spec())
    big = xshare.model(lambda p, i: {"y": i["x"] @ p["w"]}, {"w": np.zeros((4096, 16384), np.float32)},
                       inputs={"x": ("float32", (4096,))}, name="huge", max_batch=1)
    with pytest.raises(xshare.AdmissionError, match="huge"):
        served.deploy(big)
    assert "huge" not in served.models
    with pytest.raises(KeyError, match="models: affine, mlp"):
        served.undeploy("ghost")


def _square(name: str, n: int) -> xshare.ModelSpec:
    """A model whose params are exactly ``n * n * 4`` bytes (P), with one-row batches (small E)."""
    return xshare.model(lambda p, i: {"y": i["x"] @ p["w"]}, {"w": np.zeros((n, n), np.float32)},
                        inputs={"x": ("float32", (n,))}, name=name, max_batch=1)


def test_a_model_that_does_not_fit_is_refused_naming_its_size_the_arena_and_the_fix():
    # A deployed model is never queued (clients would hang), so its refusal must say what frees
    # room: its size, what is free, the arena and where its size came from, and what to do.
    with xshare.Runtime(memory="400KiB") as rt:
        with pytest.raises(xshare.AdmissionError, match=(
                r"^model 'huge' can never fit: it needs 5\d\d\.\d KiB \(P 576\.0 KiB params \+ E \d+\.\d KiB for a "
                r"batch of 1\) but the arena holds 400\.0 KiB \(memory argument\); deploy a smaller model or a "
                r"lower max_batch, or give the runtime more memory \(--memory\)$")):
            rt.deploy(_square("huge", 256 + 128))  # 384 * 384 * 4 B = 576 KiB of params: > the arena
        rt.deploy(_square("a", 256))               # 256 KiB of params: fits, and leaves < 256 KiB free
        with pytest.raises(xshare.AdmissionError, match=(
                r"^model 'b' does not fit now: it needs 25\d\.\d KiB \(P 256\.0 KiB \+ E \d+\.\d KiB\); "
                r"1\d\d\.\d KiB free; sharing a lane needs 256\.0 KiB; the arena holds 400\.0 KiB \(memory argument\)\. "
                + re.escape("A model is deployed at once or refused, never queued: undeploy a model or wait for "
                            "training jobs to end, then deploy it again; or lower its max_batch, or give the "
                            "runtime more memory (--memory)") + "$")):
            rt.deploy(_square("b", 256))
        assert sorted(rt.models) == ["a"]          # neither refused model holds anything
        rt.undeploy("a")                           # the fix the refusal names works
        assert rt.deploy(_square("b", 256)).name == "b"


def test_a_request_whose_caller_gave_up_does_not_hold_up_its_batch(served):
    m = served.deploy(mlp_spec(name="quitters", max_batch=4, max_delay_ms=600_000, buckets=(4,)))
    gone = m.submit({"x": rows(1, seed=0)})
    assert gone.cancel()  # what an HTTP client that hung up does to its future
    kept = [m.submit({"x": rows(1, seed=k)}) for k in (1, 2, 3)]  # the 4th row makes the batch due
    for k, f in zip((1, 2, 3), kept):
        np.testing.assert_allclose(f.result(30)["y"], direct_mlp(rows(1, seed=k))["y"], rtol=1e-5, atol=1e-5)


def test_models_of_one_architecture_share_executables_and_answer_with_their_own_params(served):
    # Salus packs many small models into one service; what a model costs there is mostly its
    # executables, so models that lower to the same program (other params) share them.
    import gc

    from xshare.runtime.deployed import models

    other = {k: (v * 2 + 1).astype(np.float32) for k, v in mlp_params().items()}
    a = served.deploy(mlp_spec(name="twin-a"))
    b = served.deploy(xshare.model(mlp_predict, other, inputs={"x": ("float32", (D_IN,))},
                                   name="twin-b", max_batch=16, max_delay_ms=20))
    assert all(a._m.executables[n] is b._m.executables[n] for n in (1, 4, 16))
    x = rows(3, seed=9)
    padded = np.concatenate([x, np.zeros((1, D_IN), np.float32)])  # the 4-row bucket they run in
    np.testing.assert_array_equal(a.infer({"x": x})["y"], np.asarray(jax.jit(mlp_predict)(mlp_params(), {"x": padded})["y"])[:3])
    np.testing.assert_array_equal(b.infer({"x": x})["y"], np.asarray(jax.jit(mlp_predict)(other, {"x": padded})["y"])[:3])
    # Another architecture gets its own; and the shared ones go with the last model using them.
    wide = xshare.model(mlp_predict, {**mlp_params(), "w2": np.ones((HIDDEN, D_OUT + 1), np.float32)},
                        inputs={"x": ("float32", (D_IN,))}, name="wide", max_batch=16)
    c = served.deploy(wide)
    assert c._m.executables[16] is not a._m.executables[16]
    gone = [weakref.ref(e) for e in c._m.executables.values()]
    assert all(any(e is r() for e in models._EXECUTABLES.values()) for r in gone)
    served.undeploy("wide")
    del c, wide
    gc.collect()
    assert [r() for r in gone] == [None, None, None]
    assert a._m.executables[16] in models._EXECUTABLES.values()  # the twins' stay


def test_the_dispatcher_looks_only_at_models_with_requests_waiting(served, monkeypatch):
    # serve_due runs between every two training steps: with many models resident and idle it
    # must not visit each one (1024 idle models cost 30 us per step before this).
    from xshare.runtime.deployed import models

    looked: list[str] = []
    real = models.Deployed.due_at
    monkeypatch.setattr(models.Deployed, "due_at", lambda m: looked.append(m.name) or real(m))
    hub = served._dispatcher.serving
    for i in range(3):
        served.deploy(mlp_spec(name=f"idle-{i}"))
    assert hub.serve_due() is False and looked == []
    m = served.deploy(mlp_spec(name="busy", max_delay_ms=600_000, max_batch=4, buckets=(4,)))
    futures = [m.submit({"x": rows(1, seed=i)}) for i in range(4)]  # a full batch: due at once
    got = np.concatenate([f.result(30)["y"] for f in futures])
    np.testing.assert_array_equal(got, direct_mlp(np.concatenate([rows(1, seed=i) for i in range(4)]), bucket=4)["y"])
    assert set(looked) == {"busy"}
    looked.clear()
    assert hub.serve_due() is False and looked == []  # served: nothing pending any more


def test_the_http_server_sets_tcp_nodelay_on_its_connections(served):
    # asyncio sets TCP_NODELAY only on sockets whose .proto is IPPROTO_TCP (accepted sockets
    # inherit the listener's); with proto 0 a kept-alive request's answer, head and body in two
    # writes, waited for the client's delayed ACK: 40-48 ms a request (benchmarks/serving_protocols.py).
    import socket

    assert served.status_server.socket.proto == socket.IPPROTO_TCP
    host, port = served.status_server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as client:
        client.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200" in client.recv(4096).split(b"\r\n", 1)[0]
