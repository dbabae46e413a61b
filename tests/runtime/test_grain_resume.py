"""A job fed by a checkpointable iterator (Grain's, or any with get_state/set_state) resumes
from the iterator state saved with its checkpoint, reading only the records after it; other
iterables replay their first batches, and the job's log says how many."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

import xshare
from xshare.runtime.observe import checkpoint
from tests.helpers import assert_trees_equal, linreg_data, linreg_state, linreg_step, plain_loop

grain = pytest.importorskip("grain")
from tests.runtime import grain_job  # noqa: E402 (needs grain)

REPO = Path(__file__).resolve().parents[2]


def _job(run, count, *extra):
    return subprocess.Popen([sys.executable, "-m", "tests.runtime.grain_job", str(run), str(count), *extra],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_grain_fed_job_killed_and_resumed_reads_only_the_records_after_its_checkpoint(tmp_path):
    run, ckpt = tmp_path / "run", tmp_path / "run" / "grain" / checkpoint.FILENAME
    proc = _job(run, tmp_path / "first.txt")
    deadline = time.monotonic() + 120
    while not any(s >= 60 for s in checkpoint.steps(ckpt)):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "no checkpoint at step 60 within 120 s"
        time.sleep(0.01)
    proc.kill()  # SIGKILL: nothing of the runtime runs after this
    proc.communicate(timeout=30)
    at = checkpoint.steps(ckpt)[-1]  # where the resume starts
    assert at < grain_job.STEPS, "the job finished before it was killed; nothing was tested"

    resumed = _job(run, tmp_path / "second.txt", "--resume")
    out = resumed.communicate(timeout=180)[0]
    assert resumed.returncode == 0, out

    read = [int(x) for x in (tmp_path / "second.txt").read_text().split()]
    want = grain_job.order()[at * grain_job.BATCH:]
    assert len(read) == len(want), f"the resumed job read {len(read)} records, {len(want)} were left"
    assert sorted(read) == sorted(want)
    log = (run / "grain" / "log.txt").read_text()
    assert f"resumed at step {at}; its data iterator resumed from the checkpoint's state" in log

    spec = grain_job.spec()
    saved = checkpoint.load(ckpt, spec.state, job="grain")
    assert saved.done and saved.step == grain_job.STEPS
    assert_trees_equal(saved.state, plain_loop(spec)[0])  # an uninterrupted run, plain jit loop


class Batches:
    """An iterable without get_state/set_state (slow enough to stop mid-run): a resume must
    replay it."""

    def __init__(self, n):
        self.data, self.n = linreg_data(seed=9), n

    def __iter__(self):
        for k in range(self.n):
            time.sleep(0.003)
            yield self.data(k)


def test_other_iterables_replay_and_the_log_says_how_many_batches(tmp_path):
    spec = linreg_step.bind(linreg_state(seed=9), Batches(200), steps=200, name="replay")
    rt = xshare.Runtime(memory="64MiB", log_dir=tmp_path, checkpoint_every=10)
    h = rt.submit(spec)
    while h.progress().steps_done < 15:
        time.sleep(0.005)
    rt.stop()  # checkpoints where it stopped
    rt.close()
    at = checkpoint.load(tmp_path / "replay" / checkpoint.FILENAME, spec.state, job="replay").step
    assert 15 <= at < 200
    with xshare.Runtime(memory="64MiB", log_dir=tmp_path, resume=True) as rt:
        h = rt.submit(spec)
    log = (tmp_path / "replay" / "log.txt").read_text()
    assert f"resumed at step {at}; its data replayed {at} batches to get there" in log
    assert_trees_equal(h.result()[0], plain_loop(spec)[0])


class BytesState:
    """Any iterator with get_state/set_state (here bytes, as Grain's DataLoader iterators
    return) resumes from its state: it counts the batches it makes."""

    def __init__(self, made):
        self.data, self.k, self.made = linreg_data(seed=4), 0, made

    def __iter__(self):
        return self

    def __next__(self):
        time.sleep(0.003)
        self.made.append(self.k)
        self.k += 1
        return self.data(self.k - 1)

    def get_state(self):
        return str(self.k).encode()

    def set_state(self, state):
        self.k = int(state.decode())


def test_any_iterator_with_get_state_and_set_state_resumes_from_its_bytes_state(tmp_path):
    first, second = [], []
    spec = linreg_step.bind(linreg_state(seed=4), BytesState(first), steps=150, name="bytes")
    rt = xshare.Runtime(memory="64MiB", log_dir=tmp_path, checkpoint_every=10)
    h = rt.submit(spec)
    while h.progress().steps_done < 15:
        time.sleep(0.005)
    rt.stop()
    rt.close()
    at = checkpoint.load(tmp_path / "bytes" / checkpoint.FILENAME, spec.state, job="bytes").step
    with xshare.Runtime(memory="64MiB", log_dir=tmp_path, resume=True) as rt:
        h = rt.submit(spec.replace(data=BytesState(second)))
    assert second == list(range(at, 150))  # only the batches after the checkpoint
    reference = spec.replace(data=linreg_data(seed=4))
    assert_trees_equal(h.result()[0], plain_loop(reference)[0])
