"""The recorder writes a running job's metrics rows through to metrics.jsonl a batch at a time
(not when a 64 KiB buffer fills): readers of the run directory (``xshare tune --ray``, which
prunes from these files) see them while the job runs."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np

from xshare.runtime.observe.recorder import Recorder


def test_a_batch_of_rows_is_on_disk_before_the_job_ends(tmp_path):
    rec = Recorder(log_dir=tmp_path, checkpoint_dir=None, t0=0.0)
    job = SimpleNamespace(id=1, name="trial-0", program=SimpleNamespace(metric_names=("loss",)))
    try:
        rec.open(job)
        rec.metrics_rows([(job, k, 1.0 + k, np.array([0.5 / (k + 1)]), None) for k in range(3)])
        assert rec.flush()  # (everything posted so far handled; the job's file is still open)
        rows = [json.loads(line) for line in (tmp_path / "trial-0" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [0, 1, 2] and rows[2]["loss"] == 0.5 / 3
    finally:
        rec.close_job(job)
        rec.close()


def test_flush_after_close_says_everything_was_written(tmp_path):
    # `with Runtime() as rt: ...; rt.stop()` waits on exit, and waiting flushes the recorder:
    # once closed, its thread wrote everything posted before it stopped, so a flush must not
    # wait for a thread that is gone (it did, for its whole timeout, and then said False).
    import xshare

    rt = xshare.Runtime(log_dir=tmp_path)
    rt.close()
    assert rt.recorder.flush(timeout=5) is True
