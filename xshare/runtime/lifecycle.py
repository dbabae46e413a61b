"""The dispatcher's job lifecycle ends: failing, finishing, checkpoints, finalizing.

A job ends only when nothing of it is in flight (``_settle``): a failure is recorded at once
(``_fail``) and applied when its steps have retired; ``_finalize`` moves it to its terminal state,
drops its device buffers and spec, releases its reservation, and wakes its waiters.
Runs on the dispatcher thread only.
"""

from __future__ import annotations

import logging
import traceback

import jax

from . import evaluation
from .causes import short_error
from .records import JobRecord, now_s
from .states import Event, JobState, transition

log = logging.getLogger("xshare.runtime")

S = JobState


class Lifecycle:
    """How jobs end: failures, finishing, checkpoints and the final release. A part of ``Dispatcher``:
    its methods run on the dispatcher thread and share the dispatcher's tables."""

    def _settle(self, job: JobRecord) -> None:
        """A job with nothing in flight: end it if it failed or ran out of steps."""
        if job.in_flight or job.terminal:
            return
        if job.error is not None:
            self._finalize(job, Event.FAIL)
        elif job.steps_left == 0 and job.state in (S.RUNNING, S.PAUSED) and job.id not in self.evaluating:
            self._finish(job)

    def _finish(self, job: JobRecord) -> None:
        try:
            # A device-to-host copy, once per job.
            host = job.user_state(jax.device_get(self._state_of(job)))
        except Exception as err:  # noqa: BLE001 - the last step failed on the device
            self._fail(job, f"its final state could not be read: {short_error(err)}", err)
            self._finalize(job, Event.FAIL)
            return
        job.host_state = host
        if self.checkpoint_dir is not None:
            step, source = job.spec.start_step + job.steps_done, job.source
            self.recorder.checkpoint(job, step, host, job.last_metrics, done=True,
                                     data_state=source.state_at(step) if source is not None else None)
        self._finalize(job, Event.FINISH)

    def _save(self, job: JobRecord, *, done: bool) -> None:
        if self.checkpoint_dir is None:
            return
        self._flush_rows()
        arrays = self._state_of(job)
        if arrays is None:
            return
        host = job.user_state(jax.device_get(arrays))
        step = job.spec.start_step + job.steps_done
        source = job.source  # (None once its data ran out: a resume then replays)
        self.recorder.checkpoint(job, step, host, job.last_metrics, done=done,
                                 data_state=source.state_at(step) if source is not None else None)

    def _fail(self, job: JobRecord, cause: str, err: BaseException | None = None) -> None:
        """Record a failure; the job ends once its in-flight steps have retired."""
        self.owned()
        if job.error is not None or job.terminal:
            return
        job.error, job.exception = cause, err
        log.warning("job %r failed: %s", job.name, cause)
        self.recorder.line(job, f"FAILED: {cause}")
        if err is not None:
            self.recorder.line(job, "".join(traceback.format_exception(err)))
        if self._running.pop(job.id, None) is not None:
            self._dirty = True

    def _finalize(self, job: JobRecord, event: Event) -> None:
        """Move a job with nothing in flight to its terminal state and give its memory to
        whoever waits for it."""
        self.owned()
        if job.terminal:
            return
        job.state = transition(job.state, event)
        job.ended_s = now_s() - self.t0
        self._running.pop(job.id, None)
        if self._lane_current.get(job.lane) is job:
            del self._lane_current[job.lane]
        if job in self._swap_waiting:
            self._swap_waiting.remove(job)
        if job.eval is not None or job.id in self.evaluating:
            evaluation.release(self, job)
        if job.group is not None:
            self._leave_group(job)
        self.tiers.forget(job)
        job.arrays = job.host_arrays = job.ident = None  # drop the device buffers
        # ... and the spec's step, initial state and data (its result is host_state): a runtime
        # that has run thousands of jobs must not keep every one's initial arrays and step
        # closure (a model's graph) alive; the program cache's memo is weak on the step.
        job.spec = job.spec.replace(job=None, state=None, data=None, observer=None, eval_step=None,
                                    eval_data=None, on_metrics=None)
        job.source = None
        job.batches.clear()
        self._dirty = True
        if self._rows:
            self._flush_rows()
        self.recorder.line(job, f"{job.state.value} after {job.steps_done} steps")
        self.recorder.close_job(job)
        self.jobs.pop(job.id, None)
        if job.in_ledger:
            job.in_ledger = False
            self._admitted(self.arena.release(job.id))
        job.done_event.set()
        self._on_end(job)

