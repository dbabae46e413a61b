"""Jobs as plain data and the in-process configurations of :mod:`xshare.bench.harness`.

:func:`plain_loop` (each job alone, one after another), :func:`threads` (every job's plain loop
in its own thread, released together) and :func:`runtime` (all of them submitted together to one
``xshare.Runtime``), each returning a :class:`Run`; :func:`JobPlan`, :func:`build` and
:func:`expand` name and bind the jobs they run. The benchmarks reach all of it as
``harness.<name>``.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence

from xshare.jobs.request import JobRequest


# ------------------------------------------------------------------------------------ jobs


def JobPlan(name: str, entry: str, params: Mapping[str, Any] | None = None,  # (named as the type it was)
            steps: int | None = None) -> JobRequest:
    """The benchmarks' shorthand for one named job as plain data: every process builds the same
    job from it (``make_job`` batches depend only on ``(seed, step)``)."""
    return JobRequest(entry=entry, params=dict(params or {}), steps=steps, name=name, origin="benchmark")


def build(plan: JobRequest) -> Any:
    """The bound ``xshare.JobSpec`` of a plan, through the launcher's own factory call."""
    from xshare import jobs as specs

    return specs.build(dataclasses.replace(plan, origin="benchmark"))


def expand(entry: str, params: Mapping[str, Any], steps: int | None = None, prefix: str = "") -> list[JobRequest]:
    """A grid of plans, named and expanded exactly as ``xshare launch ENTRY --set ...`` would."""
    from xshare import jobs as specs

    plan = specs.plan_entry(entry, specs.Overrides(sets=dict(params), steps=steps))
    return [dataclasses.replace(j, name=prefix + (j.name or ""), origin="benchmark") for j in plan.jobs]


# ------------------------------------------------------------------------------------ runs


@dataclass
class JobTime:
    name: str
    status: str                 # done | failed | ...
    steps: int
    jct_s: float | None         # completion - the configuration's start (compile excluded)
    run_s: float | None         # the job's own first step to its end
    metrics: dict[str, float] | None = None
    error: str | None = None


@dataclass
class Run:
    """One configuration's measurement."""

    makespan_s: float
    jobs: list[JobTime]
    peak_rss_bytes: int | None = None      # sampled from /proc (in_child, processes)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(j.status == "done" for j in self.jobs)

    @property
    def steps_per_s(self) -> float:
        return sum(j.steps for j in self.jobs) / self.makespan_s if self.makespan_s > 0 else math.nan

    @property
    def avg_jct_s(self) -> float:
        return statistics.fmean(j.jct_s for j in self.jobs if j.jct_s is not None) if self.jobs else math.nan

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "steps_per_s": self.steps_per_s, "avg_jct_s": self.avg_jct_s, "ok": self.ok}

    @staticmethod
    def from_json(raw: Mapping[str, Any]) -> "Run":
        return Run(raw["makespan_s"], [JobTime(**j) for j in raw["jobs"]], raw.get("peak_rss_bytes"),
                   dict(raw.get("extra") or {}))


def _floats(tree: Any) -> dict[str, float]:
    import jax

    out = {}
    for path, value in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path) or "value"
        out[key] = float(value.mean()) if getattr(value, "size", 1) != 1 else float(value)
    return out


def _batches(spec: Any) -> Callable[[int], Any]:
    if callable(spec.data) and not hasattr(spec.data, "__iter__"):
        return spec.data
    it = iter(spec.data)
    return lambda _step: next(it)


class PlainJob:
    """One job's plain donated loop, compiled ahead of time (untimed); :meth:`run` steps it.

    The fast version of a plain loop, so the comparison does not flatter xshare: batch ``k`` is
    made while step ``k - 1`` runs, step ``k - 1``'s metrics are read after step ``k`` is
    dispatched (every step's metrics reach the host, as under xshare), a job with an observer
    (an inference server) answers each batch before taking the next."""

    def __init__(self, spec: Any):
        import jax

        self.spec, self.name = spec, spec.name
        t0 = time.monotonic()
        self._take = _batches(spec)
        self._first = self._take(spec.start_step)
        self._state = jax.device_put(spec.state, may_alias=False)  # the caller's arrays stay intact
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            self.compiled = jax.jit(spec.fn, donate_argnums=(0,)).lower(self._state, self._first).compile()
        self.compile_s = time.monotonic() - t0

    def run(self, fresh: Any = None) -> tuple[float, float, dict[str, float] | None]:
        """``(t_start, t_end, last metrics)`` on the monotonic clock. ``fresh``: another copy of
        the job whose data and observer to use (an inference job's request clock starts now)."""
        import jax

        spec, state, self._state = self.spec, self._state, None  # donated from here on
        take = self._take if fresh is None else _batches(fresh)
        observer = (fresh or spec).observer
        pending, last = None, None
        t_start = time.monotonic()
        for k in range(spec.steps):
            step = spec.start_step + k
            state, metrics = self.compiled(state, self._first if k == 0 and fresh is None else take(step))
            if observer is not None:
                last = _floats(jax.device_get(metrics))
                last.update({n: float(v) for n, v in (observer(step, last, time.monotonic()) or {}).items()})
                continue
            if pending is not None:
                last = _floats(jax.device_get(pending))  # a sync point: step k is already queued
            pending = metrics
        if pending is not None:
            last = _floats(jax.device_get(pending))
        jax.device_get(state)
        return t_start, time.monotonic(), last


def plain_loop(specs: Sequence[Any]) -> Run:
    """Each job alone, one after the other (exclusive allocation): job ``i`` completes after
    jobs ``0..i`` ran. Only stepping is timed; each job compiles just before its turn."""
    clock, jobs = 0.0, []
    for spec in specs:
        t0, t1, metrics = PlainJob(spec).run()
        clock += t1 - t0
        jobs.append(JobTime(spec.name, "done", spec.steps, clock, t1 - t0, metrics))
    return Run(clock, jobs)


def threads(specs: Sequence[Any], fresh: Sequence[Any] | None = None) -> Run:
    """Every job's plain loop in its own thread, released together once all compiled."""
    plain = [PlainJob(s) for s in specs]
    fresh = list(fresh) if fresh is not None else [None] * len(plain)
    out: list[Any] = [None] * len(plain)
    barrier = threading.Barrier(len(plain) + 1)

    def one(i: int) -> None:
        barrier.wait()
        try:
            out[i] = plain[i].run(fresh[i])
        except BaseException as err:  # noqa: BLE001 - reported as the job's failure
            out[i] = err

    workers = [threading.Thread(target=one, args=(i,), name=f"bench-job-{i}") for i in range(len(plain))]
    for w in workers:
        w.start()
    t_go = time.monotonic()
    barrier.wait()
    for w in workers:
        w.join()
    jobs = []
    for p, r in zip(plain, out):
        if isinstance(r, BaseException):
            jobs.append(JobTime(p.name, "failed", 0, None, None, error=f"{type(r).__name__}: {r}"))
        else:
            jobs.append(JobTime(p.name, "done", p.spec.steps, r[1] - t_go, r[1] - r[0], r[2]))
    ends = [j.jct_s for j in jobs if j.jct_s is not None]
    return Run(max(ends) if ends else math.nan, jobs)


def runtime(specs: Sequence[Any], *, hold: bool = True, **runtime_kwargs: Any) -> Run:
    """All specs submitted together to one ``xshare.Runtime(**runtime_kwargs)``.

    ``hold`` (the default) is the runtime's start barrier: every job is paused as it is
    submitted and resumed together once all have compiled (their programs show in the status
    document), so compiles are excluded here as in every other configuration; ``hold=False``
    lets each job start as soon as it compiled. The clock runs from the first job's start to
    the last one's end, read from the runtime's status document (``rt.snapshot()``);
    ``extra["timeline"]`` holds the executed steps ``(job, lane, t_begin_ns, t_end_ns)``."""
    import xshare

    with xshare.Runtime(**runtime_kwargs) as rt:
        handles = rt.submit_many(list(specs))
        if hold:
            for h in handles:
                rt.pause(h)  # a job compiles while paused; it cannot start before resume
            while not all(j.get("program") is not None or j["status"] in ("failed", "cancelled")
                          for j in rt.snapshot()["jobs"]):
                time.sleep(0.02)
            for h in handles:
                if h.status() == "paused":
                    rt.resume(h)
        rt.wait()
        doc = rt.snapshot()
        timeline = [(s.job, s.lane, s.t_begin_ns, s.t_end_ns) for s in rt.timeline()]
        errors = {h.name: h.error for h in handles}
    rows = doc["jobs"]
    t0 = min((r["started_s"] for r in rows if r["started_s"] is not None), default=0.0)
    jobs = [JobTime(r["name"], r["status"], r["steps_done"],
                    None if r["ended_s"] is None else r["ended_s"] - t0,
                    None if r["ended_s"] is None or r["started_s"] is None else r["ended_s"] - r["started_s"],
                    r["metrics"], errors.get(r["name"]) or r["error"]) for r in rows]
    ends = [j.jct_s for j in jobs if j.jct_s is not None]
    return Run(max(ends, default=math.nan), jobs,
               extra={"timeline": timeline, "lanes": len({r["lane"] for r in rows if r["lane"] is not None}),
                      "fences": doc["runtime"]["fences"], "policy": doc["runtime"]["policy"]})
