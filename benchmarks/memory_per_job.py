"""What a long-lived runtime keeps per finished job: RSS growth per job over rounds of jobs in
one ``Runtime``, with each done job's final state kept in memory (``keep_results=True``, the
default) and kept only in its final checkpoint (``keep_results=False``, what ``xshare serve``
and the Ray runtime actors run).

Each way runs in its own process: ``--rounds`` rounds of ``--jobs`` zoo MLP jobs
(``xshare.models.mlp``, Adam; ``--width`` wide, so the state is large enough to see) of 20
steps, every handle dropped after its round, RSS read after each round. The growth per job is
taken from round 2 on (the first round's growth is the runtime's own warm-up: compiles,
Orbax's import, allocator pools).

    python -m benchmarks.memory_per_job [--smoke] [--rounds 6] [--jobs 16] [--width 1024] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from xshare.bench import harness as H

NAME = "memory_per_job"
ROOT = Path(__file__).resolve().parents[1]
WAYS = {"keep_results=True": True, "keep_results=False": False}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _trimmed_rss_mib() -> float | None:
    """RSS after glibc's ``malloc_trim(0)``: freed heap pages go back to the OS, so what is left
    is what the process still holds (without it, glibc keeps large freed blocks for reuse and
    RSS creeps up ~1 MiB a job here with nothing held). None where there is no glibc."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return None
    return _rss_mib()


def child(keep: bool, rounds: int, jobs: int, width: int) -> dict:
    """One way, in this process: RSS (MiB) after each round, and the state's bytes a job."""
    import gc
    import tempfile

    import jax

    import xshare
    from xshare.models import mlp

    rss, trimmed, state_bytes = [], [], 0
    with tempfile.TemporaryDirectory() as ckpt:
        with xshare.Runtime(policy="pack", memory="8GiB", checkpoint_dir=ckpt, keep_results=keep) as rt:
            for r in range(rounds):
                specs = [mlp.make_job(steps=20, name=f"r{r}-j{i}", lr=1e-3, seed=i, width=width, depth=2, batch=32)
                         for i in range(jobs)]
                state_bytes = sum(x.nbytes for x in jax.tree.leaves(specs[0].state))
                handles = rt.submit_many(specs)
                rt.wait()
                rt.recorder.flush()  # (the final checkpoints written: keep_results=False has released)
                assert all(h.status() == "done" for h in handles), [h.error for h in handles]
                del handles, specs
                gc.collect()
                rss.append(_rss_mib())
                trimmed.append(_trimmed_rss_mib())
    return {"rss_mib": rss, "trimmed_rss_mib": trimmed, "state_bytes": state_bytes}


def _spawn(keep: bool, rounds: int, jobs: int, width: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.memory_per_job", "--child",
                          json.dumps([keep, rounds, jobs, width])], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
                         timeout=1800)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("@@")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"keep_results={keep} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][2:])


def main(argv: list[str] | None = None) -> int:
    p = H.parser(NAME, __doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--jobs", type=int, default=16, help="jobs a round")
    p.add_argument("--width", type=int, default=1024, help="the MLP's width (its state: ~12.5 MiB at 1024)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print("@@" + json.dumps(child(*json.loads(args.child))))
        return 0
    if args.smoke:
        args.rounds, args.jobs, args.width = 3, 2, 32
    info = H.machine()  # (jax's version and backend on record; each way runs in its own process)
    runs = {way: _spawn(keep, args.rounds, args.jobs, args.width) for way, keep in WAYS.items()}
    columns = ["way", "state MiB a job", "RSS after each round (MiB)", "growth a job (MiB)",
               "RSS after malloc_trim (MiB)", "growth a job, trimmed (MiB)"]
    rows = []

    def growth(values: list) -> float:
        if len(values) < 2 or any(v is None for v in values):
            return float("nan")
        return (values[-1] - values[0]) / (args.jobs * (len(values) - 1))

    for way, run in runs.items():
        rss, trimmed = run["rss_mib"], run["trimmed_rss_mib"]
        run["growth_mib_per_job"], run["trimmed_growth_mib_per_job"] = growth(rss), growth(trimmed)
        rows.append([way, run["state_bytes"] / 2**20, ", ".join(f"{x:.0f}" for x in rss), growth(rss),
                     ", ".join("-" if x is None else f"{x:.0f}" for x in trimmed), growth(trimmed)])
    notes = f"""
## What is measured

One `Runtime(policy="pack", checkpoint_dir=...)` per way, each in its own process: {args.rounds}
rounds of {args.jobs} `xshare.models.mlp` jobs ({args.width} wide, depth 2, Adam) of 20 steps;
after each round every handle is dropped, the recorder flushed and the garbage collected, and the
process's RSS read, then read again after glibc's `malloc_trim(0)` (which hands freed heap
pages back to the OS: the trimmed figure is what the process still holds; untrimmed, glibc
keeps large freed blocks for reuse, and RSS creeps up with nothing held). Growth a job: (RSS
after the last round - after the first) / the jobs of the rounds after the first. With `keep_results=False` the runtime also trims by itself after it releases
states (at most once a second), so its untrimmed column shows what a service's RSS does. `keep_results=False` keeps each done job's final state in its final
checkpoint only; `result()` reads it back from there (docs/how-to/checkpoints.md).
"""
    H.write_results(NAME, args.out, title="What a long-lived runtime keeps per finished job", columns=columns,
                    rows=rows, machine_info=info,
                    config={"rounds": args.rounds, "jobs": args.jobs, "width": args.width},
                    data=runs, notes=notes, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
