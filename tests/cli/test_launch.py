"""``xshare launch`` end to end: real runtime, tiny jobs, metrics on disk, summary and exit codes."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from rich.console import Console

from xshare.cli import launch, render
from xshare.cli.main import main
from tests.cli.test_spec import REPO, fac, write_spec  # noqa: F401  (fac is a fixture)


def metrics_lines(run: Path, job: str) -> list[dict]:
    return [json.loads(line) for line in (run / job / "metrics.jsonl").read_text().splitlines()]


def test_launch_runs_every_job_and_writes_metrics(tmp_path, fac, capsys):
    write_spec(tmp_path, f'''
        [runtime]
        policy = "fair"
        memory = "256MiB"
        [[job]]
        entry = "{fac}:make"
        steps = 6
        params = {{ lr = [0.1, 0.2] }}
    ''', name="tiny.toml")
    assert main(["launch", "tiny.toml", "--out", "run"]) == 0
    out = capsys.readouterr().out
    run = tmp_path / "run"
    for job in ("0_lr=0.1", "1_lr=0.2"):
        rows = metrics_lines(run, job)
        assert [r["step"] for r in rows] == list(range(6)) or [r["step"] for r in rows] == list(range(1, 7))
        assert {"loss", "norm", "time_s"} <= set(rows[0])
        assert re.search(rf"{re.escape(job)}\s+│ done\s+│\s+6/6 │", out), out
    resolved = json.loads((run / "spec.json").read_text())
    assert resolved["runtime"] == {"policy": "fair", "memory": "256MiB", "quantum": 1, "fuse": False}
    assert [j["name"] for j in resolved["jobs"]] == ["0_lr=0.1", "1_lr=0.2"]
    assert "2 job(s)" in out and "2 done" in out
    # first loss -> final loss, from metrics.jsonl and the last progress
    first = metrics_lines(run, "0_lr=0.1")[0]["loss"]
    assert f"{render.fmt_number(first)} -> " in out


def test_a_failing_job_exits_1_with_its_cause_and_the_others_finish(tmp_path, fac, capsys):
    write_spec(tmp_path, f'''
        [[job]]
        entry = "{fac}:make"
        steps = 12
        params = {{ fail_at = [-1, 5], width = [4, 8] }}
    ''')
    assert main(["launch", "spec.toml", "--out", "run"]) == 1
    out = capsys.readouterr().out
    run = tmp_path / "run"
    for job in ("0_fail_at=-1,width=4", "1_fail_at=-1,width=8"):
        assert len(metrics_lines(run, job)) == 12
        assert re.search(rf"{re.escape(job)}\s+│ done\s+│\s+12/12 │", out), out
    for job in ("2_fail_at=5,width=4", "3_fail_at=5,width=8"):
        assert len(metrics_lines(run, job)) <= 5  # the batch for step 5 never existed
        assert re.search(rf"{re.escape(job)}\s+│ failed", out), out
        assert "bad batch at step 5" in (run / job / "log.txt").read_text()
        assert f"{job}: traceback in run/{job}/log.txt" in out
    assert "RuntimeError: bad batch at step 5" in out  # the cause, in the summary's error column
    assert "2 done, 2 failed" in out


def test_entry_point_launch_with_default_run_dir_and_plain_progress_lines(tmp_path, fac, capsys, monkeypatch):
    monkeypatch.setattr(launch, "_PLAIN_EVERY_S", 0.0)  # capsys is not a terminal: plain lines, every poll
    argv = ["launch", f"{fac}:make", "--set", "lr=0.1,0.2", "--set", "delay=0.003", "--steps", "300", "--policy", "srtf", "--quantum", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    (run,) = (tmp_path / "runs").iterdir()
    assert re.fullmatch(rf"\d{{8}}-\d{{6}}-{fac}-make", run.name)
    assert json.loads((run / "spec.json").read_text())["runtime"]["policy"] == "srtf"
    assert len(metrics_lines(run, "1_lr=0.2")) == 300
    assert re.search(r"\] 0_lr=0\.1 \w+ lane=\S+ steps=\d+/300", out), out


def test_live_table_on_a_terminal(tmp_path, fac, monkeypatch):
    screen = io.StringIO()
    monkeypatch.setattr(render, "console", lambda stderr=False: Console(file=screen, force_terminal=True, width=120))
    write_spec(tmp_path, f'[[job]]\nentry = "{fac}:make"\nsteps = 3\n')
    assert main(["launch", "spec.toml", "--out", "run"]) == 0
    text = screen.getvalue()
    assert "xshare: 1 job(s) in" in text and "1 done" in text


@pytest.mark.slow
def test_example_sweep_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)  # models.mlp resolves from the repository root, as for a user
    text = (REPO / "examples" / "sweep.toml").read_text()
    short, n = re.subn(r"(?m)^steps = \d+", "steps = 25", text)
    assert n == 1
    spec = tmp_path / "sweep.toml"
    spec.write_text(short)
    run = tmp_path / "run"
    assert main(["launch", str(spec), "--out", str(run)]) == 0
    out = capsys.readouterr().out
    jobs = ["0_lr=0.001,width=64", "1_lr=0.001,width=128", "2_lr=0.003,width=64", "3_lr=0.003,width=128"]
    for job in jobs:
        rows = metrics_lines(run, job)
        assert len(rows) == 25 and "loss" in rows[-1]
        assert re.search(rf"{re.escape(job)}\s+│ done\s+│\s+25/25 │", out), out
    assert "4 job(s)" in out and "4 done" in out


def test_a_job_that_can_never_fit_stops_the_launch_before_anything_runs(tmp_path, fac, capsys):
    write_spec(tmp_path, f'[[job]]\nentry = "{fac}:make"\nparams = {{ width = [4, 8] }}\n')
    assert main(["launch", "spec.toml", "--out", "run", "--memory", "10"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xshare launch: error: job '0_width=4' needs ")
    assert "but the arena holds 10 B" in err and err.rstrip().endswith("Nothing was run.")
    assert not any(p.stat().st_size for p in (tmp_path / "run").glob("*/metrics.jsonl"))


@pytest.mark.parametrize("policy", ["pack", "fifo"])
def test_fuse_dry_run_says_how_a_program_s_jobs_split_over_the_cores(policy, tmp_path, monkeypatch, capsys):
    """Four jobs of one program: a group per core where lanes run side by side (pack, on a
    CPU of two cores or more), one group under fifo (one call at a time)."""
    import jax

    from xshare.runtime.engine.streams import parallel_streams

    monkeypatch.chdir(tmp_path)
    (tmp_path / "sweep.toml").write_text(
        f'[runtime]\nfuse = true\npolicy = "{policy}"\n\n'
        '[[job]]\nentry = "xshare.models.mlp:make_job"\nsteps = 5\n'
        'params = { lr = [1e-3, 3e-4, 1e-4, 3e-5], width = 16, depth = 1, batch = 8 }\n')
    assert main(["launch", "sweep.toml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    names = "0_lr=0.001, 1_lr=0.0003, 2_lr=0.0001, 3_lr=3e-05"
    if policy == "pack" and parallel_streams(jax.devices()[0], True) >= 2:
        assert f"fused group 0: 4 jobs (2 groups of 2 slots, one per core): {names}" in out, out
    else:
        assert f"fused group 0: 4 jobs: {names}" in out, out


def test_fuse_dry_run_lists_the_groups_and_why_a_job_runs_alone(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sweep.toml").write_text(
        '[runtime]\nfuse = true\n\n'
        '[[job]]\nentry = "xshare.models.mlp:make_job"\nsteps = 5\n'
        'params = { lr = [1e-3, 3e-4], width = 16, depth = 1, batch = 8 }\n\n'
        '[[job]]\nentry = "xshare.models.mlp:make_job"\nsteps = 5\nparams = { width = 8, depth = 1, batch = 8 }\n')
    assert main(["launch", "sweep.toml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "fused group 0: 2 jobs: 0_lr=0.001, 1_lr=0.0003" in out
    assert "2_mlp runs alone: its state or batch shapes differ from 0_lr=0.001's" in out
    assert not (tmp_path / "runs").exists()  # a dry run creates nothing
