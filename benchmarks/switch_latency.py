"""Job-switch latency: the device idle gap between two consecutive steps, from the FFI fences.

Salus's first primitive is fast job switching at iteration granularity. Here a *switch* is two
consecutive steps on one lane that belong to different jobs: the gap is
``begin(step of job B) - end(step of job A)``, both read by the fences inside the executables.

Configurations, per step kind (``tiny``: a 16x16 matmul; ``mlp``: models.mlp, width 256):

* ``plain loop`` (the floor): one job, ``jax.jit(ffi.fenced(step), donate_argnums=(0, 1))`` in
  a Python for-loop over batches already on the device, no sync until the end. The gap
  between consecutive steps is what JAX itself costs between two executions.
* ``plain loop + fetch``: the same loop reading each step's metrics to the host one step
  behind (what the runtime does: it logs every step's metrics), for attribution.
* ``xshare, 1 job``: one job under ``Runtime(policy="pack")``: same-job gaps.
* ``xshare, N jobs, 1 lane``: N identical jobs (different seeds) in ONE lane under
  ``pack`` with ``quantum=1``: every consecutive pair is a switch.

The configurations alternate inside every repeat (the order reverses on odd repeats), gaps
are pooled over repeats for median and p99, and ratios use the per-repeat medians.

    python -m benchmarks.switch_latency [--smoke] [--out DIR]
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

import jax

import xshare
from xshare import ffi

from xshare.bench import harness as H
from .steps import device_copy, model_job, one_lane_kwargs

NAME = "switch_latency"
FLOOR_JOB = 7  # job id the plain loop's fences record


def _pair_gaps(records: list[tuple[int, int, int]], burn: int) -> tuple[list[float], list[float]]:
    """(switch gaps, same-job gaps) in µs between consecutive steps of one lane.

    ``records``: (job, t_begin_ns, t_end_ns) in start order. Pairs count only while every job
    is past its first ``burn`` steps and none has finished (the tail, where fewer jobs are
    left, is not a switch workload).
    """
    jobs = {j for j, _, _ in records}
    first_end = min(max(e for j, _, e in records if j == job) for job in jobs)
    seen: dict[int, int] = {}
    warm_from = None
    for i, (j, _, _) in enumerate(records):
        seen[j] = seen.get(j, 0) + 1
        if warm_from is None and len(seen) == len(jobs) and min(seen.values()) > burn:
            warm_from = i
    switch, same = [], []
    if warm_from is None:
        return switch, same
    for (ja, _, ea), (jb, bb, eb) in zip(records[warm_from:], records[warm_from + 1:]):
        if eb >= first_end:
            break
        (switch if ja != jb else same).append((bb - ea) / 1e3)
    return switch, same


class PlainLoop:
    """One job in a plain Python loop, fenced; compiled once and reused across repeats."""

    def __init__(self, model: str, steps: int):
        self.spec = model_job(model, steps=steps, seed=0)
        self.ring = ffi.open_ring(1 << 16)
        self.step = jax.jit(ffi.fenced(self.spec.fn, ring_id=self.ring, job_id=FLOOR_JOB),
                            donate_argnums=(0, 1))
        self.steps = steps

    def run(self, burn: int, fetch: bool) -> dict[str, Any]:
        state = device_copy(self.spec.state)
        batches = [jax.device_put(self.spec.data(k)) for k in range(self.steps)]
        jax.block_until_ready((state, batches))
        ffi.drain(self.ring)
        prev = None
        cpu0, t0 = _cpu_s(), time.perf_counter()
        for b in batches:
            state, metrics = self.step(state, b)
            if fetch:
                if prev is not None:
                    jax.device_get(prev)  # the previous step's metrics, as the runtime logs them
                prev = metrics
        jax.block_until_ready((state, metrics))
        wall, cpu = time.perf_counter() - t0, _cpu_s() - cpu0
        ev = ffi.drain(self.ring)
        ev = ev[ev["job"] == FLOOR_JOB]
        begins, ends = ev[ev["kind"] == ffi.BEGIN]["t_ns"], ev[ev["kind"] == ffi.END]["t_ns"]
        recs = [(0, int(b), int(e)) for b, e in zip(begins, ends)]
        _, same = _pair_gaps(recs, burn)
        return {"gaps_us": same, "step_us": [(e - b) / 1e3 for _, b, e in recs[burn:]],
                "steps_per_s": self.steps / wall,
                "host_cpu_us": _host_cpu_us(cpu, recs, self.steps)}


def _cpu_s() -> float:
    """CPU time of the whole process (every thread: Python, prefetch, XLA's workers)."""
    return time.process_time()


def _host_cpu_us(cpu_s: float, recs: list[tuple[int, int, int]], steps: int) -> float:
    """Process CPU per step minus the step's own execution (fence-measured): the host's cost of
    driving one step (dispatch, bookkeeping, prefetch), in µs. XLA's worker threads are
    counted too and assumed to use one core while a step runs, so this is approximate."""
    exec_s = sum(e - b for _, b, e in recs) / 1e9
    return max(cpu_s - exec_s, 0.0) / steps * 1e6


def run_runtime(model: str, n_jobs: int, steps: int, burn: int) -> dict[str, Any]:
    specs = [model_job(model, steps=steps, seed=i, name=f"{model}-{i}") for i in range(n_jobs)]
    lane_kw, how = one_lane_kwargs(specs) if n_jobs > 1 else ({}, "one job")
    with xshare.Runtime(policy="pack", quantum=1, **lane_kw) as rt:
        handles = rt.submit_many(specs)
        cpu0, t0 = _cpu_s(), time.perf_counter()
        rt.wait()
        wall, cpu = time.perf_counter() - t0, _cpu_s() - cpu0
        timeline = rt.timeline()
    failed = [h for h in handles if h.status() != "done"]
    if failed:
        raise RuntimeError(f"jobs did not finish: {[(h.name, h.status(), h.error) for h in failed]}")
    lanes = sorted({r.lane for r in timeline})
    recs_all = sorted(timeline, key=lambda r: r.t_begin_ns)
    # Gaps are measured within one lane; with several lanes (should not happen here) use lane 0's.
    recs = [(r.job, r.t_begin_ns, r.t_end_ns) for r in recs_all if r.lane == lanes[0]]
    switch, same = _pair_gaps(recs, burn)
    return {"switch_us": switch, "same_us": same, "lanes": lanes, "how": how,
            "step_us": [(e - b) / 1e3 for _, b, e in recs],
            "steps_per_s": n_jobs * steps / wall,
            "host_cpu_us": _host_cpu_us(cpu, [(r.job, r.t_begin_ns, r.t_end_ns) for r in recs_all],
                                        n_jobs * steps)}


def main(argv: list[str] | None = None) -> int:
    p = H.parser(NAME, __doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="steps per job per configuration")
    p.add_argument("--jobs", type=int, default=2, help="jobs interleaved in the one lane")
    p.add_argument("--models", default="tiny,mlp")
    args = p.parse_args(argv)
    repeats = args.repeats or (1 if args.smoke else 7)
    steps = args.steps or (30 if args.smoke else 600)
    burn = 5 if args.smoke else 30
    models = [m for m in args.models.split(",") if m]
    if not ffi.enabled():
        raise SystemExit(f"{NAME} needs the FFI fences: {ffi.unavailable_reason() or 'XSHARE_FFI=0'}")

    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    info = H.machine()
    floors = {m: PlainLoop(m, steps) for m in models}
    configs = [(m, kind) for m in models for kind in ("floor", "floor_fetch", "xshare_1", "xshare_n")]
    raw: dict[str, dict[str, list]] = {f"{m}/{k}": {"gaps": [], "switch": [], "medians": [], "switch_medians": [],
                                                     "step_us": [], "steps_per_s": [], "lanes": [],
                                                     "host_cpu_us": []}
                                      for m, k in configs}
    how = ""
    for m in models:  # burn-in: compile and warm every path once, unmeasured
        floors[m].run(burn=1, fetch=False)
    for rep in range(repeats):
        order = configs if rep % 2 == 0 else configs[::-1]
        for m, kind in order:
            r = raw[f"{m}/{kind}"]
            if kind in ("floor", "floor_fetch"):
                out = floors[m].run(burn, fetch=kind == "floor_fetch")
                r["gaps"] += out["gaps_us"]
                r["medians"].append(H.median(out["gaps_us"]))
            else:
                n = 1 if kind == "xshare_1" else args.jobs
                out = run_runtime(m, n, steps, burn)
                r["lanes"].append(out["lanes"])
                r["gaps"] += out["same_us"]
                r["medians"].append(H.median(out["same_us"]))
                if n > 1:
                    how = out["how"]
                    r["switch"] += out["switch_us"]
                    r["switch_medians"].append(H.median(out["switch_us"]))
            r["step_us"] += out["step_us"]
            r["steps_per_s"].append(out["steps_per_s"])
            r["host_cpu_us"].append(out["host_cpu_us"])
            print(f"  repeat {rep + 1}/{repeats} {m:5s} {kind:12s} done", flush=True)
    info["load_avg_end"] = H._load()

    columns = ["step", "configuration", "gap kind", "n", "median µs", "p99 µs", "min µs",
               "ratio to floor", "step µs (median)", "steps/s", "host CPU µs/step"]
    rows, results = [], {}
    labels = {"floor": "plain loop (floor)", "floor_fetch": "plain loop + metrics fetch",
              "xshare_1": "xshare, 1 job", "xshare_n": f"xshare, {args.jobs} jobs, 1 lane"}
    for m in models:
        floor_meds = raw[f"{m}/floor"]["medians"]
        for kind in ("floor", "floor_fetch", "xshare_1", "xshare_n"):
            r = raw[f"{m}/{kind}"]
            series = [("same job", r["gaps"], r["medians"])]
            if kind == "xshare_n":
                series = [("switch", r["switch"], r["switch_medians"])] + (
                    [("same job", r["gaps"], r["medians"])] if r["gaps"] else [])
            for gap_kind, gaps, meds in series:
                per_rep = [x for x in (H.ratio(a, b) for a, b in zip(meds, floor_meds)) if not math.isnan(x)]
                s = H.summary(gaps)
                row_ratio = H.median(per_rep) if kind != "floor" else 1.0
                rows.append([m, labels[kind], gap_kind, s["n"], s["median"], s["p99"], s["min"],
                             row_ratio, H.median(r["step_us"]), H.median(r["steps_per_s"]),
                             H.median(r["host_cpu_us"])])
                results[f"{m}/{kind}/{gap_kind}"] = {
                    "gaps_us": s, "median_per_repeat_us": meds, "ratio_to_floor_per_repeat": per_rep,
                    "ratio_to_floor": row_ratio, "step_us": H.summary(r["step_us"]),
                    "steps_per_s_per_repeat": r["steps_per_s"], "lanes_per_repeat": r["lanes"],
                    "host_cpu_us_per_step_per_repeat": r["host_cpu_us"]}
    headline = {m: results.get(f"{m}/xshare_n/switch", {}).get("ratio_to_floor") for m in models}
    # The switch's own cost: switch gaps vs the runtime's same-job gaps (1 job), per repeat.
    switch_vs_same = {m: H.median(H.ratio(a, b) for a, b in zip(
        raw[f"{m}/xshare_n"]["switch_medians"], raw[f"{m}/xshare_1"]["medians"])) for m in models}
    notes = f"""
## What is measured

A **gap** is `begin(next step) - end(previous step)` on one lane, both timestamps written by
the xshare FFI fences inside the compiled executables (`CLOCK_MONOTONIC`), so it is the time
the lane's device stream spends between two executions: JAX/PJRT dispatch, the runtime's
Python bookkeeping when it is not hidden behind the executing step, and the job switch.
A **switch** gap is one where the two steps belong to different jobs.

* floor: one job, `jax.jit(ffi.fenced(step), donate_argnums=(0, 1))` in a Python loop over
  batches already on the device, no host sync until the end (the best a plain loop can do).
* plain loop + metrics fetch: the same loop reading step k-1's metrics after dispatching step
  k (the runtime's pipeline: it keeps 1 step queued behind the executing one and logs every
  step's metrics).
* xshare, 1 job: `Runtime(policy="pack", quantum=1)`, one job: same-job gaps under the runtime.
* xshare, {args.jobs} jobs, 1 lane: `Runtime(policy="pack", quantum=1, {how})`; consecutive
  steps alternate jobs, so (almost) every gap is a switch.

Steps: `tiny` = a 16x16 matmul step (microseconds: the gap is all overhead); `mlp` =
`models.mlp` width 256, depth 2, batch 64, Adam. {steps} steps per job per configuration, the
first {burn} of each job and the tail after the first job finishes excluded; {repeats} repeats,
configurations alternated (order reversed on odd repeats). Medians/p99 pool every gap of every
repeat; "ratio to floor" is the median over repeats of (that repeat's median gap / the same
repeat's floor median gap). Target: switch/floor < 1.5x.

Headline (switch median / floor median): {", ".join(f"{m}: {H.fmt(v)}x" for m, v in headline.items())}.
Switch median / xshare same-job median (1 job), i.e. what switching jobs adds over the
runtime's own step boundary: {", ".join(f"{m}: {H.fmt(v)}x" for m, v in switch_vs_same.items())}.

"host CPU µs/step" is the process's CPU time (all threads) over the timed window, minus the
steps' own execution time (fence-measured), per step: what it costs the host to drive a step.
On a CPU backend the "device" is the same cores, so this host work competes with the steps.
"""
    H.write_results(NAME, args.out, title="Job-switch latency (FFI fence gaps)", columns=columns,
                         rows=rows, machine_info=info,
                         config={"repeats": repeats, "steps": steps, "burn": burn, "jobs": args.jobs,
                                 "models": models, "one_lane": how},
                         data={"results": results, "headline_switch_over_floor": headline,
                               "switch_over_xshare_same_job": switch_vs_same},
                         notes=notes, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
