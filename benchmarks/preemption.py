"""Preemption latency: how soon a more urgent job runs its first step once it is admitted.

A long low-priority job runs; after it has run ``--warm`` steps a short high-priority job is
submitted (under ``priority``), or a short job (under ``srtf``). Measured, per repeat: from the
urgent job's admission (its ``started_s`` on the runtime's clock) to the begin of its first step
(the FFI fence on the device, or the host's dispatch time without fences), in units of the long
job's median step time and of the policy's quantum (``Policy.quantum_s``, ``xshare.sched.steps``:
the device time the calls in flight may take under a preemptive policy), and how many steps of
the long job began in that interval. Target (issues #24, #32): within one step time, or within the quantum where the
long job runs several steps per call. Both clocks are CLOCK_MONOTONIC.

    python -m benchmarks.preemption [--repeats 7] [--smoke] [--out DIR]
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xshare.bench import harness as H

NAME = "preemption"
DIM = 384  # a few milliseconds of matmul per step on one CPU core


def _step(state, batch):
    w = state["w"] * 0.999 + 0.001 * jnp.tanh(batch["x"] @ state["w"])
    return {"w": w}, {"norm": jnp.mean(w * w)}


def _spec(job: Any, seed: int, steps: int, name: str, priority: int = 0) -> Any:
    w = jnp.asarray(np.random.default_rng(seed).normal(size=(DIM, DIM)) / np.sqrt(DIM), jnp.float32)
    x = np.random.default_rng(seed + 1).normal(size=(DIM, DIM)).astype(np.float32)
    return job.bind({"w": w}, lambda k: {"x": x}, steps=steps, name=name, priority=priority)


def _one(policy: str, warm: int, long_steps: int, job: Any) -> dict[str, Any]:
    import xshare

    low = _spec(job, 0, long_steps, "long")
    urgent = _spec(job, 1, 5, "urgent", priority=10)
    with xshare.Runtime(policy=policy, memory="512MiB") as rt:
        lo = rt.submit(low)
        while lo.progress().steps_done < warm and lo.status() in ("compiling", "queued", "running"):
            time.sleep(0.001)
        hi = rt.submit(urgent)
        hi.wait(timeout=300)
        lo.cancel()
        snap = {j["name"]: j for j in rt.snapshot()["jobs"]}
        per_call = snap["long"].get("steps_per_call") or {}
        t_admit_ns = int((rt.t0 + snap["urgent"]["started_s"]) * 1e9)
    timeline = rt.timeline()
    first = min(r.t_begin_ns for r in timeline if r.job == hi.id)
    low_steps = [r for r in timeline if r.job == lo.id]
    step_s = float(np.median([(r.t_end_ns - r.t_begin_ns) / 1e9 for r in low_steps]))
    between = sum(1 for r in low_steps if t_admit_ns <= r.t_begin_ns < first)
    latency_s = max(first - t_admit_ns, 0) / 1e9
    return {"policy": policy, "latency_s": latency_s, "step_s": step_s, "latency_steps": latency_s / step_s,
            "long_steps_between": between, "fenced": bool(rt.fences),
            "long_k": max((int(k) for k, n in per_call.items() if n), default=1)}


def main(argv: list[str] | None = None) -> int:
    p = H.parser(NAME, __doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warm", type=int, default=20, help="steps of the long job before the urgent one arrives")
    args = p.parse_args(argv)
    repeats, long_steps = (1, 200) if args.smoke else (args.repeats, 3000)
    import xshare

    job = xshare.job(_step, name="matmul")
    info = H.machine()
    runs: dict[str, list] = {"priority": [], "srtf": []}
    for rep in range(repeats):
        for policy in (("priority", "srtf") if rep % 2 == 0 else ("srtf", "priority")):
            r = _one(policy, args.warm, long_steps, job)
            runs[policy].append(r)
            print(f"  repeat {rep + 1}/{repeats} {policy}: {1e3 * r['latency_s']:.2f} ms = "
                  f"{r['latency_steps']:.2f} steps ({r['long_steps_between']} long steps began)", flush=True)
    info["load_avg_end"] = H._load()
    from xshare.sched import get_policy
    from xshare.sched.steps import QUANTUM_S

    def quantum(policy: str) -> float:  # (each preemptive policy's own: Policy.quantum_s)
        return float(getattr(get_policy(policy), "quantum_s", QUANTUM_S))

    columns = ["policy", "median latency ms", "max latency ms", "median step ms", "median latency / step",
               "max latency / step", "median latency / quantum", "long job's K (max)",
               "long steps begun in between (max)"]
    rows = []
    for policy, rs in runs.items():
        rows.append([policy, 1e3 * H.median(r["latency_s"] for r in rs), 1e3 * max(r["latency_s"] for r in rs),
                     1e3 * H.median(r["step_s"] for r in rs), H.median(r["latency_steps"] for r in rs),
                     max(r["latency_steps"] for r in rs), H.median(r["latency_s"] for r in rs) / quantum(policy),
                     max(r["long_k"] for r in rs), max(r["long_steps_between"] for r in rs)])
    notes = f"""
A long job ({long_steps} steps of a {DIM}x{DIM} matmul step) runs alone; after {args.warm} of its
steps an urgent job arrives: priority 10 under `priority`, a 5-step job under `srtf`. Latency:
from the urgent job's admission (`started_s`, the runtime's clock) to the begin of its first
step ({'FFI fences' if runs['priority'] and runs['priority'][0]['fenced'] else 'host dispatch times'}),
against the long job's median step time and the policy's quantum (priority {1e3 * quantum("priority"):g} ms,
srtf {1e3 * quantum("srtf"):g} ms: `Policy.quantum_s`); {repeats} repeat(s),
the policies alternating. "long job's K": the most steps one call of the long job ran.
Target (issues #24, #32): latency <= 1 step time, or <= the quantum where the long job runs
several steps per call (a call in flight is not preempted; it takes at most about the quantum's
share).
"""
    H.write_results(NAME, args.out, title="Preemption latency: an urgent job's first step after admission",
                    columns=columns, rows=rows, machine_info=info, smoke=args.smoke,
                    config={"repeats": repeats, "warm": args.warm, "long_steps": long_steps, "dim": DIM},
                    data={"runs": runs, "jax": jax.__version__}, notes=notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
