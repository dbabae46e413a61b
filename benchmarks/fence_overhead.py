"""What the FFI step fences cost: fences on vs off, same process, alternating.

* ``tiny`` step in a plain loop (``jax.jit(step, donate_argnums=(0, 1))`` vs
  ``jax.jit(ffi.fenced(step), donate_argnums=(0, 1))``): per-step overhead in µs, both
  pipelined (dispatch everything, block at the end: throughput) and synchronous (block after
  every step: latency).
* ``mlp`` step (``models.mlp`` defaults) in the same plain loop: overhead in % of steps/s.
* ``mlp`` under the runtime: ``Runtime(fences=True)`` vs ``Runtime(fences=False)``, one job:
  overhead in % of steps/s.
* XLA's memory analysis of both compiled variants (temp bytes): a fence is an aliased identity,
  so it should add nothing; any difference is reported.

    python -m benchmarks.fence_overhead [--smoke] [--out DIR]
"""

from __future__ import annotations

import re
import time
import warnings
from typing import Callable

import jax

import xshare
from xshare import ffi

from xshare.bench import harness as H
from .steps import device_copy, model_job

NAME = "fence_overhead"


class Loop:
    """A donated plain loop over device-resident batches, timed chunk by chunk."""

    def __init__(self, step: Callable, spec: xshare.JobSpec, chunk: int, sync: bool):
        self.step, self.spec, self.chunk, self.sync = step, spec, chunk, sync
        self.state = device_copy(spec.state)
        self.k = 0

    def __call__(self) -> float:
        """Seconds per step over the next ``chunk`` steps (the state carries over)."""
        # The spec holds ``chunk`` distinct host batches; every chunk cycles through them.
        batches = [jax.device_put(self.spec.data((self.k + i) % self.spec.steps)) for i in range(self.chunk)]
        jax.block_until_ready((self.state, batches))
        self.k += self.chunk
        state, step, sync = self.state, self.step, self.sync
        t0 = time.perf_counter()
        for b in batches:
            state, metrics = step(state, b)
            if sync:
                jax.block_until_ready(metrics)
        jax.block_until_ready((state, metrics))
        dt = (time.perf_counter() - t0) / len(batches)
        self.state = state
        return dt


class RuntimeCase:
    """One long-lived ``Runtime(fences=...)``; each call runs one fresh job and times it."""

    def __init__(self, fences: bool, make_spec: Callable[[str], xshare.JobSpec]):
        self.rt = xshare.Runtime(policy="pack", fences=fences)
        self.make_spec, self.n, self.fences = make_spec, 0, fences
        assert self.rt.fences == fences

    def __call__(self) -> float:
        self.n += 1
        spec = self.make_spec(f"mlp-{'on' if self.fences else 'off'}-{self.n}")
        (h,) = self.rt.submit_many([spec])  # compiles here: not timed
        t0 = time.perf_counter()
        h.wait()
        wall = time.perf_counter() - t0
        if h.status() != "done":
            raise RuntimeError(f"job {h.name} ended {h.status()}: {h.error}")
        return wall / spec.steps

    def close(self) -> None:
        self.rt.close()


def _compiled_stats(fn: Callable, spec: xshare.JobSpec) -> dict[str, int]:
    """XLA's temp bytes and the number of copy instructions in the donated compiled step."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        c = jax.jit(fn, donate_argnums=(0, 1)).lower(spec.state, spec.data(0)).compile()
    copies = sum(1 for line in c.as_text().splitlines() if re.search(r"= \S+ copy\(", line))
    return {"temp_bytes": int(c.memory_analysis().temp_size_in_bytes), "copies": copies}


def main(argv: list[str] | None = None) -> int:
    p = H.parser(NAME, __doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=None, help="plain-loop chunk pairs")
    p.add_argument("--rt-repeats", type=int, default=None, help="runtime job pairs")
    args = p.parse_args(argv)
    smoke = args.smoke
    repeats = args.repeats or (2 if smoke else 31)
    rt_repeats = args.rt_repeats or (2 if smoke else 15)
    chunk_tiny = 20 if smoke else 2000
    chunk_mlp = 10 if smoke else 300
    n_rt = 20 if smoke else 2000
    if not ffi.enabled():
        raise SystemExit(f"{NAME} needs the FFI fences: {ffi.unavailable_reason() or 'XSHARE_FFI=0'}")
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

    info = H.machine()
    ring = ffi.open_ring(1 << 12)  # the plain loops' fences; drained (dropped) as they fill
    tiny = model_job("tiny", steps=chunk_tiny)
    mlp = model_job("mlp", steps=chunk_mlp, width=128, batch=64)  # models.mlp defaults
    jit = {
        ("tiny", False): jax.jit(tiny.fn, donate_argnums=(0, 1)),
        ("tiny", True): jax.jit(ffi.fenced(tiny.fn, ring_id=ring, job_id=1), donate_argnums=(0, 1)),
        ("mlp", False): jax.jit(mlp.fn, donate_argnums=(0, 1)),
        ("mlp", True): jax.jit(ffi.fenced(mlp.fn, ring_id=ring, job_id=2), donate_argnums=(0, 1)),
    }
    loops = {
        "tiny, plain loop, pipelined": {f: Loop(jit[("tiny", f)], tiny, chunk_tiny, False) for f in (False, True)},
        "tiny, plain loop, sync each step": {f: Loop(jit[("tiny", f)], tiny, chunk_tiny, True) for f in (False, True)},
        "mlp, plain loop, pipelined": {f: Loop(jit[("mlp", f)], mlp, chunk_mlp, False) for f in (False, True)},
    }

    def rt_spec(name: str) -> xshare.JobSpec:
        return model_job("mlp", steps=n_rt, width=128, batch=64, name=name)

    runtimes = {f: RuntimeCase(f, rt_spec) for f in (False, True)}
    rt_name = "mlp, Runtime (1 job)"
    names = list(loops) + [rt_name]
    times: dict[str, dict[bool, list[float]]] = {name: {False: [], True: []} for name in names}
    try:
        for case in loops.values():  # burn-in: compile and warm every variant
            for f in (False, True):
                case[f]()
                ffi.drain(ring)
        for rep in range(repeats):
            order = (False, True) if rep % 2 == 0 else (True, False)
            for name, case in loops.items():
                for f in order:
                    times[name][f].append(case[f]())
                    ffi.drain(ring)
        print("  plain loops done", flush=True)
        for f in (False, True):  # burn-in
            runtimes[f]()
        for rep in range(rt_repeats):
            for f in ((False, True) if rep % 2 == 0 else (True, False)):
                times[rt_name][f].append(runtimes[f]())
            print(f"  runtime repeat {rep + 1}/{rt_repeats} done", flush=True)
    finally:
        for r in runtimes.values():
            r.close()
    info["load_avg_end"] = H._load()

    compiled = {m: {f: _compiled_stats(ffi.fenced(s.fn, ring_id=ring, job_id=3) if f else s.fn, s)
                    for f in (False, True)} for m, s in (("tiny", tiny), ("mlp", mlp))}

    columns = ["case", "off µs/step", "on µs/step", "overhead µs/step", "overhead %",
               "overhead % (p10..p90 over repeats)", "steps/s off", "steps/s on"]
    rows, results = [], {}
    for name in names:
        off, on = times[name][False], times[name][True]
        diffs_us = [(b - a) * 1e6 for a, b in zip(off, on)]
        pct = [100 * (b - a) / a for a, b in zip(off, on)]
        m_off, m_on = H.median(off), H.median(on)
        rows.append([name, m_off * 1e6, m_on * 1e6, H.median(diffs_us), H.median(pct),
                     f"{H.fmt(H.summary(pct)['p10'])} .. {H.fmt(H.summary(pct)['p90'])}",
                     1 / m_off, 1 / m_on])
        results[name] = {"off_s_per_step": off, "on_s_per_step": on, "overhead_us_per_repeat": diffs_us,
                         "overhead_pct_per_repeat": pct, "overhead_us_median": H.median(diffs_us),
                         "overhead_pct_median": H.median(pct)}
    mlp_pct = {k: results[k]["overhead_pct_median"] for k in results if k.startswith("mlp")}
    notes = f"""
## What is measured

Each row runs the same step with the fences off and on, back to back, alternating the order
each repeat; "overhead" is the median over repeats of the per-repeat difference (on - off),
so slow drift of the shared machine cancels. Plain loops: a donated `jax.jit` over batches
already on the device, {repeats} pairs of chunks ({chunk_tiny} tiny steps or {chunk_mlp} MLP
steps per chunk; the state carries over between chunks). Runtime: two long-lived
`Runtime(policy="pack", fences=True|False)`; each of {rt_repeats} pairs submits one fresh
`models.mlp` job of {n_rt} steps to each and times it from after `submit_many` (compile
excluded) to the job's end; with fences off the runtime times steps from the host instead. `mlp` = `models.mlp` defaults (width 128, depth 2,
batch 64, Adam); `tiny` = a 16x16 matmul step.

Target: < 2% on the MLP step. Medians: {", ".join(f"{k}: {H.fmt(v)}%" for k, v in mlp_pct.items())}.

XLA's view of the donated compiled step, fences off -> on (a zero-copy fence would change
neither): {"; ".join(f"{m}: temp {c[False]['temp_bytes']} -> {c[True]['temp_bytes']} B, copy "
                      f"instructions {c[False]['copies']} -> {c[True]['copies']}" for m, c in compiled.items())}.
"""
    H.write_results(NAME, args.out, title="FFI fence overhead (fences on vs off)", columns=columns,
                         rows=rows, machine_info=info,
                         config={"repeats": repeats, "runtime_repeats": rt_repeats, "tiny_chunk": chunk_tiny,
                                 "mlp_chunk": chunk_mlp, "runtime_steps": n_rt,
                                 "mlp": {"width": 128, "depth": 2, "batch": 64}},
                         data={"results": results, "compiled": compiled}, notes=notes, smoke=smoke)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
