"""What checkpoints cost the dispatcher: jobs' steps/s with a checkpoint every 10 steps vs none,
for two xshare trees (before: msgpack checkpoints, the base of the Orbax change; after: Orbax),
each configuration in its own process, alternated, medians reported.

usage: python benchmarks/checkpoint_cost.py --before DIR [--after DIR] [--rounds 3]
       (DIR: a source tree of xshare, e.g. ``git archive 352024c | tar -x -C /tmp/base``)

One measurement (``--one DIR``, what each process runs): 4 MLP jobs (width 128, batch 64, Adam)
of 1,500 steps under ``pack`` in one Runtime with a log directory, after a warm-up job that
compiles their program; steps/s = 6,000 steps / the wall time from submit to the last job's
end. Checkpoints written are counted by wrapping the checkpoint module's ``save``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOBS, STEPS, EVERY = 4, 1500, 10


def one(every: int | None) -> dict:
    import xshare
    from models import mlp  # (the tree's own models/, as PYTHONPATH puts it first)
    from xshare.runtime.observe import checkpoint

    saves = [0]
    real = checkpoint.save

    def counted(*a, **k):
        saves[0] += 1
        return real(*a, **k)

    checkpoint.save = counted
    with tempfile.TemporaryDirectory() as tmp:
        with xshare.Runtime(policy="pack", memory="1GiB", log_dir=tmp, checkpoint_every=every) as rt:
            rt.submit(mlp.make_job(width=128, steps=20, name="warm")).result()
            specs = [mlp.make_job(width=128, lr=1e-3 * (i + 1), steps=STEPS, seed=i, name=f"j{i}")
                     for i in range(JOBS)]
            t0 = time.perf_counter()
            handles = rt.submit_many(specs)
            rt.wait()
            wall = time.perf_counter() - t0
        assert all(h.status() == "done" for h in handles), [h.status() for h in handles]
    return {"steps_per_s": JOBS * STEPS / wall, "wall_s": wall, "saves": saves[0]}


def _run(tree: Path, every: int | None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    args = [sys.executable, str(Path(__file__).resolve()), "--one", str(tree)]
    if every:
        args += ["--every", str(every)]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tree, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, help="the xshare tree with msgpack checkpoints")
    p.add_argument("--after", type=Path, default=ROOT)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--one", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--every", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.every)))
        return
    if args.before is None:
        p.error("--before DIR is needed (a source tree of the version to compare with)")
    configs = [(name, tree, every) for name, tree in (("before", args.before), ("after", args.after))
               for every in (None, EVERY)]
    results: dict = {(n, e): [] for n, _, e in configs}
    for r in range(args.rounds):
        for name, tree, every in configs:  # alternated: drift on a shared machine hits all alike
            res = _run(tree, every)
            results[(name, every)].append(res)
            print(f"round {r + 1} {name:6s} every={every or '-':>4}: {res['steps_per_s']:8.0f} steps/s "
                  f"({res['saves']} checkpoints written)", flush=True)
    print("\n| tree | checkpoints | steps/s (median) | vs none | checkpoints written (median) |")
    print("|---|---|---|---|---|")
    for name in ("before", "after"):
        none = statistics.median(r["steps_per_s"] for r in results[(name, None)])
        for every in (None, EVERY):
            med = statistics.median(r["steps_per_s"] for r in results[(name, every)])
            saves = statistics.median(r["saves"] for r in results[(name, every)])
            print(f"| {name} | {'every ' + str(every) if every else 'none'} | {med:.0f} | "
                  f"{med / none:.2f}x | {saves:.0f} |")


if __name__ == "__main__":
    main()
