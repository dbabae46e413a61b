"""The parent's side of a measurement: start the measured processes, sample their memory, collect
their results. The parent itself never starts jax's backend (on a GPU it would take the memory
the measured processes need): everything device-side runs in :mod:`xshare.bench.worker`.

Memory of a process tree, sampled from ``/proc`` by psutil while it runs:

* ``peak_rss_bytes``: the peak of the *sum* of the processes' resident sets, sampled every
  ``RSS_INTERVAL_S``. Shared library pages (jaxlib is large) count once per process, which is
  what ``top`` shows and what the OOM killer's per-process view sees.
* ``peak_pss_bytes``: the same for the proportional set size (shared pages split between the
  processes that map them), sampled every ``PSS_INTERVAL_S`` (reading ``smaps`` costs
  milliseconds): the tree's real footprint in RAM. Coarser sampling can miss a short peak.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from .worker import MARK

RSS_INTERVAL_S = 0.01
PSS_INTERVAL_S = 0.5
CHILDREN_INTERVAL_S = 1.0   # descendants of the measured processes are looked up this often


class BenchError(RuntimeError):
    """A measured process failed (its error and the tail of its stderr are in the message)."""


class TreeSampler:
    """Samples the memory of some processes and their descendants on a background thread."""

    def __init__(self, pids: Sequence[int]):
        import psutil

        self._psutil = psutil
        self._roots = [psutil.Process(p) for p in pids]
        self._procs: dict[int, Any] = {p.pid: p for p in self._roots}
        self.peak_rss = 0
        self.peak_pss: int | None = None
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="xshare-bench-rss", daemon=True)

    def __enter__(self) -> "TreeSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _refresh(self) -> None:
        for root in self._roots:
            try:
                for child in root.children(recursive=True):
                    self._procs.setdefault(child.pid, child)
            except self._psutil.Error:
                pass

    def _main(self) -> None:
        ps = self._psutil
        next_pss = next_children = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_children:
                self._refresh()
                next_children = now + CHILDREN_INTERVAL_S
            rss = 0
            for pid, proc in list(self._procs.items()):
                try:
                    rss += proc.memory_info().rss
                except ps.Error:
                    self._procs.pop(pid, None)
            self.peak_rss = max(self.peak_rss, rss)
            self.samples += 1
            if now >= next_pss:
                pss, known = 0, False
                for proc in list(self._procs.values()):
                    try:
                        pss += proc.memory_full_info().pss
                        known = True
                    except (ps.Error, AttributeError):
                        pass
                if known:
                    self.peak_pss = max(self.peak_pss or 0, pss)
                next_pss = now + PSS_INTERVAL_S
            self._stop.wait(RSS_INTERVAL_S)


@dataclass
class _Child:
    """One measured process: its events arrive on a reader thread."""

    proc: subprocess.Popen
    what: str
    stderr: Any
    events: list = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    def read(self) -> None:
        try:
            for line in self.proc.stdout:
                if line.startswith(MARK):
                    event = json.loads(line[len(MARK):])
                    self.events.append(event)
                    if event["event"] == "ready":
                        self.ready.set()
        finally:
            self.done.set()
            self.ready.set()  # a process that died before ready must not hang the barrier

    def result(self) -> dict[str, Any]:
        for event in self.events:
            if event["event"] == "result":
                return event["result"]
        self.stderr.seek(0)
        tail = self.stderr.read()[-3000:]
        err = next((e for e in self.events if e["event"] == "error"), None)
        why = err["error"] if err else f"exit status {self.proc.returncode}, no result"
        raise BenchError(f"{self.what}: {why}\n--- stderr tail ---\n{tail}")


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


def _spawn(command: str, payload: dict[str, Any], what: str, env: dict[str, str] | None = None,
           stdin: bool = False) -> _Child:
    stderr = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, "-m", "xshare.bench.worker", command, json.dumps(payload)],
                            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=stderr, text=True, env=_env(env))
    child = _Child(proc, what, stderr)
    threading.Thread(target=child.read, name=f"xshare-bench-read-{proc.pid}", daemon=True).start()
    return child


def _finish(children: Sequence[_Child], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for c in children:
        try:
            c.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            for k in children:  # only the processes this benchmark started, by their pid
                if k.proc.poll() is None:
                    k.proc.kill()
                    k.proc.wait()
            raise BenchError(f"{c.what}: still running after {timeout:.0f} s; killed") from None
        c.done.wait(5.0)


def run_child(command: str, payload: dict[str, Any], *, what: str, timeout: float = 1800.0,
              env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one worker command in a fresh process; its result plus the process's memory peaks."""
    t = time.monotonic()
    child = _spawn(command, payload, what, env=env)
    with TreeSampler([child.proc.pid]) as sampler:
        _finish([child], timeout)
    result = child.result()
    result["peak_rss_bytes"] = sampler.peak_rss
    result["peak_pss_bytes"] = sampler.peak_pss
    result["rss_samples"] = sampler.samples
    result["wall_s"] = time.monotonic() - t    # start-up, imports and compiles included
    result["processes"] = 1
    return result


def run_processes(jobs: Sequence[dict[str, Any]], *, timeout: float = 1800.0,
                  env: dict[str, str] | None = None) -> dict[str, Any]:
    """The ``processes`` mode: one worker process per job, started together; each compiles, then
    all start running at once (a barrier), so compile time is excluded as in every mode. On a
    GPU each process is told not to preallocate (otherwise the second one cannot start)."""
    t = time.monotonic()
    env = {**(env or {}), "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    children = [_spawn("job", {"job": j}, what=f"processes: job {j['name']}", env=env, stdin=True) for j in jobs]
    with TreeSampler([c.proc.pid for c in children]) as sampler:
        try:
            for c in children:
                c.ready.wait(timeout)
            died = [c for c in children if c.done.is_set()]
            if died:  # one died while compiling: stop the rest, report the one that died
                for c in children:
                    if c.proc.poll() is None:
                        c.proc.kill()
                        c.proc.wait()
                died[0].proc.wait()
                died[0].result()
                raise BenchError(f"{died[0].what}: ended before the start barrier")
            t_go = time.monotonic()
            for c in children:  # the start barrier: every process is compiled and waiting
                c.proc.stdin.write("go\n")
                c.proc.stdin.flush()
            _finish(children, timeout)
        finally:
            for c in children:
                if c.proc.poll() is None:
                    c.proc.kill()
                    c.proc.wait()
    results = [c.result() for c in children]
    t_end = max(r["t_end"] for r in results)
    jobs_out = []
    for r in results:
        jobs_out.append({**{k: v for k, v in r.items() if k not in ("device_peak_bytes", "maxrss_bytes", "cpu")},
                         "jct_s": r["t_end"] - t_go})
    peaks = [r["device_peak_bytes"] for r in results]
    # CPU: the processes' own run phases, and the whole machine from the first one's start to the
    # last one's end (the machine's counters are the same in every process).
    first = min(results, key=lambda r: r["t_start"])["cpu"]
    last = max(results, key=lambda r: r["t_end"])["cpu"]
    cpu = {"wall_s": t_end - min(r["t_start"] for r in results),
           "process_cpu_s": sum(r["cpu"]["process_cpu_s"] for r in results),
           "machine_busy_s": last["machine_busy_at"][1] - first["machine_busy_at"][0],
           "machine_steal_s": last["machine_steal_at"][1] - first["machine_steal_at"][0]}
    return {"makespan_s": t_end - t_go, "compile_s": max(r["compile_s"] for r in results), "jobs": jobs_out, "cpu": cpu,
            "device_peak_bytes": sum(peaks) if all(p is not None for p in peaks) else None,
            "maxrss_bytes": sum(r["maxrss_bytes"] for r in results),
            "peak_rss_bytes": sampler.peak_rss, "peak_pss_bytes": sampler.peak_pss,
            "rss_samples": sampler.samples, "wall_s": time.monotonic() - t, "processes": len(children),
            "start_skew_s": max(r["t_start"] for r in results) - min(r["t_start"] for r in results)}


# ------------------------------------------------------------------------------ the machine


def machine() -> dict[str, Any]:
    """What the numbers were measured on (no jax here: see ``calibrate`` for the device)."""
    import psutil

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    return {"cpu": cpu, "logical_cores": os.cpu_count(), "physical_cores": psutil.cpu_count(logical=False),
            "ram_bytes": int(psutil.virtual_memory().total), "python": platform.python_version(),
            "os": f"{platform.system()} {platform.release()}", "loadavg_start": load, "git": git_revision()}


def xla_env(flags: str | None) -> dict[str, str]:
    """The environment that adds ``flags`` to the measured processes' ``XLA_FLAGS``."""
    if not flags:
        return {}
    return {"XLA_FLAGS": " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), flags) if f)}


def git_revision() -> str | None:
    """The checkout's commit, with ``-dirty`` when files differ from it (None outside git)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=root, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None
