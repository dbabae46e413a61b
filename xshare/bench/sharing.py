"""``xshare bench``: xshare against exclusive allocation and one process per job, on named
workloads, through :mod:`xshare.bench.harness`.

Modes (each run in a fresh process, so its peak RSS is its own):

* ``exclusive``: one job at a time, plain loop (:func:`harness.plain_loop`);
* ``threads``: the plain loops concurrently in one process, no runtime (the ceiling);
* ``processes``: one process per job, today's way (:func:`harness.processes`);
* ``xshare:<policy>[:lanes=N]``: one ``Runtime(policy=..., max_lanes=N)``.

Modes alternate within every repeat; figures are medians over repeats, ratios to
``exclusive`` are paired (repeat r over repeat r) then medians. The single-job overhead is one
job alone, plain loop vs ``xshare:pack``, alternating pairs.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from xshare.jobs.request import JobRequest

from . import harness as H

_MLP, _CNN, _TRANSFORMER, _INFER = (f"xshare.models.{m}:make_job" for m in ("mlp", "cnn", "transformer", "inference"))

# name -> (description, [(entry, params (lists sweep), steps per job)])
BUILTIN: dict[str, tuple[str, list[tuple[str, dict[str, Any], int]]]] = {
    "sweep8": ("8 MLPs (lr x width sweep, depth 2, batch 256): a hyper-parameter sweep",
               [(_MLP, {"lr": [1e-3, 3e-3], "width": [256, 384, 512, 640], "depth": 2, "batch": 256}, 300)]),
    "zoo": ("2 MLPs + ResNet CNN + char Transformer: different models, step times and memory",
            [(_MLP, {"lr": [1e-3, 3e-3], "width": 256, "batch": 128}, 600),
             (_CNN, {"lr": 1e-3, "channels": 16, "blocks": 2, "batch": 32}, 200),
             (_TRANSFORMER, {"lr": 3e-3, "d_model": 64, "layers": 2, "heads": 4, "seq": 64, "batch": 16}, 200)]),
    "train_infer": ("2 training jobs + 1 inference job (Poisson requests, 200/s, batches of 8)",
                    [(_CNN, {"lr": 1e-3}, 200), (_MLP, {"lr": 1e-3, "width": 256, "batch": 128}, 600),
                     (_INFER, {"model": "mlp", "rate": 200.0, "batch": 8}, 250)]),
    "smoke": ("2 tiny MLPs (smoke test)", [(_MLP, {"lr": [1e-3, 3e-3], "width": 32, "batch": 16}, 10)]),
}
WORKLOADS = ("sweep8", "zoo", "train_infer")
PLAIN_MODES = ("exclusive", "threads", "processes")
DEFAULT_MODES = PLAIN_MODES + ("xshare:pack", "xshare:fifo", "xshare:srtf", "xshare:fair")
BASELINE = "exclusive"
# figure -> (label, better); latency comes from the inference job's own metrics
FIGURES = {"makespan_s": ("makespan s", "lower"), "avg_jct_s": ("avg JCT s", "lower"),
           "steps_per_s": ("steps/s", "higher"), "peak_rss_mib": ("peak RSS MiB", "lower"),
           "latency_p50_ms": ("latency p50 ms", "lower"), "latency_p99_ms": ("latency p99 ms", "lower")}


def mode_spec(mode: str) -> tuple[str, dict[str, Any]]:
    """``"xshare:pack:lanes=2"`` -> ``("xshare", {"policy": "pack", "max_lanes": 2})``."""
    from xshare.sched import POLICIES

    if mode in PLAIN_MODES:
        return mode, {}
    parts = mode.split(":")
    valid = f"choose from {', '.join(PLAIN_MODES)}, or xshare:<policy>[:lanes=N] with policy one of {', '.join(POLICIES)}"
    if len(parts) < 2 or parts[0] != "xshare" or parts[1] not in POLICIES:
        raise ValueError(f"unknown mode {mode!r}; {valid}")
    kwargs: dict[str, Any] = {"policy": parts[1]}
    for opt in parts[2:]:
        key, _, value = opt.partition("=")
        if key != "lanes" or not value.isdigit() or int(value) < 1:
            raise ValueError(f"mode {mode!r}: unknown option {opt!r} (the one option is lanes=N, N >= 1); {valid}")
        kwargs["max_lanes"] = int(value)
    return "xshare", kwargs


def parse_modes(text: str | Sequence[str]) -> tuple[str, ...]:
    """``"exclusive, xshare"`` -> ``("exclusive", "xshare:pack")``, each checked, no repeats."""
    items = [m.strip() for m in (text.split(",") if isinstance(text, str) else text) if m.strip()]
    if not items:
        raise ValueError("no modes given; choose from " + ", ".join(DEFAULT_MODES))
    out: list[str] = []
    for m in ("xshare:pack" if m == "xshare" else m for m in items):
        mode_spec(m)
        out += [m] if m not in out else []
    return tuple(out)


def workload(name: str, steps: int | None = None) -> tuple[str, list[JobRequest]]:
    """A built-in workload, or a TOML launch spec's jobs (its [runtime] is ignored): its
    description and jobs, named as ``xshare launch`` names them; ``steps`` overrides each job's."""
    from xshare._errors import SpecError
    from xshare import jobs as specs

    if name in BUILTIN:
        description, tables = BUILTIN[name]
        plans = [p for entry, params, n in tables for p in H.expand(entry, params, steps or n)]
        width = len(str(len(plans)))  # one numbering across tables, as in a launch spec
        # (expand names every job: "{num}_{label}"; renumber the labels across the tables)
        return description, [dataclasses.replace(p, name=f"{i:0{width}d}_{str(p.name).partition('_')[2]}")
                             for i, p in enumerate(plans)]
    if name.endswith(".toml") or Path(name).is_file():
        plan = specs.plan_file(name, specs.Overrides(steps=steps))
        if any(j.steps is None for j in plan.jobs):
            raise SpecError(f"{name}: every job needs a number of steps for a benchmark (set steps, or --steps)")
        return f"jobs of {name}", list(plan.jobs)
    raise SpecError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}, 'all', "
                    "or give the path of a TOML launch spec")


def measure(mode: str, plans: Sequence[JobRequest], env: Mapping[str, str] | None = None) -> H.Run:
    kind, kwargs = mode_spec(mode)
    if kind == "processes":
        return H.processes(plans, env=env)
    return H.in_child({"exclusive": "plain_loop", "threads": "threads", "xshare": "runtime"}[kind], plans,
                      env=env, **kwargs)


def figures(run: H.Run) -> dict[str, float | None]:
    latency = {k: max((j.metrics or {}).get(k, -1.0) for j in run.jobs) for k in ("latency_p50_ms", "latency_p99_ms")}
    return {"makespan_s": run.makespan_s, "avg_jct_s": run.avg_jct_s, "steps_per_s": run.steps_per_s,
            "peak_rss_mib": None if run.peak_rss_bytes is None else run.peak_rss_bytes / 2**20,
            **{k: (v if v >= 0 else None) for k, v in latency.items()}}


@dataclass
class BenchConfig:
    workloads: Sequence[str] = WORKLOADS
    modes: Sequence[str] = DEFAULT_MODES
    repeats: int = 3
    steps: int | None = None
    out: Path = Path("benchmarks/results")
    stem: str = "results"
    overhead_pairs: int = 7              # 0: skip the single-job overhead
    xla_flags: str | None = None
    smoke: bool = False
    command: str = ""
    log: Callable[[str], None] = field(default=print, repr=False)


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Measure every mode of every workload; write ``{stem}.json``, ``.md`` and ``.png``."""
    import os

    env = {"XLA_FLAGS": " ".join(filter(None, [os.environ.get("XLA_FLAGS"), cfg.xla_flags]))} if cfg.xla_flags else None
    results: dict[str, Any] = {"schema": "xshare.bench/v1", "command": cfg.command, "smoke": cfg.smoke,
                               "machine": H.machine(device=False), "workloads": {},
                               "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds")}
    for name in cfg.workloads:
        description, plans = workload(name, cfg.steps)
        cfg.log(f"{name}: {description} ({len(plans)} jobs)")
        runs = H.alternate({m: functools.partial(_safe, m, plans, env) for m in cfg.modes}, cfg.repeats, log=cfg.log)
        results["workloads"][name] = {"description": description, "jobs": [p.to_json() for p in plans],
                                      "modes": summarize(runs)}
    if cfg.overhead_pairs:
        description, plans = workload("smoke" if cfg.smoke else "sweep8", cfg.steps)
        one = plans[len(plans) // 2:][:1]
        cfg.log(f"single-job overhead: {one[0].name}, {cfg.overhead_pairs} pairs")
        pairs = H.alternate({"plain": lambda: H.in_child("plain_loop", one, env=env),
                             "xshare": lambda: H.in_child("runtime", one, env=env, policy="pack")},
                            cfg.overhead_pairs, log=cfg.log)
        ratios = H.paired_ratios([r.makespan_s for r in pairs["xshare"]], [r.makespan_s for r in pairs["plain"]])
        results["overhead"] = {"job": one[0].to_json(), "plain_s": [r.makespan_s for r in pairs["plain"]],
                               "xshare_s": [r.makespan_s for r in pairs["xshare"]],
                               "overhead_percent": 100 * (H.median(ratios) - 1)}
    results["machine"]["load_avg_end"] = H._load()
    write(results, Path(cfg.out), cfg.stem)
    return results


def _safe(mode: str, plans: Sequence[JobRequest], env: Mapping[str, str] | None) -> H.Run | str:
    try:
        return measure(mode, plans, env)
    except RuntimeError as err:  # a failed run is reported, the others still run
        return f"{mode}: {err}"


def summarize(runs: Mapping[str, list[H.Run | str]]) -> dict[str, Any]:
    """Per mode: the runs, median figures, and paired ratios to ``exclusive``."""
    figs = {m: [figures(r) if isinstance(r, H.Run) and r.ok else None for r in rs] for m, rs in runs.items()}
    base = figs.get(BASELINE, [])
    out: dict[str, dict[str, Any]] = {}
    for mode, rs in runs.items():
        ok = [f for f in figs[mode] if f is not None]
        med = {k: _known(H.median(f[k] for f in ok)) for k in FIGURES}
        rat = {k: _known(H.median(H.ratio(a[k], b[k]) for a, b in zip(figs[mode], base) if a and b and a[k] and b[k]))
               for k in FIGURES}
        out[mode] = {"median": med, "ratio_to_exclusive": rat, "ok_runs": len(ok), "runs_total": len(rs),
                     "errors": [r for r in rs if isinstance(r, str)] + [
                         f"{j.name}: {j.status} {j.error or ''}" for r in rs if isinstance(r, H.Run) for j in r.jobs
                         if j.status != "done"],
                     "runs": [r.to_json() if isinstance(r, H.Run) else {"error": r} for r in rs]}
        for r in out[mode]["runs"]:
            r.get("extra", {}).pop("timeline", None)  # per-step records: too long for the report
    return out


def _known(x: float) -> float | None:
    return None if math.isnan(x) else x


def table(wl: Mapping[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """The workload's table: one row per mode, median figures with ratios to exclusive."""
    keys = [k for k in FIGURES if any(m["median"].get(k) is not None for m in wl["modes"].values())]
    columns = ["mode"] + [c for k in keys for c in (FIGURES[k][0], "x excl")] + ["ok runs"]
    rows = [[f"`{mode}`"] + [c for k in keys for c in (m["median"][k], m["ratio_to_exclusive"].get(k))]
            + [f"{m['ok_runs']}/{m['runs_total']}"] for mode, m in wl["modes"].items()]
    return columns, rows


def markdown(results: Mapping[str, Any]) -> str:
    m = results["machine"]
    out = [f"# xshare bench{' (SMOKE: tiny config, numbers meaningless)' if results['smoke'] else ''}", "",
           "```", results["command"], "```", "", f"Machine: {H.machine_line(m)}", "", f"Date: {results['date']}", ""]
    for name, wl in results["workloads"].items():
        columns, rows = table(wl)
        out += [f"## {name}: {wl['description']}", "", H.markdown_table(columns, rows), ""]
        out += [f"- {e}" for mode in wl["modes"].values() for e in mode["errors"]]
    ov = results.get("overhead")
    if ov:
        out += ["## Single-job overhead", "",
                f"`{ov['job']['name']}` alone: xshare:pack vs the plain loop, {len(ov['plain_s'])} alternating "
                f"pairs, median of paired ratios: **{ov['overhead_percent']:+.1f}%** (plain "
                f"{H.fmt(H.median(ov['plain_s']))} s, xshare {H.fmt(H.median(ov['xshare_s']))} s).", ""]
    out += ["Makespan and JCT exclude compilation in every mode (each mode's clock starts when its jobs "
            "start stepping, after a start barrier); each job ends with its state on the host. Ratios to "
            "exclusive are per repeat (modes alternate), then the median.", ""]
    return "\n".join(out)


def write(results: Mapping[str, Any], out: Path, stem: str) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md", "png": out / f"{stem}.png"}
    paths["json"].write_text(json.dumps(H._jsonable(results), indent=1) + "\n")
    paths["md"].write_text(markdown(results))
    plot(results, paths["png"])
    return paths


def plot(results: Mapping[str, Any], path: Path) -> None:
    """Throughput and peak memory per mode, relative to exclusive, one panel pair per workload."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("the plot needs matplotlib: pip install 'xshare[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wls = results["workloads"]
    fig, axes = plt.subplots(len(wls), 2, figsize=(10, 2.6 * len(wls)), squeeze=False)
    for row, (name, wl) in zip(axes, wls.items()):
        modes = list(wl["modes"])
        for ax, key in zip(row, ("steps_per_s", "peak_rss_mib")):
            values = [wl["modes"][m]["ratio_to_exclusive"].get(key) or math.nan for m in modes]
            ax.barh(modes, values, color=["tab:gray" if not m.startswith("xshare") else "tab:blue" for m in modes])
            ax.axvline(1.0, color="black", lw=0.8)
            ax.set_title(f"{name}: {FIGURES[key][0]} (x exclusive)", fontsize=9)
            ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
