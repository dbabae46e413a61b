"""Speed against K: one job's step run K per executable call (xshare's K-step programs,
``xshare/runtime/compiled/multistep.py``), rolled and unrolled, against the plain jit loop, for three MLP
sizes and the zoo's small CNN. Per row: compile seconds, whether K single steps and one K-step
call end bit-identical, and microseconds per step (median of ``--repeats``), plain loop = the
user's ``jax.jit(step, donate_argnums=0)`` called once per step with numpy batches.

usage: python -m benchmarks.steps_per_call [--ks 1,2,4,8,16,32] [--steps 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax


def _models():
    from xshare.models import cnn, mlp
    return {
        "mlp w32": lambda: mlp.make_job(width=32, depth=2, batch=32, steps=1),
        "mlp w128": lambda: mlp.make_job(width=128, depth=2, batch=64, steps=1),
        "mlp w512": lambda: mlp.make_job(width=512, depth=2, batch=64, steps=1),
        "cnn c8": lambda: cnn.make_job(channels=8, blocks=1, batch=16, steps=1),
    }


def _time(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def measure(name: str, make, ks: list[int], steps: int, repeats: int) -> list[dict]:
    from xshare.runtime.compiled import multistep
    from xshare.runtime.compiled.compiler import PROGRAMS
    from xshare.runtime.compiled.multistep import Form, first_difference

    spec = make()
    device = jax.devices()[0]
    batches = [spec.data(k) for k in range(64)]
    program = PROGRAMS.get(spec.job, spec.state, batches[0], device=device, fenced=False)
    state0 = program.state_layout.split(spec.state)
    flat = [program.batch_layout.split(b) for b in batches]

    def plain():  # the user's loop over the user's pytrees
        f = jax.jit(spec.fn, donate_argnums=0)
        s = jax.tree.map(lambda x: jax.numpy.array(x, copy=True), spec.state)
        for k in range(steps):
            s, _ = f(s, batches[k % 64])
        jax.block_until_ready(s)

    plain()
    base = _time(plain, repeats) / steps
    rows = [{"model": name, "k": 1, "form": "plain jit loop", "compile_s": None, "exact": True,
             "us_per_step": base * 1e6, "speedup": 1.0}]
    for k in ks:
        stacked = [multistep.stack(flat[i:i + k]) for i in range(0, 64 - k + 1, k)]
        for unroll in ((False, True) if k > 1 else (False,)):
            t0 = time.perf_counter()
            multi = multistep.compile_multi(program, Form(k, unroll), device)
            compile_s = time.perf_counter() - t0
            # exactness: K single steps of the one-step program against one K-step call
            a = [jax.numpy.array(x, copy=True) for x in state0]
            for b in flat[:k]:
                a, _ = program.executable(a, b)
            b_state, _ = multi.executable([jax.numpy.array(x, copy=True) for x in state0], multi.arg(stacked[0], k))
            exact = first_difference(list(a), list(b_state), "state") is None

            def run(multi=multi, stacked=stacked, k=k):
                s = [jax.numpy.array(x, copy=True) for x in state0]
                for i in range(steps // k):
                    s, _ = multi.executable(s, multi.arg(stacked[i % len(stacked)], k))
                jax.block_until_ready(s)

            run()
            per = _time(run, repeats) / (steps // k * k)
            rows.append({"model": name, "k": k, "form": "unrolled" if unroll else "rolled",
                         "compile_s": compile_s, "exact": exact, "us_per_step": per * 1e6,
                         "speedup": base / per})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ks", default="1,2,4,8,16,32")
    p.add_argument("--steps", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--models", default=None, help="comma-separated subset of: " + ", ".join(_models()))
    args = p.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    models = _models()
    chosen = args.models.split(",") if args.models else list(models)
    print("| model | K | form | compile s | bit-identical | us/step | vs plain loop |")
    print("|---|---|---|---|---|---|---|")
    for name in chosen:
        for r in measure(name, models[name], ks, args.steps, args.repeats):
            c = "" if r["compile_s"] is None else f"{r['compile_s']:.2f}"
            print(f"| {r['model']} | {r['k']} | {r['form']} | {c} | {'yes' if r['exact'] else 'NO'} | "
                  f"{r['us_per_step']:.0f} | {r['speedup']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
