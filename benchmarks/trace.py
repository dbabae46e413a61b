"""A job-arrival trace and its replayer: submit jobs to a Runtime at given times.

A trace is a list of :class:`TraceJob` (name, arrival time, model parameters, steps), made by
:func:`poisson_trace` from a seed, saved as JSON so that every policy replays exactly the same
arrivals. :func:`replay` submits each job when its arrival time comes (sleeping in between;
every job's spec is built before the clock starts; a submit that returns late makes the next
job late, and its lateness is recorded), waits for all of them, and returns each job's arrival, completion
and job completion time (JCT = completion - arrival, on the trace's clock).

Also a command line, used by ``benchmarks.jct_trace`` to replay one policy in a fresh process:

    python -m benchmarks.trace --trace T.json --policy fifo --result R.json [--compile-only]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np



def sleep_until_ns(t_ns: int) -> None:
    """Sleep until the monotonic clock reads ``t_ns`` (no spinning: the cores are the
    benchmark's; a sleep overshoots by well under a millisecond, far below a job's length)."""
    left = t_ns - time.monotonic_ns()
    if left > 0:
        time.sleep(left / 1e9)


@dataclass(frozen=True)
class TraceJob:
    name: str
    arrival_s: float          # seconds after the replay starts
    steps: int
    width: int                # xshare.models.mlp hidden width
    seed: int
    depth: int = 2
    batch: int = 64

    def spec(self, steps: int | None = None):
        from xshare.models import mlp

        return mlp.make_job(width=self.width, depth=self.depth, batch=self.batch,
                            steps=self.steps if steps is None else steps, seed=self.seed, name=self.name)


def poisson_trace(n_jobs: int, *, seed: int, mean_gap_s: float, min_steps: int, spread: float = 10.0,
                  widths: Sequence[int] = (64, 128, 256)) -> list[TraceJob]:
    """``n_jobs`` MLP jobs: Poisson arrivals (exponential gaps of mean ``mean_gap_s``, the first at
    0), lengths log-uniform over ``[min_steps, spread * min_steps]`` with both ends present (so
    the spread is exact), widths drawn from ``widths``. Deterministic in ``seed``."""
    if n_jobs < 2:
        raise ValueError(f"n_jobs={n_jobs} must be >= 2")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(mean_gap_s, size=n_jobs - 1)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps)])
    u = rng.permutation(np.linspace(0.0, 1.0, n_jobs))  # evenly spread, shuffled: ends included
    steps = np.rint(min_steps * spread ** u).astype(int)
    w = rng.choice(np.asarray(widths), size=n_jobs)
    return [TraceJob(name=f"j{i:02d}-w{int(w[i])}-{int(steps[i])}st", arrival_s=round(float(arrivals[i]), 4),
                     steps=int(steps[i]), width=int(w[i]), seed=i) for i in range(n_jobs)]


def save(trace: Sequence[TraceJob], path: Path) -> None:
    Path(path).write_text(json.dumps([asdict(j) for j in trace], indent=1) + "\n")


def load(path: Path) -> list[TraceJob]:
    return [TraceJob(**d) for d in json.loads(Path(path).read_text())]


STUCK_S = 300.0  # a replay runs for seconds; past this it is reported stuck


def replay(trace: Sequence[TraceJob], runtime: Any, *, compile_only: bool = False) -> dict[str, Any]:
    """Submit each job at its arrival time; wait for all; return their timings.

    Times are seconds on the replay's clock (0 = the first arrival). ``compile_only`` submits
    every job at once with one step (to fill a compilation cache) and records nothing useful.
    """
    jobs = sorted(trace, key=lambda j: (j.arrival_s, j.name))
    # Every job's model and initial state are built before the clock starts (the benchmarks'
    # one-clock rule): building them between arrivals made the replay thread submit late (0.14-
    # 0.18 s on average) and hold the GIL while the dispatcher ran, which counted against every
    # policy's JCT and not against the oracle's.
    specs = [job.spec(steps=1 if compile_only else None) for job in jobs]
    t0 = time.monotonic_ns()
    subs = []
    for job, spec in zip(jobs, specs):
        if not compile_only:
            sleep_until_ns(t0 + int(job.arrival_s * 1e9))
        t_sub = time.monotonic_ns()
        handle = runtime.submit(spec)  # compiles the job's step (outside the policy's control)
        subs.append((job, handle, t_sub, time.monotonic_ns()))
    if not runtime.wait(timeout=STUCK_S):
        # A replay takes seconds: name what is stuck rather than hang until the caller's timeout
        # (one jct_trace replay hung once with the dispatcher idle and a job not ended).
        stuck = [{k: j.get(k) for k in ("name", "status", "steps_done", "steps", "steps_per_call", "programs")}
                 for j in runtime.snapshot()["jobs"] if j.get("status") not in ("done", "failed", "cancelled")]
        raise RuntimeError(f"the replay did not end within {STUCK_S:.0f} s; jobs not ended: {stuck}")
    # Runtime-clock start and end of each job's run: under an exclusive policy (fifo) the run
    # is the job's service time, what the zero-overhead SRTF oracle schedules (jct_trace).
    runs = {j["name"]: j for j in runtime.snapshot()["jobs"]}
    rows = []
    for job, h, t_sub, t_sub_end in subs:
        p = h.progress()
        snap = runs.get(job.name, {})
        # progress().wall_s runs from the runtime's arrival (registered at the start of submit,
        # within microseconds of t_sub) to the job's end.
        done_s = (t_sub - t0) / 1e9 + p.wall_s
        rows.append({"name": job.name, "arrival_s": job.arrival_s, "steps": job.steps, "width": job.width,
                     "submitted_s": (t_sub - t0) / 1e9, "submit_s": (t_sub_end - t_sub) / 1e9,
                     "late_s": (t_sub - t0) / 1e9 - job.arrival_s, "completion_s": done_s,
                     "jct_s": done_s - job.arrival_s, "status": h.status(), "error": h.error,
                     "steps_done": p.steps_done,
                     "run_s": (snap["ended_s"] - snap["started_s"]) if snap.get("ended_s") is not None
                     and snap.get("started_s") is not None else None,
                     "device_time_s": snap.get("device_time_s"),
                     # where the tiers ran it (steps per K) and why (its kept form, or none)
                     "steps_per_call": snap.get("steps_per_call"), "programs": snap.get("programs")})
    done = [r for r in rows if r["status"] == "done"]
    return {
        "jobs": rows,
        "avg_jct_s": float(np.mean([r["jct_s"] for r in done])) if done else math.nan,
        "median_jct_s": float(np.median([r["jct_s"] for r in done])) if done else math.nan,
        "makespan_s": max(r["completion_s"] for r in rows) - min(j.arrival_s for j in jobs),
        "failed": [r["name"] for r in rows if r["status"] != "done"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.trace", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, required=True, help="trace JSON (benchmarks.trace.save)")
    p.add_argument("--policy", required=True, help="a policy name, or srtf:N for Runtime(policy='srtf', slots=N)")
    p.add_argument("--memory", default=None, help="Runtime(memory=...): bytes or e.g. 64MiB")
    p.add_argument("--result", type=Path, required=True, help="where to write the replay's JSON")
    p.add_argument("--compile-only", action="store_true",
                   help="submit every job with one step, at once (fills the compilation cache)")
    args = p.parse_args(argv)
    import xshare

    memory = int(args.memory) if args.memory and args.memory.isdigit() else args.memory
    trace = load(args.trace)
    t = time.perf_counter()
    name, _, slots = args.policy.partition(":")
    with xshare.Runtime(policy=name, memory=memory, slots=int(slots or 1)) as rt:
        out = replay(trace, rt, compile_only=args.compile_only)
    out.update(policy=args.policy, memory=args.memory, wall_s=time.perf_counter() - t)
    args.result.write_text(json.dumps(out, indent=1, default=lambda x: None) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
