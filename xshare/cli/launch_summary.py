"""``xshare launch``'s closing table: one row per job (its status, steps, the loss it started and
ended at, its speed and its error on one line), read from its handle and its metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from xshare._errors import error_line


def first_metrics(path: Path) -> dict[str, Any] | None:
    """The first line of a job's metrics.jsonl (the runtime writes one line per step)."""
    try:
        with path.open() as f:
            line = f.readline()
        return json.loads(line) if line.strip() else None
    except (OSError, ValueError):
        return None


def summary(handle: Any, run_dir: Path, first_seen: dict[str, dict[str, float]]) -> Any:
    from xshare._errors import JobFailed
    from xshare.cli import render

    p = handle.progress()
    error = p.error
    if p.status == "failed" and not error:
        try:
            handle.result()
        except JobFailed as err:
            error = err.cause
        except Exception as err:  # noqa: BLE001 - whatever it was, the table shows it as the job's error
            error = f"{type(err).__name__}: {err}"
    if error:
        # The cause, not the traceback (that is in log.txt), on one line.
        error = error_line(error)
    first = first_metrics(run_dir / p.name / "metrics.jsonl") or first_seen.get(p.name)
    final = render.pick_loss(p.metrics)
    first_loss = render.pick_loss(first)
    metric = final[0] if final else (first_loss[0] if first_loss else None)
    first_value = (first or {}).get(metric) if metric else None
    steps_per_s = p.steps_per_s
    if steps_per_s is None and p.wall_s:
        steps_per_s = p.steps_done / p.wall_s
    return render.JobSummary(
        name=p.name,
        status=p.status,
        steps_done=p.steps_done,
        steps_total=p.steps_total,
        metric=metric,
        first=first_value,
        final=final[1] if final else None,
        steps_per_s=steps_per_s,
        wall_s=p.wall_s,
        error=error,
    )
