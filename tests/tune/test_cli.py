"""``xshare tune`` end to end on the digits model, and each refusal of a bad spec (exit 2,
nothing started, nothing left behind)."""

from __future__ import annotations

import json

import pytest

optuna = pytest.importorskip("optuna")
pytest.importorskip("sklearn")

from xshare.cli.main import main  # noqa: E402
from tests.helpers import LR_RANGE, digits_study  # noqa: E402

GOOD = LR_RANGE + '\ndepth = [1, 2]'


def write(tmp_path, search=GOOD):
    path = tmp_path / "study.toml"
    path.write_text(digits_study(memory="1GiB", steps=30, eval_every=10, trials=4, concurrency=2, search=search))
    return path


def test_xshare_tune_runs_a_digits_study_and_resumes_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write(tmp_path)
    assert main(["tune", "study.toml", "--out", "run", "--status-port", "-1"]) == 0
    out = capsys.readouterr().out
    run = tmp_path / "run"
    assert (run / "study.png").is_file() and (run / "tune.json").is_file()
    study = optuna.load_study(study_name="study", storage=f"sqlite:///{run / 'study.db'}")
    trials = study.trials
    assert len(trials) == 4 and all(t.state.is_finished() for t in trials)
    for t in trials:
        rows = [json.loads(line) for line in (run / f"trial-{t.number}" / "metrics.jsonl").read_text().splitlines()]
        evals = {r["step"] + 1: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
        assert evals == pytest.approx(t.intermediate_values)  # every value recorded was reported
        assert set(t.params) == {"lr", "depth"}
    assert f"best: trial {study.best_trial.number} value {study.best_trial.value:.4g}" in out
    assert study.best_value > 0.5  # 30 steps of a good lr learn the digits well past chance (0.1)
    assert json.loads((run / "tune.json").read_text())["placement"] == {"ray": False}
    # The study is done: resuming it runs nothing more and keeps the 4 trials.
    assert main(["tune", "--resume", "run", "--status-port", "-1"]) == 0
    assert len(optuna.load_study(study_name="study", storage=f"sqlite:///{run / 'study.db'}").trials) == 4


@pytest.mark.parametrize("search, message", [
    ("lr = { low = 0.1, high = 0.01 }", "[search] lr: low = 0.1 is above high = 0.01; swap them"),
    ("lr = { low = 0.0, high = 0.1, log = true }", "[search] lr: log = true needs low > 0 (got low = 0.0)"),
    ("lr = { low = 1e-3, high = 0.1, scale = 2 }", "[search] lr: unknown key 'scale'"),
    ("lr = 0.1", "[search] lr = 0.1: write a range"),
    ("width_mult = [1, 2]", "the factory does not accept parameter 'width_mult'"),
    ("lr = []", "[search] lr = []: a categorical needs at least one choice"),
    ("batch = [16, 32]", "[search] batch: also fixed under [[job]] params"),
])
def test_bad_search_spaces_exit_2_and_leave_nothing(tmp_path, monkeypatch, capsys, search, message):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, search)
    assert main(["tune", "study.toml", "--status-port", "-1"]) == 2
    assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.toml"]  # no runs/, no study.db


@pytest.mark.parametrize("flags, message", [
    (["--pruner", "medain"], "--pruner 'medain' is not one of: median, successive-halving, hyperband, none"),
    (["--trials", "0"], "--trials = 0 must be a whole number >= 1"),
    (["--direction", "up"], "--direction 'up' is not one of: minimize, maximize"),
    (["--no-ray"], "--no-ray goes with --resume RUN_DIR"),
])
def test_bad_flags_exit_2_and_leave_nothing(tmp_path, monkeypatch, capsys, flags, message):
    monkeypatch.chdir(tmp_path)
    write(tmp_path)
    assert main(["tune", "study.toml", "--out", "run", *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_ends_the_study_with_130_and_resume_finishes_it(tmp_path, sig):
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    write(tmp_path)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(repo), "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "xshare", "tune", "study.toml", "--out", "run", "--status-port", "-1",
           "--trials", "6", "--steps", "4000", "--concurrency", "2", "--pruner", "none"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in proc.stdout:  # wait until the study runs (its first line), then interrupt
            seen.append(line)
            if line.startswith("study: "):
                # soon: with its constants lifted a fused study is quick, and a signal that lands
                # after the last trial (while the plot is drawn) finds no running trial to fail
                time.sleep(1)
                proc.send_signal(getattr(signal, sig))
                break
        out = "".join(seen) + proc.stdout.read()
        assert proc.wait(timeout=120) == 130, out
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "resume with: xshare tune --resume run" in out
    storage = f"sqlite:///{tmp_path / 'run' / 'study.db'}"
    trials = optuna.load_study(study_name="study", storage=storage).trials
    failed = [t for t in trials if t.state.name == "FAIL"]
    assert failed and all("interrupted" in t.user_attrs["xshare_error"] for t in failed)
    resumed = subprocess.run([sys.executable, "-m", "xshare", "tune", "--resume", "run", "--status-port", "-1"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    trials = optuna.load_study(study_name="study", storage=storage).trials
    assert sum(t.state.is_finished() for t in trials) == 6
