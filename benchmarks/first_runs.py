"""First runs: the hook's jobs on a machine that kept nothing, run after run, plain loop vs xshare.

What a new user sees. The headline figures (``shared/hooks/sidebyside.py``, RESULTS.md) run on a
machine whose compilation cache (``~/.cache/xshare/xla``) holds what earlier runs left: the jobs'
programs, their K-step forms and fused groups' forms with their verdicts, and how often each
program ran (``run-history.json``, which decides whether a form is compiled for later runs). Here
the same workload starts from an empty cache and is run ``--rounds`` times in a row, each round as
the hook runs it: the plain loop, then fifo, pack and ``fuse=True``, each in a fresh process, the
xshare ways sharing the one cache in that order (as on a machine that ran nothing before). Only
the machine-wide fence canary's verdict is kept (``~/.cache/xshare/canary``, outside the
compilation cache: a machine pays it once).

The jobs are the hook's: N Flax ``TrainState``s of a 24-48-48-6 tanh MLP, SGD with momentum and
the learning rate in state (``optax.inject_hyperparams``: one program), batches of 32 from 40
fixed numpy batches. Each clock starts after the jobs' states are built and stops when every
final state is on the host (the plain loop: ``jax.jit`` with the state donated, job after job).

Reported per round and way: the median wall time over ``--repeats`` sequences (each from its own
empty cache) and the median of its ratios against the same round's plain loop (> 1: faster).

usage: python -m benchmarks.first_runs [--n 8] [--steps 400,3000] [--rounds 4] [--repeats 1] [--smoke]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("plain", "fifo", "pack", "fused")
RUNTIME = {"fifo": {"policy": "fifo"}, "pack": {"policy": "pack"}, "fused": {"policy": "pack", "fuse": True}}


def _jobs(n: int):
    """The hook's jobs (``shared/hooks/sidebyside.py``: its net, optimizer, rates and batches)."""
    import flax.linen as nn
    import numpy as np
    import optax

    from benchmarks.steps import trainstate_mlps

    rng = np.random.default_rng(1)
    batches = [{"x": rng.normal(size=(32, 24)).astype(np.float32),
                "y": rng.integers(0, 6, size=(32,)).astype(np.int32)} for _ in range(40)]
    return trainstate_mlps(n, features=24, width=48, classes=6, activation=nn.tanh,
                           tx=optax.inject_hyperparams(optax.sgd)(learning_rate=0.01, momentum=0.9),
                           lr=lambda i: 0.01 * (i + 1), batches=batches, stride=3)


def _child(way: str, n: int, steps: int) -> float:
    import jax

    step, states, data = _jobs(n)
    jax.block_until_ready(states)
    if way == "plain":
        f = jax.jit(step, donate_argnums=0)
        t0 = time.perf_counter()
        for s, d in zip(states, data):
            for k in range(steps):
                s, _ = f(s, d(k))
            jax.block_until_ready(s)
        return time.perf_counter() - t0
    import xshare

    job = xshare.job(step, name="net")
    specs = [job.bind(s, d, steps=steps, name=f"n{i}") for i, (s, d) in enumerate(zip(states, data))]
    t0 = time.perf_counter()
    with xshare.Runtime(memory="2GiB", **RUNTIME[way]) as rt:
        handles = rt.submit_many(specs)
        rt.wait()
        [h.result() for h in handles]
    return time.perf_counter() - t0


def _run(way: str, n: int, steps: int, cache: str) -> float:
    env = {**os.environ, "XSHARE_COMPILATION_CACHE": cache}
    out = subprocess.run([sys.executable, "-m", "benchmarks.first_runs", "--child", way, str(n), str(steps)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{way} {n} x {steps} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        print("RESULT " + json.dumps(_child(argv[1], int(argv[2]), int(argv[3]))))
        return 0
    sys.path.insert(0, str(ROOT))
    from benchmarks.caches import empty_cache
    from xshare.bench import harness as h

    p = h.parser("first_runs", __doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--steps", default="400,3000")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args(argv)
    if args.smoke:
        args.n, args.steps, args.rounds, args.repeats = 2, "30", 2, 1
    columns = ["N x steps", "round", "way", "e2e s", "speed vs plain (x)"]
    rows, raw = [], []
    for steps in [int(s) for s in args.steps.split(",")]:
        # walls[round][way] = one wall time per repeat
        walls = [{w: [] for w in WAYS} for _ in range(args.rounds)]
        for r in range(args.repeats):
            with empty_cache("first-runs") as cache:  # (every round of this repeat shares it)
                for rnd in range(args.rounds):
                    for way in WAYS:
                        walls[rnd][way].append(_run(way, args.n, steps, cache))
                    print(f"  {args.n} x {steps} repeat {r + 1} round {rnd + 1}: " + ", ".join(
                        f"{w} {walls[rnd][w][-1]:.2f} s" for w in WAYS), flush=True)
        raw.append({"n": args.n, "steps": steps, "walls": walls})
        for rnd in range(args.rounds):
            for way in WAYS:
                ratios = h.paired_ratios(walls[rnd]["plain"], walls[rnd][way])  # plain / way: > 1 faster
                rows.append([f"{args.n} x {steps}", rnd + 1, way, h.median(walls[rnd][way]), h.median(ratios)])
        print(h.markdown_table(columns, [x for x in rows if x[0] == f"{args.n} x {steps}"]), flush=True)
    h.write_results("first_runs", args.out, title="First runs: the hook's jobs from an empty cache, run after run",
                    columns=columns, rows=rows, machine_info=h.machine(), smoke=args.smoke,
                    config={"n": args.n, "steps": args.steps, "rounds": args.rounds, "repeats": args.repeats},
                    data={"runs": raw}, notes=__doc__.split("\n\n", 1)[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
