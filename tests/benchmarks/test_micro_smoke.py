"""Each benchmark script runs end to end with ``--smoke`` and writes well-formed results
(through the shared harness, :mod:`xshare.bench.harness`).

Only the files are checked, never the numbers: benchmarks are measurements, never timed tests, and
a smoke configuration is far too small to mean anything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# (script, extra arguments, the results' name). Every script under benchmarks/ has a smoke run:
# these, test_serving_count_smoke below, test_serving_smoke, test_tune_smoke, tests/bench (bench_sharing is `xshare bench`),
# tests/reliability/test_soak; steps.py and trace.py are modules the others import.
SCRIPTS = [("switch_latency", [], "switch_latency"), ("fence_overhead", [], "fence_overhead"),
           ("jct_trace", [], "jct_trace"), ("footprint_accuracy", [], "footprint_accuracy"),
           ("fusion", [], "fusion"), ("fusion", ["--sweep", "naive"], "fusion_naive"),
           ("relaunch", [], "relaunch"), ("scale", [], "scale"), ("top_startup", [], "top_startup"),
           ("preemption", [], "preemption"), ("fusion_payoff", [], "fusion_payoff"),
           ("first_runs", [], "first_runs"), ("memory_per_job", [], "memory_per_job")]


def _run(name: str, out: Path, extra: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--smoke", "--out", str(out), *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def smoke_runs(request, tmp_path_factory):
    """Every selected script's smoke run, started at once, two at a time: each is a fresh
    process that mostly imports and compiles on one core, so on this 2-core machine two side
    by side take about half the time of one after another (the suite's budget). Each test waits
    for its own."""
    selected = {item.callspec.params["result"] for item in request.session.items
                if item.originalname == "test_smoke_writes_results"}
    base = tmp_path_factory.mktemp("smoke")
    pool = ThreadPoolExecutor(max_workers=2)
    runs = {}
    for name, extra, result in SCRIPTS:
        if result in selected:
            out = base / result
            out.mkdir()
            runs[result] = (out, pool.submit(_run, name, out, extra))
    yield runs
    pool.shutdown(wait=True)


@pytest.mark.slow
@pytest.mark.parametrize("name,extra,result", SCRIPTS, ids=[r for _, _, r in SCRIPTS])
def test_smoke_writes_results(name: str, extra: list[str], result: str, smoke_runs) -> None:
    out, run = smoke_runs[result]
    proc = run.result()
    assert proc.returncode == 0, proc.stderr[-4000:]
    _check_results(proc, out, name, result)


def _check_results(proc: subprocess.CompletedProcess, tmp_path: Path, name: str, result: str) -> dict:
    """The harness's files: the JSON document and the markdown, well formed; the document."""
    doc = json.loads((tmp_path / f"{result}.json").read_text())
    assert doc["schema"] == "xshare.bench/v1"
    assert doc["benchmark"] == result
    assert doc["smoke"] is True
    assert "--smoke" in doc["command"] and name in doc["command"]
    # (top_startup times a command that must never import jax: its machine has no jax fields)
    keys = ("cpu", "cores", "load_avg_start", "date") + (() if name == "top_startup" else ("jax", "backend"))
    for key in keys:
        assert key in doc["machine"], key
    # The machine's speed at the start and the end, the hour's measure the ratios depend on.
    assert doc["machine"]["probe_ms_start"] > 0 and doc["machine"]["probe_ms_end"] > 0
    assert "speed probe" in doc["machine_line"]
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
    return doc


@pytest.mark.slow
def test_serving_count_smoke_measures_both_ways_and_counts(tmp_path: Path) -> None:
    """`serving --count --smoke`: models deployed into one live service and plain server
    processes, every one answering a real request; sane fits and counts (no figure is timed)."""
    proc = _run("serving", tmp_path, ["--count"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = _check_results(proc, tmp_path, "serving", "serving_count")
    points, summary = doc["data"]["points"], doc["data"]["summary"]
    assert [p["n"] for p in points["service"]] == [0, 1, 2, 4]   # the empty service, then k models
    assert [p["n"] for p in points["processes"]] == [1, 2]
    for side in ("service", "processes"):
        for p in points[side]:
            assert p["answered"] == p["n"], (side, p)            # every model served a real request
            assert 0 < p["uss"] <= p["pss"] <= p["rss"], (side, p)
        assert points[side][-1]["rss"] > points[side][0]["rss"], side  # more models, more memory
    assert points["processes"][1]["rss"] > 1.5 * points["processes"][0]["rss"]  # a second interpreter
    for metric in ("rss", "pss"):
        svc, procs = summary[f"service_{metric}"], summary[f"processes_{metric}"]
        assert 0 < svc["marginal_bytes"] and 0 < procs["marginal_bytes"]
        assert svc["count"] > 0 and procs["count"] > 0
        assert svc["per_gib"] == pytest.approx(2**30 / svc["marginal_bytes"])
        # the count is the fitted line solved at the budget
        assert svc["base_bytes"] + svc["count"] * svc["marginal_bytes"] <= summary["budget_bytes"]
        assert svc["base_bytes"] + (svc["count"] + 1) * svc["marginal_bytes"] > summary["budget_bytes"]
        assert summary[f"ratio_{metric}"] == pytest.approx(svc["count"] / procs["count"])
    assert summary["budget_bytes"] == doc["config"]["total_ram_bytes"] - doc["config"]["reserve_bytes"] > 0
    assert (tmp_path / "serving_count.png").stat().st_size > 0


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


@pytest.mark.slow
def test_steps_per_call_measures_each_form_against_the_plain_loop() -> None:
    """`steps_per_call` (it prints its table, no harness files): each K's rolled and unrolled
    forms are called as the runtime calls them (``MultiStep.arg``) and, for the small MLP,
    found bit-identical to K single steps."""
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.steps_per_call", "--ks", "1,4", "--steps", "16",
                           "--repeats", "1", "--models", "mlp w32"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| mlp w32")]
    forms = [(r[1].strip(), r[2].strip(), r[4].strip()) for r in rows]
    assert forms == [("1", "plain jit loop", "yes"), ("1", "rolled", "yes"), ("4", "rolled", "yes"),
                     ("4", "unrolled", "yes")], proc.stdout
