"""The runtime's HTTP status server (its discovery file: :mod:`.discovery`).

Endpoints (JSON unless noted; every error is ``{"error": "..."}`` with a 4xx/5xx code):

  GET  /status                     the snapshot (schema ``xshare.status/v1``, see status.py)
  GET  /metrics                    Prometheus text format
  GET  /jobs                       ``{"jobs": [{name, status, steps_done, steps_total, priority}]}``
  POST /jobs                       |  submit (only a service, ``xshare serve``): body
                                   |  ``{"jobs": [{"entry": "module:function", ...}]}``
  POST /jobs/{name}/pause          | need ``Authorization: Bearer <token>``
  POST /jobs/{name}/resume         |
  POST /jobs/{name}/cancel         |
  POST /jobs/{name}/priority       /  body ``{"priority": <int>}``, |priority| <= 2**31-1

Refusals are 4xx with nothing changed: 401 no or wrong token, 400 a malformed body or value,
404 an unknown job, 408 a body shorter than its Content-Length (after ``_Handler.timeout``),
409 an action the job's state forbids, 411/413 chunked or over-long bodies.

Reading is open to anyone who can reach the socket, which by default is only this host
(``127.0.0.1``); changing state needs the random token that only the discovery file (mode
0600, readable by this user) carries. The token is never logged.

One ``ThreadingHTTPServer`` on a daemon thread, one short-lived thread per request: a slow or
broken client costs one thread for at most ``_Handler.timeout`` seconds and never touches the
dispatcher, which a snapshot never stops (it reads single attributes).

Why the standard library's server and not a web framework: five fixed routes on loopback, no
async, no templates; ``http.server`` adds no dependency and no event loop to a process whose
threads belong to the lanes. (``prometheus_client.start_http_server`` serves only ``/metrics``:
it has no authenticated control routes.) ``/status`` and ``/metrics`` both render the document
of the public ``Runtime.snapshot()``; ``/metrics`` through ``prometheus_client`` (:mod:`.metrics`).
"""

from __future__ import annotations

import atexit
import hmac
import json
import logging
import os
import secrets
import socket
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from .._errors import XShareError
from .discovery import discover as discover
from .discovery import discovery_dir as discovery_dir
from .discovery import loopback, write_private
from .discovery import pid_alive as pid_alive

log = logging.getLogger("xshare.server")

MAX_BODY_BYTES = 1024 * 1024  # a few thousand job requests in one POST /jobs
ACTIONS = ("pause", "resume", "cancel", "priority")
PRIORITY_MAX = 2**31 - 1  # priorities cross JSON into policies: a signed 32-bit int holds them exactly
_GONE = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)  # the client hung up


class Refused(XShareError):
    """A submit hook's refusal: answered with HTTP ``code`` and ``{"error": message, **extra}``."""

    def __init__(self, code: int, message: str, extra: dict[str, Any] | None = None):
        super().__init__(message)
        self.code, self.message, self.extra = code, message, extra or {}


# ---------------------------------------------------------------------------------------- server

class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = False  # never share a port with another runtime
    # listen() backlog: the default 5 refuses connections when a sweep driver or a dashboard
    # opens many at once; 128 is what the kernel commonly caps somaxconn at anyway.
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], runtime: Any, token: str, submit: Any = None):
        host = address[0]
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.runtime = runtime
        self.token = token
        self.submit = submit
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # The default prints a traceback to stderr; a client that hangs up is not our error.
        log.debug("status server: error while serving a request", exc_info=True)


class StatusServer:
    """Serves a runtime's status over HTTP and announces it in a discovery file.

    ``port=0`` picks a free port (see ``address`` after ``start``). ``host`` is loopback by
    default; anything else exposes ``/status`` to the network (control still needs the token).
    """

    def __init__(self, rt: Any, host: str = "127.0.0.1", port: int = 0, *,
                 directory: str | os.PathLike | None = None, submit: Any = None,
                 announce: dict[str, Any] | None = None):
        """``submit``: ``callable(payload) -> dict`` behind ``POST /jobs`` (``xshare serve``
        passes one; a plain runtime has none and answers 405); it raises :class:`Refused`.
        ``announce``: extra fields for the discovery record (e.g. ``{"kind": "service"}``)."""
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ValueError(f"status_port={port!r} must be an int in 0..65535 (0 picks a free port)")
        self.rt = rt
        self.host = host
        self.port = port
        self.token = secrets.token_urlsafe(32)
        self.submit = submit
        self.extra = dict(announce or {})
        self._directory = Path(directory) if directory is not None else None
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None
        self.discovery_path: Path | None = None
        self.started: float | None = None

    @property
    def address(self) -> str:
        """``host:port`` as clients dial it (``[::1]:port`` for IPv6)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def start(self) -> "StatusServer":
        if self._httpd is not None:
            return self
        try:
            self._httpd = _Server((self.host, self.port), self.rt, self.token, self.submit)
        except OSError as err:
            raise XShareError(f"the status server cannot listen on {self.host}:{self.port}: {err}; "
                              "pick another status port (0 picks a free one)") from err
        self.port = self._httpd.server_address[1]
        self.started = time.time()
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=f"xshare-status-{self.port}", daemon=True)
        self._thread.start()
        try:
            self._announce()
        except OSError as err:  # serving still works with --address; only discovery is lost
            log.warning("status server on %s: could not write its discovery file: %s", self.address, err)
        else:
            atexit.register(self._unannounce)  # a runtime that is never closed leaves no file
        if not loopback(self.host):
            log.warning("status server listens on %s, not loopback: anyone who can reach it may read "
                        "/status and /metrics (changing jobs still needs the token)", self.address)
        log.info("status server on http://%s (GET /status, /metrics)", self.address)
        return self

    def stop(self) -> None:
        self._unannounce()
        atexit.unregister(self._unannounce)
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _announce(self) -> None:
        directory = self._directory or discovery_dir()
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = directory / f"{os.getpid()}-{self.port}.json"
        record = {**self.extra, "pid": os.getpid(), "address": self.address, "token": self.token,
                  "started": self.started}
        write_private(path, json.dumps(record) + "\n")
        self.discovery_path = path

    def _unannounce(self) -> None:
        if self.discovery_path is not None:
            try:
                self.discovery_path.unlink()
            except FileNotFoundError:
                pass
            except OSError as err:
                log.warning("could not remove discovery file %s: %s", self.discovery_path, err)
            self.discovery_path = None

    def __repr__(self) -> str:  # no token here: reprs end up in logs
        return f"StatusServer({self.address}, running={self._httpd is not None})"


class _Reply(Exception):
    """Ends a request with an HTTP status and a JSON body."""

    def __init__(self, code: int, message: str, headers: dict[str, str] | None = None,
                 extra: dict[str, Any] | None = None):
        super().__init__(message)
        self.code, self.message, self.headers, self.extra = code, message, headers or {}, extra or {}


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    server_version = "xshare"
    sys_version = ""
    # Seconds a client may stall mid-request (a body shorter than its Content-Length answers
    # 408 after this) before its thread gives up; also how long an idle keep-alive lingers.
    timeout = 5

    # -------------------------------------------------------------- dispatch
    def do_GET(self) -> None:
        self._serve("GET")

    def do_HEAD(self) -> None:
        self._serve("HEAD")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def do_OPTIONS(self) -> None:
        self._serve("OPTIONS")

    def __getattr__(self, name: str) -> Any:
        # Any other method (BREW, PROPFIND...) gets our 404/405 instead of http.server's 501.
        if name.startswith("do_") and name[3:].isupper():
            return lambda: self._serve(name[3:])
        raise AttributeError(name)

    def _serve(self, method: str) -> None:
        try:
            path = urlsplit(self.path).path
            allowed, route = self._route(path)
            if allowed is None:
                raise _Reply(404, f"no such endpoint {path!r}; try GET /status, GET /metrics, GET /jobs, "
                                  "POST /jobs or POST /jobs/{name}/{pause|resume|cancel|priority}")
            if method not in allowed and not (method == "HEAD" and "GET" in allowed):
                raise _Reply(405, f"{method} is not allowed on {path}; use {', '.join(allowed)}",
                             {"Allow": ", ".join(allowed)})
            route(method)
        except _GONE:  # the client hung up mid-answer: nothing to tell anyone
            self.close_connection = True
        except _Reply as reply:
            self.close_connection = True  # a body we refused may still be in the socket
            try:
                self._send_json(reply.code, {"error": reply.message, **reply.extra}, reply.headers,
                                head=method == "HEAD")
            except _GONE:
                pass
        except Exception as err:  # noqa: BLE001 - one bad request must never hurt the runtime
            log.warning("status server: %s %s failed: %s: %s", method, urlsplit(self.path).path,
                        type(err).__name__, err)
            self.close_connection = True
            try:
                self._send_json(500, {"error": f"internal error: {type(err).__name__}"}, head=method == "HEAD")
            except _GONE:
                pass

    def _route(self, path: str):
        if path == "/status":
            return ("GET",), self._get_status
        if path == "/metrics":
            return ("GET",), self._get_metrics
        if path in ("/jobs", "/jobs/"):
            if self.server.submit is None:  # a plain runtime: jobs arrive as Python objects only
                return ("GET",), self._jobs
            return ("GET", "POST"), self._jobs
        parts = path.split("/")
        if len(parts) == 4 and parts[0] == "" and parts[1] == "jobs" and parts[2] and parts[3] in ACTIONS:
            name, action = unquote(parts[2]), parts[3]
            return ("POST",), lambda method: self._control(name, action)
        return None, None

    # -------------------------------------------------------------- reads
    def _get_status(self, method: str) -> None:
        self._send_json(200, self.server.runtime.snapshot(), head=method == "HEAD")

    def _get_metrics(self, method: str) -> None:
        from . import metrics  # prometheus_client: loaded on the first scrape, not with the runtime

        body = metrics.exposition(self.server.runtime.snapshot())
        self._send(200, body, metrics.CONTENT_TYPE, head=method == "HEAD")

    def _jobs(self, method: str) -> None:
        if method == "POST":
            return self._submit()
        doc = self.server.runtime.snapshot()
        keep = ("name", "status", "steps_done", "steps_total", "priority", "error")
        self._send_json(200, {"jobs": [{k: j.get(k) for k in keep} for j in doc["jobs"]]},
                        head=method == "HEAD")

    # -------------------------------------------------------------- control
    def _submit(self) -> None:
        self._authorize()
        body = self._read_body()
        try:
            payload = json.loads(body or b"null")
        except (ValueError, UnicodeDecodeError) as err:
            raise _Reply(400, f"the body is not JSON: {err}") from None
        try:
            answer = self.server.submit(payload)
        except Refused as err:
            raise _Reply(err.code, err.message, extra=err.extra) from None
        self._send_json(200, answer)

    def _control(self, name: str, action: str) -> None:
        self._authorize()
        body = self._read_body()
        rt = self.server.runtime
        priority = None
        if action == "priority":
            try:
                payload = json.loads(body or b"null")
            except (ValueError, UnicodeDecodeError) as err:
                raise _Reply(400, f"the body is not JSON: {err}") from None
            if not isinstance(payload, dict) or "priority" not in payload:
                raise _Reply(400, 'the body must be a JSON object {"priority": <int>}')
            priority = payload["priority"]
            if not isinstance(priority, int) or isinstance(priority, bool) or abs(priority) > PRIORITY_MAX:
                raise _Reply(400, f"priority={priority!r} must be an int in -{PRIORITY_MAX}..{PRIORITY_MAX}")
        elif body.strip():
            try:
                json.loads(body)
            except (ValueError, UnicodeDecodeError) as err:
                raise _Reply(400, f"the body is not JSON (send none, or {{}}): {err}") from None
        try:
            handle = rt.handle(name)
        except KeyError as err:
            raise _Reply(404, str(err.args[0]) if err.args else f"no job {name!r}") from None
        try:
            if action == "priority":
                rt.set_priority(handle, priority)
            else:
                getattr(rt, action)(handle)
        except XShareError as err:  # e.g. pausing a job that already ended
            raise _Reply(409, str(err)) from None
        except (ValueError, TypeError) as err:
            raise _Reply(400, str(err)) from None
        log.info("status server: %s job %r", action, name)
        self._send_json(200, {"job": handle.name, "action": action, "status": handle.status(),
                              **({"priority": priority} if priority is not None else {})})

    def _authorize(self) -> None:
        header = self.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        ok = hmac.compare_digest(given.strip().encode(), self.server.token.encode())
        if scheme.lower() != "bearer" or not ok:
            self.close_connection = True  # the body (if any) stays unread
            raise _Reply(401, "changing a job needs 'Authorization: Bearer <token>'; the token is in "
                              "the runtime's discovery file (see `xshare top`)",
                         {"WWW-Authenticate": 'Bearer realm="xshare"'})

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True
            raise _Reply(411, "send a Content-Length; chunked bodies are not accepted")
        raw = self.headers.get("Content-Length")
        try:
            length = int(raw) if raw is not None else 0
        except ValueError:
            self.close_connection = True
            raise _Reply(400, f"Content-Length {raw!r} is not a number") from None
        if length < 0:
            self.close_connection = True
            raise _Reply(400, f"Content-Length {length} is negative")
        if length > MAX_BODY_BYTES:
            self.close_connection = True  # never read it: that is the point of the limit
            raise _Reply(413, f"the body is {length} bytes; the limit is {MAX_BODY_BYTES}")
        if not length:
            return b""
        try:
            body = self.rfile.read(length)
        except TimeoutError:  # socket.timeout: the client sent less than it announced, then stalled
            body = None
        if body is None or len(body) < length:
            self.close_connection = True
            raise _Reply(408, f"the body ended before its Content-Length of {length} bytes "
                              f"(nothing more arrived within {self.timeout} s); send the whole body")
        return body

    # -------------------------------------------------------------- responses
    def _send_json(self, code: int, payload: Any, headers: dict[str, str] | None = None, *,
                   head: bool = False) -> None:
        body = (json.dumps(payload, allow_nan=False) + "\n").encode()
        self._send(code, body, "application/json", headers, head=head)

    def _send(self, code: int, body: bytes, content_type: str, headers: dict[str, str] | None = None,
              *, head: bool = False) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # http.server's own refusals (a malformed request line, over-long headers): JSON like
        # ours, with a status line even for what it took as HTTP/0.9, and the connection closed.
        if getattr(self, "request_version", "HTTP/0.9") == "HTTP/0.9":
            self.request_version = "HTTP/1.0"
        self.close_connection = True
        try:
            phrase = HTTPStatus(code).phrase
        except ValueError:
            phrase = "error"
        self._send_json(code, {"error": message or phrase}, head=getattr(self, "command", None) == "HEAD")

    def log_message(self, format: str, *args: Any) -> None:
        # Request lines go to debug, never stderr; they hold the path but no header (no token).
        log.debug("status server %s: " + format, self.address_string(), *args)

    def log_error(self, format: str, *args: Any) -> None:
        log.debug("status server %s: " + format, self.address_string(), *args)


__all__ = ["StatusServer", "Refused", "discover", "discovery_dir", "pid_alive", "MAX_BODY_BYTES",
           "PRIORITY_MAX"]
