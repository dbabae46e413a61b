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

# (script, extra arguments, the results' name). Every script under benchmarks/ has a smoke run:
# these, test_serving_smoke, test_tune_smoke, tests/bench (bench_sharing is `xshare bench`),
# tests/reliability/test_soak; steps.py and trace.py are modules the others import.
SCRIPTS = [("switch_latency", [], "switch_latency"), ("fence_overhead", [], "fence_overhead"),
           ("jct_trace", [], "jct_trace"), ("footprint_accuracy", [], "footprint_accuracy"),
           ("fusion", [], "fusion"), ("fusion", ["--sweep", "naive"], "fusion_naive"),
           ("relaunch", [], "relaunch"), ("scale", [], "scale"), ("top_startup", [], "top_startup"),
           ("preemption", [], "preemption")]


def _run(name: str, out: Path, extra: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--smoke", "--out", str(out), *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("name,extra,result", SCRIPTS, ids=[r for _, _, r in SCRIPTS])
def test_smoke_writes_results(name: str, extra: list[str], result: str, tmp_path: Path) -> None:
    proc = _run(name, tmp_path, extra)
    assert proc.returncode == 0, proc.stderr[-4000:]

    doc = json.loads((tmp_path / f"{result}.json").read_text())
    assert doc["schema"] == "xshare.bench/v1"
    assert doc["benchmark"] == result
    assert doc["smoke"] is True
    assert "--smoke" in doc["command"] and name in doc["command"]
    # (top_startup times a command that must never import jax: its machine has no jax fields)
    keys = ("cpu", "cores", "load_avg_start", "date") + (() if name == "top_startup" else ("jax", "backend"))
    for key in keys:
        assert key in doc["machine"], key
    columns, rows = doc["table"]["columns"], doc["table"]["rows"]
    assert columns and rows
    assert all(len(row) == len(columns) for row in rows)
    assert isinstance(doc["config"], dict) and isinstance(doc["data"], dict)

    md = (tmp_path / f"{result}.md").read_text()
    assert md.startswith("# ")
    assert "| " + columns[0] in md  # the table's header row
    assert doc["command"] in md
    assert "Machine: " + doc["machine_line"] in md
    assert "Date: " in md
    # The summary table is printed too.
    assert columns[0] in proc.stdout


# The zero-overhead SRTF oracle jct_trace compares srtf against (a table test: each row's why).
@pytest.mark.parametrize("jobs,want_avg", [
    # alone: JCT = service time
    ([(0.0, 4.0, "a")], 4.0),
    # a long job preempted by two short arrivals: b (1..3), c (3..4), a ends at 13 -> (13+2+2)/3
    ([(0.0, 10.0, "a"), (1.0, 2.0, "b"), (2.0, 1.0, "c")], 17 / 3),
    # a gap: the device idles until the second arrival
    ([(0.0, 1.0, "a"), (5.0, 1.0, "b")], 1.0),
    # equal remaining times: the earlier arrival first (a ends at 2, b at 3), both JCTs 2
    ([(0.0, 2.0, "a"), (1.0, 1.0, "b")], 2.0),
])
def test_the_srtf_oracle_schedules_shortest_remaining_first(jobs, want_avg):
    from benchmarks.jct_trace import simulate_srtf

    assert simulate_srtf(jobs)["avg_jct_s"] == pytest.approx(want_avg)
