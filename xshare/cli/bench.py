"""``xshare bench``: run the sharing benchmark and show its tables. Thin: the measuring, the
figures and the files are :mod:`xshare.bench.sharing`'s; this parses, calls it and renders.

Exit codes: 0 every measurement ran, 1 some run failed (the rest is still reported), 2 the
command line is wrong, 130 interrupted.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import shlex
import sys
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
_SMOKE_MODES = "exclusive,xshare:pack,processes"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from xshare.bench.sharing import DEFAULT_MODES, WORKLOADS

    parser.add_argument("--workload", default="all", metavar="NAME",
                        help=f"{', '.join(WORKLOADS)}, all (default), a comma list, or a TOML launch spec's path")
    parser.add_argument("--modes", metavar="M[,M...]",
                        help=f"exclusive, threads, processes, xshare:<policy>[:lanes=N] (default: {','.join(DEFAULT_MODES)})")
    parser.add_argument("--repeats", type=int, default=None, metavar="R",
                        help="repeats of every mode, alternating (default 3; 1 with --smoke); medians are reported")
    parser.add_argument("--steps", type=int, metavar="N", help="steps of every job (default: the workload's)")
    parser.add_argument("--out", metavar="DIR", help="where results.json/.md/.png go (default runs/bench-{time})")
    parser.add_argument("--no-overhead", action="store_true", help="skip the single-job overhead measurement")
    parser.add_argument("--overhead-pairs", type=int, default=None, metavar="N",
                        help="plain/xshare pairs of the single-job overhead measurement (default 7; 1 with --smoke)")
    parser.add_argument("--xla-flags", metavar="FLAGS",
                        help="added to XLA_FLAGS of every measured process, in every mode alike")
    parser.add_argument("--smoke", action="store_true",
                        help=f"a tiny run (2 small jobs, 10 steps, 1 repeat, modes {_SMOKE_MODES} unless --modes "
                             "is given): checks that everything works, measures nothing")


def config_from_args(args: argparse.Namespace):
    from xshare.bench.sharing import DEFAULT_MODES, WORKLOADS, BenchConfig, parse_modes

    repeats = args.repeats if args.repeats is not None else (1 if args.smoke else 3)
    pairs = 0 if args.no_overhead else (args.overhead_pairs if args.overhead_pairs is not None else (1 if args.smoke else 7))
    for flag, value, least in (("--repeats", repeats, 1), ("--steps", args.steps, 1), ("--overhead-pairs", pairs, 0)):
        if value is not None and value < least:
            raise ValueError(f"{flag} {value}: must be at least {least}")
    names = [w.strip() for w in args.workload.split(",") if w.strip()]
    workloads = ["smoke"] if args.smoke and names == ["all"] else list(WORKLOADS) if names == ["all"] else names
    modes = parse_modes(args.modes or (_SMOKE_MODES if args.smoke else DEFAULT_MODES))
    out = Path(args.out) if args.out else Path("runs") / f"bench-{_dt.datetime.now():%Y%m%d-%H%M%S}"
    command = shlex.join(["xshare", "bench", *sys.argv[2:]] if sys.argv[1:2] == ["bench"] else ["xshare", "bench"])
    return BenchConfig(workloads=tuple(workloads), modes=modes, repeats=repeats, steps=args.steps, out=out,
                       overhead_pairs=pairs, xla_flags=args.xla_flags, smoke=args.smoke, command=command)


def run(args: argparse.Namespace) -> int:
    from xshare._errors import SpecError

    try:
        cfg = config_from_args(args)
    except (ValueError, SpecError) as err:
        print(f"xshare bench: {err}", file=sys.stderr)
        return EXIT_USAGE
    return execute(cfg)


def execute(cfg) -> int:
    """Run a configured benchmark, print its tables and where its files went."""
    from rich.markdown import Markdown

    from xshare._errors import SpecError
    from xshare.bench import sharing
    from xshare.cli import render

    con = render.console()
    cfg.log = lambda line: con.print(line, markup=False, highlight=False)
    try:
        results = sharing.run_bench(cfg)
    except (ValueError, SpecError) as err:
        print(f"xshare bench: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("xshare bench: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    con.print(Markdown(sharing.markdown(results)))
    con.print(f"results: {cfg.out / (cfg.stem + '.json')}, {cfg.out / (cfg.stem + '.md')}, "
              f"{cfg.out / (cfg.stem + '.png')}", markup=False, highlight=False)
    failed = any(m["errors"] for wl in results["workloads"].values() for m in wl["modes"].values())
    return EXIT_FAILED if failed else EXIT_OK
