"""The benchmark's driver: calibrate, run every mode of every workload (alternating, repeated),
measure the single-job overhead, and write ``results.json``, the markdown report and the plot."""

from __future__ import annotations

import datetime as _dt
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from . import measure, report
from .modes import DEFAULT_MODES
from .workloads import NAMES, JobPlan, Workload, resolve

# The single-job overhead's job: one of sweep8's MLPs (the middle of its widths), alone.
OVERHEAD_JOB = ("models.mlp:make_job", {"lr": 1e-3, "width": 512, "depth": 2, "batch": 256}, 300)


@dataclass
class BenchConfig:
    workloads: Sequence[str] = NAMES
    modes: Sequence[str] = DEFAULT_MODES
    repeats: int = 3
    steps: int | None = None             # overrides every job's steps
    out: Path = Path("benchmarks/results")
    stem: str = "results"                # files: {stem}.json, {stem}.md, {stem}.png
    overhead: bool = True
    overhead_pairs: int = 7
    overhead_steps: int | None = None
    matmul_n: int = 2048
    matmul_repeats: int = 5
    timeout_s: float = 1800.0            # per measured process
    xla_flags: str | None = None         # added to XLA_FLAGS of every measured process (not calibration)
    smoke: bool = False
    command: str = ""
    analysis: Sequence[str] = field(default_factory=tuple)   # paragraphs added to the report

    @staticmethod
    def smoke_config(**over: Any) -> "BenchConfig":
        """A tiny run that exercises every path: 2 jobs, a few steps, one repeat."""
        base = dict(workloads=("smoke",), modes=("exclusive", "xshare:pack", "processes"), repeats=1,
                    overhead_pairs=1, overhead_steps=20, matmul_n=256, matmul_repeats=2, smoke=True)
        base.update(over)
        return BenchConfig(**base)


def _overhead_plan(cfg: BenchConfig) -> JobPlan:
    entry, params, steps = OVERHEAD_JOB
    if cfg.smoke:
        params = {**params, "width": 32, "batch": 16}
    return JobPlan("overhead", entry, params, cfg.overhead_steps or cfg.steps or steps)


def run_bench(cfg: BenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the benchmark described by ``cfg``; returns the results dict (also written to disk)."""
    if cfg.repeats < 1:
        raise ValueError(f"repeats={cfg.repeats!r} must be >= 1")
    workloads: list[Workload] = [resolve(name, steps=cfg.steps) for name in cfg.workloads]
    machine = measure.machine()
    t_begin = time.monotonic()
    date = _dt.datetime.now().astimezone().isoformat(timespec="seconds")

    log(f"calibrating: {cfg.matmul_n}^3 f32 matmul, best of {cfg.matmul_repeats}")
    calibrations = [_calibrate(cfg)]
    results: dict[str, Any] = {"schema": report.SCHEMA, "date": date, "command": cfg.command,
                               "machine": machine, "config": _config_json(cfg), "workloads": {}}

    for wl in workloads:
        for note in wl.notes:
            log(f"{wl.name}: {note}")
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in cfg.modes}
        jobs = [j.to_json() for j in wl.jobs]
        for r in range(cfg.repeats):
            order = list(cfg.modes[r % len(cfg.modes):]) + list(cfg.modes[:r % len(cfg.modes)])
            for mode in order:
                t = time.monotonic()
                run = _run_mode(mode, jobs, cfg)
                run["repeat"] = r
                runs[mode].append(run)
                status = (f"{run['makespan_s']:.2f} s makespan, peak RSS {run['peak_rss_bytes'] / 2**20:.0f} MiB"
                          if run["ok"] else f"FAILED: {run['error'].splitlines()[0]}")
                log(f"{wl.name} repeat {r + 1}/{cfg.repeats} {mode:<12} {status} ({time.monotonic() - t:.1f} s)")
        results["workloads"][wl.name] = {"runs_raw": runs, **wl.to_json()}

    overhead = None
    if cfg.overhead:
        plan = _overhead_plan(cfg)
        log(f"single-job overhead: {plan.entry} {plan.params}, {plan.steps} steps, {cfg.overhead_pairs} pairs")
        try:
            overhead = measure.run_child("overhead", {"job": plan.to_json(), "pairs": cfg.overhead_pairs},
                                         what="overhead", timeout=cfg.timeout_s, env=measure.xla_env(cfg.xla_flags))
        except measure.BenchError as err:
            overhead = {"error": str(err)}
            log(f"overhead: FAILED: {str(err).splitlines()[0]}")

    if not cfg.smoke:  # again at the end: the better of the two is closer to the device's limit
        calibrations.append(_calibrate(cfg))
    best = max((c for c in calibrations if c.get("peak_flops_per_s")), key=lambda c: c["peak_flops_per_s"],
               default=calibrations[0])
    best = {**best, "peak_flops_per_s_all": [c.get("peak_flops_per_s") for c in calibrations]}
    results["calibration"] = best
    peak = best.get("peak_flops_per_s")
    for name, raw in list(results["workloads"].items()):
        runs = raw.pop("runs_raw")
        results["workloads"][name] = report.summarize_workload(raw, runs, peak)
    results["overhead"] = report.overhead_summary(overhead)
    results["machine"]["loadavg_end"] = measure.loadavg()
    results["targets"] = report.targets(results)
    results["analysis"] = list(cfg.analysis)
    results["duration_s"] = time.monotonic() - t_begin
    write(results, cfg.out, cfg.stem)
    return results


def write(results: dict[str, Any], out: Path, stem: str) -> dict[str, Path]:
    from .plot import plot

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md", "png": out / f"{stem}.png"}
    paths["json"].write_text(json.dumps(results, indent=1, default=_json_default) + "\n")
    paths["md"].write_text(report.markdown(results))
    plot(results, paths["png"])
    return paths


def _json_default(x: Any) -> Any:
    if isinstance(x, Path):
        return str(x)
    return float(x)


def _calibrate(cfg: BenchConfig) -> dict[str, Any]:
    try:
        return measure.run_child("calibrate", {"n": cfg.matmul_n, "repeats": cfg.matmul_repeats},
                                 what="calibrate", timeout=cfg.timeout_s)
    except measure.BenchError as err:
        return {"error": str(err)}


def _run_mode(mode: str, jobs: list[dict[str, Any]], cfg: BenchConfig) -> dict[str, Any]:
    env = measure.xla_env(cfg.xla_flags)
    try:
        if mode == "processes":
            run = measure.run_processes(jobs, timeout=cfg.timeout_s, env=env)
        else:
            run = measure.run_child("mode", {"mode": mode, "jobs": jobs}, what=mode, timeout=cfg.timeout_s,
                                    env=env)
    except measure.BenchError as err:
        return {"ok": False, "error": str(err), "makespan_s": None, "peak_rss_bytes": None}
    failed = [j for j in run["jobs"] if j.get("status") != "done"]
    run["ok"] = True
    if failed:
        run["ok"] = False
        run["error"] = f"{len(failed)} job(s) did not finish: " + "; ".join(
            f"{j['name']}: {j.get('status')} {j.get('error') or ''}" for j in failed)
    return run


def _config_json(cfg: BenchConfig) -> dict[str, Any]:
    return {"workloads": list(cfg.workloads), "modes": list(cfg.modes), "repeats": cfg.repeats,
            "steps": cfg.steps, "overhead": cfg.overhead, "overhead_pairs": cfg.overhead_pairs,
            "matmul_n": cfg.matmul_n, "smoke": cfg.smoke, "xla_flags": cfg.xla_flags}
