"""Rich tables (and plain lines for logs) for ``xshare launch``. Pure formatting: no runtime calls.

Every cell built from user data goes through ``Text`` so that brackets in names, params or
error messages print as they are instead of being read as rich markup.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from rich.console import Console
from rich.table import Table
from rich.text import Text

STATUS_STYLE = {
    "queued": "dim",
    "running": "cyan",
    "paused": "yellow",
    "done": "green",
    "failed": "bold red",
    "cancelled": "magenta",
}


def console(stderr: bool = False) -> Console:
    """A console on the *current* ``sys.stdout``/``stderr`` (so pytest's capture sees it).

    Off a terminal (a log file, a pipe) rich would wrap tables at 80 columns; we give it 160
    (or ``$COLUMNS``) so a job's row stays on one line in logs.
    """
    stream = sys.stderr if stderr else sys.stdout
    probe = Console(file=stream)
    if probe.is_terminal:
        return probe
    return Console(file=stream, width=int(os.environ.get("COLUMNS", 160)))


def pick_loss(metrics: Mapping[str, Any] | None) -> tuple[str, float] | None:
    """The metric to show: ``loss`` when there is one, else the first metric reported."""
    if not metrics:
        return None
    values = {k: v for k, v in metrics.items() if k not in ("step", "time_s")}
    if not values:
        return None
    key = "loss" if "loss" in values else next(iter(values))
    return key, values[key]


def fmt_number(x: Any) -> str:
    if x is None:
        return "-"
    try:
        x = float(x)
    except (TypeError, ValueError):
        return str(x)
    if math.isnan(x) or math.isinf(x):
        return str(x)
    if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-3):
        return f"{x:.3e}"
    return f"{x:.4g}"


def fmt_rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 60:
        return f"{s:.1f}s"
    minutes, seconds = divmod(int(round(s)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


def fmt_steps(done: int | None, total: int | None) -> str:
    return f"{done or 0}/{'?' if total is None else total}"


def fmt_params(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in sorted(params.items())) or "-"


def _status(status: str) -> Text:
    return Text(status, style=STATUS_STYLE.get(status, ""))


# ------------------------------------------------------------------------------- dry run


def plan_table(plan: Any) -> Table:
    """The expanded jobs of a :class:`~xshare.jobs.LaunchPlan`."""
    rt = plan.runtime
    memory = "device" if rt.memory is None else str(rt.memory)
    table = Table(
        title=Text(f"{plan.source}: {len(plan.jobs)} job(s), policy {rt.policy}, memory {memory}, quantum {rt.quantum}"),
        title_justify="left",
    )
    table.add_column("job", no_wrap=True)
    table.add_column("entry", no_wrap=True)
    table.add_column("params")
    table.add_column("steps", justify="right")
    table.add_column("priority", justify="right")
    for job in plan.jobs:
        table.add_row(
            Text(job.name),
            Text(job.entry),
            Text(fmt_params(job.params)),
            "default" if job.steps is None else str(job.steps),
            "-" if job.priority is None else str(job.priority),
        )
    return table


# ------------------------------------------------------------------------------- while running


def progress_table(progress: Iterable[Any], elapsed_s: float) -> Table:
    """One row per job from ``JobHandle.progress()`` snapshots."""
    rows = list(progress)
    done = sum(p.status == "done" for p in rows)
    table = Table(title=Text(f"xshare: {done}/{len(rows)} done, {fmt_seconds(elapsed_s)}"), title_justify="left")
    table.add_column("job", no_wrap=True)
    table.add_column("status")
    table.add_column("lane", justify="right")
    table.add_column("steps", justify="right")
    table.add_column("loss", justify="right")
    table.add_column("steps/s", justify="right")
    for p in rows:
        loss = pick_loss(p.metrics)
        if loss is None:
            shown = "-"
        else:
            shown = fmt_number(loss[1]) if loss[0] == "loss" else f"{loss[0]} {fmt_number(loss[1])}"
        table.add_row(
            Text(p.name),
            _status(p.status),
            "-" if p.lane is None else str(p.lane),
            fmt_steps(p.steps_done, p.steps_total),
            shown,
            fmt_rate(p.steps_per_s),
        )
    return table


def progress_line(p: Any, elapsed_s: float) -> str:
    """The plain-text form of a progress row, for logs and pipes."""
    loss = pick_loss(p.metrics)
    parts = [
        f"[{fmt_seconds(elapsed_s):>6}]",
        p.name,
        p.status,
        f"lane={'-' if p.lane is None else p.lane}",
        f"steps={fmt_steps(p.steps_done, p.steps_total)}",
    ]
    if loss is not None:
        parts.append(f"{loss[0]}={fmt_number(loss[1])}")
    parts.append(f"steps/s={fmt_rate(p.steps_per_s)}")
    return " ".join(parts)


# ------------------------------------------------------------------------------- summary


@dataclass(frozen=True)
class JobSummary:
    name: str
    status: str
    steps_done: int
    steps_total: int | None
    metric: str | None  # which metric first/final refer to ("loss" unless the job has none)
    first: float | None
    final: float | None
    steps_per_s: float | None
    wall_s: float | None
    error: str | None


def summary_table(rows: Iterable[JobSummary], elapsed_s: float) -> Table:
    rows = list(rows)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.status] = counts.get(r.status, 0) + 1
    tally = ", ".join(f"{n} {s}" for s, n in counts.items())
    table = Table(title=Text(f"xshare: {len(rows)} job(s) in {fmt_seconds(elapsed_s)}: {tally}"), title_justify="left")
    table.add_column("job", no_wrap=True)
    table.add_column("status")
    table.add_column("steps", justify="right")
    metrics = {r.metric for r in rows if r.metric}
    table.add_column("loss" if metrics <= {"loss"} else "loss (or first metric)", no_wrap=True)
    table.add_column("steps/s", justify="right")
    table.add_column("wall", justify="right")
    table.add_column("error", overflow="fold")
    for r in rows:
        if r.first is None and r.final is None:
            loss = "-"
        else:
            loss = f"{fmt_number(r.first)} -> {fmt_number(r.final)}"
            if r.metric and r.metric != "loss":
                loss = f"{r.metric} {loss}"
        table.add_row(
            Text(r.name),
            _status(r.status),
            fmt_steps(r.steps_done, r.steps_total),
            loss,
            fmt_rate(r.steps_per_s),
            fmt_seconds(r.wall_s),
            Text(r.error or "", style="red"),
        )
    return table
