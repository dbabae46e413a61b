"""``xshare bench``: run the sharing benchmark and show its table. Thin: the measuring, the
figures and the files are :mod:`xshare.bench`'s; this parses, calls it and renders.

Exit codes: 0 every measurement ran, 1 some run failed (the rest is still reported), 2 the
command line is wrong.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import shlex
import sys
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from xshare.bench import DEFAULT_MODES, WORKLOADS

    parser.add_argument("--workload", default="all", metavar="NAME",
                        help=f"{', '.join(WORKLOADS)}, all (default), a comma list, or a TOML launch spec's path")
    parser.add_argument("--modes", metavar="M[,M...]",
                        help=f"exclusive, processes, xshare:<policy> (default: {','.join(DEFAULT_MODES)})")
    parser.add_argument("--repeats", type=int, default=3, metavar="R",
                        help="repeats of every mode, alternating (default: %(default)s); medians are reported")
    parser.add_argument("--steps", type=int, metavar="N", help="steps of every job (default: the workload's)")
    parser.add_argument("--out", metavar="DIR", help="where results.json/.md/.png go (default runs/bench-{time})")
    parser.add_argument("--no-overhead", action="store_true", help="skip the single-job overhead measurement")
    parser.add_argument("--overhead-pairs", type=int, default=7, metavar="N",
                        help="plain/xshare pairs of the single-job overhead measurement (default: %(default)s)")
    parser.add_argument("--xla-flags", metavar="FLAGS",
                        help="added to XLA_FLAGS of every measured process, in every mode alike (not the "
                             "peak calibration), e.g. '--xla_cpu_multi_thread_eigen=false "
                             "intra_op_parallelism_threads=1'")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny run (2 small jobs, few steps, 1 repeat; modes exclusive, xshare:pack, "
                             "processes unless --modes is given): checks that everything works, measures nothing")


def config_from_args(args: argparse.Namespace):
    from xshare.bench import DEFAULT_MODES, BenchConfig, WORKLOADS, parse_modes

    if args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats}: must be at least 1")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps {args.steps}: must be at least 1")
    if args.overhead_pairs < 1:
        raise ValueError(f"--overhead-pairs {args.overhead_pairs}: must be at least 1")
    out = Path(args.out) if args.out else Path("runs") / f"bench-{_dt.datetime.now():%Y%m%d-%H%M%S}"
    names = [w.strip() for w in args.workload.split(",") if w.strip()]
    workloads = list(WORKLOADS) if names == ["all"] else names
    common = {"out": out, "command": command_line(args, out), "overhead": not args.no_overhead,
              "xla_flags": args.xla_flags or None}
    if args.smoke:
        over = dict(common)
        if args.modes:
            over["modes"] = parse_modes(args.modes)
        if args.workload != "all":
            over["workloads"] = tuple(workloads)
        if args.steps is not None:
            over["steps"] = args.steps
        if args.repeats != 3:
            over["repeats"] = args.repeats
        if args.overhead_pairs != 7:
            over["overhead_pairs"] = args.overhead_pairs
        return BenchConfig.smoke_config(**over)
    return BenchConfig(workloads=tuple(workloads), modes=parse_modes(args.modes or DEFAULT_MODES),
                       repeats=args.repeats, steps=args.steps, overhead_pairs=args.overhead_pairs, **common)


def command_line(args: argparse.Namespace, out: Path) -> str:
    """The exact command (what the report tells readers to run): every option spelled out, or for
    ``--smoke`` the options given."""
    from xshare.bench import DEFAULT_MODES

    parts = ["xshare", "bench"]
    if args.smoke:
        parts.append("--smoke")
        parts += ["--workload", args.workload] if args.workload != "all" else []
        parts += ["--modes", args.modes] if args.modes else []
        parts += ["--repeats", str(args.repeats)] if args.repeats != 3 else []
    else:
        parts += ["--workload", args.workload, "--modes", args.modes or ",".join(DEFAULT_MODES),
                  "--repeats", str(args.repeats)]
    if args.steps is not None:
        parts += ["--steps", str(args.steps)]
    if args.no_overhead:
        parts.append("--no-overhead")
    elif args.overhead_pairs != 7:
        parts += ["--overhead-pairs", str(args.overhead_pairs)]
    if args.xla_flags:
        parts += ["--xla-flags", args.xla_flags]
    parts += ["--out", str(out)]
    return " ".join(shlex.quote(p) for p in parts)


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
    from xshare._errors import SpecError
    from xshare.bench import report, run_bench
    from xshare.cli import render

    con = render.console()
    try:
        results = run_bench(cfg, log=lambda line: con.print(line, markup=False, highlight=False))
    except (ValueError, SpecError) as err:
        print(f"xshare bench: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("xshare bench: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    for table in report.rich_tables(results):
        con.print(table)
    _print_summary(con, results)
    con.print(f"results: {cfg.out / (cfg.stem + '.json')}, {cfg.out / (cfg.stem + '.md')}, "
              f"{cfg.out / (cfg.stem + '.png')}", markup=False, highlight=False)
    failed = any(not r["ok"] for wl in results["workloads"].values() for m in wl["modes"].values()
                 for r in m["runs"])
    return EXIT_FAILED if failed else EXIT_OK


def _print_summary(con, results) -> None:
    ov = results.get("overhead") or {}
    if "overhead_percent" in ov:
        con.print(f"single-job overhead (xshare:pack vs plain loop): {ov['overhead_percent']:+.1f}% "
                  f"({ov['xshare_median_s']:.3f} s vs {ov['plain_median_s']:.3f} s, medians of "
                  f"{len(ov['plain_s'])})", markup=False, highlight=False)
    elif ov.get("error"):
        con.print(f"single-job overhead: FAILED: {ov['error'].splitlines()[0]}", markup=False, highlight=False)
    for key, t in (results.get("targets") or {}).items():
        if isinstance(t, dict) and t.get("value") is not None:
            value = f"{t['value']:+.1f}%" if key == "single_job_overhead" else f"{t['value']:.2f}x"
            con.print(f"target {key}: {value} (want {t['target']}): {'met' if t['met'] else 'NOT met'}",
                      markup=False, highlight=False)
