"""Soak: rounds of many jobs in ONE Runtime, with random controls from another thread.

Each round submits N small MLP jobs (one program: Adam with its lr in state, a seed and lr per
job) to the same ``xshare.Runtime``. The first and last rounds are clean; the rounds between
them get random pause / pause(offload) / resume / cancel / set_priority calls from a chaos
thread while they run. After every round: every job that was not cancelled must end ``done``
with a final state bit-identical to the plain loop's; then the process's RSS and thread count
are read (after ``gc.collect()``).

Pass criteria (issue #18): all non-cancelled jobs exact; RSS after the last round within 10% of
RSS after the first; the clean last round's wall time within 10% of the clean first round's;
threads flat (the feeder's two threads start lazily, the first time some job's data is slower
than ~100 us a batch: they are counted apart). One warm-up job fills the program cache first.

usage: python -m benchmarks.soak [--rounds 5] [--jobs 64] [--steps 300] [--smoke]
"""

from __future__ import annotations

import gc
import random
import tempfile
import threading
import time
from pathlib import Path

from xshare.bench import harness as h
from xshare.bench.chaos import random_controls

LRS = (1e-3, 3e-3)


def _spec(i: int, steps: int, name: str):
    from xshare.models import mlp

    return mlp.make_job(lr=LRS[i % 2], width=32, depth=2, batch=16, steps=steps, seed=i, name=name)


def _reference(i: int, steps: int):
    """The plain loop: the same step, jitted with donation (one compile for every i)."""
    import jax
    import jax.numpy as jnp

    spec = _spec(i, steps, "ref")
    fn = _reference.jitted = getattr(_reference, "jitted", None) or jax.jit(spec.fn, donate_argnums=(0,))
    state = jax.tree.map(lambda x: jnp.array(x, copy=True), spec.state)
    for k in range(steps):
        state, _ = fn(state, spec.data(k))
    return jax.device_get(state)


def _equal(a, b) -> bool:
    import jax
    import numpy as np

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return (jax.tree.structure(a) == jax.tree.structure(b)
            and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)))


def _chaos(rt, handles, stop: threading.Event, rng: random.Random, counts: dict) -> None:
    """Random controls until ``stop``; then every job it paused is resumed."""
    random_controls(rt, handles, rng, weights=(30, 15, 40, 12, 3), keep_going=lambda: not stop.is_set(),
                    counts=counts)


TRANSIENT = ("xshare-keep-executable", "xshare-compile-group", "xshare-compile-eval", "xshare-compile-moves")


def _round(rt, r: int, n: int, steps: int, chaos: bool, refs: dict, seed: int) -> dict:
    specs = [_spec(i, steps, f"r{r}-{i}") for i in range(n)]
    t0 = time.perf_counter()
    handles = rt.submit_many(specs)
    counts: dict = {}
    if chaos:
        stop = threading.Event()
        th = threading.Thread(target=_chaos, args=(rt, handles, stop, random.Random(seed + r), counts))
        th.start()
        total = n * steps
        while sum(hd.progress().steps_done for hd in handles) < 0.7 * total and \
                not all(hd.status() in ("done", "failed", "cancelled") for hd in handles):
            time.sleep(0.05)
        stop.set()
        th.join()
    ok = rt.wait(timeout=600)
    wall = time.perf_counter() - t0
    from flax import nnx

    exact = wrong = cancelled = failed = 0
    for i, hd in enumerate(handles):
        st = hd.status()
        if st == "cancelled":
            cancelled += 1
        elif st != "done":
            failed += 1
        elif _equal(nnx.state(hd.result()[0]), refs[i]):  # an NNX job: (model, optimizer)
            exact += 1
        else:
            wrong += 1
    gc.collect()
    import psutil

    # The runtime's one-off helper threads (an executable being written to the cache, a group
    # or evaluation program compiling) end on their own: waited for, so "threads flat" counts
    # threads that stay, not one that a compile in the round's last milliseconds left running
    # (the smoke test once failed on that). One that does not end within the timeout is counted.
    for t in threading.enumerate():
        if t.name in TRANSIENT:
            t.join(timeout=30)
    proc = psutil.Process()
    return {"round": r, "chaos": chaos, "wall_s": wall, "waited": ok, "exact": exact, "wrong": wrong,
            "failed": failed, "cancelled": cancelled, "rss_mib": proc.memory_info().rss / 2**20,
            "threads": sum(not t.name.startswith("xshare-feeder") for t in threading.enumerate()),
            "feeder_threads": sum(t.name.startswith("xshare-feeder") for t in threading.enumerate()),
            "os_threads": proc.num_threads(), "controls": counts}


def main() -> int:
    p = h.parser("soak", __doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--jobs", type=int, default=64)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.jobs, args.steps = 3, 8, 40
    import psutil
    import xshare

    info = h.machine()
    refs = {i: _reference(i, args.steps) for i in range(args.jobs)}
    rounds = []
    with tempfile.TemporaryDirectory() as logs:
        rt = xshare.Runtime(policy="pack", memory="2GiB", log_dir=Path(logs))
        rt.submit(_spec(0, 2, "warm-up"))  # fills the program cache: no round pays a compile
        rt.wait()
        for r in range(1, args.rounds + 1):
            chaos = 1 < r < args.rounds
            rounds.append(_round(rt, r, args.jobs, args.steps, chaos, refs, args.seed))
            print(f"round {r}: {rounds[-1]}", flush=True)
        rt.close()
        gc.collect()
        rss_closed = psutil.Process().memory_info().rss / 2**20
    first, last = rounds[0], rounds[-1]
    checks = {
        "all non-cancelled jobs exact": all(x["wrong"] == 0 and x["failed"] == 0 and x["waited"] for x in rounds),
        "RSS last/first <= 1.10": last["rss_mib"] / first["rss_mib"] <= 1.10,
        "clean wall last/first <= 1.10": last["wall_s"] / first["wall_s"] <= 1.10,
        "threads flat": len({x["threads"] for x in rounds}) == 1 and all(x["feeder_threads"] <= 2 for x in rounds),
    }
    rows = [[x["round"], "chaos" if x["chaos"] else "clean", h.fmt(x["wall_s"]), x["exact"], x["cancelled"],
             x["wrong"] + x["failed"], h.fmt(x["rss_mib"], 4), f'{x["threads"]} (+{x["feeder_threads"]})', x["os_threads"]] for x in rounds]
    notes = "\n".join([f"RSS after close(): {rss_closed:.1f} MiB",
                       f"RSS last/first: {last['rss_mib'] / first['rss_mib']:.3f}; "
                       f"clean wall last/first: {last['wall_s'] / first['wall_s']:.3f}",
                       *[f"{'PASS' if v else 'FAIL'}: {k}" for k, v in checks.items()]])
    h.write_results("soak", args.out, title=f"Soak: {args.rounds} rounds of {args.jobs} jobs x {args.steps} "
                    "steps in one Runtime", columns=["round", "kind", "wall s", "exact", "cancelled",
                                                    "wrong/failed", "RSS MiB", "threads (+feeder)", "OS threads"],
                    rows=rows, machine_info=info, smoke=args.smoke, notes=notes,
                    config=vars(args) | {"out": str(args.out)},
                    data={"rounds": rounds, "rss_after_close_mib": rss_closed, "checks": checks})
    print(notes)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
