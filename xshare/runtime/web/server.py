"""The runtime's HTTP server (its discovery file: :mod:`.discovery`; its routes: :mod:`.http_app`).

Endpoints (JSON unless noted; every error is ``{"error": "..."}`` with a 4xx/5xx code):

  GET  /status                     the snapshot (schema ``xshare.status/v1``, see status.py)
  GET  /metrics                    Prometheus text format
  GET  /jobs                       ``{"jobs": [{name, status, steps_done, steps_total, priority}]}``
  POST /jobs                       |  submit (only a service, ``xshare serve``): body
                                   |  ``{"jobs": [{"entry": "module:function", ...}]}``
  POST /jobs/{name}/pause          | need ``Authorization: Bearer <token>``
  POST /jobs/{name}/resume         |
  POST /jobs/{name}/cancel         |
  POST /jobs/{name}/priority       |  body ``{"priority": <int>}``, |priority| <= 2**31-1
  POST /models                     |  deploy (only a service): ``{"entry": ..., "params": {...}, "name": ...}``
  DELETE /models/{name}            /  undeploy
  GET  /v2/...                     the Open Inference Protocol (:mod:`xshare.serving.oip`): no token

Refusals are 4xx with nothing changed: 401 no or wrong token, 400 a malformed body or value,
404 an unknown job, 408 a body shorter than its Content-Length (after ``BODY_TIMEOUT_S``),
409 an action the job's state forbids, 411/413 chunked or over-long bodies.

A client that has not sent a whole request head within ``HEADER_TIMEOUT_S`` is disconnected.

Reading is open to anyone who can reach the socket, which by default is only this host
(``127.0.0.1``); changing state needs the random token that only the discovery file (mode
0600, readable by this user) carries. The token is never logged. Inference (``/v2``) needs no
token: Open Inference Protocol clients (tritonclient, KServe) send none, and asking a model is
not changing state; deploying and undeploying are, and need it.

The server is Starlette served by uvicorn (h11) on an asyncio loop in one daemon thread of its
own: one event loop holds every connection (hundreds of concurrent clients cost sockets, not
threads), routing, HTTP parsing, keep-alive and malformed-request answers are uvicorn's and
Starlette's, and anything that can block (a snapshot, a control call that waits on the
dispatcher, a submit that waits for compiles, an inference that waits for its batch) runs on
Starlette's worker threads or awaits a future, never on the dispatcher's thread and never
stalling the loop. We bind the socket ourselves: a port in use is an ``XShareError`` at once,
and the port is known before the loop starts.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any

from ..._errors import XShareError
from .discovery import discover as discover
from .discovery import discovery_dir as discovery_dir
from .discovery import loopback, write_private
from .discovery import pid_alive as pid_alive

log = logging.getLogger("xshare.server")

MAX_BODY_BYTES = 1024 * 1024  # a few thousand job requests in one POST /jobs
ACTIONS = ("pause", "resume", "cancel", "priority")
PRIORITY_MAX = 2**31 - 1  # priorities cross JSON into policies: a signed 32-bit int holds them exactly
BODY_TIMEOUT_S = 5.0  # a client may stall this long mid-body before it gets 408
KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this
BACKLOG = 128  # listen() backlog: a sweep driver or dashboard opens many connections at once
HEADER_TIMEOUT_S = 10.0  # a connection that has not sent a whole request head by then is closed


class Refused(XShareError):
    """A submit hook's refusal: answered with HTTP ``code`` and ``{"error": message, **extra}``."""

    def __init__(self, code: int, message: str, extra: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.code, self.message, self.extra, self.headers = code, message, extra or {}, headers or {}


# ---------------------------------------------------------------------------------------- server

class StatusServer:
    """Serves a runtime's status over HTTP and announces it in a discovery file.

    ``port=0`` picks a free port (see ``address`` after ``start``). ``host`` is loopback by
    default; anything else exposes ``/status`` to the network (control still needs the token).
    """

    def __init__(self, rt: Any, host: str = "127.0.0.1", port: int = 0, *,
                 directory: str | os.PathLike | None = None, submit: Any = None,
                 announce: dict[str, Any] | None = None, deploy: Any = None, undeploy: Any = None,
                 repository: Any = None):
        """``submit``: ``callable(payload) -> dict`` behind ``POST /jobs`` (``xshare serve``
        passes one; a plain runtime has none and answers 405); it raises :class:`Refused`.
        ``deploy``/``undeploy``: ``callable(payload) -> dict`` / ``callable(name) -> dict``
        behind ``POST /models`` and ``DELETE /models/{name}`` (a service's; same rules).
        ``announce``: extra fields for the discovery record (e.g. ``{"kind": "service"}``).
        ``repository``: a model repository (``xshare.service.repository``) behind Triton's
        ``/v2/repository`` routes."""
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ValueError(f"status_port={port!r} must be an int in 0..65535 (0 picks a free port)")
        self.rt = rt
        self.host = host
        self.port = port
        # Hex, not urlsafe base64: a token that began with '-' (1 in 64 of those) was read as
        # an option by `xshare submit --token TOKEN` and refused ("expected one argument").
        self.token = secrets.token_hex(32)
        self.submit = submit
        self.deploy, self.undeploy = deploy, undeploy
        self.repository = repository
        self.extra = dict(announce or {})
        self._directory = Path(directory) if directory is not None else None
        self.socket: socket.socket | None = None
        self._uvicorn: Any = None
        self._thread: threading.Thread | None = None
        self.discovery_path: Path | None = None
        self.started: float | None = None

    @property
    def address(self) -> str:
        """``host:port`` as clients dial it (``[::1]:port`` for IPv6)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._uvicorn is not None

    def start(self) -> "StatusServer":
        if self._uvicorn is not None:
            return self
        import uvicorn  # the server stack loads with the first server, not with `import xshare`

        from .http_app import build_app

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY only on sockets whose .proto says TCP
        # (accepted ones inherit it). Without it a response's head and body, two writes, met the
        # client's delayed ACK under Nagle's algorithm: 40 ms a request on a kept-alive connection.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:  # no SO_REUSEADDR: never share a port with another runtime
            sock.bind((self.host, self.port))
            sock.listen(BACKLOG)
        except OSError as err:
            sock.close()
            raise XShareError(f"the status server cannot listen on {self.host}:{self.port}: {err}; "
                              "pick another status port (0 picks a free one)") from err
        self.socket = sock
        self.port = sock.getsockname()[1]
        _quiet_uvicorn()
        config = uvicorn.Config(
            build_app(self), http=_header_timeout_protocol(), loop="asyncio", lifespan="off", log_config=None,
            access_log=False,  # our middleware logs requests at debug, to xshare.server
            timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=2, backlog=BACKLOG,
            server_header=False, date_header=False,
            # uvicorn answers 503 past this many open connections instead of growing without end
            limit_concurrency=1024)
        server = uvicorn.Server(config)
        self._uvicorn = server
        self.started = time.time()
        self._thread = threading.Thread(target=self._serve, args=(server, sock),
                                        name=f"xshare-status-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        if not server.started:
            self.stop()
            raise XShareError(f"the status server on {self.address} did not start within 30 s")
        try:
            self._announce()
        except OSError as err:  # serving still works with --address; only discovery is lost
            log.warning("status server on %s: could not write its discovery file: %s", self.address, err)
        else:
            atexit.register(self._unannounce)  # a runtime that is never closed leaves no file
        if not loopback(self.host):
            log.warning("status server listens on %s, not loopback: anyone who can reach it may read "
                        "/status and /metrics and ask deployed models (changing jobs and models still "
                        "needs the token)", self.address)
        log.info("status server on http://%s (GET /status, /metrics, /v2)", self.address)
        return self

    @staticmethod
    def _serve(server: Any, sock: socket.socket) -> None:
        # A fresh event loop in this thread (asyncio.run): uvicorn installs no signal handlers
        # off the main thread, so the process's SIGINT/SIGTERM stay the CLI's.
        try:
            asyncio.run(server.serve(sockets=[sock]))
        except BaseException:  # the loop died: say so (logged), the runtime goes on
            log.warning("status server: its event loop ended with an error", exc_info=True)

    def stop(self) -> None:
        self._unannounce()
        atexit.unregister(self._unannounce)
        server, self._uvicorn = self._uvicorn, None
        if server is not None:
            server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self.socket is not None:
            self.socket.close()

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
        return f"StatusServer({self.address}, running={self.running})"


def start_servers(rt: Any, host: str, status_port: int | None, grpc_port: int | None) -> None:
    """``rt``'s HTTP server (``status_port``) and gRPC server (``grpc_port``), each if asked,
    set on ``rt.status_server`` / ``rt.grpc_server`` as each starts (so ``rt.close()`` stops
    whichever started if the other fails)."""
    if status_port is not None:
        rt.status_server = StatusServer(rt, host=host, port=status_port)
        rt.status_server.start()
    if grpc_port is not None:
        from .grpc_server import GrpcServer
        rt.grpc_server = GrpcServer(rt, host=host, port=grpc_port).start()


def _header_timeout_protocol() -> type:
    """uvicorn's h11 protocol, plus a deadline for the first request head: uvicorn times out idle
    keep-alive connections but not a client that opens one and trickles (or never sends) its
    request line, which would hold a socket for ever (slowloris)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        _head_deadline: asyncio.TimerHandle | None  # the request head's deadline, until it arrives

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._head_deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._head_late)

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and self._head_deadline is not None:  # a request head arrived
                self._head_deadline.cancel()
                self._head_deadline = None

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None
            super().connection_lost(exc)

        def _head_late(self) -> None:
            self._head_deadline = None
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

    return Protocol


def _quiet_uvicorn() -> None:
    """uvicorn logs a warning per malformed request and info lines at start; to a runtime those
    are a client's problem, not ours (they are answered 400). Left alone if the user set a level."""
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.ERROR)


__all__ = ["StatusServer", "Refused", "discover", "discovery_dir", "pid_alive", "MAX_BODY_BYTES",
           "PRIORITY_MAX"]
