"""The ``xshare`` command (also ``python -m xshare``): one function per subcommand's parser.

Each ``add_*`` function registers one subcommand and points ``func`` at a ``run(args) -> int``;
the subcommand modules import the library lazily, so ``xshare --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence


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
            "  xshare launch models.mlp:make_job --set lr=1e-3,3e-4 --set width=128,256 --replicas 2"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    launch.add_arguments(parser)
    parser.set_defaults(func=launch.run)


def add_top(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("top", help="live view of a running runtime (not yet available)")
    parser.set_defaults(func=_not_yet("top"), takes_any_args=True)


def add_bench(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="side-by-side sharing benchmarks (not yet available)")
    parser.set_defaults(func=_not_yet("bench"), takes_any_args=True)


def _not_yet(command: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        print(f"xshare {command}: not yet available", file=sys.stderr)
        return 2

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xshare",
        description="Share one accelerator among many JAX jobs (fast job switching, lane-partitioned memory).",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_launch(subparsers)
    add_top(subparsers)
    add_bench(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
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
