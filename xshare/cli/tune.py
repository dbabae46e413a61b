"""``xshare tune SPEC.toml``: an Optuna study whose trials are jobs of one runtime.

Thin: :mod:`xshare.jobs.search` reads and checks the spec, :func:`xshare.tune.optimize`
runs the study, this module builds the sampler/pruner/storage and draws. Exit codes: 0 the
study ran (some trial completed), 1 no trial completed, 2 a bad spec or command line (nothing is
started and nothing is left behind), 130 interrupted (running trials are told FAIL and enqueued
again; ``--resume RUN_DIR`` continues the study).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from xshare.cli.rundir import (EXIT_INTERRUPTED, EXIT_JOB_FAILED, EXIT_OK, EXIT_USAGE)
from xshare.cli.rundir import check_out as _check_out
from xshare.cli.rundir import check_ports as _check_ports
from xshare.cli.rundir import cwd_on_path as _cwd_on_path
from xshare.cli.rundir import make_run_dir as _make_run_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", nargs="?", metavar="SPEC.toml", help="a tune spec: [[job]], [search], [tune]")
    parser.add_argument("--trials", type=int, help="trials the study runs to (ended ones count; overrides [tune])")
    parser.add_argument("--metric", help="the metric that judges a trial, e.g. eval/accuracy")
    parser.add_argument("--direction", help="minimize or maximize")
    parser.add_argument("--pruner", help="median, successive-halving, hyperband or none")
    parser.add_argument("--sampler", help="tpe or random")
    parser.add_argument("--seed", type=int, help="the sampler's seed")
    parser.add_argument("--storage", metavar="URL", help="Optuna storage (default sqlite:///RUN_DIR/study.db)")
    parser.add_argument("--study-name", help="the study's name (default: the spec's file name)")
    parser.add_argument("--concurrency", type=int, help="trials running at once (default 8)")
    parser.add_argument("--report-every", type=int, help="report the metric at steps divisible by this")
    parser.add_argument("--policy", help="fifo, pack, srtf, fair or priority (overrides [runtime] policy)")
    parser.add_argument("--memory", help="device memory the runtime may use: bytes, '2GiB', or 'device'")
    parser.add_argument("--quantum", type=int, help="steps a job runs before the policy picks again")
    parser.add_argument("--steps", type=int, help="steps per trial (overrides the job's steps)")
    parser.add_argument("--no-fuse", action="store_true", help="do not fuse trials (fused by default)")
    parser.add_argument("--out", metavar="DIR", help="run directory (default runs/{YYYYmmdd-HHMMSS}-{spec name})")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the study of an earlier xshare tune run "
                        "(where it ran: a --ray run resumes on Ray, with its --address and --actors)")
    parser.add_argument("--no-ray", action="store_true",
                        help="with --resume: continue a --ray run in this process instead")
    parser.add_argument("--status-port", type=int, default=0, metavar="PORT",
                        help="serve /status and /metrics for xshare top (default 0 = any free port; -1 = off)")
    from xshare.cli import launch_ray  # --ray, --address, --actors: as xshare launch names them
    launch_ray.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from xshare._errors import SpecError
    from xshare.jobs import parse, search

    _cwd_on_path()
    try:
        import optuna  # noqa: F401
    except ImportError:
        return _usage_error("xshare tune needs Optuna: pip install 'xshare[tune]'")
    problem = _check_ports(args.status_port)
    if problem:
        return _usage_error(problem)
    made = None
    try:
        if args.resume:
            run_dir = Path(args.resume)
            record = run_dir / "tune.json"
            if not record.is_file():
                return _usage_error(f"--resume {args.resume}: no tune.json there; give a run directory of xshare tune")
            data = json.loads(record.read_text())
            plan = search.plan_from_json(data, str(record))
            note = _placement(args, data.get("placement") or {})
            if note:
                print(f"xshare tune: {note}", file=sys.stderr)
        else:
            if not args.target:
                return _usage_error("give a tune spec (SPEC.toml), or --resume RUN_DIR")
            over = parse.Overrides(policy=args.policy, memory=args.memory, quantum=args.quantum,
                                   fuse=False if args.no_fuse else None, steps=args.steps)
            tune_over = {"trials": args.trials, "metric": args.metric, "direction": args.direction,
                         "pruner": args.pruner, "sampler": args.sampler, "seed": args.seed,
                         "storage": args.storage, "study_name": args.study_name,
                         "concurrency": args.concurrency, "report_every": args.report_every}
            plan = search.plan_tune(args.target, over, tune_over)
            problem = _check_out(args.out)
            if problem:
                return _usage_error(problem)
            if args.no_ray:
                return _usage_error("--no-ray goes with --resume RUN_DIR (a run starts in this process "
                                    "unless --ray is given)")
            run_dir, made = _make_run_dir(args.out, plan.stem)
            # Where it runs goes with the record, so --resume continues it there.
            placement = {"ray": True, "address": args.address, "actors": args.actors} if args.ray else {"ray": False}
            (run_dir / "tune.json").write_text(json.dumps({**plan.to_json(), "placement": placement},
                                                          indent=2) + "\n")
    except SpecError as err:
        return _usage_error(str(err))
    except (OSError, ValueError, KeyError, TypeError) as err:
        return _usage_error(f"cannot read or create the run: {err}")
    code = EXIT_USAGE
    try:
        code = _study(plan, run_dir, args)
    finally:
        if code == EXIT_USAGE and made is not None:
            made.undo()  # refused before any trial ran: leave nothing behind
    return code


def _placement(args: argparse.Namespace, recorded: dict) -> str | None:
    """On --resume: a run that started with --ray continues on Ray (its --address and --actors
    unless given again), unless --no-ray; what was decided, to say, or None."""
    if args.no_ray:
        args.ray = False
        return "--no-ray: resuming in this process" if recorded.get("ray") else None
    if args.ray or not recorded.get("ray"):
        return None
    args.ray = True
    args.address = args.address or recorded.get("address")
    args.actors = args.actors or recorded.get("actors")
    flags = " ".join(f for f in ("--ray", args.address and f"--address {args.address}",
                                 args.actors and f"--actors {args.actors}") if f)
    return f"this run started on Ray: resuming with {flags} (--no-ray: in this process)"


def _usage_error(message: str) -> int:
    print(f"xshare tune: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _build(plan: Any) -> tuple[Any, Any, str, str]:
    import optuna

    t = plan.tune
    sampler = (optuna.samplers.TPESampler(seed=t.seed) if t.sampler == "tpe"
               else optuna.samplers.RandomSampler(seed=t.seed))
    pruners: dict[str, Callable[[], optuna.pruners.BasePruner]] = {
        "median": lambda: optuna.pruners.MedianPruner(n_startup_trials=4),
        "successive-halving": optuna.pruners.SuccessiveHalvingPruner,
        "hyperband": lambda: optuna.pruners.HyperbandPruner(max_resource=plan.steps or "auto"),
        "none": optuna.pruners.NopPruner}
    pruner = pruners[t.pruner]()
    return sampler, pruner, t.storage, t.study_name or plan.stem


def _study(plan: Any, run_dir: Path, args: argparse.Namespace) -> int:
    import optuna

    import xshare
    import xshare.tune
    from xshare.cli import render
    from xshare.jobs.resolve import resolve_entry
    from xshare.tune._optimize import DEFAULT_CONCURRENCY

    out = render.console()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler, pruner, storage, name = _build(plan)
    storage = storage or f"sqlite:///{(run_dir / 'study.db').resolve()}"
    try:
        study = optuna.create_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner,
                                    direction=plan.tune.direction, load_if_exists=True)
    except Exception as err:  # noqa: BLE001 - a bad storage URL, a study of another direction
        return _usage_error(f"cannot open the study {name!r} in {storage}: {err}")
    factory = resolve_entry(plan.entry, f"[[job]] ({plan.entry})")

    def objective(trial: Any) -> Any:
        params = {**plan.params, **{p.name: p.suggest(trial) for p in plan.search}}
        if plan.takes_steps and plan.steps is not None:
            params["steps"] = plan.steps
        spec = factory(**params)
        # the job's parameters (fixed and searched) as its labels: TensorBoard's HParams
        spec = spec.replace(meta={**spec.meta, "params": {k: v for k, v in params.items() if k != "steps"}})
        return spec.replace(steps=plan.steps) if plan.steps is not None else spec

    t = plan.tune
    out.print(f"xshare tune: {t.trials} trials of {plan.entry} ({', '.join(p.describe() for p in plan.search)}); "
              f"{t.direction} {t.metric}, sampler {t.sampler}, pruner {t.pruner} -> {run_dir}",
              markup=False, highlight=False)
    out.print(f"study: {storage} (optuna-dashboard {storage})", markup=False, highlight=False)
    start = time.monotonic()

    def progress(study: Any, trial: Any) -> None:
        ended = [x for x in study.get_trials(deepcopy=False) if x.state.is_finished()]
        best = _best(study)
        value = "-" if trial.value is None else f"{trial.value:.4g}"
        out.print(f"[{time.monotonic() - start:7.1f}s] trial {trial.number} {trial.state.name:<8} "
                  f"value {value:<8} steps {trial.user_attrs.get('xshare_steps', '-'):<5} "
                  f"{_params(trial.params)}  ({len(ended)}/{t.trials} ended; best "
                  f"{'-' if best is None else f'{best.value:.4g}'})", markup=False, highlight=False)

    if args.ray:  # the trials on Ray's runtime actors; the same table, best and plot below
        from xshare.cli import tune_ray
        code = tune_ray.study(study, plan, run_dir, args, out, progress)
        if code != EXIT_USAGE:
            _report(study, out, run_dir, time.monotonic() - start)
        return EXIT_JOB_FAILED if code == EXIT_OK and _best(study) is None else code
    from xshare.runtime.compiled.compiler import enable_persistent_cache
    enable_persistent_cache()
    # (group_capacity: one fused group program per model shape, as optimize's own runtime has)
    from xshare.runtime.observe import writers  # TensorBoard event files when the extra is there
    rt = xshare.Runtime(**plan.runtime.as_kwargs(), log_dir=str(run_dir), writers=writers.defaults(),
                        group_capacity=t.concurrency or DEFAULT_CONCURRENCY,
                        status_port=None if args.status_port < 0 else args.status_port)
    code = EXIT_OK
    try:
        xshare.tune.optimize(study, objective, t.trials, metric=t.metric, report_every=t.report_every,
                             concurrency=t.concurrency, runtime=rt, callbacks=[progress])
    except KeyboardInterrupt:
        out.print(f"interrupted: running trials told FAIL and enqueued again; resume with: "
                  f"xshare tune --resume {run_dir}", markup=False, highlight=False)
        code = EXIT_INTERRUPTED
    except ValueError as err:  # a metric the jobs never report
        print(f"xshare tune: error: {err}", file=sys.stderr)
        code = EXIT_JOB_FAILED
    finally:
        rt.close()
    _report(study, out, run_dir, time.monotonic() - start)
    if code == EXIT_OK and _best(study) is None:
        code = EXIT_JOB_FAILED
    return code


def _best(study: Any) -> Any:
    try:
        return study.best_trial
    except ValueError:  # no COMPLETE trial yet
        return None


def _params(params: dict) -> str:
    return " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def _report(study: Any, out: Any, run_dir: Path, wall_s: float) -> None:
    from rich.table import Table

    table = Table(title=f"study {study.study_name}: {len(study.trials)} trials in {wall_s:.1f} s")
    for col in ("trial", "params", "state", "value", "steps"):
        table.add_column(col, justify="right" if col in ("trial", "value", "steps") else "left")
    for tr in study.trials:
        table.add_row(str(tr.number), _params(tr.params), tr.state.name,
                      "-" if tr.value is None else f"{tr.value:.4g}", str(tr.user_attrs.get("xshare_steps", "-")))
    out.print(table)
    best = _best(study)
    if best is not None:
        out.print(f"best: trial {best.number} value {best.value:.4g} {_params(best.params)}",
                  markup=False, highlight=False)
    out.print(f"metrics: {run_dir}/trial-<n>/metrics.jsonl", markup=False, highlight=False)
    out.print(_plot(study, run_dir / "study.png"), markup=False, highlight=False)


def _plot(study: Any, path: Path) -> str:
    """History and intermediate values in one figure; a message instead when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot: skipped (matplotlib is not installed: pip install 'xshare[bench]')"
    fig, (history, curves) = plt.subplots(1, 2, figsize=(11, 4))
    done = [t for t in study.trials if t.value is not None]
    history.scatter([t.number for t in done], [t.value for t in done], s=12,
                    c=["tab:blue" if t.state.name == "COMPLETE" else "tab:gray" for t in done])
    complete = [t for t in done if t.state.name == "COMPLETE"]
    if complete:
        pick = max if study.direction.name == "MAXIMIZE" else min
        best, xs, ys = None, [], []
        for t in sorted(complete, key=lambda t: t.number):
            best = t.value if best is None else pick(best, t.value)
            xs.append(t.number)
            ys.append(best)
        history.step(xs, ys, where="post", color="tab:red", label="best")
        history.legend()
    history.set(title="history (gray: pruned)", xlabel="trial", ylabel="value")
    for t in study.trials:
        if t.intermediate_values:
            steps = sorted(t.intermediate_values)
            curves.plot(steps, [t.intermediate_values[s] for s in steps], lw=1,
                        color="tab:gray" if t.state.name == "PRUNED" else "tab:blue", alpha=0.7)
    curves.set(title="intermediate values (gray: pruned)", xlabel="step", ylabel="value")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plot: {path}"
