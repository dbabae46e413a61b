"""Each benchmark script runs end to end with ``--smoke`` and writes well-formed results
(through the shared harness, :mod:`xshare.bench.harness`).

Only the files are checked, never the numbers: benchmarks are not timed tests (DESIGN.md), and
a smoke configuration is far too small to mean anything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPTS = ["switch_latency", "fence_overhead", "jct_trace", "footprint_accuracy"]


def _run(name: str, out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--smoke", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_smoke_writes_results(name: str, tmp_path: Path) -> None:
    proc = _run(name, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]

    doc = json.loads((tmp_path / f"{name}.json").read_text())
    assert doc["schema"] == "xshare.bench/v1"
    assert doc["benchmark"] == name
    assert doc["smoke"] is True
    assert f"benchmarks.{name}" in doc["command"] and "--smoke" in doc["command"]
    for key in ("cpu", "cores", "jax", "backend", "load_avg_start", "date"):
        assert key in doc["machine"], key
    columns, rows = doc["table"]["columns"], doc["table"]["rows"]
    assert columns and rows
    assert all(len(row) == len(columns) for row in rows)
    assert isinstance(doc["config"], dict) and isinstance(doc["data"], dict)

    md = (tmp_path / f"{name}.md").read_text()
    assert md.startswith("# ")
    assert "| " + columns[0] in md  # the table's header row
    assert doc["command"] in md
    assert "Machine: " + doc["machine_line"] in md
    assert "Date: " in md
    # The summary table is printed too.
    assert columns[0] in proc.stdout
