"""``benchmarks/tune.py --smoke`` runs its study two ways (plain Optuna, xshare fused) and writes
its results; only the files and counts are checked, never the times."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("optuna")
pytest.importorskip("sklearn")
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tune_benchmark_smoke(tmp_path: Path) -> None:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.tune", "--smoke", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["way"] for r in rows] == ["a_plain", "f_xshare_fused_state"]
    for r in rows:
        assert r["trials"] == 4 and r["complete"] + r["pruned"] + r["failed"] == 4 and r["failed"] == 0
        assert 0 < r["steps_trained"] <= 4 * 20 and r["best_val_accuracy"] > 0.1
        assert r["xla_compiles"] > 0 and r["xla_compile_s"] > 0  # each way compiles its step at least
    assert "| a_plain |" in (tmp_path / "results.md").read_text()
    for way in ("a_plain", "f_xshare_fused_state"):  # each way's study plot (PNG signature)
        assert (tmp_path / f"{way}-study.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
