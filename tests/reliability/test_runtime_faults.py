"""Faults inside one Runtime: lost log directories, a dispatch failure on a checkpoint step,
and job names that are not safe directory names. Each case ends with ``wait()``/``stop()``
returning within a bound; a hang fails the test instead of eating the suite's time."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import xshare
from tests.helpers import assert_trees_equal, linreg_data, linreg_state, linreg_step, plain_loop
from xshare.runtime.observe import checkpoint, recorder

STEPS = 300
GATE_AT = 100


def _gated(seed: int, reached: threading.Event, gate: threading.Event, delay_s: float = 0.0):
    """linreg data that stops at step GATE_AT until the test has done its damage (each batch
    ``delay_s`` slow: over a millisecond, the feeder threads make it, not the dispatcher)."""
    data = linreg_data(seed=seed)

    def gated(step: int):
        if step == GATE_AT:
            reached.set()
            assert gate.wait(30), "the test never opened the gate"
        if delay_s:
            time.sleep(delay_s)
        return data(step)

    return gated


def _specs(n, reached, gate):
    return [linreg_step.bind(linreg_state(seed=i), _gated(i, reached, gate), steps=STEPS, name=f"job{i}")
            for i in range(n)]


def _run_with_damage(tmp_path, damage, n=4):
    """Run n jobs with a log and checkpoint directory, damage it at step GATE_AT, and return
    the handles once ``wait()`` has returned (bounded)."""
    logs = tmp_path / "logs"
    reached, gate = threading.Event(), threading.Event()
    specs = _specs(n, reached, gate)
    rt = xshare.Runtime(policy="pack", memory="256MiB", log_dir=logs, checkpoint_every=20, max_lanes=2)
    try:
        handles = rt.submit_many(specs)
        assert reached.wait(60), "no job reached the gate"
        damage(logs)
        gate.set()
        assert rt.wait(timeout=60), [h.progress() for h in handles]
    finally:
        gate.set()
        rt.close()
    return specs, handles


def _assert_exact(specs, handles):
    for spec, h in zip(specs, handles):
        assert h.status() == "done", (h.name, h.status(), h.error)
        ref = plain_loop(linreg_step.bind(spec.state, linreg_data(seed=int(h.name[3:])), steps=STEPS,
                                          name="ref"))
        assert_trees_equal(h.result()[0], ref[0])


def _retried(attempt, what: str):
    # The recorder may be writing a checkpoint (which recreates the log directory) in between
    # the damage's steps: try again, for up to half a second, until ``attempt`` says it won.
    for _ in range(50):
        if attempt():
            return
        time.sleep(0.01)
    raise AssertionError(f"could not {what}")


def _delete(logs: Path):
    def attempt():
        shutil.rmtree(logs, ignore_errors=True)
        return not logs.exists()

    _retried(attempt, f"delete {logs}")


def test_log_directory_deleted_mid_run_every_job_finishes_exactly(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "xshare.runtime")
    specs, handles = _run_with_damage(tmp_path, _delete)
    _assert_exact(specs, handles)
    # (Rows written after the deletion go to the unlinked file, and the next checkpoint makes
    # the directory again, so a warning is not certain: one at most per job is.)
    # One "logging is off" warning per job at most: a lost disk does not flood the log.
    for h in handles:
        off = [r for r in caplog.records if f"job {h.name!r}" in r.getMessage()
               and "logging is off" in r.getMessage()]
        assert len(off) <= 1, [r.getMessage() for r in off]


def _replace_with_file(logs: Path):
    # The file is created exclusively: a directory made again after the delete loses it the race.
    def attempt():
        _delete(logs)
        try:
            fd = os.open(logs, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except (FileExistsError, IsADirectoryError):
            return False
        with os.fdopen(fd, "w") as f:
            f.write("not a directory\n")
        return True

    _retried(attempt, f"replace {logs} with a file")


def test_log_directory_replaced_by_a_file_mid_run(tmp_path):
    _assert_exact(*_run_with_damage(tmp_path, _replace_with_file))


def _read_only(logs: Path, monkeypatch):
    if os.geteuid() != 0:
        for d in [logs, *[p for p in logs.rglob("*") if p.is_dir()]]:
            d.chmod(stat.S_IRUSR | stat.S_IXUSR)
        for f in logs.rglob("*"):
            if f.is_file():
                f.chmod(stat.S_IRUSR)
        return
    # root ignores permission bits: every new write under logs/ fails as on a read-only mount.
    real_open, real_save = open, checkpoint.save

    def denied(path):
        raise PermissionError(13, "Permission denied (read-only test)", str(path))

    def ro_open(path, mode="r", *a, **k):
        if str(path).startswith(str(logs)) and any(c in mode for c in "wax+"):
            denied(path)
        return real_open(path, mode, *a, **k)

    def ro_save(path, **k):
        if str(path).startswith(str(logs)):
            denied(path)
        return real_save(path, **k)

    monkeypatch.setattr(recorder, "open", ro_open, raising=False)
    monkeypatch.setattr(checkpoint, "save", ro_save)


def test_log_directory_made_read_only_mid_run(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, "xshare.runtime")
    try:
        specs, handles = _run_with_damage(tmp_path, lambda logs: _read_only(logs, monkeypatch))
    finally:
        for d in [tmp_path, *tmp_path.rglob("*")]:
            if d.is_dir():
                d.chmod(0o755)
    _assert_exact(specs, handles)
    assert any("logging is off" in r.getMessage() for r in caplog.records), "the damage did nothing"


def test_stop_returns_after_a_dispatch_failure_on_a_checkpoint_step(tmp_path):
    """The bad job's batch at step 4 (a checkpoint step with checkpoint_every=5) has the wrong
    shape: it fails at dispatch; stop() must still return, reporting nothing it waits for."""
    good = linreg_data(seed=1)

    def bad(step):
        b = good(step)
        return {"x": b["x"][:, :3], "y": b["y"]} if step == 4 else b

    reached, gate = threading.Event(), threading.Event()
    # Slow data, made by a feeder thread: its gate must not hold the dispatcher, which fails the
    # bad job only once its step's program for those shapes failed to compile (in the background:
    # engine/shapes.py), possibly after the healthy job reached its gate.
    healthy = linreg_step.bind(linreg_state(seed=2), _gated(2, reached, gate, delay_s=0.002), steps=STEPS,
                               name="healthy")
    rt = xshare.Runtime(policy="pack", memory="256MiB", log_dir=tmp_path, checkpoint_every=5)
    try:
        hb, hh = rt.submit_many([linreg_step.bind(linreg_state(seed=1), bad, steps=STEPS, name="bad"), healthy])
        assert reached.wait(60)
        deadline = time.monotonic() + 30
        while hb.status() != "failed" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert hb.status() == "failed", hb.progress()
        assert hb.error.startswith("batch 4 does not match"), hb.error
        gate.set()
        t = time.monotonic()
        missed = rt.stop(checkpoint=True, timeout=30)
        assert time.monotonic() - t < 30
    finally:
        gate.set()
        rt.close()
    assert missed == []
    assert hh.status() in ("cancelled", "done")
    # The healthy job's stop checkpoint is valid and resumable.
    saved = checkpoint.load(tmp_path / "healthy" / checkpoint.FILENAME, healthy.state, job="healthy")
    assert saved is not None and saved.step >= GATE_AT


def test_unsafe_names_are_refused_or_get_distinct_directories_inside_log_dir(tmp_path):
    logs = tmp_path / "inner" / "logs"
    data = linreg_data(seed=0)
    with xshare.Runtime(policy="pack", memory="256MiB", log_dir=logs, checkpoint_every=5) as rt:
        for bad in ("..", ".", "a\x00b"):
            with pytest.raises(ValueError, match="cannot name a directory"):
                rt.submit(linreg_step.bind(linreg_state(), data, steps=10, name=bad))
        handles = rt.submit_many([linreg_step.bind(linreg_state(seed=i), data, steps=10, name=n)
                                  for i, n in enumerate(["a/b", "a_b", "../up", ".hidden"])])
        assert rt.wait(timeout=60)
    assert [h.status() for h in handles] == ["done"] * 4
    # Nothing outside log_dir; one directory per job.
    assert sorted(p.name for p in (tmp_path / "inner").iterdir()) == ["logs"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inner"]
    dirs = sorted(p.name for p in logs.iterdir())
    assert dirs == sorted({recorder.job_dir(h.name) for h in handles}) and len(dirs) == 4
    for h in handles:
        d = logs / recorder.job_dir(h.name)
        saved = checkpoint.load(d / checkpoint.FILENAME, linreg_state(), job=h.name)
        assert saved.done and saved.step == 10
        assert_trees_equal(saved.state, h.result()[0])


def test_names_that_collide_in_one_submit_many_are_refused(tmp_path):
    data = linreg_data()
    with xshare.Runtime(policy="pack", memory="256MiB", log_dir=tmp_path) as rt:
        with pytest.raises(ValueError, match="already submitted|same directory"):
            rt.submit_many([linreg_step.bind(linreg_state(), data, steps=2, name="x"),
                            linreg_step.bind(linreg_state(), data, steps=2, name="x")])
        assert rt.jobs == []  # all or nothing


def test_jobs_cancelled_while_compiling_log_cleanly_and_leak_no_file(tmp_path, caplog):
    """A cancel that lands before the compile pool has opened the job's files: its last log
    line must not turn its logging off, and the metrics file opened afterwards must not leak."""
    caplog.set_level(logging.WARNING, "xshare.runtime")
    with xshare.Runtime(policy="pack", memory="256MiB", log_dir=tmp_path, compile_workers=1) as rt:
        rt.submit(linreg_step.bind(linreg_state(), linreg_data(), steps=2, name="warm"))
        assert rt.wait(timeout=60)
        fds = len(os.listdir("/proc/self/fd"))
        # Hold the compile pool's one worker, so every cancel lands before its job's prepare
        # (with a warm program cache a prepare can otherwise win the race and run steps).
        gate = threading.Event()
        rt._pool.submit(gate.wait, 60)
        for k in range(30):
            rt.cancel(rt.submit(linreg_step.bind(linreg_state(), linreg_data(), steps=200, name=f"c{k}")))
        gate.set()
        assert rt.wait(timeout=60)
        rt._pool.submit(lambda: None).result(timeout=60)  # every _prepare has run
        assert rt.recorder.flush()
        assert len(os.listdir("/proc/self/fd")) <= fds
    assert not [r.getMessage() for r in caplog.records if "logging is off" in r.getMessage()]
    for k in range(30):
        assert "cancelled after 0 steps" in (tmp_path / f"c{k}" / "log.txt").read_text()


def test_a_job_done_before_the_recorder_reaches_its_open_keeps_every_metrics_row(tmp_path):
    """The recorder runs behind the dispatcher: a short job can be done before its queued open
    is written. Its rows (queued after the open) must still land in metrics.jsonl (CI lost a
    whole file this way when the open asked job.state instead of the queue's order)."""
    gate = threading.Event()
    rec = recorder.Recorder(log_dir=tmp_path, checkpoint_dir=None, t0=0.0)
    try:
        rec._queue.put((gate.wait, ()))  # the recorder is busy: everything below queues up
        program = type("P", (), {"metric_names": ("loss",)})()
        job = type("J", (), {"id": 7, "name": "fast", "terminal": True, "program": program})()
        rec.open(job)
        rec.metrics_rows([(job, k, 0.0, np.array([float(k)]), None) for k in range(3)])
        rec.close_job(job)
        gate.set()
        assert rec.flush()
    finally:
        rec.close()
    rows = [json.loads(ln) for ln in (tmp_path / "fast" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows] == [0.0, 1.0, 2.0]


def test_resume_drops_a_torn_metrics_line_and_logs_where_it_resumed(tmp_path, caplog):
    """A launch killed mid-write (or a full disk) leaves a torn last line in metrics.jsonl: the
    resume drops it with a warning, says "resumed at step N" in log.txt, and ends exact."""
    caplog.set_level(logging.WARNING, "xshare.runtime")
    reached, gate = threading.Event(), threading.Event()
    spec = linreg_step.bind(linreg_state(seed=4), _gated(4, reached, gate), steps=STEPS, name="torn")
    rt = xshare.Runtime(policy="pack", memory="256MiB", log_dir=tmp_path, checkpoint_every=30)
    try:
        rt.submit(spec)
        assert reached.wait(60)
        gate.set()
        assert rt.stop(checkpoint=True, timeout=30) == []
    finally:
        gate.set()
        rt.close()
    d = tmp_path / "torn"
    saved = checkpoint.load(d / checkpoint.FILENAME, spec.state, job="torn")
    assert saved is not None and not saved.done and GATE_AT <= saved.step < STEPS
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"step": 99999, "lo')  # torn: no closing brace, no newline
    with xshare.Runtime(policy="pack", memory="256MiB", log_dir=tmp_path, resume=True) as rt:
        h = rt.submit(linreg_step.bind(linreg_state(seed=4), linreg_data(seed=4), steps=STEPS, name="torn"))
        assert rt.wait(timeout=60)
    assert h.status() == "done"
    ref = plain_loop(linreg_step.bind(linreg_state(seed=4), linreg_data(seed=4), steps=STEPS, name="r"))
    assert_trees_equal(h.result()[0], ref[0])
    steps = [json.loads(ln)["step"] for ln in (d / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(STEPS))
    assert f"resumed at step {saved.step}" in (d / "log.txt").read_text()
    assert any("dropped a torn line" in r.getMessage() for r in caplog.records)
