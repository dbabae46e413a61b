"""Scale: N same-shape small jobs, plain loop vs xshare fifo vs xshare pack, side by side.

The jobs: an MLP 32-64-64-10 on batches of 64, Adam with its learning rate kept in state
(``optax.inject_hyperparams``), a different seed and learning rate per job: one program for
all N. Every configuration runs in a fresh process (no warm jit or program cache), its clock
starting before the first compile and stopping when every final state is on the host, so the
end-to-end time includes compilation, as a user would see it. Configurations alternate, repeat
after repeat, and the figures are medians.

Reported per N and configuration:
  * e2e wall time and its ratio to the plain loop (> 1: xshare finished sooner);
  * steady-state steps/s (steps completed between 25% and 75% of all steps, over that time);
  * XLA compiles (counted with jax.monitoring: backend compiles minus persistent-cache hits);
  * submit_many time;
  * host us/step: the runtime's own cost per step, measured on a trivial step (a few hundred
    nanoseconds of compute) as 1e6 * (1/xshare rate - 1/plain rate) over the same N jobs.

usage: python benchmarks/scale.py [--ns 1,8,32,64] [--steps 2000,2000,500,500] [--repeats 3] [--cache fresh|machine]
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("plain", "fifo", "pack")
CACHE = "fresh"  # the children's compilation cache (benchmarks/caches.py; --cache)


# ------------------------------------------------------------------------------ the child side
def _child(kind: str, n: int, steps: int, trivial: bool) -> dict:
    import jax
    from jax import monitoring

    counts = {"compiles": 0, "hits": 0}

    def on_duration(event: str, duration: float, **kw) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            counts["compiles"] += 1

    def on_event(event: str, **kw) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            counts["hits"] += 1

    monitoring.register_event_duration_secs_listener(on_duration)
    monitoring.register_event_listener(on_event)
    step, states, data = (_trivial if trivial else _mlp)(n)
    jax.block_until_ready(states)
    total = n * steps
    marks: list[float] = []          # time of every completed step (host)
    c0 = dict(counts)
    t0 = time.perf_counter()
    submit_s = None
    if kind == "plain":
        f = jax.jit(step, donate_argnums=0)
        finals = []
        for i in range(n):
            s, batch = states[i], data[i]
            for k in range(steps):
                s, m = f(s, batch(k))
                if k % 50 == 49:
                    jax.block_until_ready(m)
                    marks.append(time.perf_counter())
            finals.append(jax.device_get(s))
    else:
        import xshare
        job = xshare.job(step, name="scale")
        specs = [job.bind(states[i], data[i], steps=steps, name=f"j{i}") for i in range(n)]
        with xshare.Runtime(policy=kind, memory="8GiB") as rt:
            ts = time.perf_counter()
            handles = rt.submit_many(specs)
            submit_s = time.perf_counter() - ts
            rt.wait()
            finals = [h.result()[0] for h in handles]
            timeline = rt.timeline()
        # Steady-state from the device timeline (fence times; same clock as perf_counter's
        # monotonic base is not guaranteed, so use the timeline's own span).
        ends = sorted(r.t_end_ns for r in timeline)
        if len(ends) == total:
            marks = [e / 1e9 for e in ends[49::50]]
    wall = time.perf_counter() - t0
    compiles = (counts["compiles"] - c0["compiles"]) - (counts["hits"] - c0["hits"])
    steady = None
    if len(marks) >= 4:
        lo, hi = len(marks) // 4, (3 * len(marks)) // 4
        steady = (hi - lo) * 50 / (marks[hi] - marks[lo]) if marks[hi] > marks[lo] else None
    assert len(finals) == n
    return {"kind": kind, "n": n, "steps": steps, "trivial": trivial, "wall_s": wall,
            "steady_steps_per_s": steady, "xla_compiles": compiles, "submit_s": submit_s}


def _mlp(n: int):
    import flax.linen as nn
    import numpy as np
    import optax

    from benchmarks.steps import trainstate_mlps

    rng = np.random.default_rng(0)
    pool = [{"x": rng.normal(size=(64, 32)).astype(np.float32),
             "y": rng.integers(0, 10, size=(64,)).astype(np.int32)} for _ in range(64)]
    return trainstate_mlps(n, features=32, width=64, classes=10, activation=nn.relu,
                           tx=optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
                           lr=lambda i: 1e-3 * (1 + i % 4), batches=pool, stride=7)


def _trivial(n: int):
    import jax.numpy as jnp
    import numpy as np

    x = np.ones((4,), np.float32)

    def step(s, b):
        return {"w": s["w"] + b}, {"v": s["w"][0]}

    return step, [{"w": jnp.zeros((4,), jnp.float32)} for _ in range(n)], [(lambda k: x) for _ in range(n)]


# ------------------------------------------------------------------------------ the parent side
def _spawn(kind: str, n: int, steps: int, trivial: bool) -> dict:
    from benchmarks.caches import child_env

    with child_env(CACHE, JAX_COMPILATION_CACHE_DIR="") as env:
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps([kind, n, steps, trivial])],
                             capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("@@")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} n={n} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][2:])


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    from benchmarks.caches import CHOICES
    from xshare.bench import harness as h

    p = h.parser("scale", __doc__.splitlines()[0])
    p.add_argument("--ns", default="1,8,32,64")
    p.add_argument("--steps", default="2000,2000,500,500")
    p.add_argument("--trivial-steps", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cache", choices=CHOICES, default="fresh",
                   help="fresh (default): each child on an empty compilation cache of its own (every "
                        "compile paid, as by the plain loop); machine: this machine's cache (a relaunch)")
    args = p.parse_args(argv)
    global CACHE
    CACHE = args.cache
    if args.smoke:
        args.ns, args.steps, args.trivial_steps, args.repeats = "1,2", "100,100", 200, 1
    ns = [int(x) for x in args.ns.split(",")]
    steps = [int(x) for x in args.steps.split(",")]
    rows = []
    raw = []
    for n, st in zip(ns, steps):
        runs = h.alternate({k: (lambda k=k, n=n, st=st: _spawn(k, n, st, False)) for k in CONFIGS}, args.repeats)
        # The trivial runs' steady rate is read from the timeline, which keeps 100k steps.
        tiny_steps = min(args.trivial_steps, 64_000 // n)
        tiny = h.alternate({k: (lambda k=k, n=n, s=tiny_steps: _spawn(k, n, s, True)) for k in CONFIGS},
                           args.repeats)
        raw.append({"n": n, "steps": st, "runs": runs, "trivial": tiny})
        plain_rate = h.median(r["steady_steps_per_s"] for r in tiny["plain"])
        for k in CONFIGS:
            wall = h.median(r["wall_s"] for r in runs[k])
            ratios = h.paired_ratios([r["wall_s"] for r in runs["plain"]], [r["wall_s"] for r in runs[k]])
            rate = h.median(r["steady_steps_per_s"] for r in tiny[k])
            host_us = None if k == "plain" else 1e6 * (1 / rate - 1 / plain_rate)
            rows.append([n, st, k, wall, h.median(ratios), h.median(r["steady_steps_per_s"] for r in runs[k]),
                         h.median(r["xla_compiles"] for r in runs[k]),
                         None if k == "plain" else h.median(r["submit_s"] for r in runs[k]),
                         host_us])
        print(h.markdown_table(COLUMNS, [r for r in rows if r[0] == n]), flush=True)
    h.write_results("scale" + ("" if args.cache == "fresh" else f"_{args.cache}"), args.out, title="Scale: N same-shape jobs, plain loop vs xshare fifo/pack",
                    columns=COLUMNS, rows=rows, machine_info=h.machine(), smoke=args.smoke,
                    config={"ns": ns, "steps": steps, "trivial_steps": args.trivial_steps,
                            "repeats": args.repeats, "cache": args.cache}, data={"runs": raw},
                    notes=NOTES)
    return 0


NOTES = """e2e: fresh process per run, clock from before the first compile to every final state on
the host (compilation included). speed vs plain: median of per-repeat plain/config ratios (> 1:
xshare sooner). steady steps/s: steps completed between 25% and 75% of the run (plain: host
clock every 50 steps; xshare: the fence timeline). XLA compiles: jax.monitoring backend
compiles minus persistent-cache hits during the run (includes small helper programs such as
the optimizer-state init of the plain loop: count them the same way in every config).
host us/step: on a trivial step, 1e6 * (1/xshare rate - 1/plain rate): the runtime's own
per-step cost beyond a plain loop's dispatch (negative: cheaper than a plain jit call).
Compilation cache (``--cache``): fresh (default) gives every child an empty one of its own, so
xshare pays its compiles as the plain loop does; machine runs on this machine's cache, as a
relaunch does (benchmarks/caches.py)."""

COLUMNS = ["N", "steps/job", "config", "e2e s", "speed vs plain (x)", "steady steps/s", "XLA compiles",
           "submit_many s", "host us/step"]

if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        kind, n, steps, trivial = json.loads(sys.argv[2])
        sys.path.insert(0, str(ROOT))
        print("@@" + json.dumps(_child(kind, n, steps, trivial)), flush=True)
    else:
        sys.exit(main(sys.argv[1:]))
