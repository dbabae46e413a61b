"""Tests of the model zoo (models/): each job learns under the runtime, matches a plain loop bit
for bit, and (inference) reports latency. Shared helpers below."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def losses(log_dir: Path, job: str) -> np.ndarray:
    """The ``loss`` column of a job's ``metrics.jsonl``, in step order."""
    rows = [json.loads(line) for line in (Path(log_dir) / job / "metrics.jsonl").read_text().splitlines()]
    rows.sort(key=lambda r: r["step"])
    assert [r["step"] for r in rows] == list(range(len(rows))), "a step is missing or repeated"
    return np.array([r["loss"] for r in rows])


def relative_drop(values: np.ndarray, k: int = 10) -> float:
    """1 - mean(last k) / mean(first k): 0.2 means the loss fell by a fifth."""
    return 1.0 - float(np.mean(values[-k:])) / float(np.mean(values[:k]))
