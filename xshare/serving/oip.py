"""The Open Inference Protocol (KServe v2 REST) on the runtime's HTTP server.

  GET  /v2                          server metadata
  GET  /v2/health/live              200 while the server runs
  GET  /v2/health/ready             200 while the runtime takes work (503 once it closes)
  GET  /v2/models/{name}            model metadata: inputs, outputs, datatypes, shapes (-1 = batch)
  GET  /v2/models/{name}/ready      200 if deployed and taking requests, else 400 (404 unknown)
  POST /v2/models/{name}/infer      JSON tensors, or Triton's binary tensor extension
  GET  /v2/models/{name}/config     Triton's model configuration extension (:mod:`.extensions`)
  GET  /v2/models[/{name}]/stats    Triton's statistics extension (every model's without a name)
  POST /v2/repository/index         Triton's repository extension (``xshare serve --model-repository``):
  POST /v2/repository/models/{name}/load|unload    these two need the token (they change state)

Every numeric datatype goes in and out (:mod:`.tensors`); BYTES is refused with 400.

``/versions/{v}`` after the name routes to that version (404 if it is not deployed); without
it, to the name's default version, the highest ready one.

Refusals (``{"error": reason}``, as Triton and KServe send them): 400 a wrong input name,
datatype or shape, a batch over ``max_batch``, data that does not fill its shape, malformed
JSON or a body over ``INFER_MAX_BODY_BYTES``; 404 an unknown model; 503 + ``Retry-After`` a
full queue; 500 this batch's predict raised (the next batch is served).

No token: OIP clients (tritonclient, KServe) send none, and asking a model changes nothing.
The server listens on loopback unless the user gives another address (docs/reference/http.md).
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
from ..runtime.web.http_app import Reply, authorize, endpoint, json_response, parse_json, raw_parts, read_body
from . import tensors
from .extensions import model_config, model_statistics
from .spec import InferError

INFER_MAX_BODY_BYTES = 64 * 1024 * 1024  # 64 MiB: ~16M float32 values as binary, ~3M as JSON
INFER_TIMEOUT_S = 120.0                  # an answer that takes longer is a 504
_HEADER_LENGTH = "inference-header-content-length"


def oip_routes(rt: Any, srv: Any = None) -> list[Route]:
    """The routes; ``srv.repository`` (a :class:`.repository.Repository`, ``xshare serve
    --model-repository``) adds the repository extension, whose load and unload need the token."""
    repo = getattr(srv, "repository", None)

    @endpoint
    async def server_metadata(request: Request) -> Response:
        extensions = ["binary_tensor_data", "model_configuration", "statistics"]
        return json_response(200, {"name": "xshare", "version": __version__,
                                   "extensions": extensions + (["model_repository"] if repo is not None else [])})

    @endpoint
    async def live(request: Request) -> Response:
        return json_response(200, {"live": True})

    @endpoint
    async def ready(request: Request) -> Response:
        ok = not rt.closed
        return json_response(200 if ok else 503, {"ready": ok})

    @endpoint
    async def models(request: Request) -> Response:
        name, version, action = _model_path(request)
        if name == "stats" and action == "" and "stats" not in rt.models:  # every model's (Triton's route)
            _only(request, "GET")
            return json_response(200, model_statistics([h for n in sorted(rt.models) for h in rt.model_versions(n)]))
        handle = _handle(rt, name, version)
        if action in ("config", "stats"):
            _only(request, "GET")
            if action == "config":
                return json_response(200, model_config(handle))
            # a name's statistics are its every version's (Triton's), a version's its own
            return json_response(200, model_statistics([handle] if version is not None else rt.model_versions(name)))
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
                         "GET /v2/models/{name}/ready, /config, /stats and POST /v2/models/{name}/infer")

    @endpoint
    async def repository_index(request: Request) -> Response:
        doc = parse_json(await read_body(request), ' (send none, or {"ready": true})')
        ready_only = bool(doc.get("ready", False)) if isinstance(doc, dict) else False
        assert repo is not None  # the route exists only with a repository
        return json_response(200, await run_in_threadpool(repo.index, ready_only))

    @endpoint
    async def repository_model(request: Request) -> Response:
        parts = raw_parts(request)  # ["", "v2", "repository", "models", name, action]
        if len(parts) != 6 or parts[5] not in ("load", "unload") or not parts[4]:
            raise Reply(404, f"no such endpoint {request.url.path!r}; try POST /v2/repository/models/{{name}}/load "
                             "or /unload")
        authorize(srv, request, f"{parts[5]}ing a model")
        doc = parse_json(await read_body(request))
        given = doc.get("parameters") if isinstance(doc, dict) else None
        refuse_overrides(sorted(given) if isinstance(given, dict) else [], parts[5])
        try:
            await run_in_threadpool(getattr(repo, parts[5]), parts[4])
        except InferError as err:
            raise Reply(err.code, err.message) from None
        return json_response(200, {})

    any_method = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]
    routes = [Route("/v2", server_metadata, methods=["GET"]),
              Route("/v2/health/live", live, methods=["GET"]),
              Route("/v2/health/ready", ready, methods=["GET"]),
              Route("/v2/models/{rest:path}", models, methods=any_method)]
    if repo is not None:
        routes += [Route("/v2/repository/index", repository_index, methods=["POST"]),
                   Route("/v2/repository/models/{rest:path}", repository_model, methods=["POST"])]
    return routes


def refuse_overrides(keys: list[str], action: str) -> None:
    """Triton's load takes a ``config`` (and ``file:`` contents) overriding the repository's; here
    the entry's config.toml is what loads, so an override is refused rather than ignored.
    Unload's ``unload_dependents`` means nothing here (no ensembles) and is accepted."""
    unknown = [k for k in keys if not (action == "unload" and k == "unload_dependents")]
    if unknown:
        raise Reply(400, f"{action} takes no parameter {unknown[0]!r}: the entry's config.toml is what loads; edit it "
                         "and load again")


def _only(request: Request, method: str) -> None:
    if request.method != method:
        raise Reply(405, f"{request.method} is not allowed on {request.url.path}; use {method}", {"Allow": method})


def _model_path(request: Request) -> tuple[str, int | None, str]:
    """``(name, version or None, action)`` of ``/v2/models/{name}[/versions/{v}][/action]``."""
    parts = raw_parts(request)[3:]  # after "", "v2", "models"
    version = None
    if len(parts) >= 3 and parts[1] == "versions":  # /v2/models/{name}/versions/{v}[/action]
        version = parse_version(parts[2])
        parts = [parts[0], *parts[3:]]
    if not parts or not parts[0] or len(parts) > 2:
        raise Reply(404, f"no such endpoint {request.url.path!r}; try GET /v2/models/{{name}}")
    return parts[0], version, (parts[1] if len(parts) == 2 else "")


def parse_version(text: str) -> int | None:
    """A protocol version string: ``""`` is the default; else a positive integer (404 if not)."""
    if text == "":
        return None
    if not text.isdigit() or int(text) < 1:
        raise Reply(404, f"model version {text!r} is not a version number; versions are integers >= 1")
    return int(text)


def _handle(rt: Any, name: str, version: int | None = None) -> Any:
    try:
        return rt.model(name, version)
    except KeyError as err:
        raise Reply(404, str(err.args[0])) from None


async def _infer(rt: Any, handle: Any, request: Request) -> Response:
    body = await read_body(request, INFER_MAX_BODY_BYTES, too_large=400)
    header_len = request.headers.get(_HEADER_LENGTH)
    schedule: dict[str, Any] = {}
    parsed = await run_in_threadpool(parse_infer, body, header_len, handle.metadata(), schedule)
    inputs, wanted, binary_out, req_id = parsed
    try:
        fut = handle.submit(inputs, **schedule)
        outputs = await asyncio.wait_for(asyncio.wrap_future(fut), INFER_TIMEOUT_S)
    except InferError as err:
        headers = {"Retry-After": str(max(1, round(err.retry_after_s)))} if err.retry_after_s else {}
        raise Reply(err.code, err.message, headers) from None
    except asyncio.TimeoutError:
        raise Reply(504, f"model {handle.name!r} did not answer within {INFER_TIMEOUT_S:g} s") from None
    body, headers, ctype = await run_in_threadpool(render_infer, handle.name, req_id, outputs, wanted,
                                                   binary_out, str(getattr(fut, "model_version", 1)))
    return Response(body, 200, {"Cache-Control": "no-store", **headers}, ctype)


def parse_infer(body: bytes, header_len: str | None, meta: dict[str, Any], schedule: dict | None = None,
                ) -> tuple[dict[str, np.ndarray], list[str] | None, dict[str, bool], Any]:
    """The request's tensors as numpy arrays; ``Reply(400)`` says what is wrong. ``schedule``,
    if given, receives the request's ``priority`` and ``timeout_us`` (Triton's schedule-policy
    parameters ``priority`` and ``timeout``, in the body's ``parameters``)."""
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
    inputs: dict[str, np.ndarray] = {}
    seen: set = set()
    offset = 0
    try:
        for t in doc["inputs"]:
            if not isinstance(t, dict):
                raise Reply(400, f"an input must be an object with name, shape, datatype and data; got {t!r:.80}")
            name, shape, datatype = t.get("name"), t.get("shape"), t.get("datatype")
            dtype = tensors.check_header(meta, name, datatype, shape, seen)
            # check_header accepted them: a declared input's name and datatype, a list of ints >= 0
            assert isinstance(name, str) and isinstance(datatype, str) and isinstance(shape, list)
            params = t.get("parameters") or {}
            size = params.get("binary_data_size") if isinstance(params, dict) else None
            if size is not None:
                if not isinstance(size, int) or isinstance(size, bool) or size < 0 or offset + size > len(binary):
                    raise Reply(400, f"input {name!r}: binary_data_size {size!r} is not a byte count within the "
                                     f"{len(binary) - offset} bytes of binary data left")
                arr = tensors.from_bytes(name, datatype, dtype, shape, memoryview(binary)[offset:offset + size])  # no copy
                offset += size
            else:
                if "data" not in t:
                    raise Reply(400, f"input {name!r} has no data")
                arr = tensors.from_values(name, datatype, dtype, shape, t["data"])
            inputs[name] = arr
    except InferError as err:
        raise Reply(err.code, err.message) from None
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise Reply(400, 'the body\'s "parameters" must be an object')
    if schedule is not None:
        schedule["priority"] = params.get("priority", 0)
        schedule["timeout_us"] = params.get("timeout")
    outs = doc.get("outputs")
    wanted, binary_out = None, {}
    default_binary = bool(params.get("binary_data_output", False))
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
                 binary_out: dict[str, bool], version: str = "1") -> tuple[bytes, dict[str, str], str]:
    names = wanted if wanted is not None else list(outputs)
    out, blobs = [], []
    for name in names:
        arr = outputs[name]
        t: dict[str, Any] = {"name": name, "datatype": tensors.datatype_of(arr.dtype), "shape": list(arr.shape)}
        if binary_out.get(name):
            raw = tensors.to_bytes(arr)
            t["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            t["data"] = tensors.to_values(arr)  # exact: see tensors.to_values
        out.append(t)
    doc: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": out}
    if req_id is not None:
        doc["id"] = req_id
    head = json.dumps(doc, allow_nan=True).encode()
    if not blobs:
        return head, {}, "application/json"
    return head + b"".join(blobs), {"Inference-Header-Content-Length": str(len(head))}, "application/octet-stream"


__all__ = ["refuse_overrides", "oip_routes", "parse_infer", "render_infer", "INFER_MAX_BODY_BYTES"]
