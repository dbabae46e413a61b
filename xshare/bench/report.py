"""Comparing and reporting for :mod:`xshare.bench.harness`: configurations in rotating order
(:func:`alternate`), medians and paired ratios, percentiles (:func:`summary`), timing a command
line (:func:`time_command`), markdown tables, the machine the numbers come from, and the
results files (:func:`write_results`). The benchmarks reach all of it as ``harness.<name>``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

from .loops import Run

T = TypeVar("T")


# ------------------------------------------------------------------------------------ comparing


def alternate(configs: Mapping[str, Callable[[], T]], repeats: int,
              log: Callable[[str], None] | None = print) -> dict[str, list[T]]:
    """Run every configuration ``repeats`` times, the order rotating by one each repeat (a, b, c;
    b, c, a; ...), so no configuration always runs first or right after the same neighbour."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be >= 1")
    names = list(configs)
    out: dict[str, list[T]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t = time.monotonic()
            out[name].append(configs[name]())
            if log is not None:
                log(f"  repeat {r + 1}/{repeats} {name}: {time.monotonic() - t:.1f} s")
    return out


def median(xs: Iterable[float | None]) -> float:
    known = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(known) if known else math.nan


def ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b and not math.isnan(a) and not math.isnan(b) else math.nan


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """``a[r] / b[r]`` per repeat: neighbours in time, so most of a shared machine's drift cancels."""
    return [ratio(x, y) for x, y in zip(a, b)]


def summary(xs: Iterable[float]) -> dict[str, float]:
    xs = sorted(float(x) for x in xs)
    if not xs:
        return {"n": 0, "median": math.nan, "p10": math.nan, "p90": math.nan, "p99": math.nan,
                "mean": math.nan, "min": math.nan, "max": math.nan}
    q = statistics.quantiles(xs, n=100, method="inclusive") if len(xs) > 1 else [xs[0]] * 99
    return {"n": len(xs), "median": statistics.median(xs), "p10": q[9], "p90": q[89], "p99": q[98],
            "mean": statistics.fmean(xs), "min": xs[0], "max": xs[-1]}


def time_command(argv: Sequence[str], repeats: int, *, env: Mapping[str, str] | None = None,
                 cwd: str | os.PathLike | None = None) -> dict[str, Any]:
    """Wall seconds from starting ``argv`` to its exit, ``repeats`` times (the first run is a
    burn-in for the OS's file cache, reported apart); raises if a run fails."""
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        proc = subprocess.run(list(argv), capture_output=True, text=True, cwd=cwd, env={**os.environ, **(env or {})})
        times.append(time.perf_counter() - t)
        if proc.returncode != 0:
            raise RuntimeError(f"{shlex.join(argv)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return {"burn_in_s": times[0], "times_s": times[1:], **summary(times[1:])}


# ------------------------------------------------------------------------------------ reporting


def fmt(x: Any, digits: int = 3) -> str:
    """A table cell: floats to ``digits`` significant figures, NaN/None as ``n/a``."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, float):
        if x == 0:
            return "0"
        return f"{x:.{max(digits - 1 - math.floor(math.log10(abs(x))), 0)}f}"
    return str(x)


def markdown_row(cells: Sequence[Any]) -> str:
    return "| " + " | ".join(fmt(c) for c in cells) + " |"


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(columns)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    return "\n".join([line(list(columns)), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *(line(r) for r in cells)])


def parser(name: str, description: str) -> argparse.ArgumentParser:
    """A benchmark script's command line: ``--smoke`` and ``--out`` (default benchmarks/results)."""
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=description)
    p.add_argument("--smoke", action="store_true",
                   help="a tiny configuration (seconds): checks the script end to end, not the numbers")
    p.add_argument("--out", type=Path, default=Path("benchmarks") / "results",
                   help=f"directory for {name}.json and {name}.md (default: benchmarks/results)")
    return p


def command_line() -> str:
    """The command that reproduces this run, as typed from the repository root."""
    mod = getattr(sys.modules["__main__"], "__spec__", None)
    head = ["python", "-m", mod.name] if mod is not None else ["python", sys.argv[0]]
    return shlex.join(head + sys.argv[1:])


def machine(device: bool = True) -> dict[str, Any]:
    """Where the numbers come from. ``device=True`` imports jax to name the backend: call it
    after any environment variable the script sets."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.lower().startswith("model name")), cpu)
    except OSError:
        pass
    info: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
                            "load_avg_start": _load(), "probe_ms_start": speed_probe_ms(), "git": _git(),
                            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")}
    if device:
        import jax
        import jaxlib

        dev = jax.devices()[0]
        info.update(jax=jax.__version__, jaxlib=jaxlib.__version__, backend=jax.default_backend(),
                    device=f"{dev.platform}:{getattr(dev, 'device_kind', '?')}")
    return info


def machine_line(m: Mapping[str, Any]) -> str:
    load = m.get("load_avg_start")
    load_s = f"load {load[0]:.2f}" if load else "load n/a"
    if m.get("load_avg_end"):
        load_s += f" -> {m['load_avg_end'][0]:.2f}"
    probe = m.get("probe_ms_start")
    probe_s = ""
    if probe is not None:
        end = m.get("probe_ms_end")
        probe_s = f"; speed probe {probe:.0f}{f' -> {end:.0f}' if end is not None else ''} ms ({PROBE_ADDS // 10**6}M Python additions)"
    jax_s = (f"jax {m['jax']} (jaxlib {m['jaxlib']}), backend {m['backend']} ({m['device']})"
             if "jax" in m else "no jax")
    return (f"{m['cpu']}, {m['cores']} cores, {load_s} (1-min avg){probe_s}; python {m['python']}, {jax_s}; "
            f"git {m['git'] or 'n/a'}")


# The speed probe's loop: the fastest of three runs took 28-34 ms on this project's 2-core VM on
# 2026-11-29 at 08:15 UTC (and 48 ms minutes before: the machine's speed moves within minutes).
PROBE_ADDS = 1_000_000


def speed_probe_ms() -> float:
    """How fast this machine runs Python right now: the fastest of three runs of a loop of
    ``PROBE_ADDS`` additions, in ms. The project's shared 2-core VM runs the same code up to
    ~1.6x slower in some hours than others, and that moves the plain loops (host-bound Python)
    more than the runtime's K-step calls, so ratios from different hours differ (the hook's 8 x
    3000 fused: 2.35-2.90x in a fast hour, 3.01-4.52x in slow ones: benchmarks/RESULTS.md). Each
    results file records the probe at its start and end, so readers compare like with like."""
    best = math.inf
    for _ in range(3):
        t0, total = time.perf_counter(), 0
        for i in range(PROBE_ADDS):
            total += i
        best = min(best, time.perf_counter() - t0)
    return round(1e3 * best, 1)


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _git() -> str | None:
    """The checkout's commit, ``+dirty`` when tracked files differ from it (None outside git)."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if head.returncode == 0 else None


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, Run):
        return _jsonable(x.to_json())
    if isinstance(x, float) or type(x).__name__.startswith(("float", "int")):
        x = float(x) if not isinstance(x, int) else x
        return None if isinstance(x, float) and not math.isfinite(x) else x
    return str(x) if isinstance(x, Path) else x


def write_results(name: str, out_dir: Path, *, title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
                  machine_info: dict[str, Any], config: Mapping[str, Any], data: Mapping[str, Any],
                  notes: str = "", smoke: bool = False) -> tuple[Path, Path]:
    """Print the table; write ``<name>.json`` (every figure) and ``<name>.md`` (the table, the
    exact command, the machine line, the date, the notes) into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    machine_info.setdefault("load_avg_end", _load())
    if "probe_ms_start" in machine_info:
        machine_info.setdefault("probe_ms_end", speed_probe_ms())
    cmd, table, mline = command_line(), markdown_table(columns, rows), machine_line(machine_info)
    print(f"\n{title}{' (SMOKE: tiny config, numbers meaningless)' if smoke else ''}\n\n{table}\n\nmachine: {mline}")
    doc = {"schema": "xshare.bench/v1", "benchmark": name, "smoke": smoke, "command": cmd,
           "date": machine_info.get("date"), "machine": machine_info, "machine_line": mline, "config": config,
           "table": {"columns": list(columns), "rows": [list(r) for r in rows]}, "data": data}
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    json_path.write_text(json.dumps(_jsonable(doc), indent=1) + "\n")
    md = [f"# {title}", ""] + (["**Smoke run: a tiny configuration; the numbers mean nothing.**", ""] if smoke else [])
    md += [table, "", "```", cmd, "```", "", f"Machine: {mline}", "", f"Date: {machine_info.get('date')}", ""]
    md_path.write_text("\n".join(md + ([notes.strip(), ""] if notes else [])))
    return json_path, md_path
