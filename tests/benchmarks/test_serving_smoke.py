"""benchmarks/serving.py end to end with --smoke: every case runs (services, training jobs, plain
servers, the load generator in its own process) and every request is answered. Numbers are not
checked: benchmarks are not timed tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_serving_smoke_runs_every_case_and_answers_every_request(tmp_path: Path) -> None:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.serving", "--smoke", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((tmp_path / "serving.json").read_text())
    assert doc["benchmark"] == "serving" and doc["smoke"] is True
    cases = {c["case"][0]: c for c in doc["data"]["cases"]}
    assert sorted(cases) == ["a", "b", "c", "d", "t"]
    for key in "abcd":
        c = cases[key]
        why = {k: v for k, v in c.items() if not isinstance(v, (list, dict))}  # (what a failure says)
        assert c["sent"] > 0 and c["errors"] == 0, why
        assert c["answered"] == c["sent"], why
        assert c["rss_mib"] > 0, why
    assert cases["c"]["train_steps_per_s"] > 0 and cases["t"]["train_steps_per_s"] > 0
    assert (tmp_path / "serving.md").read_text().startswith("# Serving")


@pytest.mark.slow
def test_serving_protocols_smoke_measures_grpc_http_and_plain_side_by_side(tmp_path: Path) -> None:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.serving", "--protocols", "--smoke", "--out",
                           str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    doc = json.loads((tmp_path / "serving_protocols.json").read_text())
    assert {(s["concurrency"], s["server"]) for s in doc["summary"]} == {
        (c, k) for c in (1, 4) for k in ("grpc", "http", "plain")}
    assert all(r["errors"] == 0 and r["requests"] > 0 for r in doc["runs"])
