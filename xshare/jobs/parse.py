"""Reading a launch spec: the plan's data model, ``--set`` values, and the checks of the
``[runtime]`` and ``[[job]]`` tables. Pure Python: no jax, no user module is imported here.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from xshare._errors import SpecError
from xshare._units import parse_bytes

from .request import JobRequest
from .request import safe as safe
from .resolve import did_you_mean

TOP_KEYS = ("runtime", "job")
RUNTIME_KEYS = ("policy", "memory", "quantum", "fuse")
JOB_KEYS = ("entry", "steps", "replicas", "priority", "name", "params")
_MEMORY_DEVICE = ("device", "none")  # --memory device: let the runtime use the whole device


def policies() -> tuple[str, ...]:
    from xshare.sched import POLICIES  # pure: no jax

    return tuple(POLICIES)


@dataclass(frozen=True)
class RuntimeOptions:
    """What ``xshare.Runtime(...)`` is built with; ``memory`` is kept as written ("2GiB")."""

    policy: str = "pack"
    memory: int | str | None = None
    quantum: int = 1
    fuse: bool = False

    def as_kwargs(self) -> dict[str, Any]:
        return {"policy": self.policy, "memory": self.memory, "quantum": self.quantum, "fuse": self.fuse}


@dataclass(frozen=True)
class Overrides:
    """Command-line values that win over the spec file (None = not given)."""

    policy: str | None = None
    memory: str | None = None
    quantum: int | None = None
    fuse: bool | None = None
    steps: int | None = None
    replicas: int | None = None
    sets: Mapping[str, Any] = field(default_factory=dict)  # key -> value, or list of values to sweep


# One expanded job is the one "job as data" type, the request the service and Ray take too (its
# ``origin`` locates it in the spec). The old name stays for code that imports it.
PlannedJob = JobRequest


@dataclass(frozen=True)
class LaunchPlan:
    source: str  # the spec file, or the entry for --set launches
    stem: str  # names the default run directory
    runtime: RuntimeOptions
    jobs: tuple[JobRequest, ...]  # each named

    def to_json(self) -> dict[str, Any]:
        # The launch record (spec.json, --dry-run --json) keeps every key, null included.
        jobs = [{"name": j.name, "entry": j.entry, "params": dict(j.params), "steps": j.steps,
                 "priority": j.priority} for j in self.jobs]
        return {"schema": "xshare.launch/v1", "source": self.source,
                "runtime": dict(self.runtime.as_kwargs()), "jobs": jobs}


@dataclass
class JobTable:
    """One ``[[job]]`` table, checked, with the command line's overrides applied."""

    origin: str
    entry: str
    params: dict[str, Any]
    steps: int | None
    replicas: int
    priority: int | None
    name: str | None


# ---------------------------------------------------------------------------------- values


def parse_value(text: str) -> Any:
    """A ``--set`` value: int, else float, else bool (true/false), else the string itself."""
    text = text.strip()
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def parse_set(item: str) -> tuple[str, Any]:
    """``"lr=1e-3,3e-4"`` -> ``("lr", [0.001, 0.0003])``; one value stays a scalar."""
    key, eq, rest = item.partition("=")
    key = key.strip()
    if not eq or not key.isidentifier():
        raise SpecError(f"--set {item!r}: write --set NAME=VALUE or --set NAME=V1,V2,... (e.g. --set lr=1e-3,3e-4)")
    values = [parse_value(v) for v in rest.split(",")]
    if any(v == "" for v in values):
        raise SpecError(f"--set {item!r}: empty value; write --set {key}=V1,V2 with no empty items")
    return key, values if len(values) > 1 else values[0]


# ---------------------------------------------------------------------------------- tables


def load_spec(path: str | Path, keys: Sequence[str], allowed: str, missing_hint: str = "") -> dict[str, Any]:
    """A spec file's top-level tables, each key one of ``keys``; errors name ``path`` as given.

    ``allowed`` ends the unknown-key error ("Allowed: {allowed}."); ``missing_hint`` follows
    the missing-file one. Shared by launch specs (here) and tune specs (``search.py``).
    """
    try:
        raw = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SpecError(f"spec file {str(path)!r} does not exist{missing_hint}") from None
    except tomllib.TOMLDecodeError as err:
        raise SpecError(f"{path}: not valid TOML: {err}") from None
    for key in raw:
        if key not in keys:
            raise SpecError(f"{path}: unknown top-level key {key!r}{did_you_mean(key, keys)}. Allowed: {allowed}.")
    return raw


def read_toml(path: Path) -> tuple[Mapping[str, Any], list[Any]]:
    """The ``[runtime]`` table and the ``[[job]]`` tables of a spec file, shape-checked."""
    raw = load_spec(path, TOP_KEYS, "[runtime] and [[job]] tables", missing_hint=" (give SPEC.toml or module:function)")
    where = f"{path}: "
    runtime_raw = raw.get("runtime", {})
    if not isinstance(runtime_raw, Mapping):
        raise SpecError(f"{where}'runtime' must be a table: [runtime] policy = \"pack\"")
    jobs_raw = raw.get("job")
    if isinstance(jobs_raw, Mapping):
        raise SpecError(f"{where}write each job as [[job]] (an array of tables), not [job]")
    if not jobs_raw:
        raise SpecError(f"{where}no jobs: add at least one [[job]] table with entry = \"module:function\"")
    return runtime_raw, list(jobs_raw)


def check_runtime(raw: Mapping[str, Any], over: Overrides, where: str) -> RuntimeOptions:
    for key in raw:
        if key not in RUNTIME_KEYS:
            raise SpecError(
                f"{where}[runtime]: unknown key {key!r}{did_you_mean(key, RUNTIME_KEYS)}. "
                f"Allowed keys: {', '.join(RUNTIME_KEYS)}."
            )

    def pick(key: str, default: Any) -> tuple[Any, str]:
        """The command-line value if given, else the spec's; and where it came from."""
        flag = getattr(over, key)
        return (flag, f"--{key}") if flag is not None else (raw.get(key, default), f"{where}[runtime] {key}")

    policy, source = pick("policy", "pack")
    valid = policies()
    if policy not in valid:
        raise SpecError(
            f"{source} {policy!r} is not a policy{did_you_mean(str(policy), valid)}. Choose one of: {', '.join(valid)}."
        )
    memory, source = pick("memory", None)
    if isinstance(memory, str) and memory.strip().lower() in _MEMORY_DEVICE:
        memory = None
    if memory is not None:
        try:
            parse_bytes(memory)
        except ValueError as err:
            raise SpecError(f"{source}: {err}") from None
    quantum, source = pick("quantum", 1)
    if not isinstance(quantum, int) or isinstance(quantum, bool) or quantum < 1:
        raise SpecError(f"{source} = {quantum!r}: the quantum is a whole number of steps, at least 1")
    fuse, source = pick("fuse", False)
    if not isinstance(fuse, bool):
        raise SpecError(f"{source} = {fuse!r}: fuse is true or false")
    return RuntimeOptions(policy=policy, memory=memory, quantum=quantum, fuse=fuse)


def _check_int(value: Any, what: str, least: int, who: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise SpecError(f"{who}: {what} = {value!r} must be a whole number >= {least}")
    return value


def check_job(raw: Any, origin: str, over: Overrides) -> JobTable:
    if not isinstance(raw, Mapping):
        raise SpecError(f"{origin}: each [[job]] is a table of keys ({', '.join(JOB_KEYS)}); got {type(raw).__name__}")
    entry = raw.get("entry")
    who = f"{origin} ({entry})" if isinstance(entry, str) else origin
    for key in raw:
        if key not in JOB_KEYS:
            raise SpecError(f"{who}: unknown key {key!r}{did_you_mean(key, JOB_KEYS)}. Allowed keys: {', '.join(JOB_KEYS)}.")
    if "entry" not in raw:
        raise SpecError(f"{who}: missing required key 'entry'; add entry = \"module:function\" (e.g. entry = \"xshare.models.mlp:make_job\")")
    params = raw.get("params", {})
    if not isinstance(params, Mapping):
        raise SpecError(f"{who}: params must be a table, e.g. params = {{ lr = [1e-3, 3e-4] }}; got {type(params).__name__}")
    params = {**params, **over.sets}
    steps = over.steps if over.steps is not None else raw.get("steps")
    if steps is not None:
        _check_int(steps, "steps", 0, who)
    replicas = _check_int(over.replicas if over.replicas is not None else raw.get("replicas", 1), "replicas", 1, who)
    priority = raw.get("priority")
    if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)):
        raise SpecError(f"{who}: priority = {priority!r} must be a whole number (larger runs first)")
    name = raw.get("name")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise SpecError(f"{who}: name = {name!r} must be a non-empty string")
    for key, value in params.items():
        if isinstance(value, list) and not value:
            raise SpecError(f"{who}: params.{key} is an empty list, so the grid is empty; give at least one value")
    return JobTable(origin, raw["entry"], params, steps, replicas, priority, name)


def plan_from_json(data: Mapping[str, Any], where: str) -> LaunchPlan:
    """The plan a run directory's ``spec.json`` recorded (for ``xshare launch --resume``)."""
    if data.get("schema") != "xshare.launch/v1":
        raise SpecError(f"{where} is not an xshare launch record (schema {data.get('schema')!r}); "
                        "--resume takes a run directory written by xshare launch")
    rt = data.get("runtime") or {}
    runtime = RuntimeOptions(policy=rt.get("policy", "pack"), memory=rt.get("memory"),
                             quantum=rt.get("quantum", 1), fuse=bool(rt.get("fuse", False)))
    jobs = tuple(
        JobRequest(name=j["name"], entry=j["entry"], params=dict(j.get("params") or {}),
                   steps=j.get("steps"), priority=j.get("priority"), origin=f"{where} job #{i}")
        for i, j in enumerate(data.get("jobs") or []))
    source = str(data.get("source", where))
    return LaunchPlan(source=source, stem=Path(source).stem, runtime=runtime, jobs=jobs)
