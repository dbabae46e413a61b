"""Metrics rows on their way to the recorder: each retired step's row (and each evaluation's)
is buffered here and handed over in batches, so the recorder's thread wakes once per batch,
not once per step (a queue put per step would have the two threads take turns at the GIL).

Written by the executor (a step's row) and evaluations (an ``eval/<name>`` row); flushed by the
executor at ``BATCH`` rows, by the lifecycle before a job's end line or checkpoint, and by the
dispatcher when it idles. Plain data, no jax. Owned by the dispatcher thread.
"""

from __future__ import annotations

from typing import Any

# (job, step, t_end in seconds, metrics vector, extra metrics or None): recorder.metrics_rows
Row = tuple[Any, int, float, Any, "dict[str, float] | None"]
BATCH = 256  # rows handed to the recorder at once


class MetricsRows:
    """The buffer of rows not yet handed to the recorder. ``enabled``: the runtime logs (it has
    a log directory); without one, rows are never made."""

    def __init__(self, recorder: Any, *, enabled: bool):
        self.recorder, self.enabled = recorder, enabled
        self.items: list[Row] = []

    def add(self, job: Any, step: int, t_s: float, values: Any, extra: dict[str, float] | None) -> None:
        """Buffer one row (flushed at the next ``flush``)."""
        if self.enabled:
            self.items.append((job, step, t_s, values, extra))

    def flush(self) -> None:
        """Hand the buffered rows to the recorder (nothing if there are none)."""
        if self.items:
            rows, self.items = self.items, []
            self.recorder.metrics_rows(rows)
