"""Hyperparameter search, side by side: one Optuna study of the digits model run six ways.

The study: ``xshare.models.digits:make_job`` (scikit-learn's digits, a Linen MLP with dropout,
AdamW), ``--trials`` trials of ``--steps`` steps, evaluated every ``--every`` steps on the
360-image validation split; RandomSampler(seed=0) (so every way asks the same parameters in the
same order) and MedianPruner(n_startup_trials=5). The search: lr (log 1e-4..3e-2), weight_decay
(log 1e-6..1e-2), dropout (0..0.4), width in {64, 128}; depth 2, batch 64. The ways:

  * a_plain: ``study.optimize(objective)`` in one process; the objective a ``jax.jit`` training
    loop with the hyperparameters baked in (a compile per trial), evaluating every ``--every``
    steps with ``trial.report`` / ``should_prune`` (how Optuna users run it today);
  * b_plain_state: the same with the hyperparameters in state (one compile per model shape);
  * b_plain_state_cache: b with JAX's persistent compilation cache on, as xshare turns it on
    (every program, however quick; its own directory): the model inits' compiles load on a
    machine that ran the study before, as they do under xshare;
  * c_plain_njobs2: a_plain with ``n_jobs=2`` (Optuna's threads);
  * d_xshare: ``xshare.tune.optimize`` with ``Runtime(fuse=False)``, the user's baked job;
  * e_xshare_fused: the same with ``fuse=True`` (baked constants keep trials apart until the
    runtime lifts them: expect d's figures);
  * f_xshare_fused_state: fused, hyperparameters in state (trials of one shape fuse).

Each way runs in a fresh process (its clock includes every compile; its peak RSS is its own).
Reports wall time, trials completed/pruned/failed, steps trained, best validation accuracy, peak
RSS, the XLA compiles the process ran with their seconds (``jax.monitoring``; the model
inits' eager ops included, which every way runs), and the seconds spent in ``make_job`` (the
user's model build, which every way runs: no way can take less than that).

usage: python -m benchmarks.tune [--trials 64] [--steps 300] [--every 25] [--concurrency 8] [--ways a,b,...] [--smoke] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("a_plain", "b_plain_state", "b_plain_state_cache", "c_plain_njobs2", "d_xshare", "e_xshare_fused", "f_xshare_fused_state")


def _suggest(trial) -> dict:
    return {"lr": trial.suggest_float("lr", 1e-4, 3e-2, log=True),
            "weight_decay": trial.suggest_float("weight_decay", 1e-6, 1e-2, log=True),
            "dropout": trial.suggest_float("dropout", 0.0, 0.4),
            "width": trial.suggest_categorical("width", [64, 128]),
            "depth": 2, "batch": 64, "seed": trial.number}


def _study():
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0),
                               pruner=optuna.pruners.MedianPruner(n_startup_trials=5))


BUILD = [0.0]  # seconds the way spent in make_job: the user's model init, which every way runs


def _plain(way: str, trials: int, steps: int, every: int, concurrency: int = 8) -> tuple:
    """Optuna's own loop: the objective trains with jax.jit and reports every ``every`` steps."""
    import threading

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optuna

    from xshare.models.digits import make_job

    in_state = way.startswith("b_plain_state")
    if way == "b_plain_state_cache":
        jax.config.update("jax_compilation_cache_dir",
                          str(Path.home() / ".cache" / "xshare-bench" / "tune-b-jax-cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jits: dict = {}
    lock = threading.Lock()
    trained = [0]

    def objective(trial):
        t = time.perf_counter()
        spec = make_job(**_suggest(trial), steps=steps, eval_every=every, hparams_in_state=in_state)
        BUILD[0] += time.perf_counter() - t
        with lock:  # one jit per step function: per trial when baked, per shape in state
            step = jits.setdefault(spec.fn, jax.jit(spec.fn, donate_argnums=0))
            evaluate = jits.setdefault(spec.eval_step, jax.jit(spec.eval_step))
        state = jax.tree.map(jnp.array, spec.state)
        acc = None
        for k in range(steps):
            state, _ = step(state, spec.data(k))
            with lock:
                trained[0] += 1
            if (k + 1) % every == 0 or k + 1 == steps:
                acc = float(np.mean([float(evaluate(state, b)["accuracy"]) for b in spec.eval_data]))
                trial.report(acc, k + 1)
                if k + 1 < steps and trial.should_prune():
                    raise optuna.TrialPruned()
        return acc

    study = _study()
    study.optimize(objective, n_trials=trials, n_jobs=2 if way == "c_plain_njobs2" else 1)
    return study, trained[0]


def _xshare(way: str, trials: int, steps: int, every: int, concurrency: int = 8) -> tuple:
    import xshare
    import xshare.tune
    from xshare.models.digits import make_job

    in_state = way == "f_xshare_fused_state"
    study = _study()
    runtime = {"fuse": way != "d_xshare", "memory": "2GiB"}

    def objective(trial):
        t = time.perf_counter()
        spec = make_job(**_suggest(trial), steps=steps, eval_every=every, hparams_in_state=in_state)
        BUILD[0] += time.perf_counter() - t
        return spec

    xshare.tune.optimize(study, objective, trials, metric="eval/accuracy", concurrency=concurrency,
                         runtime=runtime)
    return study, sum(t.user_attrs.get("xshare_steps", 0) for t in study.trials)


def child(way: str, trials: int, steps: int, every: int, plot: str | None = None,
          concurrency: int = 8) -> dict:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jax import monitoring

    # Every XLA compile in the process, whoever asked (the ways' steps and evals, xshare's group
    # programs, slot moves and vmapped evals, and the model inits' eager ops, which all ways run),
    # and by site: the innermost frame of the compiling thread in this project's code
    # (``fusion.py:fused_program`` a group program, ``fusion.py:<lambda>`` its slot moves,
    # ``compiler.py:shared`` an eval, ``program.py:ensure`` a solo step, ``digits.py:*`` the
    # model's init; a plain way's own jits show as ``tune.py:objective``).
    import traceback

    compiles = [0, 0.0]
    sites: dict = {}

    def on_duration(event: str, seconds: float, **_: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles[0] += 1
            compiles[1] += seconds
            frames = [f for f in traceback.extract_stack()[:-1]  # (not this listener)
                      if any(d in f.filename for d in ("/xshare/", "/models/", "/benchmarks/"))]
            site = f"{Path(frames[-1].filename).name}:{frames[-1].name}" if frames else "other"
            n, s = sites.get(site, (0, 0.0))
            sites[site] = (n + 1, s + seconds)

    monitoring.register_event_duration_secs_listener(on_duration)
    t0 = time.perf_counter()
    study, trained = (_plain if way.startswith(("a_", "b_", "c_")) else _xshare)(way, trials, steps, every,
                                                                                concurrency)
    wall = time.perf_counter() - t0
    if plot:  # after the clock: the study's history and intermediate values, as `xshare tune` draws them
        from xshare.cli.tune import _plot

        _plot(study, Path(plot))
    states = [t.state.name for t in study.trials]
    # Steps a pruned trial trained past the report that pruned it (xshare: the decision is taken
    # off the dispatcher and lands at a later step boundary, behind the steps in flight; the
    # plain ways stop at the report itself, so theirs is 0).
    past = sum(t.user_attrs.get("xshare_steps", 0) - t.user_attrs["xshare_pruned_at"]
               for t in study.trials if "xshare_pruned_at" in t.user_attrs)
    best = max((t.value for t in study.trials if t.state.name == "COMPLETE"), default=None)
    return {"way": way, "wall_s": wall, "trials": len(states), "complete": states.count("COMPLETE"),
            "pruned": states.count("PRUNED"), "failed": states.count("FAIL"), "steps_trained": trained,
            "steps_past_pruning": past,
            "best_val_accuracy": best, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "xla_compiles": compiles[0], "xla_compile_s": compiles[1], "build_s": BUILD[0],
            "concurrency": concurrency if way.startswith(("d_", "e_", "f_")) else None,
            "compiles_by_site": {k: {"n": n, "s": round(s, 3)} for k, (n, s) in
                                 sorted(sites.items(), key=lambda kv: -kv[1][1])}}


def eval_cost(jobs: int = 8, steps: int = 600, repeats: int = 3) -> list[dict]:
    """What evaluation costs a fused sweep: ``jobs`` digits jobs (hyperparameters in state: one
    group) of ``steps`` steps, evaluated only at the end, every 100 and every 25 steps on the
    3 validation batches; compiled once before the clock (a warm-up run of each setting),
    settings alternated, median of ``repeats``."""
    import statistics

    import xshare
    from xshare.models.digits import make_job

    settings = (None, 100, 25)

    def sweep(every, n_steps, tag):
        specs = [make_job(lr=1e-3 * (i + 1), steps=n_steps, eval_every=every, seed=i, name=f"{tag}{i}",
                          hparams_in_state=True) for i in range(jobs)]
        t0 = time.perf_counter()
        with xshare.Runtime(fuse=True, memory="2GiB") as rt:
            rt.submit_many(specs)
            rt.wait()
        return time.perf_counter() - t0

    for every in settings:
        sweep(every, steps, "warm")  # compiles (and the vmapped eval, in the background)
    time.sleep(2)
    walls: dict = {every: [] for every in settings}
    for r in range(repeats):
        for every in settings:
            walls[every].append(sweep(every, steps, f"r{r}-"))
    base = statistics.median(walls[None])
    return [{"eval_every": every, "wall_s": statistics.median(w), "vs_end_only": statistics.median(w) / base}
            for every, w in walls.items()]


def run_way(way: str, trials: int, steps: int, every: int, plot: Path | None = None,
            concurrency: int = 8) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.tune", "--child", way, "--trials", str(trials),
           "--steps", str(steps), "--every", str(every), "--concurrency", str(concurrency),
           *(["--plot", str(plot)] if plot else [])]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise RuntimeError(f"{way} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["way"] == "a_plain"), None)
    lines = ["| way | wall s | vs a_plain | trials (done/pruned/failed) | steps trained | best val acc | peak RSS MiB "
             "| XLA compiles (s) | in make_job s |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = f"{base['wall_s'] / r['wall_s']:.2f}x" if base else "-"
        best = "-" if r["best_val_accuracy"] is None else f"{r['best_val_accuracy']:.4f}"
        way = r["way"] + (f" (concurrency {r['concurrency']})" if r.get("concurrency") not in (None, 8) else "")
        lines.append(f"| {way} | {r['wall_s']:.1f} | {ratio} | {r['trials']} ({r['complete']}/{r['pruned']}/"
                     f"{r['failed']}) | {r['steps_trained']} | {best} | {r['peak_rss_bytes'] / 2**20:.0f} "
                     f"| {r.get('xla_compiles', '-')} ({r.get('xla_compile_s', 0):.1f}) | {r.get('build_s', 0):.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--concurrency", type=int, default=8, help="trials at once in the xshare ways (d, e, f)")
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--smoke", action="store_true", help="4 trials of 20 steps, two ways: that it runs")
    parser.add_argument("--out", help="write results.json and results.md here")
    parser.add_argument("--eval-cost", action="store_true",
                        help="instead: what evaluation costs a fused 8-job sweep (600 steps; end, every 100, every 25)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--plot", help=argparse.SUPPRESS)  # (a child: draw its study here)
    args = parser.parse_args(argv)
    if args.eval_cost:
        rows = eval_cost(steps=60 if args.smoke else 600, repeats=1 if args.smoke else 3)
        for r in rows:
            print(json.dumps(r))
        return 0
    if args.child:
        print(json.dumps(child(args.child, args.trials, args.steps, args.every, args.plot, args.concurrency)))
        return 0
    if args.smoke:
        args.trials, args.steps, args.every, args.ways = 4, 20, 10, "a_plain,f_xshare_fused_state"
    ways = [w for w in args.ways.split(",") if w]
    unknown = [w for w in ways if w not in WAYS]
    if unknown:
        parser.error(f"unknown ways {unknown}; choose from {', '.join(WAYS)}")
    rows = []
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    for i, way in enumerate(ways):
        # With --out, each way's study plot too (history, intermediate values): {way}-study.png
        # (a way run twice: its first run's).
        plot = out / f"{way}-study.png" if out is not None and way not in ways[:i] else None
        rows.append(run_way(way, args.trials, args.steps, args.every, plot, args.concurrency))
        print(json.dumps(rows[-1]), flush=True)
    md = table(rows)
    print(md)
    if out is not None:
        (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
        (out / "results.md").write_text(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
