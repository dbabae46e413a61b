"""FIFO: one job at a time, in arrival order — the exclusive-allocation baseline.

This is what a GPU cluster without sharing gives each job (the whole device until it finishes),
run inside the runtime so benchmarks compare sharing against it on equal footing.
"""

from __future__ import annotations

from typing import Any

from .base import pick_one
from .view import Decision, View


class Fifo:
    name = "fifo"
    exclusive = True
    preemptive = False

    def init(self) -> Any:
        return None

    def pick(self, view: View, state: Any) -> tuple[Decision, Any]:
        # Earliest arrival runs; the id breaks ties (ids increase with submission).
        return pick_one(view, key=lambda job: (job.arrival, job.id)), state
