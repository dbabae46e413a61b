"""A launch killed mid-run (SIGKILL) or interrupted (SIGINT) resumes to exactly the state an
uninterrupted run reaches."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from xshare.models import mlp
from xshare.runtime.observe import checkpoint
from tests.helpers import assert_trees_equal, plain_loop, sigint_as_in_a_terminal

# Long enough that the signal, sent once both jobs have a checkpoint, lands mid-run: at 1,500
# steps (K-step calls of tiny MLPs, ~20 us a step) the launch once finished first.
STEPS = 12000
SPEC = """
[runtime]
policy = "pack"
memory = "512MiB"

[[job]]
entry = "xshare.models.mlp:make_job"
steps = {steps}
params = {{ width = [16, 32], batch = 16, lr = 0.003 }}
"""


def _launch(*args, cwd):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "xshare", "launch", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=sigint_as_in_a_terminal)


def _wait_for_checkpoints(run: Path, proc, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # (an Orbax step directory is named {step} once it is complete)
        if sum(bool(checkpoint.steps(d)) for d in run.glob("*/" + checkpoint.FILENAME)) == 2:
            return
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.02)
    raise AssertionError("the launch wrote no checkpoints")


def _check_final_states(run: Path):
    for job_dir, width in ((run / "0_width=16", 16), (run / "1_width=32", 32)):
        spec = mlp.make_job(width=width, batch=16, lr=0.003, steps=STEPS)
        saved = checkpoint.load(job_dir / checkpoint.FILENAME, spec.state, job=job_dir.name)
        assert saved.done and saved.step == STEPS
        assert_trees_equal(saved.state, plain_loop(spec)[0])
        steps = [json.loads(line)["step"] for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
        assert steps == list(range(STEPS))


@pytest.mark.parametrize("sig, code", [
    # (the default run's SIGKILL-and-resume is tests/reliability/test_launch_signals.py's)
    pytest.param(signal.SIGKILL, -9, marks=pytest.mark.slow),
    pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow),
])
def test_interrupted_launch_resumes_to_the_uninterrupted_state(tmp_path, sig, code):
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(steps=STEPS))
    run = tmp_path / "run"
    repo = Path(__file__).resolve().parents[2]
    proc = _launch(str(spec), "--out", str(run), "--checkpoint-every", "30", cwd=repo)
    _wait_for_checkpoints(run, proc)
    proc.send_signal(sig)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == code, out
    if sig == signal.SIGINT:
        assert f"resume with: xshare launch --resume {run}" in out
    unfinished = [d for d in run.iterdir() if d.is_dir()
                  and len((d / "metrics.jsonl").read_text().splitlines()) < STEPS]
    assert unfinished, "the launch finished before it was interrupted; nothing was tested"

    resumed = _launch("--resume", str(run), cwd=repo)
    out = resumed.communicate(timeout=180)[0]
    assert resumed.returncode == 0, out
    _check_final_states(run)
