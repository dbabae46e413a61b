"""The benchmark's workloads: named lists of jobs, each an ``entry`` + ``params`` + ``steps``.

A workload is expanded exactly like an ``xshare launch`` spec (:mod:`xshare.cli.spec`: lists
under ``params`` sweep a grid, jobs are named ``{num}_{k=v,...}``) and every job is built by
its model's ``make_job``. Only the *description* travels between processes (entry, params,
steps, name), never a closure: each process of the benchmark builds the same job from it, with
the same data (every model's batch ``k`` depends only on ``(seed, k)``).

Built-in workloads (sizes picked so that a step takes milliseconds on a 2-core CPU: the regime
of hyper-parameter sweeps of small models, where one job leaves most of the device idle):

* ``sweep8``: 8 MLPs, lr x width grid (2 x 4), the same data (seed 0).
* ``zoo``: 2 MLPs, a ResNet-style CNN and a char Transformer (the CNN and Transformer only
  when ``models.cnn`` / ``models.transformer`` exist).
* ``train_infer``: 2 training jobs and 1 inference job answering Poisson requests (needs
  ``models.inference``; its latency p50/p99 are reported).

A path to a TOML launch spec works as a workload too (its ``[runtime]`` table is ignored:
the benchmark chooses the modes).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from .._errors import SpecError


@dataclass(frozen=True)
class JobPlan:
    """One job of a workload, as plain data (JSON-able): how any process rebuilds it."""

    name: str
    entry: str
    params: Mapping[str, Any]
    steps: int | None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "entry": self.entry, "params": dict(self.params), "steps": self.steps}

    @staticmethod
    def from_json(raw: Mapping[str, Any]) -> "JobPlan":
        return JobPlan(raw["name"], raw["entry"], dict(raw["params"]), raw["steps"])


@dataclass(frozen=True)
class Workload:
    name: str
    jobs: tuple[JobPlan, ...]
    description: str
    notes: tuple[str, ...] = ()   # e.g. which models were missing and left out

    @property
    def total_steps(self) -> int:
        return sum(j.steps or 0 for j in self.jobs)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "notes": list(self.notes),
                "jobs": [j.to_json() for j in self.jobs], "total_steps": self.total_steps}


# A table: (entry, params (lists sweep), steps). Steps are per job.
Table = tuple[str, Mapping[str, Any], int]

_MLP, _CNN, _TRANSFORMER, _INFER = ("models.mlp:make_job", "models.cnn:make_job",
                                    "models.transformer:make_job", "models.inference:make_job")

BUILTIN: dict[str, dict[str, Any]] = {
    "sweep8": {
        "description": "8 MLPs (lr x width sweep, depth 2, batch 256): a hyper-parameter sweep",
        "tables": [(_MLP, {"lr": [1e-3, 3e-3], "width": [256, 384, 512, 640], "depth": 2, "batch": 256}, 300)],
    },
    "zoo": {
        "description": "2 MLPs + ResNet CNN + char Transformer: different models, step times and memory",
        "tables": [(_MLP, {"lr": [1e-3, 3e-3], "width": 256, "batch": 128}, 600),
                   (_CNN, {"lr": 1e-3, "channels": 16, "blocks": 2, "batch": 32}, 200),
                   (_TRANSFORMER, {"lr": 3e-3, "d_model": 64, "layers": 2, "heads": 4, "seq": 64,
                                   "batch": 16}, 200)],
    },
    "train_infer": {
        "description": "2 training jobs + 1 inference job (Poisson requests, 200/s, batches of 8)",
        "tables": [(_CNN, {"lr": 1e-3}, 200),
                   (_MLP, {"lr": 1e-3, "width": 256, "batch": 128}, 600),
                   (_INFER, {"model": "mlp", "rate": 200.0, "batch": 8}, 250)],
        "fallback": {_CNN: (_MLP, {"lr": 3e-3, "width": 192, "batch": 128}, 600)},
    },
    # The smoke test's workload: 2 tiny jobs, a few steps.
    "smoke": {
        "description": "2 tiny MLPs (smoke test)",
        "tables": [(_MLP, {"lr": [1e-3, 3e-3], "width": 32, "batch": 16}, 10)],
    },
}
NAMES = ("sweep8", "zoo", "train_infer")


def available(entry: str) -> bool:
    """Whether the entry's module can be imported (a model another change has not landed yet)."""
    try:
        return importlib.util.find_spec(entry.split(":")[0]) is not None
    except (ImportError, ValueError):
        return False


def resolve(name: str, *, steps: int | None = None) -> Workload:
    """A built-in workload by name, or a TOML launch spec by path; ``steps`` overrides every job's.

    Models that are not importable are left out (or replaced by the workload's fallback) with a
    note saying so; a workload left with no job raises SpecError."""
    if name in BUILTIN:
        raw = BUILTIN[name]
        tables, notes = [], []
        for table in raw["tables"]:
            entry = table[0]
            if available(entry):
                tables.append(table)
                continue
            fallback = raw.get("fallback", {}).get(entry)
            if fallback is not None and available(fallback[0]):
                tables.append(fallback)
                notes.append(f"{entry} is not available: replaced by {fallback[0]} {dict(fallback[1])}")
            else:
                notes.append(f"{entry} is not available: left out")
        if not tables:
            raise SpecError(f"workload {name!r}: none of its models can be imported ({'; '.join(notes)})")
        if name == "train_infer" and not any(t[0] == _INFER for t in tables):
            raise SpecError(f"workload 'train_infer' needs {_INFER}, which is not available")
        jobs = expand(tables, steps=steps)
        return Workload(name, jobs, raw["description"], tuple(notes))
    path = Path(name)
    if path.suffix == ".toml" or path.exists():
        return from_spec_file(path, steps=steps)
    raise SpecError(f"unknown workload {name!r}; choose one of {', '.join(NAMES)}, 'all', "
                    "or give the path of a TOML launch spec")


def expand(tables: Sequence[Table], *, steps: int | None = None) -> tuple[JobPlan, ...]:
    """Expand tables into jobs through the launcher's own grid expansion (and naming rules)."""
    from ..cli import spec as specs

    planned = []
    for entry, params, table_steps in tables:
        plan = specs.plan_entry(entry, specs.Overrides(sets=dict(params),
                                                       steps=steps if steps is not None else table_steps))
        planned.extend(plan.jobs)
    width = len(str(len(planned)))
    jobs = []
    for num, job in enumerate(planned):
        label = job.name.partition("_")[2]  # plan_entry numbers each table from 0: renumber
        jobs.append(JobPlan(f"{num:0{width}d}_{label}", job.entry, dict(job.params), job.steps))
    return tuple(jobs)


def from_spec_file(path: Path, *, steps: int | None = None) -> Workload:
    from ..cli import spec as specs

    plan = specs.plan_file(path, specs.Overrides(steps=steps))
    jobs = tuple(JobPlan(j.name, j.entry, dict(j.params), j.steps) for j in plan.jobs)
    if any(j.steps is None for j in jobs):
        raise SpecError(f"{path}: every job needs a number of steps for a benchmark (set steps, or --steps)")
    return Workload(path.stem, jobs, f"jobs of {path}")


def build(job: JobPlan):
    """The bound :class:`xshare.JobSpec` of one job (calls its model's ``make_job``)."""
    from ..cli import spec as specs

    planned = specs.PlannedJob(index=0, name=job.name, entry=job.entry, params=dict(job.params),
                               steps=job.steps, priority=None, origin="benchmark workload")
    return specs.build(planned)


def with_steps(workload: Workload, steps: int) -> Workload:
    return dataclasses.replace(workload, jobs=tuple(dataclasses.replace(j, steps=steps) for j in workload.jobs))
