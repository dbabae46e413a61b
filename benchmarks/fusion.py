"""Fused sweeps, side by side: the same N-job learning-rate sweep run eight ways.

The jobs: ``xshare.models.mlp:make_job`` (an MLP 32-64-64-10 on batches of 64 from its own
synthetic teacher data, Adam with the learning rate in state), N learning rates x seeds: one
program. The ways:

  * plain: one donated ``jax.jit`` loop per job, one job after another;
  * pack: ``xshare.Runtime(policy="pack")`` (unfused);
  * pack-one-stream: the same with ``parallel_lanes=False`` (every call on one execution stream);
  * fused: ``xshare.Runtime(policy="pack", fuse=True)``;
  * vmap: a hand-written ``jax.vmap`` of the step over the N stacked states and batches;
  * scan: a hand-written bound for pack: each job 16 steps per call (``lax.scan`` over 16
    stacked batches, jitted once), the jobs taking turns from one thread, each on an execution
    stream of its own (what the runtime's K-step forms and lanes do, with none of its work);
  * vmap-scan: a hand-written bound for fused: the jobs in one group per core (two here), each
    group's states stacked and 16 steps of the vmapped step per call, the groups taking turns
    from one thread on streams of their own (the runtime's fused K-step form and lanes, with
    none of its work); with ``--cache machine`` its compile loads from JAX's persistent cache
    (a directory of its own), as the runtime's programs load from the machine's;
  * processes: one Python process per job, all at once (how a device is shared today);
    only for N <= 8: 32 processes of JAX do not fit this machine's memory and cores.

Every way runs in a fresh process; its clock starts before the first compile (processes: at
spawn) and stops when every final state is on the host. Peak RSS is the process's (processes:
the sum over them, sampled). Also measured: a sweep whose jobs arrive over time (one every 150
steps of the first) and end at different step counts, under fuse=True: the fraction of member
steps that ran fused.

The naive sweep (``--sweep naive``): the same N jobs as users write them, one Flax Linen
``TrainState`` per job with the learning rate baked in (``optax.adam(lr_i)``, a new ``tx`` object
per job), on the same teacher data, run as

  * naive-plain: a ``jax.jit`` per job (each job's step closes over its own optimizer, so each
    compiles), one job after another: how such a sweep runs today;
  * naive-fused: ``xshare.Runtime(fuse=True)`` on those jobs unchanged (constants lifted);
  * inject-plain / inject-fused: the same with ``optax.inject_hyperparams(optax.adam)`` (the
    learning rate in state: one program without lifting), one jit for all / fused.

Every row reports how many times the train step was compiled.

usage: python benchmarks/fusion.py [--ns 8,32] [--steps 2000] [--repeats 3] [--sweep naive] [--data teacher|cached] [--cache fresh|machine] [--smoke]
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENTRY = "xshare.models.mlp:make_job"
LRS = (3e-3, 1e-3, 3e-4, 1e-4)


def _params(i: int) -> dict:
    return {"lr": LRS[i % len(LRS)], "seed": i // len(LRS), "width": 64, "depth": 2, "batch": 64}


DATA = os.environ.get("XSHARE_FUSION_DATA", "teacher")
CACHE = "fresh"  # the children's compilation cache (benchmarks/caches.py; --cache)


def _specs(n: int, steps: int) -> list:
    """The sweep. ``--data teacher``: each job makes its batches from its synthetic teacher
    network (about 25 us of numpy a batch, made 16 at a time; the same in every way of running); ``--data
    cached``: 64 such batches per job made up front and cycled, so data costs nothing and the
    figures show the runtime and the device alone."""
    from xshare.models import mlp
    specs = [mlp.make_job(steps=steps, name=f"j{i}", **_params(i)) for i in range(n)]
    if DATA == "cached":
        specs = [s.replace(data=_cycle([s.data(k) for k in range(64)])) for s in specs]
    return specs


def _cycle(batches: list):
    return lambda k: batches[k % len(batches)]


def _naive_specs(n: int, steps: int, inject: bool) -> list:
    """N Linen TrainState jobs as the Flax docs write them; lr baked in unless ``inject``."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax
    from flax.training import train_state

    import xshare
    from xshare.models.mlp import TeacherData

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(2):
                x = nn.relu(nn.Dense(64)(x))
            return nn.Dense(10)(x)

    def step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn(params, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    job = xshare.job(step)
    specs = []
    for i in range(n):
        p = _params(i)
        net = MLP()
        params = net.init(jax.random.key(p["seed"]), jnp.ones((1, 32)))
        tx = optax.inject_hyperparams(optax.adam)(learning_rate=p["lr"]) if inject else optax.adam(p["lr"])
        state = train_state.TrainState.create(apply_fn=net.apply, params=params, tx=tx)
        specs.append(job.bind(state, TeacherData(p["batch"], p["seed"]), steps=steps, name=f"j{i}"))
    return specs


# ------------------------------------------------------------------------------ the child side
def _child(kind: str, n: int, steps: int) -> dict:
    import jax
    import numpy as np

    if kind.startswith(("naive", "inject")):
        return _child_naive(kind, n, steps)
    hand_cache = os.environ.get("XSHARE_FUSION_HAND_CACHE")
    if kind == "vmap-scan" and hand_cache:
        # --cache machine: the bound loads its compile from JAX's persistent cache, as the
        # runtime loads its programs from its own (before any compile: the cache opens once)
        jax.config.update("jax_compilation_cache_dir", hand_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    specs = _specs(n, steps)
    jax.block_until_ready([s.state for s in specs])
    extra: dict = {}
    t0 = time.perf_counter()
    if kind == "plain":
        f = jax.jit(specs[0].fn, donate_argnums=0)
        finals = []
        for spec in specs:
            s = jax.tree.map(lambda x: jax.numpy.array(x, copy=True), spec.state)
            for k in range(steps):
                s, _ = f(s, spec.data(k))
            finals.append(jax.device_get(s))
    elif kind == "vmap":
        stacked = jax.tree.map(lambda *xs: jax.numpy.stack(xs), *[s.state for s in specs])
        f = jax.jit(jax.vmap(specs[0].fn), donate_argnums=0)
        for k in range(steps):
            batches = [s.data(k) for s in specs]
            stacked, _ = f(stacked, jax.tree.map(lambda *xs: np.stack(xs), *batches))
        finals = jax.device_get(stacked)
    elif kind == "scan":
        # The hand-written bound for the runtime's unfused way: each job K=16 steps per call (a
        # scan over stacked batches, as the runtime's K-step form; a shorter last call if the
        # steps do not divide), the jobs taking turns from one thread, each on an execution
        # stream of its own (as the runtime's lanes on CPU).
        from jaxlib import xla_client
        step = specs[0].fn
        f = jax.jit(lambda s, bs: jax.lax.scan(step, s, bs), donate_argnums=0)
        states = [jax.tree.map(lambda x: jax.numpy.array(x, copy=True), spec.state) for spec in specs]
        for start in range(0, steps, 16):
            for i, spec in enumerate(specs):
                batches = [spec.data(k) for k in range(start, min(start + 16, steps))]
                with xla_client.execution_stream_id(1 + i):
                    states[i], _ = f(states[i], jax.tree.map(lambda *xs: np.stack(xs), *batches))
        finals = jax.device_get(states)
    elif kind == "vmap-scan":
        # The hand-written bound for fused: what the runtime's fused K-step form and lanes run,
        # with none of its work: the jobs in one group per core (as the runtime's groups on a
        # CPU), each group's states stacked, K=16 steps of the vmapped step per call (a scan
        # over stacked batches), the groups taking turns from one thread, each on an execution
        # stream of its own.
        from jaxlib import xla_client
        step = specs[0].fn
        f = jax.jit(lambda s, bs: jax.lax.scan(jax.vmap(step), s, bs), donate_argnums=0)
        groups = [specs[g::min(2, n)] for g in range(min(2, n))]
        states = [jax.tree.map(lambda *xs: jax.numpy.stack(xs), *[m.state for m in members]) for members in groups]
        for start in range(0, steps, 16):
            for g, members in enumerate(groups):
                rows = [jax.tree.map(lambda *xs: np.stack(xs), *[m.data(k) for m in members])
                        for k in range(start, min(start + 16, steps))]
                with xla_client.execution_stream_id(1 + g):
                    states[g], _ = f(states[g], jax.tree.map(lambda *xs: np.stack(xs), *rows))
        finals = jax.device_get(states)
    elif kind == "arrivals":
        import xshare
        # Job i arrives when job 0 has run 150*i steps and runs steps + 100*i steps.
        specs = [s.replace(steps=steps + 100 * i) for i, s in enumerate(specs)]
        with xshare.Runtime(policy="pack", memory="8GiB", fuse=True) as rt:
            handles = [rt.submit(specs[0])]
            for i, spec in enumerate(specs[1:], start=1):
                while handles[0].progress().steps_done < 150 * i and handles[0].status() != "done":
                    time.sleep(0.001)
                handles.append(rt.submit(spec))
            rt.wait()
            snap = rt.snapshot()
        finals = [h.result()[0] for h in handles]
        total = sum(j["steps_done"] for j in snap["jobs"])
        extra["fused_fraction"] = snap["runtime"]["fused_member_steps"] / total
    else:
        import xshare
        with xshare.Runtime(policy="pack", memory="8GiB", fuse=(kind == "fused"),
                            parallel_lanes=(kind != "pack-one-stream")) as rt:
            handles = rt.submit_many(specs)
            rt.wait()
            if kind == "fused":
                extra["fused_fraction"] = rt.snapshot()["runtime"]["fused_member_steps"] / (n * steps)
        finals = [h.result()[0] for h in handles]
    wall = time.perf_counter() - t0
    assert finals is not None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"kind": kind, "n": n, "steps": steps, "wall_s": wall, "peak_rss_bytes": rss, **extra}


def _child_naive(kind: str, n: int, steps: int) -> dict:
    import jax

    import xshare
    from xshare.runtime.compiled.compiler import PROGRAMS

    specs = _naive_specs(n, steps, inject=kind.startswith("inject"))
    jax.block_until_ready([jax.tree.leaves(s.state) for s in specs])
    t0 = time.perf_counter()  # states built; before the first compile
    if kind.endswith("plain"):
        finals, traces = [], [0]

        def counted(fn):
            def step(state, batch):  # runs once per trace, i.e. once per compile of the step
                traces[0] += 1
                return fn(state, batch)
            return step

        shared = jax.jit(counted(specs[0].fn), donate_argnums=0)
        for spec in specs:
            # As users run a sweep: each job its own jitted step (its tx is its own object, so
            # the trace differs), except the inject form, whose one step serves every job.
            f = shared if kind == "inject-plain" else jax.jit(counted(spec.fn), donate_argnums=0)
            s = jax.tree.map(lambda x: jax.numpy.array(x, copy=True), spec.state)
            for k in range(steps):
                s, _ = f(s, spec.data(k))
            finals.append(jax.device_get(s))
        # the step's compiles: its traces (a TrainState whose tx is another object, or whose
        # step went from a Python int to an array, is another trace and compile)
        n_compiles = traces[0]
    else:
        before = PROGRAMS.compiles
        with xshare.Runtime(policy="pack", memory="8GiB", fuse=True) as rt:
            handles = rt.submit_many(specs)
            rt.wait()
            fused = rt.snapshot()["runtime"]["fused_member_steps"]
        finals = [h.result()[0] for h in handles]
        n_compiles = PROGRAMS.compiles - before
    wall = time.perf_counter() - t0  # every final state on the host
    assert len(finals) == n
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"kind": kind, "n": n, "steps": steps, "wall_s": wall, "peak_rss_bytes": rss,
            "compiles": n_compiles, "fused_fraction": None if kind.endswith("plain") else fused / (n * steps)}


# ------------------------------------------------------------------------------ the parent side
def _spawn(kind: str, n: int, steps: int) -> dict:
    from benchmarks.caches import child_env

    hand = ({"XSHARE_FUSION_HAND_CACHE": str(Path.home() / ".cache" / "xshare-bench" / "fusion-hand-jax-cache")}
            if CACHE == "machine" else {})
    with child_env(CACHE, **hand) as env:
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps([kind, n, steps])],
                             capture_output=True, text=True, env=env, cwd=ROOT, timeout=3600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("@@")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} n={n} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][2:])


def _processes(n: int, steps: int) -> dict:
    from xshare.bench import harness as h
    plans = [h.JobPlan(f"j{i}", ENTRY, _params(i), steps) for i in range(n)]
    t0 = time.perf_counter()
    run = h.processes(plans)
    return {"kind": "processes", "n": n, "steps": steps, "wall_s": time.perf_counter() - t0,
            "peak_rss_bytes": run.peak_rss_bytes}


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    from benchmarks.caches import CHOICES
    from xshare.bench import harness as h

    p = h.parser("fusion", __doc__.splitlines()[0])
    p.add_argument("--ns", default="8,32")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sweep", choices=("zoo", "naive"), default="zoo",
                   help="zoo: the model zoo's MLP (lr in state); naive: Linen TrainStates with "
                        "optax.adam(lr) baked in, as users write them")
    p.add_argument("--data", choices=("teacher", "cached"), default="teacher",
                   help="teacher: each batch made by its job's synthetic teacher (~25 us); cached: "
                        "batches made up front (data costs nothing)")
    p.add_argument("--cache", choices=CHOICES, default="fresh",
                   help="fresh (default): each child on an empty compilation cache of its own (every "
                        "compile paid, as by the plain loop); machine: this machine's cache (a relaunch)")
    args = p.parse_args(argv)
    global CACHE
    CACHE = args.cache
    os.environ["XSHARE_FUSION_DATA"] = args.data  # the children build their specs from it
    if args.smoke:
        args.ns, args.steps, args.repeats = "2", 50, 1
    if args.sweep == "naive":
        return _main_naive(args, h)
    rows, raw = [], []
    for n in [int(x) for x in args.ns.split(",")]:
        configs = {k: (lambda k=k, n=n: _spawn(k, n, args.steps)) for k in ("plain", "pack", "pack-one-stream", "fused", "vmap", "scan", "vmap-scan")}
        if n <= 8 and args.data == "teacher":  # (processes always make their own data)
            configs["processes"] = lambda n=n: _processes(n, args.steps)
        runs = h.alternate(configs, args.repeats)
        arrivals = [_spawn("arrivals", n, args.steps) for _ in range(args.repeats)]
        raw.append({"n": n, "runs": runs, "arrivals": arrivals})
        base = [r["wall_s"] for r in runs["plain"]]
        for k, rs in runs.items():
            rows.append([n, args.steps, k, h.median(r["wall_s"] for r in rs),
                         h.median(h.paired_ratios(base, [r["wall_s"] for r in rs])),
                         h.median(h.paired_ratios([r["wall_s"] for r in runs["vmap"]], [r["wall_s"] for r in rs])),
                         h.median(r["peak_rss_bytes"] for r in rs) / 2**20,
                         f"{100 * h.median(r['fused_fraction'] for r in rs):.0f}% of steps fused"
                         if k == "fused" else ""])
        rows.append([n, f"{args.steps}+100i", "fused, arriving over time",
                     h.median(r["wall_s"] for r in arrivals), "", "", h.median(r["peak_rss_bytes"] for r in arrivals) / 2**20,
                     f"{100 * h.median(r['fused_fraction'] for r in arrivals):.0f}% of steps fused"])
        print(h.markdown_table(COLUMNS, [r for r in rows if r[0] == n]), flush=True)
    name = "fusion" if args.data == "teacher" else f"fusion_{args.data}"
    h.write_results(name + ("" if args.cache == "fresh" else f"_{args.cache}"), args.out, title="Fused sweeps: plain loop, xshare pack (lanes side by side, one stream), fused, hand vmap, hand K=16 scan, hand vmap x K=16 scan, processes",
                    columns=COLUMNS, rows=rows, machine_info=h.machine(), smoke=args.smoke,
                    config={"ns": args.ns, "steps": args.steps, "repeats": args.repeats, "entry": ENTRY,
                            "data": args.data, "cache": args.cache},
                    data={"runs": raw}, notes=NOTES)
    return 0


def _main_naive(args, h) -> int:
    rows, raw = [], []
    kinds = ("naive-plain", "naive-fused", "inject-plain", "inject-fused")
    for n in [int(x) for x in args.ns.split(",")]:
        runs = h.alternate({k: (lambda k=k, n=n: _spawn(k, n, args.steps)) for k in kinds}, args.repeats)
        raw.append({"n": n, "runs": runs})
        base = [r["wall_s"] for r in runs["naive-plain"]]
        inject = [r["wall_s"] for r in runs["inject-fused"]]
        for k, rs in runs.items():
            walls = [r["wall_s"] for r in rs]
            fused = [r["fused_fraction"] for r in rs if r.get("fused_fraction") is not None]
            rows.append([n, args.steps, k, h.median(walls), h.median(h.paired_ratios(base, walls)),
                         h.median(h.paired_ratios(inject, walls)), h.median(r["compiles"] for r in rs),
                         h.median(r["peak_rss_bytes"] for r in rs) / 2**20,
                         f"{100 * h.median(fused):.0f}% of member steps fused" if fused else ""])
        print(h.markdown_table(NAIVE_COLUMNS, [r for r in rows if r[0] == n]), flush=True)
    h.write_results("fusion_naive" + ("" if args.cache == "fresh" else f"_{args.cache}"), args.out, title="Sweeps as users write them: baked optax.adam(lr_i) TrainStates",
                    columns=NAIVE_COLUMNS, rows=rows, machine_info=h.machine(), smoke=args.smoke,
                    config={"ns": args.ns, "steps": args.steps, "repeats": args.repeats, "cache": args.cache},
                    data={"runs": raw}, notes=NAIVE_NOTES)
    return 0


NAIVE_COLUMNS = ["N", "steps/job", "way", "e2e s", "speed vs naive-plain (x)", "speed vs inject-fused (x)",
                 "XLA compiles", "peak RSS MiB", "note"]
NAIVE_NOTES = """e2e: fresh process per run; the clock starts when every job's initial state is built
(before the first compile) and stops when every final state is on the host; the same points for
every way. speed: median of per-repeat ratios (reference time / this way's; > 1 = faster).
compiles: compiles of the train step (the plain loops' traces of it, one per jit cache miss; the
runtime's XLA compile count for xshare; xshare's slot-move helpers are not counted). note: the
share of member steps that ran fused (``fuse=True`` runs a program's jobs alone where its fused
step was measured to cost them more than their own: "fusion only where it pays")."""

COLUMNS = ["N", "steps/job", "way", "e2e s", "speed vs plain (x)", "speed vs hand vmap (x)", "peak RSS MiB", "note"]
NOTES = """e2e: fresh process per run, clock from before the first compile to every final state on the
host. speed: median of per-repeat ratios (reference time / this way's time; > 1 = faster).
processes: one process per job, wall time from spawn to the last exit (compile included), RSS
summed over the processes. Arrivals: job i is submitted when job 0 has run 150*i steps and runs
steps + 100*i steps; the note is fused member steps / all member steps (from Runtime.snapshot()),
for the fused ways (``fuse=True`` runs a program's jobs alone where its fused step was measured to
cost them more than their own). Compilation cache (``--cache``): fresh (default) gives every
child an empty one of its own, so each way pays its own compiles, as the plain loop does;
machine runs on this machine's cache, as a relaunch does (benchmarks/caches.py)."""

if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        kind, n, steps = json.loads(sys.argv[2])
        sys.path.insert(0, str(ROOT))
        print("@@" + json.dumps(_child(kind, n, steps)), flush=True)
    else:
        sys.exit(main(sys.argv[1:]))
