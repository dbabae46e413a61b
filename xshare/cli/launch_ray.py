"""``xshare launch SPEC.toml --ray [--address ADDR] [--actors N]``: the sweep across the runtime
actors of a Ray cluster (:mod:`xshare.service.ray_actors`). Thin: connect, run, summarize.
``--address`` is Ray's (``auto`` for the cluster this node belongs to, ``ray://head:10001``
for a remote one); none starts a local Ray for the launch."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from xshare.cli.rundir import EXIT_JOB_FAILED, EXIT_OK
_EVERY_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ray", action="store_true",
                        help="run the jobs across the runtime actors of a Ray cluster (pip install 'xshare[ray]')")
    parser.add_argument("--address", metavar="ADDR",
                        help="with --ray: the Ray cluster ('auto', 'ray://head:10001'); default a local Ray")
    parser.add_argument("--actors", type=int, metavar="N",
                        help="with --ray: runtime actors to start (default: one per GPU, else 2)")


def run(plan: Any, args: argparse.Namespace) -> int:
    import logging

    from xshare._errors import XShareError
    from xshare.cli.rundir import make_run_dir, resolved, usage_error as _usage_error
    from xshare.jobs import requests_from_plan

    try:
        import ray
    except ImportError:
        return _usage_error("--ray needs Ray: pip install 'xshare[ray]'")
    if args.actors is not None and args.actors < 1:
        return _usage_error(f"--actors {args.actors} must be >= 1")
    requests = requests_from_plan(plan)
    try:
        ray.init(address=args.address, namespace="xshare", logging_level=logging.WARNING, log_to_driver=False)
    except Exception as err:  # noqa: BLE001 - Ray's own message says which address and why
        # (before the run directory exists: a refused launch leaves nothing behind)
        return _usage_error(f"cannot connect to Ray at {args.address or 'a new local cluster'}: {err}")
    run_dir, _ = make_run_dir(args.out, plan.stem)
    (run_dir / "spec.json").write_text(json.dumps({**resolved(plan, run_dir), "ray": True}, indent=2,
                                                  default=str) + "\n")
    from xshare.service.ray_actors import run_sweep

    gpus = int(ray.cluster_resources().get("GPU", 0))
    actors = args.actors or gpus or 2
    opts = plan.runtime
    print(f"xshare: {len(requests)} job(s) on {actors} runtime actor(s) "
          f"({'1 GPU' if gpus else '1 CPU'} each), policy {opts.policy} -> {run_dir}", flush=True)
    last = [time.monotonic()]

    def progress(sweep: Any, live: Any) -> None:
        if time.monotonic() - last[0] < _EVERY_S:
            return
        last[0] = time.monotonic()
        done = sum(1 for s in sweep.status.values() if s.get("status") == "done")
        print(f"  {done}/{len(sweep.requests)} done on {len(live)} actor(s)", flush=True)

    try:
        sweep = run_sweep(requests, run_dir=str(run_dir.resolve()), actors=actors, memory=opts.memory,
                          policy=opts.policy, checkpoint_every=args.checkpoint_every or None, fuse=opts.fuse,
                          on_poll=progress)
    except XShareError as err:
        return _usage_error(str(err))
    finally:
        ray.shutdown()
    code = EXIT_OK
    for name in sweep.requests:
        s = sweep.status.get(name, {})
        status = "refused" if name in sweep.refused else s.get("status", "?")
        moved = f", moved {sweep.moves[name]}x" if sweep.moves.get(name) else ""
        why = sweep.refused.get(name) or s.get("error") or ""
        print(f"{name}\t{status}\t{s.get('steps_done', 0)}/{s.get('steps_total', '?')}\t"
              f"{s.get('actor', '-')}{moved}\t{why}".rstrip(), flush=True)
        if status != "done":
            code = EXIT_JOB_FAILED
    print(f"metrics: {run_dir}/<job>/metrics.jsonl", flush=True)
    return code
