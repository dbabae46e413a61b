"""What every benchmark shares: the machine line, statistics, and the result writers.

Each benchmark script prints one summary table and writes ``<name>.json`` (every figure, the
machine, the command) and ``<name>.md`` (the table, the exact command, the machine line, the
date, and notes on what the numbers mean) into ``--out`` (default ``benchmarks/results``).

Absolute times on a shared machine drift, so scripts run their configurations side by side in
one process, alternating, and report medians and ratios (STYLE.md, "Benchmarks").
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- arguments


def parser(name: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=description)
    p.add_argument("--smoke", action="store_true",
                   help="a tiny configuration (seconds): checks the script end to end, not the numbers")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"directory for {name}.json and {name}.md (default: benchmarks/results)")
    return p


def command_line() -> str:
    """The command that reproduces this run, as typed from the repository root."""
    mod = sys.modules["__main__"].__spec__
    head = ["python", "-m", mod.name] if mod is not None else ["python", sys.argv[0]]
    return shlex.join(head + sys.argv[1:])


# --------------------------------------------------------------------------- machine


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _git() -> str | None:
    """The commit the tree is based on, with ``+dirty`` when it has local changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=5)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=5)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def machine() -> dict[str, Any]:
    """Where the numbers come from. Imports jax (call after any env var the script sets)."""
    import jax
    import jaxlib

    dev = jax.devices()[0]
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": affinity,
        "load_avg_start": _load(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backend": jax.default_backend(),
        "device": f"{dev.platform}:{getattr(dev, 'device_kind', '?')}",
        "git": _git(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
    }


def finish_machine(m: dict[str, Any]) -> dict[str, Any]:
    m["load_avg_end"] = _load()
    return m


def machine_line(m: dict[str, Any]) -> str:
    cores = f"{m['cores']} cores" + (f" ({m['cores_usable']} usable)" if m.get("cores_usable")
                                      and m["cores_usable"] != m["cores"] else "")
    load = m.get("load_avg_start")
    load_s = f"load {load[0]:.2f}" if load else "load n/a"
    if m.get("load_avg_end"):
        load_s += f" -> {m['load_avg_end'][0]:.2f}"
    return (f"{m['cpu']}, {cores}, {load_s} (1-min avg); python {m['python']}, jax {m['jax']} "
            f"(jaxlib {m['jaxlib']}), backend {m['backend']} ({m['device']}); git {m['git'] or 'n/a'}")


# --------------------------------------------------------------------------- statistics


def median(xs: Iterable[float]) -> float:
    a = np.asarray(list(xs), dtype=float)
    return float(np.median(a)) if a.size else math.nan


def percentile(xs: Iterable[float], q: float) -> float:
    a = np.asarray(list(xs), dtype=float)
    return float(np.percentile(a, q)) if a.size else math.nan


def summary(xs: Iterable[float]) -> dict[str, float]:
    a = np.asarray(list(xs), dtype=float)
    if not a.size:
        return {"n": 0, "median": math.nan, "p10": math.nan, "p90": math.nan, "p99": math.nan,
                "mean": math.nan, "min": math.nan, "max": math.nan}
    return {"n": int(a.size), "median": float(np.median(a)), "p10": float(np.percentile(a, 10)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)),
            "mean": float(a.mean()), "min": float(a.min()), "max": float(a.max())}


def ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) and not math.isnan(a) else math.nan


def fmt(x: Any, digits: int = 3) -> str:
    """A table cell: floats to ``digits`` significant figures, NaN/None as ``n/a``."""
    if x is None:
        return "n/a"
    if isinstance(x, float):
        if math.isnan(x):
            return "n/a"
        if x == 0:
            return "0"
        mag = math.floor(math.log10(abs(x)))
        decimals = max(digits - 1 - mag, 0)
        return f"{x:.{decimals}f}"
    return str(x)


# --------------------------------------------------------------------------- tables and files


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(columns)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    out = [line(list(columns)), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    return "\n".join(out)


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        x = float(x)
        return None if math.isnan(x) or math.isinf(x) else x
    if isinstance(x, Path):
        return str(x)
    return x


def write_results(name: str, out_dir: Path, *, title: str, columns: Sequence[str],
                  rows: Sequence[Sequence[Any]], machine_info: dict[str, Any], config: dict[str, Any],
                  data: dict[str, Any], notes: str = "", smoke: bool = False) -> tuple[Path, Path]:
    """Print the summary table and write ``<name>.json`` and ``<name>.md`` into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = command_line()
    table = markdown_table(columns, rows)
    mline = machine_line(machine_info)
    print(f"\n{title}{' (SMOKE: tiny config, numbers meaningless)' if smoke else ''}\n")
    print(table)
    print(f"\nmachine: {mline}")
    doc = {
        "schema": "xshare.bench/v1",
        "benchmark": name,
        "smoke": smoke,
        "command": cmd,
        "date": machine_info.get("date"),
        "machine": machine_info,
        "machine_line": mline,
        "config": config,
        "table": {"columns": list(columns), "rows": [list(r) for r in rows]},
        "data": data,
    }
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    json_path.write_text(json.dumps(_jsonable(doc), indent=2, sort_keys=False) + "\n")
    md = [f"# {title}", ""]
    if smoke:
        md += ["**Smoke run: a tiny configuration; the numbers mean nothing.**", ""]
    md += [table, "", "```", cmd, "```", "", f"Machine: {mline}", "", f"Date: {machine_info.get('date')}", ""]
    if notes:
        md += [notes.strip(), ""]
    md_path.write_text("\n".join(md))
    return json_path, md_path


def sleep_until_ns(t_ns: int) -> None:
    """Sleep until the monotonic clock reads ``t_ns`` (no spinning: the cores are the
    benchmark's; a sleep overshoots by well under a millisecond, far below a job's length)."""
    import time

    left = t_ns - time.monotonic_ns()
    if left > 0:
        time.sleep(left / 1e9)
