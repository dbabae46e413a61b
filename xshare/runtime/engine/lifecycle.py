"""How jobs end: failing, finishing, checkpoints, and the one call that ends a job.

A job ends only when nothing of it is in flight (``settle``): a failure is recorded at once
(``fail``) and applied when its steps have retired. ``end`` is the one call that ends a job: it
moves the job to its terminal state, asks each owner to forget its part (admission's waiting
list, the job's evaluation, its group slot, its K-step tier), drops its device buffers and
spec, releases its reservation last, and wakes its waiters. ``abort`` is ``fail`` + ``end`` for
a job with nothing in flight.

No jax here: reading a job's final state (a device-to-host copy) goes through ``read_state``
(``placement.read_state``), so the lifecycle is tested on hand-made jobs
(``tests/runtime/engine/test_lifecycle.py``). Owned by the dispatcher thread.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any, Callable, Sequence

from ..causes import short_error
from .states import Event, JobState, transition
from .units import Units

log = logging.getLogger("xshare.runtime")

S = JobState


class Lifecycle:
    """Failures, finishing, checkpoints and the final release.

    ``forget``: each owner's ``forget(job)``, called in order when a job ends (before its
    buffers are dropped). ``release(job)``: give its reservation back (last). ``read_state(job)``:
    its state as the user's pytree on the host. ``flush``: send buffered metrics rows to the
    recorder (a job's last rows go before its end line). ``on_end(job)``: after it ended.
    """

    def __init__(self, units: Units, recorder: Any, *, t0: float, clock: Callable[[], float],
                 checkpoint_dir: Any, read_state: Callable[[Any], Any], keep_results: bool = True,
                 forget: Sequence[Callable[[Any], None]], release: Callable[[Any], None],
                 flush: Callable[[], None], on_end: Callable[[Any], None]):
        self.units, self.recorder = units, recorder
        self.t0, self.clock, self.checkpoint_dir = t0, clock, checkpoint_dir
        self.keep_results = keep_results
        self.read_state, self.forgetters, self.release = read_state, tuple(forget), release
        self.flush, self.on_end = flush, on_end

    def settle(self, job: Any) -> None:
        """A job with nothing in flight: end it if it failed or ran out of steps."""
        if job.in_flight or job.terminal:
            return
        if job.error is not None:
            self.end(job, Event.FAIL)
        elif job.steps_left == 0 and job.state in (S.RUNNING, S.PAUSED) and job.id not in self.units.evaluating:
            self.finish(job)

    def fail(self, job: Any, cause: str, err: BaseException | None = None, *, at_step: int | None = None) -> None:
        """Record a failure; the job ends once its in-flight steps have retired (``settle``).
        ``at_step``: the step whose own metrics failed it (a non-finite one under
        ``nan_policy="fail"``, its observer or ``on_metrics`` hook raising): the steps after it
        that were in flight then are not the job's (``Executor.retired`` drops their rows). A
        failure with no step (its data, a call that raised) keeps every step that completed."""
        if job.error is not None or job.terminal:
            return
        job.error, job.exception, job.failed_at = cause, err, at_step
        log.warning("job %r failed: %s", job.name, cause)
        self.recorder.line(job, f"FAILED: {cause}")
        if err is not None:
            self.recorder.line(job, "".join(traceback.format_exception(err)))
        self.units.stop(job)

    def abort(self, job: Any, cause: str, err: BaseException | None = None) -> None:
        """Fail a job with nothing in flight and end it now."""
        self.fail(job, cause, err)
        self.end(job, Event.FAIL)

    def finish(self, job: Any) -> None:
        """A job that ran all its steps: read its final state, checkpoint it, end it."""
        try:
            host = self.read_state(job)
        except Exception as err:  # noqa: BLE001 - the last step failed on the device
            self.abort(job, f"its final state could not be read: {short_error(err)}", err)
            return
        job.host_state = host
        if self.checkpoint_dir is not None:
            # keep_results=False: once this checkpoint is written, the recorder drops the state
            # (observe/released.py); result() reads it back from there.
            self._checkpoint(job, host, done=True, release=not self.keep_results)
        self.end(job, Event.FINISH)

    def save(self, job: Any, *, done: bool) -> None:
        """Checkpoint a live job's current state (every N steps, on stop)."""
        if self.checkpoint_dir is None:
            return
        self.flush()
        host = self.read_state(job)
        if host is not None:
            self._checkpoint(job, host, done=done)

    def _checkpoint(self, job: Any, host: Any, *, done: bool, release: bool = False) -> None:
        step = job.spec.start_step + job.steps_done
        source = job.source  # (None once its data ran out: a resume then replays)
        self.recorder.checkpoint(job, step, host, job.last_metrics, done=done,
                                 data_state=source.state_at(step) if source is not None else None,
                                 release=release)

    def end(self, job: Any, event: Event) -> None:
        """Move a job with nothing in flight to its terminal state; every owner forgets it and
        its memory goes to whoever waits for it."""
        if job.terminal:
            return
        job.state = transition(job.state, event)
        job.ended_s = self.clock() - self.t0
        self.units.stop(job)
        self.units.leave_lane(job)
        for forget in self.forgetters:
            forget(job)
        job.arrays = job.host_arrays = job.ident = None  # drop the device buffers
        # ... and the spec's step, initial state and data (its result is host_state): a runtime
        # that has run thousands of jobs must not keep every one's initial arrays and step
        # closure (a model's graph) alive; the program cache's memo is weak on the step.
        job.spec = job.spec.replace(job=None, state=None, data=None, observer=None, eval_step=None,
                                    eval_data=None, on_metrics=None)
        job.source = None
        job.batches.clear()
        # ... and what only its steps read: its layouts (an NNX model's graph, its variables'
        # paths and metadata: tens of KiB a job), its program read as data, its lifted
        # constants. A finished job answers from host_state, its counters and its tier.
        job.layout = job.batch_layout = job.traced = job.lifted = job.now = None
        job.other_programs = job.waiting = None  # (its programs for other shapes: shapes.py)
        self.units.changed = True
        self.flush()
        self.recorder.line(job, f"{job.state.value} after {job.steps_done} steps")
        self.recorder.close_job(job)
        self.units.forget(job)
        self.release(job)
        job.done_event.set()
        self.on_end(job)
