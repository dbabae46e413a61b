"""``xshare launch``'s plan: what a spec (or an entry point and its ``--set`` grid) expands to,
and what ``--dry-run --fuse`` explains (the fused groups the run would form, and why each other
job would run alone). :mod:`xshare.cli.launch` prints the plan and runs it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def plan(args: argparse.Namespace, specs: Any) -> Any:
    """The launch plan of ``args.target`` (a spec file or an entry point) with the command
    line's overrides; ``specs`` is :mod:`xshare.jobs` (imported by the caller)."""
    over = specs.Overrides(
        policy=args.policy,
        memory=args.memory,
        quantum=args.quantum,
        fuse=True if args.fuse else None,
        steps=args.steps,
        replicas=args.replicas,
        sets=dict(specs.parse_set(item) for item in args.sets),
    )
    target = args.target
    if target.endswith(".toml") or Path(target).is_file():
        return specs.plan_file(target, over)
    if ":" in target:
        return specs.plan_entry(target, over)
    raise specs.SpecError(f"{target!r} is neither a spec file (SPEC.toml) nor an entry point (module:function)")


def print_fusion(jobs: list[Any], out: Any, policy: str = "pack") -> None:
    """The fused groups the run would form, and why each other job would run alone (lowers
    every job's step: this imports jax, which a plain dry run does not). ``policy``: the
    launch's (under fifo, priority and srtf lanes do not run side by side: one group a program)."""
    import jax

    from xshare import sched
    from xshare.runtime.compiled.sweeps import explain
    from xshare.runtime.config import RuntimeConfig
    from xshare.runtime.engine.streams import parallel_streams
    from xshare.runtime.setup import fences_wanted

    device = jax.devices()[0]  # (keyed as the launch's runtime keys them: its measured verdicts)
    config = RuntimeConfig.of(sched.get_policy(policy))  # (as the launch's runtime decides lanes and staging)
    report = explain(jobs, device, fenced=fences_wanted(None, device),
                     streams=parallel_streams(device, config.parallel_lanes), staging=config.staging)
    for i, (names, (groups, slots)) in enumerate(zip(report.groups, report.split)):
        how = f" ({groups} groups of {slots} slots, one per core)" if groups > 1 else ""
        out.print(f"fused group {i}: {len(names)} jobs{how}: {', '.join(names)}", markup=False, highlight=False)
    for name, why in report.alone.items():
        out.print(f"{name} runs alone: {why}", markup=False, highlight=False)
    if not report.groups:
        out.print("no jobs fuse", markup=False, highlight=False)
