"""The client side of ``xshare serve``: find the service, carry its token, call its control API.
Standard library HTTP only; no jax (``xshare submit`` and ``xshare ctl`` start in a blink).

The token comes, in order, from ``--token``, ``$XSHARE_TOKEN``, or the discovery file (mode
0600) that the service wrote for this user; a client on another host passes it explicitly.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from .._errors import XShareError


class ClientError(XShareError):
    """The service could not be reached, refused the call, or answered nonsense. ``code`` is
    the HTTP status (None when nothing answered); the message is the service's own."""

    def __init__(self, message: str, code: int | None = None, payload: Any = None):
        super().__init__(message)
        self.code, self.payload = code, payload


@dataclass
class Service:
    address: str
    token: str | None


def find(address: str | None = None, token: str | None = None) -> Service:
    """The service to talk to: ``address``, or the only ``xshare serve`` of this user."""
    from xshare.runtime.web.discovery import discover, discovery_dir

    token = token or os.environ.get("XSHARE_TOKEN") or None
    found = discover()
    if address:
        for rec in found:
            if rec["address"] == address:
                return Service(address, token or rec.get("token"))
        return Service(address, token)
    services = [r for r in found if r.get("kind") == "service"]
    if not services:
        raise ClientError(f"no xshare service found in {discovery_dir()}: start one with `xshare serve`, "
                          "or pass --address HOST:PORT (and --token) for one elsewhere")
    if len(services) > 1:
        listed = ", ".join(f"{r['address']} (pid {r['pid']})" for r in services)
        raise ClientError(f"{len(services)} xshare services are running: {listed}; pick one with --address")
    return Service(services[0]["address"], token or services[0].get("token"))


def call(svc: Service, method: str, path: str, payload: Any = None, *, timeout: float = 180.0) -> Any:
    """One HTTP call; the decoded JSON answer. Raises ClientError with the service's message."""
    body = None if payload is None else json.dumps(payload, allow_nan=False).encode()
    headers = {"Content-Type": "application/json"}
    if method != "GET":
        if not svc.token:
            call(svc, "GET", "/jobs", timeout=10)  # "no service there" says more than "no token"
            raise ClientError(f"no token for the service at {svc.address}: it is in the service's discovery "
                              "file on its host (or its run dir's service.json); pass --token or set XSHARE_TOKEN")
        headers["Authorization"] = f"Bearer {svc.token}"
    req = urllib.request.Request(f"http://{svc.address}{path}", data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        try:
            answer = json.loads(err.read())
        except ValueError:
            answer = {}
        message = answer.get("error") if isinstance(answer, dict) else None
        if err.code == 401:
            message = f"the service at {svc.address} refused the token (wrong or missing): {message}"
        raise ClientError(message or f"HTTP {err.code}", err.code, answer) from None
    except (OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        if isinstance(reason, ConnectionRefusedError):
            reason = "connection refused"
        raise ClientError(f"no xshare service at {svc.address} ({reason}); is `xshare serve` running there?") from None


def submit(svc: Service, requests: list[Any]) -> list[dict[str, Any]]:
    from xshare.jobs.request import SCHEMA_ID

    answer = call(svc, "POST", "/jobs", {"schema": SCHEMA_ID, "jobs": [r.to_json() for r in requests]})
    return list(answer["jobs"])


def jobs(svc: Service) -> list[dict[str, Any]]:
    return list(call(svc, "GET", "/jobs")["jobs"])


def control(svc: Service, name: str, action: str, priority: int | None = None) -> dict[str, Any]:
    payload = {"priority": priority} if action == "priority" else None
    return call(svc, "POST", f"/jobs/{quote(name, safe='')}/{action}", payload, timeout=30.0)


def deploy(svc: Service, request: Any) -> dict[str, Any]:
    return call(svc, "POST", "/models", request.to_json())


def undeploy(svc: Service, name: str, version: int | None = None) -> dict[str, Any]:
    """Undeploy model ``name``: every version, or only ``version``."""
    query = f"?version={int(version)}" if version is not None else ""
    return call(svc, "DELETE", f"/models/{quote(name, safe='')}{query}", timeout=60.0)


__all__ = ["ClientError", "Service", "find", "call", "submit", "jobs", "control", "deploy", "undeploy"]
