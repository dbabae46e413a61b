"""The one benchmark harness: "plain loop vs processes vs xshare", measured from the outside.

Every script under ``benchmarks/`` and ``xshare bench`` use it. What it measures:

* :func:`plain_loop`: N jobs one after another, each in the fast plain loop a user writes alone
  (``jax.jit(step, donate_argnums=0)`` compiled ahead of time, metrics read one step behind):
  exclusive allocation of the device.
* :func:`threads`: the same plain loops in one thread each, started together (sharing by hand,
  no runtime: the ceiling of concurrency on this device).
* :func:`runtime`: the same specs submitted together to one ``xshare.Runtime(**kwargs)``; times
  from the public status document (``Runtime.snapshot()``) and handles.
* :func:`processes`: one Python process per job, each running the plain loop, released together
  from a start barrier once all have compiled: how users share a device today.

Each returns a :class:`Run` (makespan, per-job completion times, peak RSS where sampled).
Compilation is excluded everywhere (each job's clock starts when it starts stepping), every job
ends with its final state on the host. :func:`in_child` runs any of them in a fresh process
(its own memory, no warm caches) and samples that process's RSS.

Comparing: :func:`alternate` runs configurations in rotating order, repeat after repeat (a
shared machine drifts: compare neighbours), :func:`paired_ratios` divides repeat ``r`` by
repeat ``r``; report medians. Reporting: :func:`markdown_table`, :func:`write_results` (JSON
and markdown with the command, machine and date), :func:`machine`. :func:`time_command`
times a command line from start to exit (e.g. ``xshare top --once``).

Jobs cross process boundaries as :class:`xshare.jobs.JobRequest` (entry + params + steps:
plain data; :func:`JobPlan` makes a named one), never closures; ``python -m
xshare.bench.harness`` is the child side. Nothing here reads runtime
internals. psutil (``pip install 'xshare[bench]'``) samples memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

from xshare.jobs.request import JobRequest

T = TypeVar("T")
_MARK = "@@xshare-bench "  # result lines of a child; anything else a library prints is ignored


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


# ------------------------------------------------------------------------------------ processes


class RssSampler:
    """Peak resident memory of process trees (each pid and its children), sampled on a thread."""

    def __init__(self, pids: Iterable[int], every_s: float = 0.05):
        try:
            import psutil
        except ImportError:
            raise RuntimeError("measuring memory needs psutil: pip install 'xshare[bench]'") from None
        self._psutil, self._pids, self._every = psutil, list(pids), every_s
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-rss", daemon=True)

    def _loop(self) -> None:
        ps = self._psutil
        while not self._stop.is_set():
            total = 0
            for pid in self._pids:
                try:
                    proc = ps.Process(pid)
                    total += sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
                except (ps.NoSuchProcess, ps.AccessDenied):
                    pass
            self.peak = max(self.peak, total)
            self._stop.wait(self._every)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


class _Child(subprocess.Popen):
    """A child process of the harness; ``errors`` holds its stderr."""

    errors: IO[str]


def _spawn(payload: Mapping[str, Any], env: Mapping[str, str] | None) -> _Child:
    errors = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a chatty child never blocks on it
    proc = _Child([sys.executable, "-m", "xshare.bench.harness", json.dumps(payload)],
                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors,
                  text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    proc.errors = errors
    return proc


def _events(proc: _Child) -> Iterator[dict[str, Any]]:
    assert proc.stdout is not None  # (spawned with stdout=PIPE)
    for line in proc.stdout:
        if line.startswith(_MARK):
            yield json.loads(line[len(_MARK):])


def _result(proc: _Child, events: Iterable[dict[str, Any]], what: str) -> dict[str, Any]:
    for ev in events:
        if ev["event"] == "result":
            return ev["result"]
        if ev["event"] == "error":
            raise RuntimeError(f"{what}: {ev['error']}\n{ev['traceback']}")
    proc.wait()
    proc.errors.seek(0)
    raise RuntimeError(f"{what}: exited {proc.returncode} without a result:\n{proc.errors.read()[-3000:]}")


def processes(plans: Sequence[JobRequest], *, env: Mapping[str, str] | None = None, timeout_s: float = 1800) -> Run:
    """One process per job: each compiles, says ready, waits at the start barrier, runs its
    plain loop. On a GPU each is told not to preallocate (else the second cannot start)."""
    env = {**(env or {}), "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    procs = [_spawn({"command": "job", "job": p.to_json()}, env) for p in plans]
    streams = [_events(p) for p in procs]

    def kill_all() -> None:
        for p in procs:
            if p.poll() is None:
                p.kill()

    watchdog = threading.Timer(timeout_s, kill_all)
    watchdog.start()
    try:
        with RssSampler([p.pid for p in procs]) as rss:
            for plan, proc, events in zip(plans, procs, streams):
                ev = next(events, None)
                if ev is None or ev["event"] != "ready":
                    _result(proc, [ev] if ev else [], f"processes: job {plan.name}")
            t_go = time.monotonic()
            for proc in procs:  # the barrier: every process is compiled and waiting
                assert proc.stdin is not None  # (spawned with stdin=PIPE)
                proc.stdin.write("go\n")
                proc.stdin.flush()
            results = [_result(p, e, f"processes: job {plan.name}") for plan, p, e in zip(plans, procs, streams)]
    finally:
        watchdog.cancel()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    jobs = [JobTime(r["name"], "done", r["steps"], r["t_end"] - t_go, r["t_end"] - r["t_start"], r["metrics"])
            for r in results]
    return Run(max(r["t_end"] for r in results) - t_go, jobs, rss.peak,
               extra={"start_skew_s": max(r["t_start"] for r in results) - min(r["t_start"] for r in results)})


def in_child(kind: str, plans: Sequence[JobRequest], *, env: Mapping[str, str] | None = None,
             timeout_s: float = 1800, **kwargs: Any) -> Run:
    """``plain_loop``, ``threads`` or ``runtime`` (with ``kwargs``) over ``plans`` in a fresh
    process, with that process's peak RSS."""
    if kind not in ("plain_loop", "threads", "runtime"):
        raise ValueError(f"in_child: kind {kind!r} must be plain_loop, threads or runtime")
    proc = _spawn({"command": kind, "jobs": [p.to_json() for p in plans], "kwargs": kwargs}, env)
    with RssSampler([proc.pid]) as rss:
        try:
            raw = _result(proc, _events(proc), kind)
            proc.wait(timeout=timeout_s)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    run = Run.from_json(raw)
    run.peak_rss_bytes = rss.peak
    return run


def _child(payload: Mapping[str, Any]) -> dict[str, Any]:
    command = payload["command"]
    if command == "job":
        plan = JobRequest.from_json(payload["job"])
        spec = build(plan)
        job = PlainJob(spec)
        # An inference job serves requests on a clock that starts with its data's first call:
        # a fresh copy at the start keeps the barrier's wait out of its requests' latency.
        fresh = build(plan) if spec.observer is not None else None
        _emit("ready")
        sys.stdin.readline()
        t0, t1, metrics = job.run(fresh)
        return {"name": plan.name, "steps": spec.steps, "t_start": t0, "t_end": t1, "metrics": metrics}
    plans = [JobRequest.from_json(j) for j in payload["jobs"]]
    if command == "threads":
        specs = [build(p) for p in plans]
        fresh = [build(p) if s.observer is not None else None for p, s in zip(plans, specs)]
        return threads(specs, fresh).to_json()
    run = {"plain_loop": plain_loop, "runtime": runtime}[command]
    return run([build(p) for p in plans], **payload.get("kwargs", {})).to_json()


def _emit(event: str, **fields: Any) -> None:
    sys.stdout.write(_MARK + json.dumps({"event": event, **fields}, default=str) + "\n")
    sys.stdout.flush()


# ------------------------------------------------------------------------------------ comparing


def alternate(configs: Mapping[str, Callable[[], T]], repeats: int,
              log: Callable[[str], None] | None = print) -> dict[str, list[T]]:
    """Run every configuration ``repeats`` times, the order rotating by one each repeat (a, b, c;
    b, c, a; ...), so no configuration always runs first or right after the same neighbour."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be >= 1")
    names = list(configs)
    out: dict[str, list[T]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t = time.monotonic()
            out[name].append(configs[name]())
            if log is not None:
                log(f"  repeat {r + 1}/{repeats} {name}: {time.monotonic() - t:.1f} s")
    return out


def median(xs: Iterable[float | None]) -> float:
    known = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(known) if known else math.nan


def ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b and not math.isnan(a) and not math.isnan(b) else math.nan


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """``a[r] / b[r]`` per repeat: neighbours in time, so most of a shared machine's drift cancels."""
    return [ratio(x, y) for x, y in zip(a, b)]


def summary(xs: Iterable[float]) -> dict[str, float]:
    xs = sorted(float(x) for x in xs)
    if not xs:
        return {"n": 0, "median": math.nan, "p10": math.nan, "p90": math.nan, "p99": math.nan,
                "mean": math.nan, "min": math.nan, "max": math.nan}
    q = statistics.quantiles(xs, n=100, method="inclusive") if len(xs) > 1 else [xs[0]] * 99
    return {"n": len(xs), "median": statistics.median(xs), "p10": q[9], "p90": q[89], "p99": q[98],
            "mean": statistics.fmean(xs), "min": xs[0], "max": xs[-1]}


def time_command(argv: Sequence[str], repeats: int, *, env: Mapping[str, str] | None = None,
                 cwd: str | os.PathLike | None = None) -> dict[str, Any]:
    """Wall seconds from starting ``argv`` to its exit, ``repeats`` times (the first run is a
    burn-in for the OS's file cache, reported apart); raises if a run fails."""
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        proc = subprocess.run(list(argv), capture_output=True, text=True, cwd=cwd, env={**os.environ, **(env or {})})
        times.append(time.perf_counter() - t)
        if proc.returncode != 0:
            raise RuntimeError(f"{shlex.join(argv)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return {"burn_in_s": times[0], "times_s": times[1:], **summary(times[1:])}


# ------------------------------------------------------------------------------------ reporting


def fmt(x: Any, digits: int = 3) -> str:
    """A table cell: floats to ``digits`` significant figures, NaN/None as ``n/a``."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, float):
        if x == 0:
            return "0"
        return f"{x:.{max(digits - 1 - math.floor(math.log10(abs(x))), 0)}f}"
    return str(x)


def markdown_row(cells: Sequence[Any]) -> str:
    return "| " + " | ".join(fmt(c) for c in cells) + " |"


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(columns)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    return "\n".join([line(list(columns)), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *(line(r) for r in cells)])


def parser(name: str, description: str) -> argparse.ArgumentParser:
    """A benchmark script's command line: ``--smoke`` and ``--out`` (default benchmarks/results)."""
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=description)
    p.add_argument("--smoke", action="store_true",
                   help="a tiny configuration (seconds): checks the script end to end, not the numbers")
    p.add_argument("--out", type=Path, default=Path("benchmarks") / "results",
                   help=f"directory for {name}.json and {name}.md (default: benchmarks/results)")
    return p


def command_line() -> str:
    """The command that reproduces this run, as typed from the repository root."""
    mod = getattr(sys.modules["__main__"], "__spec__", None)
    head = ["python", "-m", mod.name] if mod is not None else ["python", sys.argv[0]]
    return shlex.join(head + sys.argv[1:])


def machine(device: bool = True) -> dict[str, Any]:
    """Where the numbers come from. ``device=True`` imports jax to name the backend: call it
    after any environment variable the script sets."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.lower().startswith("model name")), cpu)
    except OSError:
        pass
    info: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
                            "load_avg_start": _load(), "git": _git(),
                            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")}
    if device:
        import jax
        import jaxlib

        dev = jax.devices()[0]
        info.update(jax=jax.__version__, jaxlib=jaxlib.__version__, backend=jax.default_backend(),
                    device=f"{dev.platform}:{getattr(dev, 'device_kind', '?')}")
    return info


def machine_line(m: Mapping[str, Any]) -> str:
    load = m.get("load_avg_start")
    load_s = f"load {load[0]:.2f}" if load else "load n/a"
    if m.get("load_avg_end"):
        load_s += f" -> {m['load_avg_end'][0]:.2f}"
    jax_s = (f"jax {m['jax']} (jaxlib {m['jaxlib']}), backend {m['backend']} ({m['device']})"
             if "jax" in m else "no jax")
    return f"{m['cpu']}, {m['cores']} cores, {load_s} (1-min avg); python {m['python']}, {jax_s}; git {m['git'] or 'n/a'}"


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _git() -> str | None:
    """The checkout's commit, ``+dirty`` when tracked files differ from it (None outside git)."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if head.returncode == 0 else None


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, Run):
        return _jsonable(x.to_json())
    if isinstance(x, float) or type(x).__name__.startswith(("float", "int")):
        x = float(x) if not isinstance(x, int) else x
        return None if isinstance(x, float) and not math.isfinite(x) else x
    return str(x) if isinstance(x, Path) else x


def write_results(name: str, out_dir: Path, *, title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
                  machine_info: dict[str, Any], config: Mapping[str, Any], data: Mapping[str, Any],
                  notes: str = "", smoke: bool = False) -> tuple[Path, Path]:
    """Print the table; write ``<name>.json`` (every figure) and ``<name>.md`` (the table, the
    exact command, the machine line, the date, the notes) into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    machine_info.setdefault("load_avg_end", _load())
    cmd, table, mline = command_line(), markdown_table(columns, rows), machine_line(machine_info)
    print(f"\n{title}{' (SMOKE: tiny config, numbers meaningless)' if smoke else ''}\n\n{table}\n\nmachine: {mline}")
    doc = {"schema": "xshare.bench/v1", "benchmark": name, "smoke": smoke, "command": cmd,
           "date": machine_info.get("date"), "machine": machine_info, "machine_line": mline, "config": config,
           "table": {"columns": list(columns), "rows": [list(r) for r in rows]}, "data": data}
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    json_path.write_text(json.dumps(_jsonable(doc), indent=1) + "\n")
    md = [f"# {title}", ""] + (["**Smoke run: a tiny configuration; the numbers mean nothing.**", ""] if smoke else [])
    md += [table, "", "```", cmd, "```", "", f"Machine: {mline}", "", f"Date: {machine_info.get('date')}", ""]
    md_path.write_text("\n".join(md + ([notes.strip(), ""] if notes else [])))
    return json_path, md_path


def main(argv: Sequence[str]) -> int:
    """The child side: one JSON payload in, ``@@xshare-bench`` result lines out."""
    import traceback

    try:
        _emit("result", result=_child(json.loads(argv[0])))
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which decides
        _emit("error", error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
