"""The Open Inference Protocol (KServe v2 REST) on the runtime's HTTP server.

  GET  /v2                          server metadata
  GET  /v2/health/live              200 while the server runs
  GET  /v2/health/ready             200 while the runtime takes work (503 once it closes)
  GET  /v2/models/{name}            model metadata: inputs, outputs, datatypes, shapes (-1 = batch)
  GET  /v2/models/{name}/ready      200 if deployed and taking requests, else 400 (404 unknown)
  POST /v2/models/{name}/infer      JSON tensors, or Triton's binary tensor extension

(``/versions/{v}`` after the name is accepted and ignored: a model has one version, "1".)

Refusals (``{"error": reason}``, as Triton and KServe send them): 400 a wrong input name,
datatype or shape, a batch over ``max_batch``, data that does not fill its shape, malformed
JSON or a body over ``INFER_MAX_BODY_BYTES``; 404 an unknown model; 503 + ``Retry-After`` a
full queue; 500 this batch's predict raised (the next batch is served).

No token: OIP clients (tritonclient, KServe) send none, and asking a model changes nothing.
The server listens on loopback unless the user gives another address (README: Serving).
Only the public runtime API is used (``rt.model(name)``, ``handle.submit``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .. import __version__
from ..runtime.http_app import Reply, endpoint, json_response, raw_parts, read_body
from .spec import OIP_DATATYPES, InferError

INFER_MAX_BODY_BYTES = 64 * 1024 * 1024  # 64 MiB: ~16M float32 values as binary, ~3M as JSON
INFER_TIMEOUT_S = 120.0                  # an answer that takes longer is a 504
_NP_OF = {v: k for k, v in OIP_DATATYPES.items()}
_HEADER_LENGTH = "inference-header-content-length"


def oip_routes(rt: Any) -> list[Route]:
    @endpoint
    async def server_metadata(request: Request) -> Response:
        return json_response(200, {"name": "xshare", "version": __version__,
                                   "extensions": ["binary_tensor_data"]})

    @endpoint
    async def live(request: Request) -> Response:
        return json_response(200, {"live": True})

    @endpoint
    async def ready(request: Request) -> Response:
        ok = not rt.closed
        return json_response(200 if ok else 503, {"ready": ok})

    @endpoint
    async def models(request: Request) -> Response:
        name, action = _model_path(request)
        handle = _handle(rt, name)
        if action == "":
            if request.method != "GET":
                raise Reply(405, f"{request.method} is not allowed on {request.url.path}; use GET", {"Allow": "GET"})
            return json_response(200, handle.metadata())
        if action == "ready":
            if request.method != "GET":
                raise Reply(405, f"{request.method} is not allowed on {request.url.path}; use GET", {"Allow": "GET"})
            ok = handle.ready()
            return json_response(200 if ok else 400, {"name": name, "ready": ok})
        if action == "infer":
            if request.method != "POST":
                raise Reply(405, f"{request.method} is not allowed on {request.url.path}; use POST",
                            {"Allow": "POST"})
            return await _infer(rt, handle, request)
        raise Reply(404, f"no such endpoint {request.url.path!r}; models answer GET /v2/models/{{name}}, "
                         "GET /v2/models/{name}/ready and POST /v2/models/{name}/infer")

    any_method = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]
    return [Route("/v2", server_metadata, methods=["GET"]),
            Route("/v2/health/live", live, methods=["GET"]),
            Route("/v2/health/ready", ready, methods=["GET"]),
            Route("/v2/models/{rest:path}", models, methods=any_method)]


def _model_path(request: Request) -> tuple[str, str]:
    parts = raw_parts(request)[3:]  # after "", "v2", "models"
    if len(parts) >= 3 and parts[1] == "versions":  # /v2/models/{name}/versions/{v}[/action]
        parts = [parts[0], *parts[3:]]
    if not parts or not parts[0] or len(parts) > 2:
        raise Reply(404, f"no such endpoint {request.url.path!r}; try GET /v2/models/{{name}}")
    return parts[0], (parts[1] if len(parts) == 2 else "")


def _handle(rt: Any, name: str) -> Any:
    try:
        return rt.model(name)
    except KeyError as err:
        raise Reply(404, str(err.args[0])) from None


async def _infer(rt: Any, handle: Any, request: Request) -> Response:
    body = await read_body(request, INFER_MAX_BODY_BYTES, too_large=400)
    header_len = request.headers.get(_HEADER_LENGTH)
    parsed = await run_in_threadpool(parse_infer, body, header_len, handle.metadata())
    inputs, wanted, binary_out, req_id = parsed
    try:
        fut = handle.submit(inputs)
        outputs = await asyncio.wait_for(asyncio.wrap_future(fut), INFER_TIMEOUT_S)
    except InferError as err:
        headers = {"Retry-After": str(max(1, round(err.retry_after_s)))} if err.retry_after_s else {}
        raise Reply(err.code, err.message, headers) from None
    except asyncio.TimeoutError:
        raise Reply(504, f"model {handle.name!r} did not answer within {INFER_TIMEOUT_S:g} s") from None
    body, headers, ctype = await run_in_threadpool(render_infer, handle.name, req_id, outputs, wanted,
                                                   binary_out)
    return Response(body, 200, {"Cache-Control": "no-store", **headers}, ctype)


def parse_infer(body: bytes, header_len: str | None, meta: dict[str, Any]
                ) -> tuple[dict[str, np.ndarray], list[str] | None, dict[str, bool], Any]:
    """The request's tensors as numpy arrays; ``Reply(400)`` says what is wrong."""
    binary = b""
    if header_len is not None:
        try:
            n = int(header_len)
        except ValueError:
            raise Reply(400, f"Inference-Header-Content-Length {header_len!r} is not a number") from None
        if not 0 <= n <= len(body):
            raise Reply(400, f"Inference-Header-Content-Length {n} is outside the body's {len(body)} bytes")
        body, binary = body[:n], body[n:]
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise Reply(400, f"the body is not JSON: {err}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list):
        raise Reply(400, 'the body must be a JSON object with "inputs": [{"name", "shape", "datatype", "data"}]')
    declared = {i["name"]: i for i in meta["inputs"]}
    inputs: dict[str, np.ndarray] = {}
    offset = 0
    for t in doc["inputs"]:
        if not isinstance(t, dict):
            raise Reply(400, f"an input must be an object with name, shape, datatype and data; got {t!r:.80}")
        name, shape, datatype = t.get("name"), t.get("shape"), t.get("datatype")
        if not isinstance(name, str) or name not in declared:
            raise Reply(400, f"unknown input {name!r}; model {meta['name']!r} takes {sorted(declared)}")
        if name in inputs:
            raise Reply(400, f"input {name!r} is given twice")
        want = declared[name]["datatype"]
        if datatype != want:
            raise Reply(400, f"input {name!r} has datatype {datatype!r}; model {meta['name']!r} takes {want}")
        if (not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                    for d in shape)):
            raise Reply(400, f"input {name!r} has shape {shape!r}; give a list of ints >= 0")
        dtype = np.dtype(_NP_OF[want]) if want != "BF16" else None
        if dtype is None:
            raise Reply(400, f"input {name!r}: BF16 tensors are not accepted over HTTP; send FP32")
        count = int(np.prod(shape)) if shape else 1
        params = t.get("parameters") or {}
        size = params.get("binary_data_size") if isinstance(params, dict) else None
        if size is not None:
            if not isinstance(size, int) or size != count * dtype.itemsize or offset + size > len(binary):
                raise Reply(400, f"input {name!r}: binary_data_size {size!r} does not match shape {shape} of "
                                 f"{want} ({count * dtype.itemsize} bytes) or the binary data sent")
            arr = np.frombuffer(binary, dtype, count, offset).reshape(shape)
            offset += size
        else:
            if "data" not in t:
                raise Reply(400, f"input {name!r} has no data")
            try:
                arr = np.asarray(t["data"], dtype=dtype)
            except (ValueError, TypeError, OverflowError) as err:
                raise Reply(400, f"input {name!r}: its data are not {want} values: {err}") from None
            if arr.size != count:
                raise Reply(400, f"input {name!r} has {arr.size} values; shape {shape} needs {count}")
            arr = arr.reshape(shape)
        inputs[name] = arr
    outs = doc.get("outputs")
    wanted, binary_out = None, {}
    default_binary = bool((doc.get("parameters") or {}).get("binary_data_output", False))
    known = {o["name"] for o in meta["outputs"]}
    if outs is not None:
        if not isinstance(outs, list):
            raise Reply(400, 'the body\'s "outputs" must be a list of {"name": ...}')
        wanted = []
        for o in outs:
            name = o.get("name") if isinstance(o, dict) else None
            if not isinstance(name, str) or name not in known:
                raise Reply(400, f"unknown output {name!r}; model {meta['name']!r} has {sorted(known)}")
            wanted.append(name)
            binary_out[name] = bool((o.get("parameters") or {}).get("binary_data", default_binary))
    else:
        binary_out = {k: default_binary for k in known}
    return inputs, wanted, binary_out, doc.get("id")


def render_infer(model: str, req_id: Any, outputs: dict[str, np.ndarray], wanted: list[str] | None,
                 binary_out: dict[str, bool]) -> tuple[bytes, dict[str, str], str]:
    names = wanted if wanted is not None else list(outputs)
    tensors, blobs = [], []
    for name in names:
        arr = outputs[name]
        t: dict[str, Any] = {"name": name, "datatype": OIP_DATATYPES.get(str(arr.dtype), str(arr.dtype).upper()),
                             "shape": list(arr.shape)}
        if binary_out.get(name):
            raw = np.ascontiguousarray(arr).tobytes()
            t["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            # float32 -> Python float is exact, and JSON's shortest repr of it reads back exactly
            t["data"] = arr.ravel().tolist()
        tensors.append(t)
    doc: dict[str, Any] = {"model_name": model, "model_version": "1", "outputs": tensors}
    if req_id is not None:
        doc["id"] = req_id
    head = json.dumps(doc, allow_nan=True).encode()
    if not blobs:
        return head, {}, "application/json"
    return head + b"".join(blobs), {"Inference-Header-Content-Length": str(len(head))}, "application/octet-stream"


__all__ = ["oip_routes", "parse_infer", "render_infer", "INFER_MAX_BODY_BYTES"]
