"""The status server's routes as a Starlette app (the server itself: :mod:`.server`).

Thin: each route reads and checks the request, calls the public ``Runtime`` API (or a
service's hook) on a worker thread, and answers JSON. Refusals end a request through
:class:`Reply`; anything unexpected is a 500 that names the exception type and never reaches
the runtime. Paths under ``/jobs/`` and ``/v2/models/`` are split on the *raw* path, then each
piece unquoted, so a job or model name may hold a URL-quoted slash.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
from typing import Any, Awaitable, Callable
from urllib.parse import unquote

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from ..._errors import XShareError
from .server import ACTIONS, BODY_TIMEOUT_S, MAX_BODY_BYTES, PRIORITY_MAX, Refused

log = logging.getLogger("xshare.server")

ALL_METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]
ENDPOINTS = ("GET /status, GET /metrics, GET /jobs, POST /jobs, "
             "POST /jobs/{name}/{pause|resume|cancel|priority}, GET /v2/models/{name}")


class Reply(XShareError):
    """Ends a request with an HTTP status and a JSON body ``{"error": message, **extra}``."""

    def __init__(self, code: int, message: str, headers: dict[str, str] | None = None,
                 extra: dict[str, Any] | None = None):
        super().__init__(message)
        self.code, self.message, self.headers, self.extra = code, message, headers or {}, extra or {}


def json_response(code: int, payload: Any, headers: dict[str, str] | None = None) -> Response:
    body = (json.dumps(payload, allow_nan=False) + "\n").encode()
    return Response(body, code, {"Cache-Control": "no-store", **(headers or {})}, "application/json")


def refusal(reply: Reply) -> Response:
    # Close after a refusal: a body we did not read may still be in the socket.
    return json_response(reply.code, {"error": reply.message, **reply.extra},
                         {**reply.headers, "Connection": "close"})


def endpoint(fn: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """One bad request must never hurt the runtime: refusals become their answer, bugs a 500."""

    @functools.wraps(fn)
    async def wrapped(request: Request) -> Response:
        try:
            return await fn(request)
        except Reply as reply:
            return refusal(reply)
        except Refused as err:
            return refusal(Reply(err.code, err.message, err.headers, err.extra))
        except ClientDisconnect:  # the client hung up mid-body: nobody to answer
            return Response(b"", 400, {"Connection": "close"})
        except Exception as err:  # noqa: BLE001
            log.warning("status server: %s %s failed: %s: %s", request.method, request.url.path,
                        type(err).__name__, err)
            return refusal(Reply(500, f"internal error: {type(err).__name__}"))

    return wrapped


async def read_body(request: Request, limit: int = MAX_BODY_BYTES, *, too_large: int = 413) -> bytes:
    """The request's body, bounded: refused on its declared length before a byte is read, and
    408 if it stalls for ``BODY_TIMEOUT_S`` before its Content-Length is complete."""
    if "chunked" in request.headers.get("transfer-encoding", "").lower():
        raise Reply(411, "send a Content-Length; chunked bodies are not accepted")
    raw = request.headers.get("content-length")
    try:
        length = int(raw) if raw is not None else 0
    except ValueError:
        raise Reply(400, f"Content-Length {raw!r} is not a number") from None
    if length < 0:
        raise Reply(400, f"Content-Length {length} is negative")
    if length > limit:  # never read it: that is the point of the limit
        raise Reply(too_large, f"the body is {length} bytes; the limit is {limit}")
    if not length:
        return b""
    try:
        body = await asyncio.wait_for(request.body(), BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        body = None
    if body is None or len(body) < length:
        raise Reply(408, f"the body ended before its Content-Length of {length} bytes "
                         f"(nothing more arrived within {BODY_TIMEOUT_S:g} s); send the whole body")
    return body


def parse_json(body: bytes, hint: str = "") -> Any:
    try:
        return json.loads(body or b"null")
    except (ValueError, UnicodeDecodeError) as err:
        raise Reply(400, f"the body is not JSON{hint}: {err}") from None


def authorize(srv: Any, request: Request, what: str = "changing a job") -> None:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    ok = hmac.compare_digest(given.strip().encode(), srv.token.encode())
    if scheme.lower() != "bearer" or not ok:
        raise Reply(401, f"{what} needs 'Authorization: Bearer <token>'; the token is in the runtime's "
                         "discovery file (see `xshare top`)", {"WWW-Authenticate": 'Bearer realm="xshare"'})


def raw_parts(request: Request) -> list[str]:
    """The path split on its raw slashes, each piece unquoted (``%2F`` stays inside a name)."""
    raw = request.scope.get("raw_path") or request.url.path.encode()
    return [unquote(p) for p in raw.decode("latin-1").split("?", 1)[0].split("/")]


def build_app(srv: Any) -> AccessLog:
    rt = srv.rt

    @endpoint
    async def status(request: Request) -> Response:
        return json_response(200, await run_in_threadpool(rt.snapshot))

    @endpoint
    async def metrics(request: Request) -> Response:
        from ..observe import metrics as prom  # prometheus_client: loaded on the first scrape

        def render() -> bytes:
            return prom.exposition(rt.snapshot())

        return Response(await run_in_threadpool(render), 200, {"Cache-Control": "no-store"},
                        prom.CONTENT_TYPE)

    @endpoint
    async def jobs(request: Request) -> Response:
        if request.method == "POST":
            authorize(srv, request)
            payload = parse_json(await read_body(request))
            return json_response(200, await run_in_threadpool(srv.submit, payload))
        doc = await run_in_threadpool(rt.snapshot)
        keep = ("name", "status", "steps_done", "steps_total", "priority", "error")
        return json_response(200, {"jobs": [{k: j.get(k) for k in keep} for j in doc["jobs"]]})

    @endpoint
    async def job_action(request: Request) -> Response:
        parts = raw_parts(request)  # ["", "jobs", name, action]
        if len(parts) == 3 and parts[2] == "":  # "/jobs/" is "/jobs"
            return await jobs(request)
        if not (len(parts) == 4 and parts[2] and parts[3] in ACTIONS):
            raise Reply(404, f"no such endpoint {request.url.path!r}; try {ENDPOINTS}")
        if request.method != "POST":
            raise Reply(405, f"{request.method} is not allowed on {request.url.path}; use POST",
                        {"Allow": "POST"})
        name, action = parts[2], parts[3]
        authorize(srv, request)
        body = await read_body(request)
        priority = None
        if action == "priority":
            payload = parse_json(body)
            if not isinstance(payload, dict) or "priority" not in payload:
                raise Reply(400, 'the body must be a JSON object {"priority": <int>}')
            priority = payload["priority"]
            if not isinstance(priority, int) or isinstance(priority, bool) or abs(priority) > PRIORITY_MAX:
                raise Reply(400, f"priority={priority!r} must be an int in -{PRIORITY_MAX}..{PRIORITY_MAX}")
        elif body.strip():
            parse_json(body, " (send none, or {})")
        return json_response(200, await run_in_threadpool(_control, rt, name, action, priority))

    @endpoint
    async def deploy(request: Request) -> Response:
        authorize(srv, request, "deploying a model")
        payload = parse_json(await read_body(request))
        return json_response(200, await run_in_threadpool(srv.deploy, payload))

    @endpoint
    async def undeploy(request: Request) -> Response:
        authorize(srv, request, "undeploying a model")
        raw = request.query_params.get("version")
        if raw is not None and (not raw.isdigit() or int(raw) < 1):
            raise Reply(400, f"version={raw!r} must be an integer >= 1 (leave it out to undeploy every version)")
        version = int(raw) if raw is not None else None
        return json_response(200, await run_in_threadpool(srv.undeploy, raw_parts(request)[2], version))

    jobs_methods = ["GET", "POST"] if srv.submit is not None else ["GET"]
    routes = [Route("/status", status, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"]),
              Route("/jobs", jobs, methods=jobs_methods),
              Route("/jobs/{rest:path}", job_action, methods=ALL_METHODS)]
    if srv.deploy is not None:
        routes.append(Route("/models", deploy, methods=["POST"]))
    if srv.undeploy is not None:
        routes.append(Route("/models/{name}", undeploy, methods=["DELETE"]))
    from ...serving.oip import oip_routes

    routes += oip_routes(rt, srv)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            return refusal(Reply(405, f"{request.method} is not allowed on {request.url.path}; use {allowed}",
                                 {"Allow": allowed}))
        if exc.status_code == 404:
            return refusal(Reply(404, f"no such endpoint {request.url.path!r}; try {ENDPOINTS}"))
        return refusal(Reply(exc.status_code, str(exc.detail)))

    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
    return AccessLog(app)


def _control(rt: Any, name: str, action: str, priority: int | None) -> dict[str, Any]:
    try:
        handle = rt.handle(name)
    except KeyError as err:
        raise Reply(404, str(err.args[0]) if err.args else f"no job {name!r}") from None
    try:
        if action == "priority":
            rt.set_priority(handle, priority)
        else:
            getattr(rt, action)(handle)
    except XShareError as err:  # e.g. pausing a job that already ended
        raise Reply(409, str(err)) from None
    except (ValueError, TypeError) as err:
        raise Reply(400, str(err)) from None
    log.info("status server: %s job %r", action, name)
    return {"job": handle.name, "action": action, "status": handle.status(),
            **({"priority": priority} if priority is not None else {})}


class AccessLog:
    """Request lines to ``xshare.server`` at debug, never stderr: the path, never a header (no token)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        code = [0]

        async def send_logged(message: dict) -> None:
            if message["type"] == "http.response.start":
                code[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_logged)
        finally:
            if log.isEnabledFor(logging.DEBUG):
                client = (scope.get("client") or ("-",))[0]
                path = (scope.get("raw_path") or b"").decode("latin-1") or scope["path"]
                log.debug('status server %s: "%s %s HTTP/%s" %d', client, scope["method"], path,
                          scope.get("http_version", "1.1"), code[0])
