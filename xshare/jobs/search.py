"""Reading a tune spec (``xshare tune SPEC.toml``): one ``[[job]]`` plus a ``[search]`` table of
parameter ranges and ``[tune]`` settings. Pure Python: no jax, no optuna, nothing imported from
the user's module (its signature is read from source when it can be).

```toml
[[job]]
entry = "xshare.models.digits:make_job"
steps = 300
params = { eval_every = 25 }              # fixed values

[search]
lr = { low = 1e-4, high = 1e-1, log = true }   # float range (log scale)
depth = { low = 1, high = 3 }                  # int range: both ends ints
width = [32, 64, 128]                          # categorical

[tune]
trials = 32
metric = "eval/accuracy"
direction = "maximize"
```
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from xshare._errors import SpecError

from .parse import Overrides, RuntimeOptions, check_job, check_runtime, load_spec
from .resolve import check_params, did_you_mean, signature

TOP_KEYS = ("runtime", "job", "search", "tune")
RANGE_KEYS = ("low", "high", "log", "step")
TUNE_KEYS = ("trials", "metric", "direction", "pruner", "sampler", "seed", "storage", "study_name",
             "concurrency", "report_every")
DIRECTIONS = ("minimize", "maximize")
PRUNERS = ("median", "successive-halving", "hyperband", "none")
SAMPLERS = ("tpe", "random")


@dataclass(frozen=True)
class Param:
    """One searched parameter: ``kind`` float | int | categorical."""

    name: str
    kind: str
    low: Any = None
    high: Any = None
    log: bool = False
    step: Any = None
    choices: tuple = ()

    def suggest(self, trial: Any) -> Any:
        if self.kind == "categorical":
            return trial.suggest_categorical(self.name, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.name, self.low, self.high, log=self.log, step=self.step or 1)
        return trial.suggest_float(self.name, self.low, self.high, log=self.log, step=self.step)

    def describe(self) -> str:
        if self.kind == "categorical":
            return f"{self.name} in {list(self.choices)}"
        return f"{self.name}: {self.kind} {self.low}..{self.high}{' (log)' if self.log else ''}"


@dataclass(frozen=True)
class TuneOptions:
    trials: int = 32
    metric: str = "eval/accuracy"
    direction: str = "maximize"
    pruner: str = "median"
    sampler: str = "tpe"
    seed: int | None = 0
    storage: str | None = None
    study_name: str | None = None
    concurrency: int | None = None
    report_every: int | None = None


@dataclass(frozen=True)
class TunePlan:
    source: str
    stem: str
    runtime: RuntimeOptions
    entry: str
    params: Mapping[str, Any]
    steps: int | None
    takes_steps: bool
    search: tuple[Param, ...]
    tune: TuneOptions

    def to_json(self) -> dict[str, Any]:
        return {"schema": "xshare.tune/v1", "source": self.source, "stem": self.stem,
                "runtime": self.runtime.as_kwargs(), "entry": self.entry, "params": dict(self.params),
                "steps": self.steps, "takes_steps": self.takes_steps,
                "search": [asdict(p) for p in self.search], "tune": asdict(self.tune)}


@dataclass(frozen=True)
class TuneOverrides:
    """Command-line values that win over ``[tune]`` (None = not given)."""

    values: Mapping[str, Any] = field(default_factory=dict)


def plan_from_json(data: Mapping[str, Any], where: str) -> TunePlan:
    if data.get("schema") != "xshare.tune/v1":
        raise SpecError(f"{where} is not an xshare tune record; --resume takes a run directory of xshare tune")
    search = tuple(Param(**{**p, "choices": tuple(p.get("choices") or ())}) for p in data["search"])
    return TunePlan(source=data["source"], stem=data["stem"], runtime=RuntimeOptions(**data["runtime"]),
                    entry=data["entry"], params=data["params"], steps=data["steps"],
                    takes_steps=data["takes_steps"], search=search, tune=TuneOptions(**data["tune"]))


def plan_tune(path: str, runtime_over: Overrides, tune_over: Mapping[str, Any]) -> TunePlan:
    """Read and check everything a tune run needs; a SpecError names the problem and the fix."""
    file = Path(path)
    raw = load_spec(path, TOP_KEYS, "[runtime], [[job]], [search] and [tune]")
    where = f"{path}: "
    runtime_raw = raw.get("runtime", {})
    if not isinstance(runtime_raw, Mapping):
        raise SpecError(f"{where}'runtime' must be a table")
    if "fuse" not in runtime_raw and runtime_over.fuse is None:  # fused by default here
        runtime_raw = {**runtime_raw, "fuse": True}
    runtime = check_runtime(runtime_raw, runtime_over, where)
    jobs = raw.get("job")
    if not isinstance(jobs, list) or len(jobs) != 1:
        raise SpecError(f"{where}a tune spec has exactly one [[job]] table (the entry its trials call); "
                        f"found {0 if not isinstance(jobs, list) else len(jobs)}")
    job = check_job(jobs[0], f"{where}[[job]]", Overrides(steps=runtime_over.steps))
    who = f"{where}[[job]] ({job.entry})"
    for key, value in job.params.items():
        if isinstance(value, list):
            raise SpecError(f"{who}: params.{key} is a list; xshare tune searches under [search] "
                            f"(write {key} = {value!r} there for a categorical choice)")
    search_raw = raw.get("search")
    if not isinstance(search_raw, Mapping) or not search_raw:
        raise SpecError(f"{where}no [search] table: add one, e.g. [search] lr = {{ low = 1e-4, high = 1e-1, log = true }}")
    search = tuple(_param(name, value, f"{where}[search] {name}") for name, value in search_raw.items())
    for p in search:
        if p.name in job.params:
            raise SpecError(f"{where}[search] {p.name}: also fixed under [[job]] params; keep it in one place")
    names = {**job.params, **{p.name: None for p in search}}
    takes_steps = check_params(signature(job.entry, who), names, who,
                               hint=" (a [search] key or a params key names a factory parameter).")
    tune = _tune(raw.get("tune", {}), tune_over, where)
    return TunePlan(source=str(file), stem=file.stem, runtime=runtime, entry=job.entry, params=dict(job.params),
                    steps=job.steps, takes_steps=takes_steps, search=search, tune=tune)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _param(name: str, raw: Any, who: str) -> Param:
    if isinstance(raw, list):
        if not raw:
            raise SpecError(f"{who} = []: a categorical needs at least one choice")
        if len({repr(v) for v in raw}) != len(raw):
            raise SpecError(f"{who} = {raw!r}: choices repeat; list each once")
        return Param(name, "categorical", choices=tuple(raw))
    if not isinstance(raw, Mapping):
        raise SpecError(f"{who} = {raw!r}: write a range {{ low = ..., high = ... [, log = true] }} or a "
                        "list of choices [a, b, c] (fixed values go under [[job]] params)")
    for key in raw:
        if key not in RANGE_KEYS:
            raise SpecError(f"{who}: unknown key {key!r}{did_you_mean(key, RANGE_KEYS)}. "
                            f"A range takes: {', '.join(RANGE_KEYS)}.")
    if "low" not in raw or "high" not in raw:
        raise SpecError(f"{who}: a range needs both low and high, e.g. {{ low = 1e-4, high = 1e-1 }}")
    low, high, log, step = raw["low"], raw["high"], raw.get("log", False), raw.get("step")
    if not _number(low) or not _number(high):
        raise SpecError(f"{who}: low = {low!r} and high = {high!r} must be numbers")
    if low > high:
        raise SpecError(f"{who}: low = {low!r} is above high = {high!r}; swap them")
    if not isinstance(log, bool):
        raise SpecError(f"{who}: log = {log!r} must be true or false")
    if log and low <= 0:
        raise SpecError(f"{who}: log = true needs low > 0 (got low = {low!r}); raise low or drop log")
    if step is not None and (not _number(step) or step <= 0):
        raise SpecError(f"{who}: step = {step!r} must be a positive number")
    if step is not None and log:
        raise SpecError(f"{who}: step and log = true cannot be combined (Optuna does not sample that)")
    kind = "int" if isinstance(low, int) and isinstance(high, int) and (step is None or isinstance(step, int)) else "float"
    return Param(name, kind, low=low, high=high, log=log, step=step)


def _tune(raw: Any, over: Mapping[str, Any], where: str) -> TuneOptions:
    if not isinstance(raw, Mapping):
        raise SpecError(f"{where}'tune' must be a table: [tune] trials = 32")
    for key in raw:
        if key not in TUNE_KEYS:
            raise SpecError(f"{where}[tune]: unknown key {key!r}{did_you_mean(key, TUNE_KEYS)}. "
                            f"Allowed keys: {', '.join(TUNE_KEYS)}.")
    values = {**raw, **{k: v for k, v in over.items() if v is not None}}

    def src(key: str) -> str:
        return f"--{key.replace('_', '-')}" if over.get(key) is not None else f"{where}[tune] {key}"

    for key in ("trials", "concurrency", "report_every"):
        v = values.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise SpecError(f"{src(key)} = {v!r} must be a whole number >= 1")
    seed = values.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise SpecError(f"{src('seed')} = {seed!r} must be a whole number >= 0")
    for key, valid in (("direction", DIRECTIONS), ("pruner", PRUNERS), ("sampler", SAMPLERS)):
        v = values.get(key)
        if v is not None and v not in valid:
            raise SpecError(f"{src(key)} {v!r} is not one of: {', '.join(valid)}{did_you_mean(str(v), valid)}")
    for key in ("metric", "storage", "study_name"):
        v = values.get(key)
        if v is not None and (not isinstance(v, str) or not v):
            raise SpecError(f"{src(key)} = {v!r} must be a non-empty string")
    return TuneOptions(**values)
