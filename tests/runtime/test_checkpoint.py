"""Checkpoints: periodic, final and on stop(); resume continues bit for bit."""

from __future__ import annotations

import time


import xshare
from xshare.runtime.observe import checkpoint
from tests.helpers import assert_trees_equal, linreg_data, linreg_state, linreg_step, plain_loop


def _slow_data(seed, delay=0.004):
    data = linreg_data(seed=seed)

    def slow(step):
        time.sleep(delay)
        return data(step)

    return slow


def test_periodic_and_final_checkpoints(tmp_path):
    spec = linreg_step.bind(linreg_state(), linreg_data(), steps=35, name="ck")
    with xshare.Runtime(memory="64MiB", log_dir=tmp_path, checkpoint_every=10) as rt:
        h = rt.submit(spec)
    final, _ = h.result()
    saved = checkpoint.load(tmp_path / "ck" / checkpoint.FILENAME, spec.state, job="ck")
    assert saved.done and saved.step == 35
    assert_trees_equal(saved.state, final)
    assert_trees_equal(final, plain_loop(spec)[0])


def test_stop_then_resume_ends_bit_identical_to_an_uninterrupted_run(tmp_path):
    specs = [linreg_step.bind(linreg_state(seed=i), _slow_data(i), steps=120, name=f"r{i}")
             for i in range(3)]
    rt = xshare.Runtime(memory="64MiB", log_dir=tmp_path, checkpoint_every=7)
    rt.submit_many(specs)
    while min(h.progress().steps_done for h in rt.jobs) < 15:
        time.sleep(0.01)
    rt.stop()
    stopped_at = {h.name: h.progress().steps_done for h in rt.jobs}
    assert all(h.status() == "cancelled" for h in rt.jobs)
    assert all(0 < n < 120 for n in stopped_at.values()), stopped_at

    with xshare.Runtime(memory="64MiB", log_dir=tmp_path, resume=True) as rt2:
        handles = rt2.submit_many(specs)
    for spec, h in zip(specs, handles):
        assert_trees_equal(h.result()[0], plain_loop(spec)[0])
        rows = [int(line.split('"step": ')[1].split(",")[0])
                for line in (tmp_path / spec.name / "metrics.jsonl").read_text().splitlines()]
        assert rows == list(range(120)), f"{spec.name}: metrics rows are not exactly steps 0..119"


def test_resume_of_a_finished_job_returns_its_saved_state_without_running(tmp_path):
    spec = linreg_step.bind(linreg_state(), linreg_data(), steps=12, name="fin")
    with xshare.Runtime(memory="64MiB", log_dir=tmp_path, checkpoint_every=5) as rt:
        first = rt.submit(spec).result()[0]
    with xshare.Runtime(memory="64MiB", log_dir=tmp_path, resume=True) as rt:
        h = rt.submit(spec)
    assert h.status() == "done"
    assert_trees_equal(h.result()[0], first)
    assert rt.timeline() == []


def test_checkpoint_of_another_model_is_refused_with_the_mismatch(tmp_path):
    spec = linreg_step.bind(linreg_state(dim=8), linreg_data(dim=8), steps=3, name="m")
    with xshare.Runtime(memory="64MiB", log_dir=tmp_path, checkpoint_every=1) as rt:
        rt.submit(spec)
    other = linreg_step.bind(linreg_state(dim=4), linreg_data(dim=4), steps=3, name="m")
    with xshare.Runtime(memory="64MiB", log_dir=tmp_path, resume=True) as rt:
        h = rt.submit(other)  # returns at once; the checkpoint is read off the submitting thread
        h.wait(timeout=60)
    assert h.status() == "failed", "a mismatched checkpoint was accepted"
    assert h.error.startswith("could not resume from its checkpoint: ")
    assert "array 1 (w) is float32[8, 1] but the job's state has float32[4, 1]" in h.error
