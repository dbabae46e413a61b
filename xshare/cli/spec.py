"""Launch specs: a TOML file or ``module:function --set k=v1,v2`` expanded into a list of jobs.

A spec names factories (``module:function``) and the parameters to call them with. Lists
under ``params`` expand to a grid, the cartesian product of every list (like Hydra multirun),
and ``replicas = N`` runs each grid point N times. Everything here is checked before any job
starts: every problem is a :class:`xshare.SpecError` whose message names the job and the fix.

Rules a user relies on (also in the README):

* ``replicas = N`` passes ``seed = 0 .. N-1`` to the factory, unless ``params`` sets ``seed``
  itself: then the N replicas are identical copies (useful to measure sharing), named
  ``replica=i``.
* To pass a list as one value instead of sweeping it, wrap it in another list:
  ``layers = [[128, 64]]``.
* Job names are ``{num}_{k=v,...}``: ``num`` counts every job of the run from 0, zero-padded
  to the width of the count; ``k=v`` lists the swept parameters (sorted by key, plus ``seed``
  or ``replica`` when ``replicas > 1``). A job table's ``name`` goes first: ``{num}_{name}_...``.
  With nothing swept and no name, the label is the entry's module name.
* ``steps`` is passed to the factory as ``steps=`` when it takes that parameter, and is set on
  the returned job in any case; ``priority`` is set on the returned job.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import itertools
import pkgutil
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import xshare
from xshare._errors import SpecError
from xshare._job import Job, JobSpec
from xshare._units import parse_bytes

TOP_KEYS = ("runtime", "job")
RUNTIME_KEYS = ("policy", "memory", "quantum")
JOB_KEYS = ("entry", "steps", "replicas", "priority", "name", "params")
_MAX_LABEL = 120  # characters of k=v text in a job name; directory names stay well under 255
_MEMORY_DEVICE = ("device", "none")  # --memory device: let the runtime use the whole device


def policies() -> tuple[str, ...]:
    return tuple(xshare.POLICIES)


@dataclass(frozen=True)
class RuntimeOptions:
    """What ``xshare.Runtime(...)`` is built with; ``memory`` is kept as written ("2GiB")."""

    policy: str = "pack"
    memory: int | str | None = None
    quantum: int = 1

    def as_kwargs(self) -> dict[str, Any]:
        return {"policy": self.policy, "memory": self.memory, "quantum": self.quantum}


@dataclass(frozen=True)
class Overrides:
    """Command-line values that win over the spec file (None = not given)."""

    policy: str | None = None
    memory: str | None = None
    quantum: int | None = None
    steps: int | None = None
    replicas: int | None = None
    sets: Mapping[str, Any] = field(default_factory=dict)  # key -> value, or list of values to sweep


@dataclass(frozen=True)
class PlannedJob:
    """One expanded job: which factory, called with what. ``origin`` locates it in the spec."""

    index: int
    name: str
    entry: str
    params: Mapping[str, Any]
    steps: int | None  # None: the factory decides
    priority: int | None  # None: keep the factory's
    origin: str

    @property
    def who(self) -> str:
        return f"job {self.name} ({self.origin}, {self.entry})"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "entry": self.entry,
            "params": dict(self.params),
            "steps": self.steps,
            "priority": self.priority,
        }


@dataclass(frozen=True)
class LaunchPlan:
    source: str  # the spec file, or the entry for --set launches
    stem: str  # names the default run directory
    runtime: RuntimeOptions
    jobs: tuple[PlannedJob, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": "xshare.launch/v1",
            "source": self.source,
            "runtime": {k: v for k, v in self.runtime.as_kwargs().items()},
            "jobs": [j.to_json() for j in self.jobs],
        }


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


def _label_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)  # shortest exact form: 0.001, 0.0003, 1e-05
    if isinstance(value, (list, tuple)):
        return "-".join(_label_value(v) for v in value)
    return str(value)


def _safe(text: str) -> str:
    """Filesystem-safe on every OS, and left unchanged by the runtime's own log-dir naming:
    ASCII letters, digits and ``. _ = , -``."""
    return re.sub(r"[^A-Za-z0-9._=,-]+", "-", text).strip("-.") or "job"


def _did_you_mean(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


# ---------------------------------------------------------------------------------- runtime


def _check_runtime(raw: Mapping[str, Any], over: Overrides, where: str) -> RuntimeOptions:
    for key in raw:
        if key not in RUNTIME_KEYS:
            raise SpecError(
                f"{where}[runtime]: unknown key {key!r}{_did_you_mean(key, RUNTIME_KEYS)}. "
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
            f"{source} {policy!r} is not a policy{_did_you_mean(str(policy), valid)}. Choose one of: {', '.join(valid)}."
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
    return RuntimeOptions(policy=policy, memory=memory, quantum=quantum)


# ---------------------------------------------------------------------------------- entries


def resolve_entry(entry: Any, who: str) -> Callable[..., Any]:
    """``"models.mlp:make_job"`` -> the function. Errors list close matches when there are any."""
    if not isinstance(entry, str) or entry.count(":") != 1 or not all(entry.split(":")):
        raise SpecError(f"{who}: entry {entry!r} must be 'module:function' (e.g. 'models.mlp:make_job')")
    module_name, func_name = entry.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        missing = err.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            raise SpecError(
                f"{who}: no module named {missing!r}{_did_you_mean(missing, _sibling_modules(missing))}. "
                "Modules resolve from the current directory and the installed packages; run from the directory that holds it."
            ) from None
        raise SpecError(f"{who}: importing {module_name!r} failed: {err} (a dependency of that module is missing)") from None
    except Exception as err:  # the user's module raised while importing: show what, not our traceback
        raise SpecError(f"{who}: importing {module_name!r} raised {type(err).__name__}: {err}") from None

    fn = getattr(module, func_name, None)
    if fn is None:
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        hint = _did_you_mean(func_name, names)
        if not hint:
            own = [n for n in names if getattr(getattr(module, n), "__module__", None) == module.__name__]
            hint = f"; it defines: {', '.join(own[:12])}" if own else ""
        raise SpecError(f"{who}: module {module_name!r} has no function {func_name!r}{hint}")
    if not callable(fn):
        raise SpecError(f"{who}: {entry} is not a function (it is a {type(fn).__name__} value); name a function that returns a bound job")
    return fn


def _sibling_modules(dotted: str) -> list[str]:
    parent, _, _ = dotted.rpartition(".")
    try:
        path = importlib.import_module(parent).__path__ if parent else None
    except (ImportError, AttributeError):
        return []
    prefix = parent + "." if parent else ""
    return [prefix + m.name for m in pkgutil.iter_modules(path)]


def check_params(fn: Callable[..., Any], params: Mapping[str, Any], who: str, hint: str = ".") -> bool:
    """Check ``fn(**params)`` binds; return whether ``fn`` takes ``steps=``."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and C functions: nothing to check before calling
        return True
    kinds = inspect.Parameter
    var_kw = any(p.kind is kinds.VAR_KEYWORD for p in sig.parameters.values())
    named = [p.name for p in sig.parameters.values() if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)]
    if not var_kw:
        for key in params:
            if key not in named:
                raise SpecError(
                    f"{who}: the factory does not accept parameter {key!r}{_did_you_mean(key, named)}{hint} "
                    f"It accepts: {', '.join(named) or '(no parameters)'}."
                )
    variadic = (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)
    required = [
        p.name
        for p in sig.parameters.values()
        if p.default is kinds.empty and p.kind not in variadic and p.name not in params
    ]
    if required:
        raise SpecError(f"{who}: the factory needs {', '.join(repr(r) for r in required)}; set it under params (or with --set NAME=VALUE)")
    return var_kw or "steps" in named


def _steps_default(fn: Callable[..., Any]) -> int | None:
    try:
        param = inspect.signature(fn).parameters.get("steps")
    except (TypeError, ValueError):
        return None
    default = getattr(param, "default", None)
    return default if isinstance(default, int) and not isinstance(default, bool) else None


# ---------------------------------------------------------------------------------- expansion


@dataclass
class _Table:
    origin: str
    entry: str
    params: dict[str, Any]
    steps: int | None
    replicas: int
    priority: int | None
    name: str | None


def _check_int(value: Any, what: str, least: int, who: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise SpecError(f"{who}: {what} = {value!r} must be a whole number >= {least}")
    return value


def _table(raw: Any, origin: str, over: Overrides) -> _Table:
    if not isinstance(raw, Mapping):
        raise SpecError(f"{origin}: each [[job]] is a table of keys ({', '.join(JOB_KEYS)}); got {type(raw).__name__}")
    entry = raw.get("entry")
    who = f"{origin} ({entry})" if isinstance(entry, str) else origin
    for key in raw:
        if key not in JOB_KEYS:
            raise SpecError(f"{who}: unknown key {key!r}{_did_you_mean(key, JOB_KEYS)}. Allowed keys: {', '.join(JOB_KEYS)}.")
    if "entry" not in raw:
        raise SpecError(f"{who}: missing required key 'entry'; add entry = \"module:function\" (e.g. entry = \"models.mlp:make_job\")")
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
    return _Table(origin, entry, params, steps, replicas, priority, name)


def _expand(table: _Table) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The grid of one job table: ``(params, label)`` per job, label = the values that vary."""
    keys = sorted(table.params)
    axes = [table.params[k] if isinstance(table.params[k], list) else [table.params[k]] for k in keys]
    swept = {k for k, axis in zip(keys, axes) if len(axis) > 1}
    explicit_seed = "seed" in table.params
    out = []
    for point in itertools.product(*axes):
        base = dict(zip(keys, point))
        for rep in range(table.replicas):
            params = dict(base)
            label = {k: params[k] for k in keys if k in swept}
            if table.replicas > 1:
                if explicit_seed:
                    label["replica"] = rep
                else:
                    params["seed"] = label["seed"] = rep
            out.append((params, dict(sorted(label.items()))))
    return out


def _job_name(num: int, width: int, table: _Table, label: Mapping[str, Any]) -> str:
    parts = [table.name] if table.name else []
    if label:
        parts.append(",".join(f"{k}={_label_value(v)}" for k, v in label.items()))
    if not parts:
        parts.append(table.entry.split(":")[0].rpartition(".")[2])
    text = _safe("_".join(parts))[:_MAX_LABEL]
    return f"{num:0{width}d}_{text}"


def _plan(tables: list[_Table], runtime: RuntimeOptions, source: str, stem: str) -> LaunchPlan:
    grid = [(t, params, label) for t in tables for params, label in _expand(t)]
    width = len(str(len(grid)))
    factories: dict[str, Callable[..., Any]] = {}
    jobs = []
    for num, (table, params, label) in enumerate(grid):
        fn = factories.get(table.entry) or resolve_entry(table.entry, f"{table.origin} ({table.entry})")
        factories[table.entry] = fn
        name = _job_name(num, width, table, label)
        hint = " (replicas > 1 passes seed=0..N-1; set params.seed to run identical copies instead)." if "seed" in label else "."
        check_params(fn, params, f"job {name} ({table.origin}, {table.entry})", hint)
        steps = table.steps if table.steps is not None else _steps_default(fn)
        jobs.append(PlannedJob(num, name, table.entry, params, steps, table.priority, table.origin))
    return LaunchPlan(source=source, stem=stem, runtime=runtime, jobs=tuple(jobs))


def plan_file(path: str | Path, over: Overrides = Overrides()) -> LaunchPlan:
    """Read, check and expand a TOML spec (command-line overrides applied)."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SpecError(f"spec file {str(path)!r} does not exist (give SPEC.toml or module:function)") from None
    except tomllib.TOMLDecodeError as err:
        raise SpecError(f"{path}: not valid TOML: {err}") from None
    where = f"{path}: "
    for key in raw:
        if key not in TOP_KEYS:
            raise SpecError(f"{where}unknown top-level key {key!r}{_did_you_mean(key, TOP_KEYS)}. Allowed: [runtime] and [[job]] tables.")
    runtime_raw = raw.get("runtime", {})
    if not isinstance(runtime_raw, Mapping):
        raise SpecError(f"{where}'runtime' must be a table: [runtime] policy = \"pack\"")
    runtime = _check_runtime(runtime_raw, over, where)
    jobs_raw = raw.get("job")
    if isinstance(jobs_raw, Mapping):
        raise SpecError(f"{where}write each job as [[job]] (an array of tables), not [job]")
    if not jobs_raw:
        raise SpecError(f"{where}no jobs: add at least one [[job]] table with entry = \"module:function\"")
    tables = [_table(t, f"{where}[[job]] #{i + 1}", over) for i, t in enumerate(jobs_raw)]
    return _plan(tables, runtime, str(path), _safe(path.stem))


def plan_entry(entry: str, over: Overrides = Overrides()) -> LaunchPlan:
    """Expand ``xshare launch module:function --set ...`` (one job table made of flags)."""
    runtime = _check_runtime({}, over, "")
    table = _table({"entry": entry}, "command line", over)
    stem = _safe(entry.replace(":", "-").rpartition(".")[2])
    return _plan([table], runtime, entry, stem)


# ---------------------------------------------------------------------------------- building


def build(job: PlannedJob) -> JobSpec:
    """Call the job's factory and name the bound job it returns. Raises SpecError on any problem."""
    fn = resolve_entry(job.entry, job.who)
    takes_steps = check_params(fn, job.params, job.who)
    kwargs = dict(job.params)
    if takes_steps and job.steps is not None:
        kwargs["steps"] = job.steps
    try:
        spec = fn(**kwargs)
    except Exception as err:
        raise SpecError(f"{job.who}: the factory raised {type(err).__name__}: {err}") from err
    if isinstance(spec, Job):
        raise SpecError(f"{job.who}: the factory returned the step itself; return step.bind(state, data, steps=...) instead")
    if not isinstance(spec, JobSpec):
        raise SpecError(
            f"{job.who}: the factory returned {type(spec).__name__}, not a bound job; "
            "it must return step.bind(state, data, steps=...) of an @xshare.job step"
        )
    meta = {**spec.meta, "entry": job.entry, "params": dict(job.params)}  # shown by status and `xshare top`
    changes: dict[str, Any] = {"name": job.name, "meta": meta}
    if job.steps is not None:
        changes["steps"] = job.steps
    if job.priority is not None:
        changes["priority"] = job.priority
    return spec.replace(**changes)


def plan_from_json(data: Mapping[str, Any], where: str) -> LaunchPlan:
    """The plan a run directory's ``spec.json`` recorded (for ``xshare launch --resume``)."""
    if data.get("schema") != "xshare.launch/v1":
        raise SpecError(f"{where} is not an xshare launch record (schema {data.get('schema')!r}); "
                        "--resume takes a run directory written by xshare launch")
    rt = data.get("runtime") or {}
    runtime = RuntimeOptions(policy=rt.get("policy", "pack"), memory=rt.get("memory"),
                             quantum=rt.get("quantum", 1))
    jobs = tuple(
        PlannedJob(index=i, name=j["name"], entry=j["entry"], params=dict(j.get("params") or {}),
                   steps=j.get("steps"), priority=j.get("priority"), origin=f"{where} job #{i}")
        for i, j in enumerate(data.get("jobs") or []))
    source = str(data.get("source", where))
    return LaunchPlan(source=source, stem=Path(source).stem, runtime=runtime, jobs=jobs)


def build_all(plan: LaunchPlan) -> list[JobSpec]:
    return [build(job) for job in plan.jobs]
