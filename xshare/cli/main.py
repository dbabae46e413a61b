"""The ``xshare`` command (also ``python -m xshare``): one function per subcommand's parser.

Each ``add_*`` function registers one subcommand and points ``func`` at a ``run(args) -> int``;
the subcommand modules import the library lazily, so ``xshare --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def add_launch(subparsers: argparse._SubParsersAction) -> None:
    from xshare.cli import launch

    parser = subparsers.add_parser(
        "launch",
        help="run jobs from a TOML spec or a module:function grid in one runtime",
        description=(
            "Run many JAX jobs in one xshare runtime. The target is a TOML spec ([runtime] and [[job]] "
            "tables) or a factory 'module:function' swept with --set. Lists expand to a grid; "
            "command-line options override the spec. Exit 0 when every job is done, 1 when one "
            "failed, 2 when the spec is wrong (nothing is started)."
        ),
        epilog=(
            "examples:\n"
            "  xshare launch examples/sweep.toml --dry-run\n"
            "  xshare launch xshare.models.mlp:make_job --set lr=1e-3,3e-4 --set width=128,256 --replicas 2"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    launch.add_arguments(parser)
    parser.set_defaults(func=launch.run)


def add_tune(subparsers: argparse._SubParsersAction) -> None:
    from xshare.cli import tune

    parser = subparsers.add_parser(
        "tune",
        help="hyperparameter search: an Optuna study whose trials are jobs of one runtime",
        description=(
            "Run an Optuna study (sampler, pruner, storage) whose trials are jobs of one xshare runtime, "
            "fused by default. The spec has one [[job]] entry, a [search] table (ranges {low, high, log}, "
            "lists = categorical) and [tune] settings; flags override them. Writes RUN_DIR/study.db, "
            "study.png and each trial's metrics.jsonl. Needs pip install 'xshare[tune]'. Exit 0 done, "
            "1 no trial completed, 2 bad spec (nothing is started), 130 interrupted (--resume continues)."
        ),
        epilog=(
            "examples:\n"
            "  xshare tune examples/tune_digits.toml\n"
            "  xshare tune examples/tune_digits.toml --trials 64 --pruner hyperband --sampler random --seed 1\n"
            "  xshare tune --resume runs/20260101-120000-tune_digits"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tune.add_arguments(parser)
    parser.set_defaults(func=tune.run)


def add_top(subparsers: argparse._SubParsersAction) -> None:
    from xshare.cli import top

    parser = subparsers.add_parser(
        "top",
        help="live view of running runtimes: device, arena, lanes and jobs",
        description=(
            "Show what the running xshare runtimes are doing, from their status endpoints (found "
            "through their discovery files, or --address). Live keys: q quit, up/down select a "
            "job, p pause/resume it, s cycle the sort key. Off a terminal it prints once. Exit 1 "
            "when no runtime is found."
        ),
        epilog=(
            "examples:\n"
            "  xshare top\n"
            "  xshare top --once\n"
            "  xshare top --json --interval 5 > status.ndjson\n"
            "  xshare top --address 127.0.0.1:8470 --token $TOKEN"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    top.add_arguments(parser)
    parser.set_defaults(func=top.run)


def add_bench(subparsers: argparse._SubParsersAction) -> None:
    from xshare.cli import bench

    parser = subparsers.add_parser(
        "bench",
        help="benchmark sharing against exclusive allocation and one process per job",
        description=(
            "Run workloads of JAX jobs in several modes, alternating and repeated: exclusive (one job "
            "at a time, plain loop), threads (plain loops side by side), processes (one process per job) "
            "and xshare:<policy> (one runtime). Reports makespan, average JCT, aggregate steps/s, peak RSS "
            "and inference latency as medians with paired ratios to exclusive, and the single-job "
            "overhead; writes results.json, results.md and results.png under --out. Needs the bench "
            "extra (pip install 'xshare[bench]'). Exit 0 when every run succeeded, 1 when one failed, "
            "2 on a usage error."
        ),
        epilog=(
            "examples:\n"
            "  xshare bench --smoke\n"
            "  xshare bench --workload sweep8 --modes exclusive,processes,xshare:pack --repeats 3\n"
            "  xshare bench --workload examples/zoo.toml --steps 100 --out runs/zoo-bench"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_arguments(parser)
    parser.set_defaults(func=bench.run)


def add_service(subparsers: argparse._SubParsersAction) -> None:
    from xshare.cli import serve, submit

    fmt = argparse.RawDescriptionHelpFormatter
    parser = subparsers.add_parser(
        "serve", help="a long-running runtime that owns one device; jobs arrive with xshare submit",
        description=("Keep one xshare runtime alive as a service. Jobs arrive as plain data (xshare submit, "
                     "POST /jobs) over the token-checked control API on --address (loopback by default); "
                     "each job logs under --run-dir. SIGTERM/SIGINT checkpoint every job and exit 0; "
                     "--resume continues them."),
        epilog="examples:\n  xshare serve --memory 4GiB --policy pack\n  xshare serve --resume --run-dir runs/my-serve",
        formatter_class=fmt)
    serve.add_arguments(parser)
    parser.set_defaults(func=serve.run)
    parser = subparsers.add_parser(
        "submit", help="send jobs (a spec, or module:function --set k=v) to a running xshare serve",
        description=("Expand a spec or an entry with --set into jobs and send them to a running service; "
                     "prints one job name per line. The service imports the entries: the client needs neither "
                     "jax nor the module. Exit 0 accepted, 1 refused (the service says why), 2 usage error or "
                     "no service."),
        epilog="examples:\n  xshare submit examples/sweep.toml\n  xshare submit xshare.models.mlp:make_job --set lr=1e-3,3e-4",
        formatter_class=fmt)
    submit.add_submit_arguments(parser)
    parser.set_defaults(func=submit.run_submit)
    parser = subparsers.add_parser(
        "ctl", help="pause, resume, cancel or reprioritize jobs of a running xshare serve (or list them)",
        description="Act on the jobs of a running service (an extension of the command line contract).",
        epilog="examples:\n  xshare ctl list\n  xshare ctl cancel 0_lr=0.001\n  xshare ctl priority 1_lr=0.0003 5",
        formatter_class=fmt)
    submit.add_ctl_arguments(parser)
    parser.set_defaults(func=submit.run_ctl)
    parser = subparsers.add_parser(
        "deploy", help="deploy a model (module:function --set k=v) on a running xshare serve",
        description=("Deploy a model on a running service: ENTRY is a factory returning xshare.model(...); the "
                     "service imports and compiles it, and serves it over the Open Inference Protocol at "
                     "/v2/models/NAME. Prints the model's name."),
        epilog="examples:\n  xshare deploy xshare.models.inference:make_model --set model=cnn --name digits",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    submit.add_deploy_arguments(parser)
    parser.set_defaults(func=submit.run_deploy)
    parser = subparsers.add_parser("undeploy", help="undeploy a model of a running xshare serve",
                                   description="Stop serving model NAME: queued requests are answered first.")
    submit.add_undeploy_arguments(parser)
    parser.set_defaults(func=submit.run_undeploy)



def add_doctor(subparsers: argparse._SubParsersAction) -> None:
    from xshare.cli import doctor

    parser = subparsers.add_parser(
        "doctor",
        help="check that this machine runs xshare correctly (versions, device, fences, memory)",
        description=(
            "Check this machine: Python and package versions, the backend and its devices, the GPU "
            "allocator settings and where each comes from, the XLA FFI fences and their canary, NVML, "
            "the compilation cache and the optional extras. --json for a bug report; --selftest runs "
            "every device path once. Exit 0 all passed (warnings allowed), 1 a check failed (its fix "
            "is named), 2 usage error."
        ),
        epilog=(
            "examples:\n"
            "  xshare doctor\n"
            "  xshare doctor --json > doctor.json\n"
            "  xshare doctor --selftest --report selftest.md"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.add_arguments(parser)
    parser.set_defaults(func=doctor.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xshare",
        description="Share one accelerator among many JAX jobs (fast job switching, lane-partitioned memory).",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_launch(subparsers)
    add_tune(subparsers)
    add_top(subparsers)
    add_bench(subparsers)
    add_service(subparsers)
    add_doctor(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C while parsing or importing, before a subcommand handles it
        print("xshare: interrupted", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra and not getattr(args, "takes_any_args", False):  # placeholders accept anything for now
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exit_:  # --help (0) and usage errors (2): return, so callers get an int
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
