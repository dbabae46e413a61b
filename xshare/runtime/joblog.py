"""Per-job files under ``log_dir``/``checkpoint_dir``: ``metrics.jsonl``, ``log.txt`` and the
checkpoint written after a step.

A mixin of :class:`xshare.runtime.Runtime`.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import jax

from . import checkpoint
from .causes import short_error
from .records import JobRecord, now_s

log = logging.getLogger("xshare.runtime")


def safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.=," else "_" for c in name)


class JobLogMixin:
    def _open_log(self, job: JobRecord) -> None:
        if self.log_dir is None:
            return
        d = self.log_dir / safe_name(job.name)
        d.mkdir(parents=True, exist_ok=True)
        metrics_path = d / "metrics.jsonl"
        if self._resume and metrics_path.exists():
            # Steps after the checkpoint ran but their state was lost: they run again, so their
            # old rows go (the file then reads exactly like an uninterrupted run's).
            keep = [ln for ln in metrics_path.read_text().splitlines()
                    if ln.strip() and json.loads(ln).get("step", -1) < job.spec.start_step]
            metrics_path.write_text("".join(ln + "\n" for ln in keep))
        job.log_file = open(metrics_path, "a", buffering=1 << 16)
        (d / "log.txt").touch()

    def _log(self, job: JobRecord, line: str) -> None:
        if self.log_dir is None:
            return
        with open(self.log_dir / safe_name(job.name) / "log.txt", "a") as f:
            f.write(line.rstrip("\n") + "\n")

    def _write_metrics(self, job: JobRecord, step: int, metrics: dict[str, float]) -> None:
        if job.log_file is not None:
            row = {"step": step, "time_s": round(now_s() - self.t0, 6), **metrics}
            job.log_file.write(json.dumps(row) + "\n")

    def _save_checkpoint(self, job: JobRecord, step: int, state: Any, *, done: bool) -> None:
        """Copy ``state`` to the host and write it (outside the lock). A failed write is logged and
        fails nothing: the job goes on and the previous checkpoint stays valid."""
        if job.log_file is not None:
            job.log_file.flush()  # the metrics rows up to the checkpoint survive a kill
        try:
            host = state if done else jax.device_get(state)
            checkpoint.save(checkpoint.path_for(self.checkpoint_dir, safe_name(job.name)), step=step,
                            state=host, metrics=job.last_metrics, done=done)
        except Exception as err:  # noqa: BLE001
            log.warning("job %r: checkpoint at step %d failed: %s", job.name, step, err)
            self._log(job, f"checkpoint at step {step} failed: {short_error(err)}")
