"""The headline benchmark: xshare against exclusive allocation and one process per job.

    python -m benchmarks.bench_sharing            # the full default run -> benchmarks/results/
    python -m benchmarks.bench_sharing --workload sweep8 --repeats 5

A thin wrapper over ``xshare bench`` (same options; see ``xshare bench --help``) that writes
``benchmarks/results/bench_sharing.{json,md,png}`` (``--stem`` names other files there). All the work is in :mod:`xshare.bench`.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    from xshare.cli import bench

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_sharing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(parser)
    parser.add_argument("--stem", default="bench_sharing",
                        help="file names: benchmarks/results/STEM.{json,md,png} (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = str(OUT.relative_to(Path.cwd()) if OUT.is_relative_to(Path.cwd()) else OUT)
    try:
        cfg = bench.config_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    command = " ".join(["python -m benchmarks.bench_sharing", *map(shlex.quote, argv)]).strip()
    cfg = dataclasses.replace(cfg, stem=args.stem, command=f"{command}   # = {cfg.command}")
    return bench.execute(cfg)


if __name__ == "__main__":
    sys.exit(main())
