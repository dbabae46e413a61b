"""The ways of running a workload that the benchmark compares, and what each one measures.

* ``exclusive``: one job at a time, each alone with the device, in the plain loop
  (:mod:`xshare.bench.loop`): what exclusive allocation gives each job. One process.
* ``threads``: every job's plain loop in its own thread of one process, started together:
  sharing by hand, without a runtime; the ceiling of what concurrency gives on this device.
* ``processes``: one Python process per job, all started at once, each running the plain loop:
  how users share a device today. (Orchestrated by :mod:`xshare.bench.measure`; each process
  runs :func:`run_worker`.)
* ``xshare:<policy>``: every job submitted together (``submit_many``) to one ``Runtime``.

Every mode compiles every job *before* its clock starts (xshare's ``submit_many`` compiles all
jobs first; the plain loop compiles ahead of time; each process compiles, then waits at a start
barrier), so makespans, JCTs and throughputs exclude compilation everywhere; compile time is
reported on its own. Each job ends when its final state is on the host.

The functions here run inside the measured process (the parent only samples its memory), and
return plain JSON-able dicts.
"""

from __future__ import annotations

import gc
import resource
import time
from typing import Any, Iterable, Mapping, Sequence

from .workloads import JobPlan, build

PLAIN_MODES = ("exclusive", "threads", "processes")
XSHARE_POLICIES = ("pack", "fifo", "srtf", "fair")
DEFAULT_MODES = ("exclusive", "threads", "processes") + tuple(f"xshare:{p}" for p in XSHARE_POLICIES)


def parse_modes(text: str | Sequence[str]) -> tuple[str, ...]:
    """``"exclusive,xshare:pack"`` -> ``("exclusive", "xshare:pack")``, each checked."""
    items = [m.strip() for m in (text.split(",") if isinstance(text, str) else text) if m.strip()]
    if not items:
        raise ValueError("no modes given; choose from " + ", ".join(DEFAULT_MODES))
    out: list[str] = []
    for m in items:
        m = "xshare:pack" if m == "xshare" else m
        mode_spec(m)  # raises on a bad one
        if m not in out:
            out.append(m)
    return tuple(out)


def mode_spec(mode: str) -> tuple[str, str | None, dict[str, Any]]:
    """``"xshare:pack:lanes=2"`` -> ``("xshare", "pack", {"max_lanes": 2})``.

    ``xshare:<policy>`` runs the Runtime with its defaults; an optional ``:lanes=N`` caps its
    lanes (``Runtime(max_lanes=N)``)."""
    import xshare

    if mode in PLAIN_MODES:
        return mode, None, {}
    parts = mode.split(":")
    policies = tuple(xshare.POLICIES)
    valid = (f"choose from exclusive, processes, or xshare:<policy>[:lanes=N] with policy one of "
             f"{', '.join(policies)}")
    if len(parts) < 2 or parts[0] != "xshare" or parts[1] not in policies:
        raise ValueError(f"unknown mode {mode!r}; {valid}")
    kwargs: dict[str, Any] = {}
    for opt in parts[2:]:
        key, _, value = opt.partition("=")
        if key != "lanes" or not value.isdigit() or int(value) < 1:
            raise ValueError(f"mode {mode!r}: unknown option {opt!r} (the one option is lanes=N, N >= 1); {valid}")
        kwargs["max_lanes"] = int(value)
    return "xshare", parts[1], kwargs


# ------------------------------------------------------------------------------ figures


def device_peak_bytes() -> int | None:
    """The device allocator's peak (GPU); None where the backend keeps no statistics (CPU)."""
    import jax

    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001
        return None
    if not stats:
        return None
    peak = stats.get("peak_bytes_in_use")
    return int(peak) if peak is not None else None


def maxrss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def sum_cpu(deltas: Iterable[Any]) -> dict[str, float] | None:
    """Several CpuDelta (or their JSON) added up: CPU seconds over the summed windows."""
    out: dict[str, float] = {}
    for d in deltas:
        if d is None:
            return None
        for k, v in (d if isinstance(d, Mapping) else d.to_json()).items():
            if isinstance(v, (int, float)):
                out[k] = out.get(k, 0.0) + v
    return out or None


def _latency(metrics: Mapping[str, float] | None) -> dict[str, float]:
    return {k: float(metrics[k]) for k in ("latency_p50_ms", "latency_p99_ms") if metrics and k in metrics}


def lane_profile(steps: Iterable[tuple[int, int, int]], t_start_ns: int, t_end_ns: int) -> dict[str, Any]:
    """Where the device time went, from executed steps ``(lane, t_begin_ns, t_end_ns)``.

    ``busy_fraction`` per lane: the part of the makespan its steps were executing.
    ``device_busy_fraction``: the part of the makespan at least one step was executing.
    ``mean_concurrency``: steps executing at once on average (> 1: lanes overlapped).
    ``gap_us_p50`` per lane: the idle time between one step's end and the next one's begin."""
    span = max(t_end_ns - t_start_ns, 1)
    by_lane: dict[int, list[tuple[int, int]]] = {}
    for lane, a, b in steps:
        by_lane.setdefault(int(lane), []).append((int(a), int(b)))
    lanes, everything, total = {}, [], 0
    for lane, iv in sorted(by_lane.items()):
        iv.sort()
        merged = _union(iv)
        busy = sum(b - a for a, b in merged)
        gaps = sorted(max(iv[i + 1][0] - iv[i][1], 0) for i in range(len(iv) - 1))
        lanes[str(lane)] = {"steps": len(iv), "busy_fraction": busy / span,
                            "gap_us_p50": gaps[len(gaps) // 2] / 1e3 if gaps else None,
                            "gap_us_mean": sum(gaps) / len(gaps) / 1e3 if gaps else None}
        everything.extend(iv)
        total += sum(b - a for a, b in iv)
    union = sum(b - a for a, b in _union(sorted(everything)))
    return {"lanes": lanes, "device_busy_fraction": union / span, "mean_concurrency": total / span}


def _union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in intervals:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


# ------------------------------------------------------------------------------ modes


def run_exclusive(plans: Sequence[JobPlan]) -> dict[str, Any]:
    """Each job alone, one after the other, in the plain loop. The clock runs only while a job
    runs (its compile, like every mode's, is not counted); job ``i`` completes after jobs
    ``0..i`` ran, as in a FIFO queue for an exclusively allocated device."""
    from .loop import prepare

    jobs, clock, compile_s, cpu = [], 0.0, 0.0, []
    t_first = None
    for plan in plans:
        spec = build(plan)
        plain = prepare(spec)
        compile_s += plain.compile_s
        run = plain.run_steps()
        t_first = run.t_start if t_first is None else t_first
        clock += run.seconds
        cpu.append(run.cpu)
        jobs.append({"name": plan.name, "status": "done", "steps": run.steps, "jct_s": clock,
                     "run_s": run.seconds, "mean_step_s": run.seconds / max(run.steps, 1),
                     "flops_per_step": plain.flops_per_step, "compile_s": plain.compile_s,
                     **_latency(run.metrics)})
        del plain, spec
        gc.collect()
    return {"makespan_s": clock, "compile_s": compile_s, "jobs": jobs, "cpu": sum_cpu(cpu),
            "device_peak_bytes": device_peak_bytes(), "maxrss_bytes": maxrss_bytes()}


def run_threads(plans: Sequence[JobPlan]) -> dict[str, Any]:
    """Every job's plain loop in its own thread of one process, all started together: sharing
    by hand, without a runtime (no admission, no policy, no memory bookkeeping). Its throughput
    is what this machine gives to concurrent steps at all: the ceiling a runtime can approach."""
    import threading

    from .loop import cpu_snapshot, prepare

    specs = [build(p) for p in plans]
    plain = [prepare(s) for s in specs]
    fresh = [build(p) if s.observer is not None else None for p, s in zip(plans, specs)]
    runs: list[Any] = [None] * len(plain)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(plain) + 1)

    def one(i: int) -> None:
        barrier.wait()
        try:
            runs[i] = plain[i].run_steps(fresh[i])
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=one, args=(i,), name=f"bench-job-{i}") for i in range(len(plain))]
    for t in threads:
        t.start()
    cpu0 = cpu_snapshot()
    t_go = time.monotonic()
    barrier.wait()
    for t in threads:
        t.join()
    cpu = cpu_snapshot().since(cpu0)
    if errors:
        raise errors[0]
    jobs = []
    for plan, p, run in zip(plans, plain, runs):
        jobs.append({"name": plan.name, "status": "done", "steps": run.steps, "jct_s": run.t_end - t_go,
                     "run_s": run.seconds, "mean_step_s": run.seconds / max(run.steps, 1),
                     "flops_per_step": p.flops_per_step, "compile_s": p.compile_s, **_latency(run.metrics)})
    return {"makespan_s": max(r.t_end for r in runs) - t_go, "compile_s": sum(p.compile_s for p in plain),
            "jobs": jobs, "cpu": cpu.to_json(), "device_peak_bytes": device_peak_bytes(),
            "maxrss_bytes": maxrss_bytes()}


def run_worker(plan: JobPlan, ready: Any, go: Any) -> dict[str, Any]:
    """One job of the ``processes`` mode: compile, say ``ready``, wait for ``go``, run."""
    from .loop import prepare

    spec = build(plan)
    plain = prepare(spec)
    # A job with an observer (an inference server) serves requests on a clock that starts with
    # its data's first call: give it a fresh copy of its data at the start, so that the wait at
    # the barrier (for the slowest process to compile) does not count as its requests' latency.
    fresh = build(plan) if spec.observer is not None else None
    ready()
    go()
    run = plain.run_steps(fresh)
    return {"name": plan.name, "status": "done", "steps": run.steps, "t_start": run.t_start,
            "t_end": run.t_end, "run_s": run.seconds, "mean_step_s": run.seconds / max(run.steps, 1),
            "flops_per_step": plain.flops_per_step, "compile_s": plain.compile_s,
            "cpu": run.cpu.to_json(), "device_peak_bytes": device_peak_bytes(), "maxrss_bytes": maxrss_bytes(),
            **_latency(run.metrics)}


def run_xshare(plans: Sequence[JobPlan], policy: str, *, profile: bool = True,
               runtime_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """All jobs submitted together to one Runtime. The clock starts when the first job starts
    (after ``submit_many`` compiled them all) and stops when the last one ended."""
    import xshare
    from xshare.runtime.status import snapshot

    from .loop import cpu_snapshot

    specs = [build(p) for p in plans]
    t_submit = time.monotonic()
    with xshare.Runtime(policy=policy, **(runtime_kwargs or {})) as rt:
        handles = rt.submit_many(specs)
        cpu0 = cpu_snapshot()  # the jobs started a moment ago (submit_many starts them as it returns)
        rt.wait()
        cpu = cpu_snapshot().since(cpu0)
        snap = snapshot(rt)
        timeline = rt.timeline() if profile else []
        compiled = {h.name: getattr(getattr(h._rec, "compiled", None), "flops", None) for h in handles}
    rows = snap["jobs"]
    started = [r["started_s"] for r in rows if r["started_s"] is not None]
    ended = [r["ended_s"] for r in rows if r["ended_s"] is not None]
    t0 = min(started) if started else 0.0
    t1 = max(ended) if ended else t0
    jobs = []
    for r in rows:
        jobs.append({"name": r["name"], "status": r["status"], "error": r["error"],
                     "steps": r["steps_done"], "jct_s": None if r["ended_s"] is None else r["ended_s"] - t0,
                     "run_s": None if r["ended_s"] is None or r["started_s"] is None else r["ended_s"] - r["started_s"],
                     "step_time_p50_s": r["step_time_p50_s"], "device_time_s": r["device_time_s"],
                     "flops_per_step": compiled.get(r["name"]), **_latency(r["metrics"])})
    out = {"makespan_s": t1 - t0, "compile_s": (rt.t0 + t0) - t_submit, "jobs": jobs, "cpu": cpu.to_json(),
           "device_peak_bytes": device_peak_bytes(), "maxrss_bytes": maxrss_bytes(),
           "fences": snap["runtime"]["fences"], "lanes_opened": len({r["lane"] for r in rows if r["lane"] is not None}),
           "arena_peak_in_flight_bytes": snap["arena"]["peak_in_flight_bytes"]}
    if profile and timeline:
        a, b = int((rt.t0 + t0) * 1e9), int((rt.t0 + t1) * 1e9)
        out["profile"] = lane_profile(((s.lane, s.t_begin_ns, s.t_end_ns) for s in timeline), a, b)
    return out


def run_overhead(plan: JobPlan, pairs: int) -> dict[str, Any]:
    """One job, in the plain loop and alone under xshare (pack), alternating (the order flips
    every pair) in this one process. Both clocks exclude compilation and end with the state on
    the host."""
    from .loop import prepare

    # Burn-in: a few untimed steps of each, so neither pays the process's one-time costs (the
    # first execution in a process costs tens of milliseconds) inside its measurement.
    warm = JobPlan(plan.name, plan.entry, dict(plan.params), min(plan.steps or 5, 5))
    prepare(build(warm)).run_steps()
    run_xshare([warm], "pack", profile=False)
    plain_s, xshare_s, order, profiles = [], [], [], []
    for i in range(pairs):
        for which in (("plain", "xshare") if i % 2 == 0 else ("xshare", "plain")):
            if which == "plain":
                plain = prepare(build(plan))
                plain_s.append(plain.run_steps().seconds)
                del plain
            else:
                res = run_xshare([plan], "pack")
                if res["jobs"][0]["status"] != "done":
                    raise RuntimeError(f"overhead job under xshare: {res['jobs'][0]['error']}")
                xshare_s.append(res["makespan_s"])
                profiles.append({"device_busy_fraction": res.get("profile", {}).get("device_busy_fraction"),
                                 "gap_us_p50": next(iter(res.get("profile", {}).get("lanes", {}).values()),
                                                    {}).get("gap_us_p50"),
                                 "step_time_p50_s": res["jobs"][0]["step_time_p50_s"]})
            order.append(which)
            gc.collect()
    return {"job": plan.to_json(), "plain_s": plain_s, "xshare_s": xshare_s, "order": order,
            "xshare_profiles": profiles}
