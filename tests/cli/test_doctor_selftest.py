"""``xshare doctor --selftest``: the quick subset in the default run, the whole one marked slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from xshare.cli import doctor_selftest
from xshare.cli.main import main

from ..test_imports import REPO

NAMES = ["memory_analysis vs peaks", "fences", "preallocation and arena", "equivalence", "fused sweep",
         "served model", "throughput"]


def test_quick_selftest_passes_on_cpu_and_writes_its_report(capsys, tmp_path):
    out = tmp_path / "selftest.md"
    capsys.readouterr()
    code = main(["doctor", "--selftest", "--quick", "--report", str(out), "--json"])
    report = json.loads(capsys.readouterr().out)
    st = report["selftest"]
    assert code == 0 and report["ok"] and st["ok"] and st["quick"]
    checks = {c["name"]: c for c in st["checks"]}
    assert list(checks) == NAMES
    assert {c["status"] for c in st["checks"]} <= {"ok", "info"}, st["checks"]
    # What a CPU lacks is N/A, never a number made up.
    [mlp] = checks["memory_analysis vs peaks"]["figures"]["models"]
    assert mlp["model"] == "mlp" and mlp["measured_bytes"] is None and mlp["temp_bytes"] > 0
    assert checks["preallocation and arena"]["figures"]["bytes_limit"] is None
    assert "bit-identical to a plain jit loop" in checks["equivalence"]["summary"]
    assert checks["fences"]["figures"]["steps"] == 20
    assert checks["throughput"]["figures"]["ratio"] > 0
    text = out.read_text()
    assert text.startswith("# xshare doctor --selftest --quick")
    for name in NAMES:
        assert f"| {name} |" in text
    assert "| mlp |" in text and "| N/A |" in text


def test_a_check_that_raises_is_a_failed_row_and_the_others_still_run(monkeypatch):
    def broken(quick):
        raise RuntimeError("device lost")

    monkeypatch.setattr(doctor_selftest, "CHECKS", [broken, doctor_selftest.check_arena])
    st = doctor_selftest.run_selftest(quick=True)
    assert st["ok"] is False
    first, second = st["checks"]
    assert (first["name"], first["status"]) == ("broken", "fail")
    assert first["summary"] == "raised RuntimeError: device lost"
    assert second["status"] == "ok"


@pytest.mark.slow
def test_full_selftest_as_a_user_runs_it(tmp_path):
    out = tmp_path / "selftest.md"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "xshare", "doctor", "--selftest", "--report", str(out)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all checks passed" in proc.stdout
    text = out.read_text()
    for model in ("mlp", "cnn", "transformer"):
        assert f"| {model} |" in text
