"""``xshare tune --ray`` stopped by SIGTERM: exit 130, the running trials FAIL and enqueued
again, the runtime actors gone with the Ray the command started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")
pytest.importorskip("sklearn")
pytest.importorskip("ray", reason="Ray is not installed (pip install 'xshare[ray]')")

from tests.tune.test_ray import SPEC  # noqa: E402


@pytest.mark.slow
def test_sigterm_ends_a_ray_study_with_130_and_enqueues_its_running_trials(tmp_path):
    repo = Path(__file__).resolve().parents[2]
    (tmp_path / "study.toml").write_text(textwrap.dedent(SPEC))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(repo), "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "xshare", "tune", "study.toml", "--ray", "--actors", "2", "--out", "run",
           "--status-port", "-1", "--steps", "100000", "--concurrency", "2"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run = tmp_path / "run"
    try:
        # Wait until both trials' jobs have written rows (they run), then stop the command.
        # (Polled, not timed: 100000 steps cannot end first.)
        while proc.poll() is None and not all((run / f"trial-{n}" / "metrics.jsonl").is_file() and
                                              (run / f"trial-{n}" / "metrics.jsonl").stat().st_size
                                              for n in (0, 1)):
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out = proc.stdout.read()
        assert proc.wait(timeout=120) == 130, out
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "resume with: xshare tune --resume run\n" in out  # (on Ray: tune.json says where it ran)
    trials = optuna.load_study(study_name="study", storage=f"sqlite:///{run / 'study.db'}").trials
    states = sorted(t.state.name for t in trials)
    assert states == ["FAIL", "FAIL", "WAITING", "WAITING"], states
    for t in trials:
        if t.state.name == "FAIL":
            assert t.user_attrs["xshare_error"].startswith("interrupted after ")
            assert 0 < t.user_attrs["xshare_steps"] < 100000
