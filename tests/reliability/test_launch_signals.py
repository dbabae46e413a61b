"""`xshare launch` interrupted at random moments (SIGINT before the runtime exists, a double
SIGINT, SIGTERM, SIGKILL), then `--resume`: the documented exit codes (130 for SIGINT/SIGTERM,
-9 for SIGKILL), no traceback, no discovery file left behind (a killed launch's is cleaned by
the next one), and final states bit-identical to an uninterrupted run — `--checkpoint-every 0`
included (it checkpoints on exit)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import assert_trees_equal, plain_loop, sigint_as_in_a_terminal
from xshare.runtime.observe import checkpoint

REPO = Path(__file__).resolve().parents[2]
STEPS, MARK_AT = 300, 60
MODULE = f'''
import time
from xshare.models import mlp

def make_job(seed=0, slow=0.003, steps={STEPS}):
    """A tiny MLP whose data marks step {MARK_AT} with a file (the test's cue) and takes a few
    ms per batch (so an interrupt lands mid-run); the batches themselves do not depend on it."""
    spec = mlp.make_job(width=8, depth=1, batch=4, steps=steps, seed=seed, lr=1e-2)
    data = spec.data

    def batches(step):
        if step == {MARK_AT} and slow:
            open(f"reached-{{seed}}", "w").close()
        if slow:
            time.sleep(slow)
        return data(step)

    return spec.replace(data=batches)
'''


@pytest.fixture
def work(tmp_path, monkeypatch):
    (tmp_path / "relmod.py").write_text(MODULE)
    (tmp_path / "disc").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _launch(work: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "XSHARE_RUNTIME_DIR": str(work / "disc"),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "xshare", "launch", *args], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=sigint_as_in_a_terminal)


def _start(work: Path, *extra: str) -> subprocess.Popen:
    return _launch(work, "relmod:make_job", "--set", "seed=0,1", "--out", "run", *extra)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the launch ended (rc {proc.returncode}) before {path.name}:\n"
                                 + proc.stdout.read())
        assert time.monotonic() < deadline, f"no {path} after {timeout} s"
        time.sleep(0.005)


def _finish(proc: subprocess.Popen, code: int) -> str:
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == code, out
    assert "Traceback" not in out, out
    return out


def _resume_and_check(work: Path) -> None:
    """--resume finishes every job; each final state equals the plain loop's, bit for bit, and
    each metrics.jsonl holds every step exactly once."""
    from relmod import make_job

    out = _finish(_launch(work, "--resume", str(work / "run")), 0)
    dirs = sorted(d for d in (work / "run").iterdir() if d.is_dir())
    assert len(dirs) == 2, (dirs, out)
    for d in dirs:
        seed = int(d.name.split("seed=")[1])
        spec = make_job(seed=seed, slow=0)
        saved = checkpoint.load(d / checkpoint.FILENAME, spec.state, job=d.name)
        assert saved is not None and saved.done and saved.step == STEPS, (d, saved and saved.step)
        assert_trees_equal(saved.state, plain_loop(spec)[0])
        steps = [json.loads(ln)["step"] for ln in (d / "metrics.jsonl").read_text().splitlines()]
        assert steps == list(range(STEPS)), d
    assert list((work / "disc").iterdir()) == []  # every discovery file removed


def _interrupted_mid_run(work: Path) -> None:
    """Something must have been left to resume (else the test tested nothing)."""
    done = [d for d in (work / "run").iterdir() if d.is_dir()
            and len((d / "metrics.jsonl").read_text().splitlines()) >= STEPS]
    assert len(done) < 2, "the launch finished before the signal; nothing was tested"


def _before_any_handler(proc: subprocess.Popen, out: str) -> bool:
    """Whether a SIGINT ended the launch before any of the command's code ran: in the
    interpreter's start (``site``: "Fatal Python error", status 1) or while ``python -m`` imports
    the package itself (runpy, status -2), before ``xshare/__main__.py``. No code of xshare's can
    handle it there (the package's ``__init__`` must not take over a library user's Ctrl-C), and
    Python prints its traceback as for any module. On a loaded machine's fresh clone (no
    bytecode yet) 0.2 s can still be that early. A traceback through the command's own frames
    (``__main__``, ``xshare/cli``) is not excused."""
    interrupted = proc.returncode == -signal.SIGINT or (proc.returncode == 1 and "KeyboardInterrupt" in out)
    ours = ("xshare/__main__.py", "xshare/cli", "xshare: interrupted")
    return interrupted and not any(mark in out for mark in ours)


@pytest.mark.parametrize("delay", [0.2, 0.9])
def test_sigint_before_the_runtime_exists_exits_130_without_traceback(work, delay):
    for attempt in range(3):
        proc = _start(work)
        time.sleep(delay + 0.2 * attempt)  # python starting, jax importing, the factory building
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
        if not _before_any_handler(proc, out):
            break  # (else too early for any handler: signal the next launch later)
    assert proc.returncode == 130, out
    assert "Traceback" not in out, out
    assert list((work / "disc").iterdir()) == []
    if (work / "run" / "spec.json").exists():  # interrupted after the run directory was made
        _resume_and_check(work)


@pytest.mark.slow  # (the default run keeps SIGINT before the runtime and SIGTERM mid-run)
def test_double_sigint_mid_run_with_checkpoint_every_0_checkpoints_on_exit(work):
    rng = random.Random(1)
    proc = _start(work, "--checkpoint-every", "0")
    _wait_for(work / "reached-1", proc)
    time.sleep(rng.uniform(0, 0.1))
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)  # a second Ctrl-C while it stops: a note, no traceback
    out = _finish(proc, 130)
    assert "resume with: xshare launch --resume run" in out, out
    _interrupted_mid_run(work)
    for d in (work / "run").iterdir():
        if d.is_dir():  # --checkpoint-every 0 means "on exit": there is one for every job
            assert (d / checkpoint.FILENAME).exists(), d
    assert list((work / "disc").iterdir()) == []
    _resume_and_check(work)


def test_sigterm_mid_run_exits_130_and_resumes_exactly(work):
    rng = random.Random(2)
    proc = _start(work, "--checkpoint-every", "25")
    _wait_for(work / "reached-0", proc)
    time.sleep(rng.uniform(0, 0.2))
    proc.send_signal(signal.SIGTERM)
    _finish(proc, 130)
    _interrupted_mid_run(work)
    assert list((work / "disc").iterdir()) == []
    _resume_and_check(work)


def test_sigkill_mid_run_resumes_exactly_and_its_discovery_file_is_cleaned(work):
    rng = random.Random(3)
    proc = _start(work, "--checkpoint-every", "25")
    _wait_for(work / "reached-1", proc)
    time.sleep(rng.uniform(0, 0.2))
    proc.send_signal(signal.SIGKILL)
    _finish(proc, -signal.SIGKILL)
    _interrupted_mid_run(work)
    stale = list((work / "disc").glob("*.json"))
    assert [p.name.split("-")[0] for p in stale] == [str(proc.pid)]  # SIGKILL cannot clean up
    _resume_and_check(work)  # ... the next launch does (and removes its own at exit)
