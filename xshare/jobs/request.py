"""Jobs as plain data: what crosses a process boundary instead of a closure.

A :class:`JobRequest` is the launch spec's job shape after expansion (one grid point):
``{"entry": "module:function", "params": {...}, "steps": N, "name": ..., "priority": ...}``.
It is the one "job as data" type: the jobs of a launch plan (``xshare launch``), of
``xshare submit``, of the control API's ``POST /jobs``, of the Ray actors and of the
benchmarks' child processes. Only the side that runs the job imports the
entry (:meth:`JobRequest.build`, through :func:`xshare.jobs.build`): a client never needs
jax, nor even the module, to describe a job.

Pure Python, no jax: validating a request imports nothing of the user's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from .._errors import SpecError

SCHEMA_ID = "xshare.jobs/v1"
FIELDS = ("entry", "params", "steps", "name", "priority")
# Priorities cross JSON and land in policies that compare them: bounded so that every runtime,
# language and database on the way holds them exactly (a signed 32-bit int).
PRIORITY_MAX = 2**31 - 1


class RequestError(SpecError):
    """A job request is malformed; the message names the field, the value and the fix."""


def safe(text: str) -> str:
    """Filesystem-safe on every OS, and left unchanged by the runtime's own log-dir naming:
    ASCII letters, digits and ``. _ = , -``."""
    return re.sub(r"[^A-Za-z0-9._=,-]+", "-", text).strip("-.") or "job"


def check_priority(value: Any, who: str = "priority") -> int:
    if not isinstance(value, int) or isinstance(value, bool) or abs(value) > PRIORITY_MAX:
        raise RequestError(f"{who} = {value!r} must be a whole number in -{PRIORITY_MAX}..{PRIORITY_MAX} "
                           "(larger runs first)")
    return value


def _check_json_value(value: Any, where: str) -> None:
    """Params must survive JSON both ways unchanged: no NaN, no tuples, no objects."""
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise RequestError(f"{where} = {value!r}: JSON has no NaN or infinity; pass a finite number")
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_json_value(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise RequestError(f"{where}: key {k!r} must be a string")
            _check_json_value(v, f"{where}.{k}")
        return
    raise RequestError(f"{where} = {value!r} is a {type(value).__name__}; params are JSON values "
                       "(numbers, strings, booleans, lists, tables)")


@dataclass(frozen=True)
class JobRequest:
    """One job, described without live objects. ``name`` None: the service names it after
    the entry; ``steps`` None: the factory decides; ``priority`` None: the factory's.
    ``origin`` says where it was described (a spec file's table, the command line), for
    messages only: it is not part of the job (not compared, not sent)."""

    entry: str
    params: Mapping[str, Any] = field(default_factory=dict)
    steps: int | None = None
    name: str | None = None
    priority: int | None = None
    origin: str = field(default="submitted job", compare=False)

    def __post_init__(self) -> None:
        who = f"job {self.name!r}" if self.name else "job"
        e = self.entry
        if not isinstance(e, str) or e.count(":") != 1 or not all(p.strip() for p in e.split(":")):
            raise RequestError(f"{who}: entry = {e!r} must be 'module:function' "
                               "(e.g. 'xshare.models.mlp:make_job')")
        if not isinstance(self.params, Mapping):
            raise RequestError(f"{who}: params = {self.params!r} must be a table of keyword arguments")
        for k in self.params:
            if not isinstance(k, str) or not k.isidentifier():
                raise RequestError(f"{who}: params key {k!r} must be a Python identifier (a keyword argument)")
        _check_json_value(dict(self.params), f"{who}: params")
        if self.steps is not None and (not isinstance(self.steps, int) or isinstance(self.steps, bool)
                                       or self.steps < 0):
            raise RequestError(f"{who}: steps = {self.steps!r} must be a whole number >= 0, or omitted")
        if self.name is not None and (not isinstance(self.name, str) or not self.name.strip()
                                      or self.name in (".", "..") or "\x00" in self.name
                                      or len(self.name) > 200):
            raise RequestError(f"{who}: name = {self.name!r} must be a non-empty string of at most 200 "
                               "characters (letters, digits and -_.=, read best)")
        if self.priority is not None:
            check_priority(self.priority, f"{who}: priority")
        object.__setattr__(self, "params", dict(self.params))

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"entry": self.entry, "params": dict(self.params)}
        for key in ("steps", "name", "priority"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    @classmethod
    def from_json(cls, data: Any, where: str = "job") -> "JobRequest":
        if not isinstance(data, Mapping):
            raise RequestError(f"{where}: a job is a JSON object like "
                               '{"entry": "module:function", "params": {...}, "steps": N}; '
                               f"got {type(data).__name__}")
        unknown = [k for k in data if k not in FIELDS]
        if unknown:
            raise RequestError(f"{where}: unknown key {unknown[0]!r}; a job has {', '.join(FIELDS)}")
        if "entry" not in data:
            raise RequestError(f"{where}: missing 'entry' (\"module:function\")")
        try:
            return cls(**{k: data[k] for k in FIELDS if k in data and data[k] is not None})
        except RequestError as err:
            raise RequestError(f"{where}: {err}") from None

    @property
    def who(self) -> str:
        """The job in messages: its name, where it was described and its entry."""
        return f"job {self.name} ({self.origin}, {self.entry})"

    # ------------------------------------------------------------------ the side that runs it
    def build(self, name: str | None = None) -> Any:
        """Import the entry, call it with ``params`` and return the bound job (a JobSpec),
        named ``name`` (default: after the entry) and with steps/priority applied. Raises
        SpecError with a one-line reason (no module, no function, a wrong parameter, the
        factory raised)."""
        from .factory import build  # imports the user's module, and so jax: only here

        return build(dataclasses.replace(self, name=name or self.default_name()))

    def default_name(self) -> str:
        return safe(self.entry.split(":")[0].rpartition(".")[2])


def dumps(requests: list[JobRequest]) -> str:
    return json.dumps({"schema": SCHEMA_ID, "jobs": [r.to_json() for r in requests]}, allow_nan=False)


def loads(payload: Any, where: str = "body") -> list[JobRequest]:
    """Requests from ``POST /jobs``'s JSON: ``{"jobs": [...]}`` or a bare list."""
    if isinstance(payload, Mapping):
        if payload.get("schema", SCHEMA_ID) != SCHEMA_ID:
            raise RequestError(f"{where}: schema {payload.get('schema')!r} is not {SCHEMA_ID!r}")
        payload = payload.get("jobs")
    if not isinstance(payload, list) or not payload:
        raise RequestError(f'{where}: send a non-empty JSON list of jobs, or {{"jobs": [...]}}')
    return [JobRequest.from_json(j, f"{where} job #{i}") for i, j in enumerate(payload)]


__all__ = ["JobRequest", "RequestError", "dumps", "loads", "check_priority", "safe", "PRIORITY_MAX",
           "SCHEMA_ID"]
