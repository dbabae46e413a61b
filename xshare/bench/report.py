"""From raw runs to figures: medians over repeats, ratios to ``exclusive``, targets, and the
renderings (a rich table, a markdown report). Pure functions of the results dict.

Ratios are *paired*: repeat ``r`` of a mode is divided by repeat ``r`` of ``exclusive`` (the
two ran next to each other, modes alternating), and the median of those ratios is reported.
That cancels most of the drift of a shared machine, which medians of absolute times do not.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Iterable, Mapping, Sequence

from .._units import format_bytes

SCHEMA = "xshare.bench/v1"
BASELINE = "exclusive"
TARGET_MODE = "xshare:pack"   # the runtime's default policy answers the targets

# figure -> (label, unit, which way is better)
FIGURES: dict[str, tuple[str, str, str]] = {
    "makespan_s": ("makespan", "s", "lower"),
    "avg_jct_s": ("avg JCT", "s", "lower"),
    "steps_per_s": ("aggregate steps/s", "1/s", "higher"),
    "peak_rss_bytes": ("peak RSS", "bytes", "lower"),
    "peak_pss_bytes": ("peak PSS", "bytes", "lower"),
    "device_peak_bytes": ("device peak", "bytes", "lower"),
    "achieved_flops_per_s": ("achieved FLOP/s", "1/s", "higher"),
    "utilization": ("utilization", "fraction", "higher"),
    "latency_p50_ms": ("latency p50", "ms", "lower"),
    "latency_p99_ms": ("latency p99", "ms", "lower"),
    "cores_used": ("CPU used", "cores", "neutral"),
    "other_load_cores": ("others' load", "cores", "neutral"),
    "compile_s": ("compile", "s", "lower"),
    "wall_s": ("wall incl. start-up", "s", "lower"),
}

TARGETS = {
    "throughput_vs_exclusive": 1.3,   # xshare steps/s >= 1.3 x exclusive (sweep8)
    "throughput_vs_processes": 1.0,   # xshare steps/s >= processes
    "memory_vs_processes": 1.0,       # xshare peak memory < processes
    "overhead_percent": 3.0,          # one job under xshare vs the plain loop
}


def _median(xs: Iterable[float | None]) -> float | None:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return statistics.median(xs) if xs else None


def job_flops(runs_by_mode: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, float | None]:
    """FLOPs per step of each job, one figure for every mode (the same job does the same useful
    work wherever it runs): from the plain loop's compile when there is one, else the runtime's."""
    out: dict[str, float | None] = {}
    order = sorted(runs_by_mode, key=lambda m: (m != BASELINE, m != "processes", m))
    for mode in order:
        for run in runs_by_mode[mode]:
            for job in run.get("jobs", []):
                if out.get(job["name"]) is None and job.get("flops_per_step"):
                    out[job["name"]] = float(job["flops_per_step"])
    return out


def figures(run: Mapping[str, Any], flops: Mapping[str, float | None], peak_flops: float | None) -> dict[str, Any]:
    """The figures of one run of one mode."""
    jobs = run["jobs"]
    makespan = run["makespan_s"]
    cpu = run.get("cpu")
    steps = sum(j["steps"] or 0 for j in jobs)
    jcts = [j["jct_s"] for j in jobs if j.get("jct_s") is not None]
    work = [(j["steps"] or 0) * flops.get(j["name"]) for j in jobs if flops.get(j["name"])]
    achieved = sum(work) / makespan if work and len(work) == len(jobs) and makespan > 0 else None
    lat50 = [j["latency_p50_ms"] for j in jobs if j.get("latency_p50_ms") is not None]
    lat99 = [j["latency_p99_ms"] for j in jobs if j.get("latency_p99_ms") is not None]
    return {
        "makespan_s": makespan,
        "avg_jct_s": sum(jcts) / len(jcts) if jcts else None,
        "steps": steps,
        "steps_per_s": steps / makespan if makespan > 0 else None,
        "peak_rss_bytes": run.get("peak_rss_bytes"),
        "peak_pss_bytes": run.get("peak_pss_bytes"),
        "device_peak_bytes": run.get("device_peak_bytes"),
        "achieved_flops_per_s": achieved,
        "utilization": achieved / peak_flops if achieved is not None and peak_flops else None,
        "latency_p50_ms": max(lat50) if lat50 else None,
        "latency_p99_ms": max(lat99) if lat99 else None,
        "cores_used": cpu["process_cpu_s"] / makespan if cpu and makespan > 0 else None,
        "other_load_cores": (max(cpu["machine_busy_s"] - cpu["process_cpu_s"], 0.0) / cpu["wall_s"]
                             if cpu and cpu["wall_s"] > 0 else None),
        "compile_s": run.get("compile_s"),
        "wall_s": run.get("wall_s"),
    }


def summarize_workload(workload: Mapping[str, Any], runs_by_mode: Mapping[str, Sequence[Mapping[str, Any]]],
                       peak_flops: float | None) -> dict[str, Any]:
    """Per mode: each run's figures, their medians, and the paired ratios to ``exclusive``."""
    flops = job_flops(runs_by_mode)
    expected = workload["total_steps"]
    modes: dict[str, Any] = {}
    base_by_repeat = {}
    for run in runs_by_mode.get(BASELINE, []):
        if run.get("ok"):
            base_by_repeat[run["repeat"]] = figures(run, flops, peak_flops)
    for mode, runs in runs_by_mode.items():
        per_run, ratios = [], {k: [] for k in FIGURES}
        for run in runs:
            if not run.get("ok"):
                per_run.append({"repeat": run["repeat"], "ok": False, "error": run.get("error")})
                continue
            fig = figures(run, flops, peak_flops)
            complete = fig["steps"] == expected and all(j["status"] == "done" for j in run["jobs"])
            per_run.append({"repeat": run["repeat"], "ok": True, "complete": complete, **fig})
            base = base_by_repeat.get(run["repeat"])
            if base is not None:
                for k in FIGURES:
                    if fig.get(k) is not None and base.get(k):
                        ratios[k].append(fig[k] / base[k])
        ok = [r for r in per_run if r["ok"]]
        median = {k: _median(r.get(k) for r in ok) for k in FIGURES}
        extra = _profile_median([run for run in runs if run.get("ok")])
        modes[mode] = {
            "ok_runs": len(ok), "runs_total": len(runs),
            "complete": bool(ok) and all(r["complete"] for r in ok),
            "median": median,
            "ratio_to_exclusive": {k: _median(v) for k, v in ratios.items()} if base_by_repeat else None,
            "runs": per_run,
            "jobs": _jobs_median(runs),
            **extra,
        }
    return {**workload, "flops_per_step": flops, "modes": modes}


def _jobs_median(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each job's median JCT, run time and step time across the mode's repeats."""
    names: list[str] = []
    by: dict[str, list[Mapping[str, Any]]] = {}
    for run in runs:
        if not run.get("ok"):
            continue
        for j in run["jobs"]:
            if j["name"] not in by:
                names.append(j["name"])
            by.setdefault(j["name"], []).append(j)
    out = []
    for n in names:
        rows = by[n]
        out.append({"name": n, "jct_s": _median(r.get("jct_s") for r in rows),
                    "run_s": _median(r.get("run_s") for r in rows),
                    "mean_step_s": _median((r["run_s"] / r["steps"]) if r.get("run_s") and r.get("steps") else None
                                           for r in rows),
                    "step_time_p50_s": _median(r.get("step_time_p50_s") for r in rows),
                    "latency_p50_ms": _median(r.get("latency_p50_ms") for r in rows),
                    "latency_p99_ms": _median(r.get("latency_p99_ms") for r in rows)})
    return out


def _profile_median(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """For xshare modes: the runtime's timeline, summarised (medians over repeats)."""
    profs = [r["profile"] for r in runs if r.get("profile")]
    if not profs:
        return {}
    lanes = _median(len(p["lanes"]) for p in profs)
    gaps = [g["gap_us_p50"] for p in profs for g in p["lanes"].values() if g.get("gap_us_p50") is not None]
    busy = [g["busy_fraction"] for p in profs for g in p["lanes"].values()]
    return {"profile": {
        "lanes": lanes,
        "device_busy_fraction": _median(p["device_busy_fraction"] for p in profs),
        "mean_concurrency": _median(p["mean_concurrency"] for p in profs),
        "lane_busy_fraction_median": _median(busy),
        "lane_gap_us_p50_median": _median(gaps),
        "fences": runs[0].get("fences"),
    }}


def overhead_summary(raw: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not raw or not raw.get("plain_s"):
        return raw
    plain, xs = statistics.median(raw["plain_s"]), statistics.median(raw["xshare_s"])
    pairs = [x / p - 1 for p, x in zip(raw["plain_s"], raw["xshare_s"])]
    # The headline is the median of the paired ratios: the two runs of a pair ran back to back,
    # under the same load from the rest of the machine (the ratio of the medians is kept too).
    pct = 100 * statistics.median(pairs)
    profs = raw.get("xshare_profiles") or []
    prof = {k: _median(p.get(k) for p in profs) for k in ("device_busy_fraction", "gap_us_p50", "step_time_p50_s")}
    steps = raw["job"]["steps"] or 1
    return {**raw, "plain_median_s": plain, "xshare_median_s": xs, "overhead_percent": pct,
            "ratio_of_medians_percent": 100 * (xs / plain - 1), "xshare_profile": prof,
            "plain_step_us": 1e6 * plain / steps, "added_us_per_step": 1e6 * (xs - plain) / steps,
            "paired_overhead_percent": [100 * v for v in pairs],
            "target_percent": TARGETS["overhead_percent"], "met": pct < TARGETS["overhead_percent"]}


def targets(results: Mapping[str, Any]) -> dict[str, Any]:
    """Whether sweep8 (or the first workload) meets the issue's targets, with the figures."""
    out: dict[str, Any] = {}
    wl = results["workloads"].get("sweep8") or next(iter(results["workloads"].values()), None)
    if wl is not None:
        modes = wl["modes"]
        x = modes.get(TARGET_MODE)
        out["workload"] = wl["name"]
        out["mode"] = TARGET_MODE
        if x and x["ok_runs"]:
            r = x.get("ratio_to_exclusive") or {}
            if r.get("steps_per_s") is not None:
                out["throughput_vs_exclusive"] = {"value": r["steps_per_s"], "target": ">= 1.3",
                                                  "met": r["steps_per_s"] >= TARGETS["throughput_vs_exclusive"]}
            p = modes.get("processes")
            if p and p["ok_runs"]:
                pr = _paired(x["runs"], p["runs"], "steps_per_s")
                out["throughput_vs_processes"] = {"value": pr, "target": ">= 1.0",
                                                  "met": pr is not None and pr >= TARGETS["throughput_vs_processes"]}
                for key in ("peak_rss_bytes", "peak_pss_bytes"):
                    mr = _paired(x["runs"], p["runs"], key)
                    out[f"memory_vs_processes_{key[5:8]}"] = {
                        "value": mr, "target": "< 1.0", "met": mr is not None and mr < TARGETS["memory_vs_processes"]}
    ov = results.get("overhead")
    if ov and "overhead_percent" in ov:
        out["single_job_overhead"] = {"value": ov["overhead_percent"], "target": "< 3 %", "met": ov["met"]}
    return out


def _paired(a_runs: Sequence[Mapping[str, Any]], b_runs: Sequence[Mapping[str, Any]], key: str) -> float | None:
    b = {r["repeat"]: r for r in b_runs if r.get("ok") and r.get(key)}
    return _median(r[key] / b[r["repeat"]][key] for r in a_runs
                   if r.get("ok") and r.get(key) is not None and r["repeat"] in b)


# ------------------------------------------------------------------------------ rendering


def fmt(key: str, value: Any) -> str:
    if value is None:
        return "N/A"
    unit = FIGURES.get(key, ("", "", ""))[1]
    if unit == "bytes":
        return format_bytes(int(value))
    if key == "utilization":
        return f"{100 * value:.1f}%"
    if key == "achieved_flops_per_s":
        return f"{value / 1e9:.2f} G"
    if unit == "cores":
        return f"{value:.2f}"
    if unit == "ms":
        return f"{value:.1f}"
    if key == "steps_per_s":
        return f"{value:.0f}" if value >= 100 else f"{value:.1f}"
    return f"{value:.2f}"


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def columns(wl: Mapping[str, Any]) -> list[str]:
    """The table's figures for a workload (latency only when a job reports it; device memory
    only where the backend has allocator statistics)."""
    cols = ["makespan_s", "avg_jct_s", "steps_per_s", "peak_rss_bytes", "peak_pss_bytes"]
    medians = [m["median"] for m in wl["modes"].values()]
    if any(m.get("device_peak_bytes") for m in medians):
        cols.append("device_peak_bytes")
    cols += ["utilization", "cores_used", "other_load_cores"]
    if any(m.get("latency_p50_ms") is not None for m in medians):
        cols += ["latency_p50_ms", "latency_p99_ms"]
    return cols


_RATIO_COLS = ("makespan_s", "avg_jct_s", "steps_per_s", "peak_rss_bytes")


_TERMINAL_SKIP = ("peak_pss_bytes", "other_load_cores")  # in the markdown and JSON, not on a terminal


def table_rows(wl: Mapping[str, Any], compact: bool = False) -> tuple[list[str], list[list[str]]]:
    cols = [c for c in columns(wl) if not (compact and c in _TERMINAL_SKIP)]
    header = ["mode"]
    for c in cols:
        label, unit, _ = FIGURES[c]
        header.append(f"{label} ({unit})" if unit in ("s", "ms", "cores") else label)
        if c in _RATIO_COLS:
            header.append("x excl")
    header.append("runs")
    rows = []
    for mode, m in wl["modes"].items():
        row = [mode]
        for c in cols:
            row.append(fmt(c, m["median"].get(c)))
            if c in _RATIO_COLS:
                row.append(fmt_ratio((m.get("ratio_to_exclusive") or {}).get(c)))
        row.append(f"{m['ok_runs']}/{m['runs_total']}" + ("" if m["complete"] or not m["ok_runs"] else " (incomplete)"))
        rows.append(row)
    return header, rows


def rich_tables(results: Mapping[str, Any]) -> list[Any]:
    from rich.table import Table
    from rich.text import Text

    out = []
    for wl in results["workloads"].values():
        header, rows = table_rows(wl, compact=True)
        t = Table(title=f"{wl['name']}: {len(wl['jobs'])} jobs, {wl['total_steps']} steps "
                        f"(medians of {results['config']['repeats']} repeats)", title_justify="left")
        for i, h in enumerate(header):
            t.add_column(h, justify="left" if i == 0 else "right", no_wrap=i == 0)
        for row in rows:
            t.add_row(*(Text(c) for c in row))
        out.append(t)
    return out


def markdown_table(wl: Mapping[str, Any]) -> str:
    header, rows = table_rows(wl)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(f"`{r[0]}`" if i == 0 else r[i] for i in range(len(r))) + " |" for r in rows]
    return "\n".join(lines)


def _profile_lines(wl: Mapping[str, Any]) -> list[str]:
    lines = []
    excl = {j["name"]: j for j in (wl["modes"].get(BASELINE) or {}).get("jobs", [])}
    for mode, m in wl["modes"].items():
        p = m.get("profile")
        if not p:
            continue
        gap = p.get("lane_gap_us_p50_median")
        lines.append(f"- `{mode}`: {p['lanes']:.0f} lanes; device busy (at least one step executing) "
                     f"{100 * p['device_busy_fraction']:.0f}% of the makespan; on average "
                     f"{p['mean_concurrency']:.2f} steps executing at once; median lane busy "
                     f"{100 * (p['lane_busy_fraction_median'] or 0):.0f}%; median gap between a lane's steps "
                     f"{'N/A' if gap is None else f'{gap:.0f} us'} (timeline from "
                     f"{'FFI fences' if p.get('fences') else 'host clocks'}).")
        slow = []
        for j in m.get("jobs", []):
            alone = excl.get(j["name"], {}).get("mean_step_s")
            shared = j.get("mean_step_s")
            if alone and shared:
                slow.append(shared / alone)
        if slow:
            lines.append(f"  A job's run (from when the runtime started it to its end) per step is "
                         f"{statistics.median(slow):.2f}x its time per step alone (median over jobs): it shares "
                         "the device, or waits for it, for its whole run.")
    return lines


def markdown(results: Mapping[str, Any]) -> str:
    """The report: ready to paste as a section of benchmarks/RESULTS.md."""
    m, cal, cfg = results["machine"], results.get("calibration") or {}, results["config"]
    out = ["## Sharing vs exclusive allocation (`xshare bench`)", "",
           f"Measured {results['date']} with:", "", "```", results["command"], "```", "",
           f"Machine: {m['cpu']}, {m['logical_cores']} logical cores ({m.get('physical_cores')} physical), "
           f"{format_bytes(m['ram_bytes'])} RAM, {m['os']}, Python {m['python']}, "
           f"jax {cal.get('jax_version', '?')} (jaxlib {cal.get('jaxlib_version', '?')}) on "
           f"{cal.get('platform', '?')} ({cal.get('device_kind', '?')}). "
           f"Load average (1/5/15 min) at start {_load(m.get('loadavg_start'))}, at end {_load(m.get('loadavg_end'))}"
           " (a shared machine: other work ran alongside). "
           f"Code: {m.get('git') or 'unknown revision'}. "
           + (f"Every measured process ran with `XLA_FLAGS` += `{cfg['xla_flags']}` (all modes alike)."
              if cfg.get("xla_flags") else "XLA flags: defaults."), "",
           f"Device peak: {fmt('achieved_flops_per_s', cal.get('peak_flops_per_s'))}FLOP/s "
           f"({cal.get('method', 'not measured')}; the better of the measurements at the start and end of the run). "
           "Utilization = achieved FLOP/s (steps x FLOPs per step from XLA's `cost_analysis()`) / that peak.", "",
           f"Repeats: {cfg['repeats']}, modes alternating round-robin (the first mode rotates every repeat); "
           "figures are medians, `x excl` the median of per-repeat ratios to `exclusive` "
           "(for makespan, JCT and memory lower is better; for steps/s higher is better).", ""]
    out += METHOD
    for wl in results["workloads"].values():
        out += ["", f"### `{wl['name']}`: {wl['description']}", ""]
        out += [f"Jobs ({len(wl['jobs'])}, {wl['total_steps']} steps in all): "
                + ", ".join(f"`{j['name']}` ({j['steps']} steps)" for j in wl["jobs"]) + "."]
        for note in wl.get("notes", []):
            out.append(f"Note: {note}.")
        out += ["", markdown_table(wl), ""]
        failed = [(mode, r) for mode, md in wl["modes"].items() for r in md["runs"] if not r["ok"]]
        for mode, r in failed:
            out.append(f"- `{mode}` repeat {r['repeat']} failed: {str(r.get('error', '')).splitlines()[0]}")
        prof = _profile_lines(wl)
        if prof:
            out += ["Where the time goes (the runtime's timeline):", ""] + prof + [""]
    ov = results.get("overhead")
    if ov and "overhead_percent" in ov:
        job = ov["job"]
        out += ["", "### Single-job overhead", "",
                f"One job (`{job['entry']}` {job['params']}, {job['steps']} steps) alone under `xshare:pack` "
                f"vs the same step in the plain loop, same process, alternating ({len(ov['plain_s'])} pairs, "
                f"order flipped every pair): plain {ov['plain_median_s']:.3f} s, xshare {ov['xshare_median_s']:.3f} s "
                f"(medians). Overhead, the median of the per-pair ratios: **{ov['overhead_percent']:+.1f}%** "
                f"(per pair: {', '.join(f'{v:+.1f}%' for v in ov['paired_overhead_percent'])}; ratio of the "
                f"medians: {ov['ratio_of_medians_percent']:+.1f}%). In absolute terms the runtime adds "
                f"{ov['added_us_per_step']:+.0f} us to a step of {ov['plain_step_us']:.0f} us (plain loop), "
                "so the overhead in percent shrinks as steps grow."]
        prof = ov.get("xshare_profile") or {}
        if prof.get("device_busy_fraction") is not None:
            out.append(f"Under xshare the job's steps executed {100 * prof['device_busy_fraction']:.1f}% of its "
                       f"run time (fence timeline), with a median gap of {prof['gap_us_p50'] or 0:.0f} us between "
                       f"one step's end and the next one's begin; median step (device) time "
                       f"{1e6 * (prof['step_time_p50_s'] or 0):.0f} us.")
        out.append("")
    tg = results.get("targets") or {}
    if tg:
        out += ["### Targets", "", "| target | value | met |", "|---|---:|:---:|"]
        names = {"throughput_vs_exclusive": f"{tg.get('workload')}: `{tg.get('mode')}` steps/s vs `exclusive`",
                 "throughput_vs_processes": f"{tg.get('workload')}: `{tg.get('mode')}` steps/s vs `processes`",
                 "memory_vs_processes_rss": f"{tg.get('workload')}: `{tg.get('mode')}` peak RSS vs `processes`",
                 "memory_vs_processes_pss": f"{tg.get('workload')}: `{tg.get('mode')}` peak PSS vs `processes`",
                 "single_job_overhead": "single-job overhead"}
        for key, label in names.items():
            t = tg.get(key)
            if not t:
                continue
            value = "N/A" if t["value"] is None else (f"{t['value']:+.1f}%" if key == "single_job_overhead"
                                                      else f"{t['value']:.2f}x")
            out.append(f"| {label} (target {t['target']}) | {value} | {'yes' if t['met'] else '**no**'} |")
        out.append("")
    reading = [line for para in results.get("analysis") or [] for line in (para, "")] + explain(results)
    if reading:
        out += ["### Reading the numbers", ""] + reading + [""]
    return "\n".join(out) + "\n"


def _load(load: Sequence[float] | None) -> str:
    return "N/A" if not load else " / ".join(f"{x:.2f}" for x in load)


METHOD = [
    "How each mode runs (same jobs, same data, same number of steps; every job is compiled "
    "before the clock starts in every mode, and compile time is reported apart, not counted):", "",
    "- `exclusive`: one job at a time, alone with the device, its step `jax.jit`-ed (state donated) "
    "in a plain Python loop (batch k made while step k-1 runs; metrics read one step behind); "
    "one fresh process. Job i completes after jobs 0..i: the JCTs of a FIFO queue.",
    "- `threads`: one fresh process, every job's plain loop in its own thread, all started together: "
    "sharing by hand, without a runtime. It shows how much this machine gives to concurrent steps at all, "
    "the ceiling for any sharing runtime.",
    "- `processes`: one fresh Python process per job, all started at once, each running that plain "
    "loop; each compiles, then all start together at a barrier. On GPU they run with "
    "`XLA_PYTHON_CLIENT_PREALLOCATE=false` (otherwise the second process cannot start).",
    "- `xshare:<policy>`: one fresh process, one `xshare.Runtime(policy=...)`, all jobs given to "
    "`submit_many` together; the clock starts when the first job starts (after all compiled).",
    "- Makespan: first step starts -> last job's final state is on the host. Steps/s: all jobs' steps / "
    "makespan. Peak memory: the peak of the summed RSS (and PSS, shared pages split) of the measured "
    "process tree, sampled by psutil (RSS every 10 ms, PSS every 0.5 s), over its whole life "
    "(imports and compiles included). GPU: the allocator's `peak_bytes_in_use`, summed over processes.",
    "- No burn-in in the modes: each measured process starts cold, as a job does, so the one-time "
    "cost of a process's first execution (tens of milliseconds) is in every mode, once per process "
    "(eight times, in parallel, for `processes`). The single-job overhead measurement does burn in.",
    "- CPU cores used: CPU seconds of the measured processes (all threads, XLA's included) during the "
    "run / makespan. Others' load: CPU time of everything else on the machine over the same window, in "
    "cores (other tenants of a shared machine; it varies run to run and is why modes alternate).",
]


def explain(results: Mapping[str, Any]) -> list[str]:
    """Sentences read off the figures (so that a re-run's report stays true to its numbers)."""
    out: list[str] = []
    for wl in results["workloads"].values():
        modes = wl["modes"]
        ex, xp, pr = modes.get(BASELINE), modes.get(TARGET_MODE), modes.get("processes")
        if not (ex and xp and ex["ok_runs"] and xp["ok_runs"]):
            continue
        e, x = ex["median"], xp["median"]
        r = (xp.get("ratio_to_exclusive") or {}).get("steps_per_s")
        prof = xp.get("profile") or {}
        line = (f"- `{wl['name']}`: `{TARGET_MODE}` completes {r:.2f}x the steps per second of `exclusive`. "
                if r is not None else f"- `{wl['name']}`: ")
        if e.get("cores_used") is not None and x.get("cores_used") is not None:
            line += (f"One job at a time kept {e['cores_used']:.2f} of the {results['machine']['logical_cores']} "
                     f"cores busy on average; `{TARGET_MODE}` kept {x['cores_used']:.2f} busy")
            if prof.get("mean_concurrency") is not None:
                line += (f", with {prof['mean_concurrency']:.2f} steps executing at once on average over "
                         f"{prof['lanes']:.0f} lanes and the device busy {100 * prof['device_busy_fraction']:.0f}% "
                         "of the makespan")
            line += ". "
        if e.get("utilization") is not None and x.get("utilization") is not None:
            line += (f"Utilization (achieved FLOP/s over the measured matmul peak): {100 * e['utilization']:.1f}% "
                     f"alone, {100 * x['utilization']:.1f}% shared.")
        out.append(line)
        th = modes.get("threads")
        if th and th["ok_runs"] and (th.get("ratio_to_exclusive") or {}).get("steps_per_s") is not None:
            rt = th["ratio_to_exclusive"]["steps_per_s"]
            rx = _paired(xp["runs"], th["runs"], "steps_per_s")
            out.append(f"  `threads` (the same plain loops run concurrently in one process, no runtime) completes "
                       f"{rt:.2f}x the steps per second of `exclusive`: that is what running these steps "
                       f"concurrently buys on this machine at all, the ceiling for sharing"
                       + (f"; `{TARGET_MODE}` reaches {rx:.2f}x of it." if rx is not None else "."))
        if pr and pr["ok_runs"]:
            p = pr["median"]
            n = len(wl["jobs"])
            per = p["peak_rss_bytes"] / n if p.get("peak_rss_bytes") else None
            line = f"  `processes` ({n} interpreters, each with its own jax runtime, XLA client and thread pools) "
            rp = _paired(xp["runs"], pr["runs"], "steps_per_s")
            if rp is not None:
                line += f"completes {1 / rp:.2f}x the steps per second of `{TARGET_MODE}`"
            if p.get("cores_used") is not None:
                line += f" while keeping {p['cores_used']:.2f} cores busy"
            if per is not None and x.get("peak_rss_bytes"):
                line += (f"; its peak RSS is {format_bytes(int(p['peak_rss_bytes']))} (about "
                         f"{format_bytes(int(per))} per process) against {format_bytes(int(x['peak_rss_bytes']))} "
                         f"for all {n} jobs in one xshare process")
            out.append(line + ".")
        loads = [run.get("other_load_cores") for m in modes.values() for run in m["runs"] if run.get("ok")]
        loads = [v for v in loads if v is not None]
        if loads:
            out.append(f"  Other tenants of the machine used {min(loads):.2f} to {max(loads):.2f} cores during "
                       "these runs (median " + f"{statistics.median(loads):.2f}): absolute times vary with it, "
                       "which is why the ratios are paired per repeat.")
    return out
