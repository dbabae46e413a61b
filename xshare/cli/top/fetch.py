"""Where ``xshare top`` gets its data: the runtimes to ask (discovery files or ``--address``),
their ``/status`` documents, and the control POSTs of the live view. HTTP client only: no jax,
no device."""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Iterable, Sequence
from urllib.parse import quote

from ..._errors import XShareError

SCHEMA_ID = "xshare.status/v1"


@dataclass
class Target:
    """A runtime to ask: its address and, when we have it, its control token."""

    address: str
    token: str | None = None
    pid: int | None = None


@dataclass
class View:
    """What one runtime said this refresh: its status, or why there is none."""

    target: Target
    status: dict[str, Any] | None = None
    error: str | None = None


class NotAStatus(XShareError, ValueError):
    """The address answered, but not with an ``xshare.status/v1`` document."""


def fetch_status(address: str, timeout: float = 2.0) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{address}/status", timeout=timeout) as resp:
        doc = json.loads(resp.read())
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA_ID:
        found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise NotAStatus(f"answered with schema {found!r}, not {SCHEMA_ID!r} (another program, or another "
                         "xshare version: use the xshare that started the runtime)")
    return doc


def schema_errors(doc: Any, limit: int = 3) -> list[str]:
    """Why ``doc`` does not follow the status schema (empty: it does). Imports jsonschema, so
    ``top`` calls it only to explain a document it could not draw."""
    from xshare.runtime.observe.schema import validate

    return validate(doc)[:limit]


def control(target: Target, job: str, action: str, payload: Any = None, timeout: float = 5.0) -> dict[str, Any]:
    """POST a control action; returns the server's JSON. Raises RuntimeError with its error text."""
    body = json.dumps(payload).encode() if payload is not None else b""
    req = urllib.request.Request(f"http://{target.address}/jobs/{quote(job, safe='')}/{action}",
                                 data=body, method="POST",
                                 headers={"Authorization": f"Bearer {target.token or ''}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        try:
            message = json.loads(err.read()).get("error", "")
        except ValueError:
            message = ""
        raise RuntimeError(f"{err.code} {message}".strip()) from None
    except (OSError, ValueError) as err:
        raise RuntimeError(f"{target.address} unreachable: {err}") from None


def find_targets(args: argparse.Namespace) -> list[Target]:
    from xshare.runtime.web.discovery import discover

    found = discover()
    if args.address:
        token = args.token
        pid = None
        for rec in found:  # a discovery file for this address lends its token
            if rec["address"] == args.address:
                token = token or rec.get("token")
                pid = rec["pid"]
        return [Target(args.address, token, pid)]
    return [Target(rec["address"], args.token or rec.get("token"), rec["pid"]) for rec in found]


def fetch_all(targets: Iterable[Target]) -> list[View]:
    views = []
    for t in targets:
        try:
            views.append(View(t, status=fetch_status(t.address)))
        except (OSError, ValueError) as err:
            views.append(View(t, error=_why(err)))
    return views


def _why(err: BaseException) -> str:
    reason = getattr(err, "reason", None)
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    return str(reason if reason is not None else err)


def none_found(args: argparse.Namespace, views: Sequence[View] = ()) -> str:
    """The message for "no runtime answered"."""
    from xshare.runtime.web.discovery import discovery_dir

    if args.address:
        why = next((v.error for v in views if v.error), None)
        return f"no runtime at {args.address}" + (f" ({why})" if why else "")
    return (f"no running xshare runtime found in {discovery_dir()} "
            "(start one with status_port=0, e.g. Runtime(status_port=0), or pass --address HOST:PORT; "
            "XSHARE_RUNTIME_DIR overrides the directory)")
