"""``xshare tune SPEC.toml --ray [--address ADDR] [--actors K]``: the study's trials on the runtime
actors of a Ray cluster (:func:`xshare.tune._ray.optimize_ray`); the flags are ``xshare launch
--ray``'s. Thin: connect, turn each trial into a job request, run, hand the exit code back to
:mod:`xshare.cli.tune`, which draws the same table, best trial and plot as a local study.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any, Callable

from xshare.cli.rundir import EXIT_INTERRUPTED, EXIT_JOB_FAILED, EXIT_OK, EXIT_USAGE


def study(study: Any, plan: Any, run_dir: Path, args: argparse.Namespace, out: Any,
          progress: Callable[[Any, Any], None]) -> int:
    """Run ``study`` on Ray; EXIT_USAGE (before any trial ran) when Ray is missing or unreachable."""
    try:
        import ray
    except ImportError:
        return _error("--ray needs Ray: pip install 'xshare[ray]'")
    if args.actors is not None and args.actors < 1:
        return _error(f"--actors {args.actors} must be >= 1 (runtime actors to start)")
    from xshare.jobs.request import JobRequest
    from xshare.tune._ray import check_actors, optimize_ray

    owned = not ray.is_initialized()  # (a caller's Ray, e.g. a test's, is left running)
    if owned:
        try:
            ray.init(address=args.address, namespace="xshare", logging_level=logging.WARNING, log_to_driver=False)
        except Exception as err:  # noqa: BLE001 - Ray's own message says which address and why
            return _error(f"cannot connect to Ray at {args.address or 'a new local cluster'}: {err}")
    try:
        gpus = int(ray.cluster_resources().get("GPU", 0))
        actors = args.actors or gpus or 2
        problem = check_actors(actors)
        if problem:
            return _error(problem)
        t, opts = plan.tune, plan.runtime

        def request(trial: Any) -> Any:
            # Plain data: the actor imports the entry and calls it (steps too, when it takes them).
            params = {**plan.params, **{p.name: p.suggest(trial) for p in plan.search}}
            return JobRequest(entry=plan.entry, params=params, steps=plan.steps)

        out.print(f"on Ray: {actors} runtime actor(s) ({'1 GPU' if gpus else '1 CPU'} each); the driver "
                  f"reads {run_dir}/trial-<n>/metrics.jsonl", markup=False, highlight=False)
        try:
            optimize_ray(study, request, t.trials, metric=t.metric, run_dir=str(run_dir.resolve()),
                         actors=actors, report_every=t.report_every, concurrency=t.concurrency,
                         runtime={"memory": opts.memory, "policy": opts.policy, "fuse": opts.fuse},
                         callbacks=[progress])
        except KeyboardInterrupt:
            out.print(f"interrupted: running trials told FAIL and enqueued again; resume with: "
                      f"xshare tune --resume {run_dir}", markup=False, highlight=False)
            return EXIT_INTERRUPTED
        except (ValueError, RuntimeError) as err:  # a metric the jobs never report; every actor died
            print(f"xshare tune: error: {err}", file=sys.stderr)
            return EXIT_JOB_FAILED
        return EXIT_OK
    finally:
        if owned:
            ray.shutdown()


def _error(message: str) -> int:
    print(f"xshare tune: error: {message}", file=sys.stderr)
    return EXIT_USAGE
