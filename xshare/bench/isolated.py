"""The configurations of :mod:`xshare.bench.harness` that run in other processes, and the child
protocol: :func:`processes` (one process per job, released together from a start barrier once
all have compiled) and :func:`in_child` (any in-process configuration in a fresh process), each
with its peak RSS (:class:`RssSampler`).

A child is ``python -m xshare.bench.harness PAYLOAD`` (one JSON payload in, ``@@xshare-bench``
result lines out: :func:`main`); jobs cross the process boundary as
:class:`xshare.jobs.JobRequest`, never closures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any, Iterable, Iterator, Mapping, Sequence

from xshare.jobs.request import JobRequest

from .loops import JobTime, PlainJob, Run, build, plain_loop, runtime, threads

_MARK = "@@xshare-bench "  # result lines of a child; anything else a library prints is ignored


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


def main(argv: Sequence[str]) -> int:
    """The child side: one JSON payload in, ``@@xshare-bench`` result lines out."""
    import traceback

    try:
        _emit("result", result=_child(json.loads(argv[0])))
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which decides
        _emit("error", error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc())
        return 1
    return 0
