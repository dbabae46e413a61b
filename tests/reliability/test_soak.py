"""The soak (benchmarks/soak.py) end to end in a small configuration: rounds of jobs in one
Runtime with random controls from another thread; every non-cancelled job exact, threads flat.
The full run (5 x 64 jobs, RSS and time criteria) is a benchmark: see benchmarks/RESULTS.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_soak_smoke_every_non_cancelled_job_exact_and_threads_flat(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.soak", "--rounds", "4", "--jobs", "12",
                           "--steps", "60", "--out", str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    doc = json.loads((tmp_path / "soak.json").read_text())
    rounds = doc["data"]["rounds"]
    assert len(rounds) == 4, proc.stdout + proc.stderr
    checks = doc["data"]["checks"]
    assert checks["all non-cancelled jobs exact"], rounds
    assert checks["threads flat"], rounds
    assert all(r["exact"] + r["cancelled"] == 12 for r in rounds), rounds
    assert sum(r["cancelled"] for r in rounds[1:-1]) + sum(sum(r["controls"].values()) for r in rounds) > 0
