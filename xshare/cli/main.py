"""The ``xshare`` command (also ``python -m xshare``): one table row per subcommand.

Each row of ``COMMANDS`` names a subcommand's module, the function that adds its arguments and
its ``run(args) -> int``; the modules are imported when the parser is built, and they import
the library lazily, so ``xshare --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Command:
    """One subcommand: its parser's texts and where its arguments and its run live."""

    name: str
    module: str  # under xshare.cli
    add: str  # the module's function that adds the arguments to the parser
    run: str  # the module's run(args) -> int
    help: str
    description: str
    epilog: str | None = None  # examples, laid out as written; without them the plain formatter

    def add_to(self, subparsers: argparse._SubParsersAction) -> None:
        module = importlib.import_module(f"xshare.cli.{self.module}")
        parser = subparsers.add_parser(
            self.name,
            help=self.help,
            description=self.description,
            epilog=self.epilog,
            formatter_class=argparse.HelpFormatter if self.epilog is None else argparse.RawDescriptionHelpFormatter,
        )
        getattr(module, self.add)(parser)
        parser.set_defaults(func=getattr(module, self.run))


def _examples(*lines: str) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


COMMANDS: tuple[Command, ...] = (
    Command(
        "launch", "launch", "add_arguments", "run",
        help="run jobs from a TOML spec or a module:function grid in one runtime",
        description=(
            "Run many JAX jobs in one xshare runtime. The target is a TOML spec ([runtime] and [[job]] "
            "tables) or a factory 'module:function' swept with --set. Lists expand to a grid; "
            "command-line options override the spec. Exit 0 when every job is done, 1 when one "
            "failed, 2 when the spec is wrong (nothing is started)."
        ),
        epilog=_examples(
            "xshare launch examples/sweep.toml --dry-run",
            "xshare launch xshare.models.mlp:make_job --set lr=1e-3,3e-4 --set width=128,256 --replicas 2",
        ),
    ),
    Command(
        "tune", "tune", "add_arguments", "run",
        help="hyperparameter search: an Optuna study whose trials are jobs of one runtime",
        description=(
            "Run an Optuna study (sampler, pruner, storage) whose trials are jobs of one xshare runtime, "
            "fused by default. The spec has one [[job]] entry, a [search] table (ranges {low, high, log}, "
            "lists = categorical) and [tune] settings; flags override them. Writes RUN_DIR/study.db, "
            "study.png and each trial's metrics.jsonl. Needs pip install 'xshare[tune]'. Exit 0 done, "
            "1 no trial completed, 2 bad spec (nothing is started), 130 interrupted (--resume continues)."
        ),
        epilog=_examples(
            "xshare tune examples/tune_digits.toml",
            "xshare tune examples/tune_digits.toml --trials 64 --pruner hyperband --sampler random --seed 1",
            "xshare tune --resume runs/20260101-120000-tune_digits",
        ),
    ),
    Command(
        "top", "top", "add_arguments", "run",
        help="live view of running runtimes: device, arena, lanes and jobs",
        description=(
            "Show what the running xshare runtimes are doing, from their status endpoints (found "
            "through their discovery files, or --address). Live keys: q quit, up/down select a "
            "job, p pause/resume it, s cycle the sort key. Off a terminal it prints once. Exit 1 "
            "when no runtime is found."
        ),
        epilog=_examples(
            "xshare top",
            "xshare top --once",
            "xshare top --json --interval 5 > status.ndjson",
            "xshare top --address 127.0.0.1:8470 --token $TOKEN",
        ),
    ),
    Command(
        "bench", "bench", "add_arguments", "run",
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
        epilog=_examples(
            "xshare bench --smoke",
            "xshare bench --workload sweep8 --modes exclusive,processes,xshare:pack --repeats 3",
            "xshare bench --workload examples/zoo.toml --steps 100 --out runs/zoo-bench",
        ),
    ),
    Command(
        "serve", "serve", "add_arguments", "run",
        help="a long-running runtime that owns one device; jobs arrive with xshare submit",
        description=(
            "Keep one xshare runtime alive as a service. Jobs arrive as plain data (xshare submit, "
            "POST /jobs) over the token-checked control API on --address (loopback by default); "
            "each job logs under --run-dir. SIGTERM/SIGINT checkpoint every job and exit 0; "
            "--resume continues them."
        ),
        epilog=_examples(
            "xshare serve --memory 4GiB --policy pack",
            "xshare serve --resume --run-dir runs/my-serve",
        ),
    ),
    Command(
        "submit", "submit", "add_submit_arguments", "run_submit",
        help="send jobs (a spec, or module:function --set k=v) to a running xshare serve",
        description=(
            "Expand a spec or an entry with --set into jobs and send them to a running service; "
            "prints one job name per line. The service imports the entries: the client needs neither "
            "jax nor the module. Exit 0 accepted, 1 refused (the service says why), 2 usage error or "
            "no service."
        ),
        epilog=_examples(
            "xshare submit examples/sweep.toml",
            "xshare submit xshare.models.mlp:make_job --set lr=1e-3,3e-4",
        ),
    ),
    Command(
        "ctl", "submit", "add_ctl_arguments", "run_ctl",
        help="pause, resume, cancel or reprioritize jobs of a running xshare serve (or list them)",
        description="Act on the jobs of a running service (an extension of the command line contract).",
        epilog=_examples(
            "xshare ctl list",
            "xshare ctl cancel 0_lr=0.001",
            "xshare ctl priority 1_lr=0.0003 5",
        ),
    ),
    Command(
        "deploy", "submit", "add_deploy_arguments", "run_deploy",
        help="deploy a model (module:function --set k=v) on a running xshare serve",
        description=(
            "Deploy a model on a running service: ENTRY is a factory returning xshare.model(...); the "
            "service imports and compiles it, and serves it over the Open Inference Protocol at "
            "/v2/models/NAME. Prints the model's name."
        ),
        epilog=_examples("xshare deploy xshare.models.inference:make_model --set model=cnn --name digits"),
    ),
    Command(
        "undeploy", "submit", "add_undeploy_arguments", "run_undeploy",
        help="undeploy a model of a running xshare serve",
        description="Stop serving model NAME: queued requests are answered first.",
    ),
    Command(
        "doctor", "doctor", "add_arguments", "run",
        help="check that this machine runs xshare correctly (versions, device, fences, memory)",
        description=(
            "Check this machine: Python and package versions, the backend and its devices, the GPU "
            "allocator settings and where each comes from, the XLA FFI fences and their canary, NVML, "
            "the compilation cache and the optional extras. --json for a bug report; --selftest runs "
            "every device path once. Exit 0 all passed (warnings allowed), 1 a check failed (its fix "
            "is named), 2 usage error."
        ),
        epilog=_examples(
            "xshare doctor",
            "xshare doctor --json > doctor.json",
            "xshare doctor --selftest --report selftest.md",
        ),
    ),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xshare",
        description="Share one accelerator among many JAX jobs (fast job switching, lane-partitioned memory).",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_to(subparsers)
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
