"""Expanding checked job tables into the jobs of a plan: the grid, replicas, names.

Planning reads each factory's signature (:func:`.resolve.signature`: from source when it can,
so a dry run imports no jax) to check every job's parameters before anything starts.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Mapping, Sequence

from . import resolve
from .parse import (JobTable, LaunchPlan, Overrides, RuntimeOptions, check_job, check_runtime, parse_set,
                    read_toml, safe)
from .request import JobRequest, RequestError

_MAX_LABEL = 120  # characters of k=v text in a job name; directory names stay well under 255


def _label_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)  # shortest exact form: 0.001, 0.0003, 1e-05
    if isinstance(value, (list, tuple)):
        return "-".join(_label_value(v) for v in value)
    return str(value)


def grid(table: JobTable) -> list[tuple[dict[str, Any], dict[str, Any]]]:
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


def job_name(num: int, width: int, table: JobTable, label: Mapping[str, Any]) -> str:
    parts = [table.name] if table.name else []
    if label:
        parts.append(",".join(f"{k}={_label_value(v)}" for k, v in label.items()))
    if not parts:
        parts.append(table.entry.split(":")[0].rpartition(".")[2])
    text = safe("_".join(parts))[:_MAX_LABEL]
    return f"{num:0{width}d}_{text}"


def plan(tables: list[JobTable], runtime: RuntimeOptions, source: str, stem: str) -> LaunchPlan:
    points = [(t, params, label) for t in tables for params, label in grid(t)]
    width = len(str(len(points)))
    signatures: dict[str, Any] = {}
    jobs = []
    for num, (table, params, label) in enumerate(points):
        if table.entry not in signatures:
            signatures[table.entry] = resolve.signature(table.entry, f"{table.origin} ({table.entry})")
        sig = signatures[table.entry]
        name = job_name(num, width, table, label)
        hint = " (replicas > 1 passes seed=0..N-1; set params.seed to run identical copies instead)." if "seed" in label else "."
        resolve.check_params(sig, params, f"job {name} ({table.origin}, {table.entry})", hint)
        steps = table.steps if table.steps is not None else resolve.steps_default(sig)
        jobs.append(JobRequest(entry=table.entry, params=params, steps=steps, name=name, priority=table.priority,
                               origin=table.origin))
    return LaunchPlan(source=source, stem=stem, runtime=runtime, jobs=tuple(jobs))


def plan_file(path: str | Path, over: Overrides = Overrides()) -> LaunchPlan:
    """Read, check and expand a TOML spec (command-line overrides applied)."""
    path = Path(path)
    runtime_raw, jobs_raw = read_toml(path)
    where = f"{path}: "
    runtime = check_runtime(runtime_raw, over, where)
    tables = [check_job(t, f"{where}[[job]] #{i + 1}", over) for i, t in enumerate(jobs_raw)]
    return plan(tables, runtime, str(path), safe(path.stem))


def plan_entry(entry: str, over: Overrides = Overrides()) -> LaunchPlan:
    """Expand ``xshare launch module:function --set ...`` (one job table made of flags)."""
    runtime = check_runtime({}, over, "")
    table = check_job({"entry": entry}, "command line", over)
    stem = safe(entry.replace(":", "-").rpartition(".")[2])
    return plan([table], runtime, entry, stem)


def plan_target(target: str, sets: Sequence[str] = (), steps: int | None = None) -> LaunchPlan:
    """Expand ``SPEC.toml`` or ``module:function --set k=v`` into a plan, without importing any
    entry: the grid and the names only (the service checks parameters when it builds the
    jobs, so a client needs neither jax nor the module)."""
    over = Overrides(steps=steps, sets=dict(parse_set(s) for s in sets))
    if target.endswith(".toml") or Path(target).is_file():
        path = Path(target)
        runtime_raw, jobs_raw = read_toml(path)
        where = f"{path}: "
        runtime = check_runtime(runtime_raw, over, where)
        tables = [check_job(t, f"{where}[[job]] #{i + 1}", over) for i, t in enumerate(jobs_raw)]
        source, stem = str(path), safe(path.stem)
    elif ":" in target:
        runtime = check_runtime({}, over, "")
        tables = [check_job({"entry": target}, "command line", over)]
        source, stem = target, safe(target.replace(":", "-").rpartition(".")[2])
    else:
        raise RequestError(f"{target!r} is neither a spec file (SPEC.toml) nor an entry point (module:function)")
    points = [(t, params, label) for t in tables for params, label in grid(t)]
    width = len(str(len(points)))
    jobs = tuple(JobRequest(entry=t.entry, params=params, steps=t.steps, name=job_name(num, width, t, label),
                            priority=t.priority, origin=t.origin)
                 for num, (t, params, label) in enumerate(points))
    return LaunchPlan(source=source, stem=stem, runtime=runtime, jobs=jobs)


def requests_from_plan(plan: LaunchPlan) -> list[JobRequest]:
    """A launch plan's jobs (a spec file or an entry with ``--set``) as requests: same names,
    params, steps and priorities as ``xshare launch`` would run. (They are requests already:
    kept for callers that ask for a list.)"""
    return list(plan.jobs)
