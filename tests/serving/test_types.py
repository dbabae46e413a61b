"""Every numeric tensor type in and out, bit for bit, over every way the protocol carries it:
HTTP JSON, HTTP's binary tensor extension, gRPC raw contents (tritonclient.grpc) and gRPC typed
contents (the generated stub); BYTES is refused with its reason; 64-bit types need JAX's x64."""

from __future__ import annotations

import grpc
import jax
import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

import xshare
from xshare.serving.spec import OIP_DATATYPES
from xshare.serving.tensors import NUMPY_OF

WAYS = ("http-json", "http-binary", "grpc-raw", "grpc-typed")
# gRPC's typed contents for a datatype (as the proto names them); FP16/BF16 have none.
TYPED = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
         "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
         "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents"}


def echo(params, inputs):  # the identity and a per-row reversal: values must come back bit for bit
    return {"same": inputs["x"], "flipped": inputs["x"][:, ::-1]}


def values(dtype: str) -> np.ndarray:
    """Two rows of the type's edge values: its extremes, signed zero, a subnormal, 1/3."""
    if dtype == "bool":
        return np.array([[True, False, True, True], [False, False, True, False]])
    d = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    if d.kind in "iu":
        i = np.iinfo(d)
        return np.array([[i.min, i.max, 0, 1], [i.max - 1, i.min + 1, 7, i.max // 3]], d)
    f = ml_dtypes.finfo(d) if dtype == "bfloat16" else np.finfo(d)
    row = [float(f.max), -float(f.tiny), -0.0, float(f.smallest_subnormal)]
    return np.array([row, [1 / 3, -2.5, float(f.min), float(f.eps)]], np.float64).astype(d)


@pytest.fixture(scope="module")
def typed(tmp_path_factory):
    """One echo model per numeric datatype, served over HTTP and gRPC, with JAX's 64-bit types on
    (without them JAX computes INT64/FP64 in 32 bits: deploy refuses that, see the last test)."""
    was = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    rt = xshare.Runtime(memory="256MiB", status_port=0, grpc_port=0)
    try:
        for dtype in OIP_DATATYPES:
            rt.deploy(xshare.model(echo, {}, inputs={"x": (dtype, (4,))}, name=f"echo-{dtype}", max_batch=2,
                                   buckets=(2,), max_delay_ms=0))
        yield rt
    finally:
        rt.close()
        jax.config.update("jax_enable_x64", was)


def send(rt, way: str, datatype: str, x: np.ndarray) -> dict[str, np.ndarray]:
    model = f"echo-{NUMPY_OF[datatype]}"
    if way.startswith("http"):
        binary = way == "http-binary"
        c = httpclient.InferenceServerClient(rt.status_server.address)
        try:
            i = httpclient.InferInput("x", list(x.shape), datatype)
            i.set_data_from_numpy(x, binary_data=binary)
            r = c.infer(model, [i], outputs=[httpclient.InferRequestedOutput(n, binary_data=binary)
                                             for n in ("same", "flipped")])
            return {n: np.array(r.as_numpy(n)) for n in ("same", "flipped")}
        finally:
            c.close()
    if way == "grpc-raw":
        c = grpcclient.InferenceServerClient(rt.grpc_server.address)
        try:
            i = grpcclient.InferInput("x", list(x.shape), datatype)
            i.set_data_from_numpy(x)
            r = c.infer(model, [i])
            return {n: np.array(r.as_numpy(n)) for n in ("same", "flipped")}
        finally:
            c.close()
    with grpc.insecure_channel(rt.grpc_server.address) as channel:
        req = service_pb2.ModelInferRequest(model_name=model)
        t = req.inputs.add(name="x", datatype=datatype, shape=list(x.shape))
        getattr(t.contents, TYPED[datatype]).extend(x.ravel().tolist())
        resp = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=30)
    dtype = x.dtype
    return {o.name: np.frombuffer(raw, dtype).reshape(list(o.shape)) for o, raw in
            zip(resp.outputs, resp.raw_output_contents) if o.datatype == datatype}


CASES = [(d, w) for d in OIP_DATATYPES.values() for w in WAYS
         # tritonclient.http sends BF16 only as binary (as Triton takes it); the protocol has no
         # typed gRPC contents for FP16 and BF16 (raw only)
         if not (d == "BF16" and w == "http-json") and not (d in ("FP16", "BF16") and w == "grpc-typed")]


@pytest.mark.parametrize("datatype,way", CASES, ids=[f"{d}-{w}" for d, w in CASES])
def test_every_numeric_type_round_trips_exactly(typed, datatype, way):
    x = values(NUMPY_OF[datatype])
    got = send(typed, way, datatype, x)
    for name, want in (("same", x), ("flipped", x[:, ::-1])):
        assert got[name].dtype == want.dtype and got[name].shape == want.shape
        assert got[name].tobytes() == np.ascontiguousarray(want).tobytes(), (name, got[name], want)  # bits, -0.0 too


def test_bytes_and_unrepresentable_values_are_refused_with_the_reason(typed):
    c = httpclient.InferenceServerClient(typed.status_server.address)
    try:
        i = httpclient.InferInput("x", [1, 4], "BYTES")
        i.set_data_from_numpy(np.array([[b"a", b"b", b"c", b"d"]], dtype=np.object_), binary_data=False)
        with pytest.raises(InferenceServerException, match="BYTES tensors are not accepted") as info:
            c.infer("echo-int8", [i])
        assert info.value.status() == "400"
    finally:
        c.close()
    import http.client
    import json

    host, port = typed.status_server.address.rsplit(":", 1)
    for data, reason in (([[300, 0, 0, 0]], "outside INT8's range -128..127"),
                         ([[1.5, 0, 0, 0]], "INT8 takes whole numbers")):
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        body = {"inputs": [{"name": "x", "datatype": "INT8", "shape": [1, 4], "data": data}]}
        conn.request("POST", "/v2/models/echo-int8/infer", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 400 and reason in json.loads(resp.read())["error"]
        conn.close()


def test_a_64_bit_input_without_jax_x64_is_refused_with_the_fix():
    was = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)  # JAX's default (the module fixture turns it on)
    try:
        with xshare.Runtime(memory="64MiB") as rt:
            with pytest.raises(xshare.XShareError, match=r"input 'x' is int64, but JAX runs with 64-bit types "
                                                         r"off.*set JAX_ENABLE_X64=1"):
                rt.deploy(xshare.model(echo, {}, inputs={"x": ("int64", (4,))}, name="wide", max_batch=2))
            assert rt.models == {}
    finally:
        jax.config.update("jax_enable_x64", was)
