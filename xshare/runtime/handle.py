"""``JobHandle``: the user's view of one submitted job (status, progress, result, controls).

It holds the runtime only as "something with controls" (duck-typed): this module imports
nothing of the runtime, so there is no import cycle.
"""

from __future__ import annotations

from typing import Any

from .._errors import AdmissionError, JobCancelled, JobFailed
from .engine.records import JobRecord, Progress, now_s
from .engine.states import JobState


class JobHandle:
    """The user's handle on a submitted job. Thread-safe; cheap to poll."""

    def __init__(self, runtime: Any, record: JobRecord):
        self._rt, self._rec = runtime, record

    @property
    def name(self) -> str:
        """The job's unique name in its runtime."""
        return self._rec.name

    @property
    def id(self) -> int:
        """The job's id in its runtime (also accepted by the controls)."""
        return self._rec.id

    def status(self) -> str:
        """compiling | queued | running | paused | done | failed | cancelled"""
        return self._rec.status

    @property
    def state(self) -> JobState:
        """The precise lifecycle state (``swapped`` shows as ``paused`` in ``status()``)."""
        return self._rec.state

    def progress(self) -> Progress:
        """The job's :class:`Progress` now: status, steps, the last metrics, rate, lane."""
        return self._rec.progress(now_s() - self._rt.t0)

    @property
    def error(self) -> str | None:
        """Why the job failed, in one line (``None`` unless it failed); ``exception`` holds the error."""
        return self._rec.error

    @property
    def exception(self) -> BaseException | None:
        """The exception behind ``error`` (e.g. ``AdmissionError`` for a job that can never
        fit), or None."""
        return self._rec.exception

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job ends (done, failed or cancelled); False on timeout."""
        return self._rec.done_event.wait(timeout)

    def result(self, timeout: float | None = None) -> tuple[Any, dict[str, float] | None]:
        """Wait for the job to end and return ``(final state, last metrics)``.

        The state is on the host (numpy arrays); under ``Runtime(keep_results=False)`` it is
        read back from the job's final checkpoint. A spec with a ``result_transform``
        (``xshare.nnx`` jobs) gets it applied: an NNX job's result is ``(new NNX objects,
        metrics)``, new objects on every call.

        Args:
          timeout: seconds to wait (None: until the job ends).

        Returns:
          ``(state, metrics)``; ``metrics`` is None for a job that ran no step.

        Raises:
          JobFailed: the job failed (``error`` says why).
          AdmissionError: the job can never fit in the arena (with the numbers).
          JobCancelled: the job was cancelled before it finished.
          TimeoutError: it did not end within ``timeout``.
          XShareError: its final state is not kept any more (``keep_results=False`` and its
            final checkpoint is gone, or the runtime's owner let it go: ``xshare.tune``).
        """
        if not self.wait(timeout):
            raise TimeoutError(f"job {self.name!r} still {self.status()} after {timeout} s")
        rec = self._rec
        if rec.state is JobState.FAILED:
            if isinstance(rec.exception, AdmissionError):
                raise AdmissionError(str(rec.exception))
            raise JobFailed(self.name, rec.error or "unknown error")
        if rec.state is JobState.CANCELLED:
            raise JobCancelled(f"job {self.name!r} was cancelled at step {rec.spec.start_step + rec.steps_done}")
        transform = rec.spec.result_transform
        state = rec.host_state
        if state is None and rec.on_disk is not None:  # (in this order: observe/released.py)
            state = rec.on_disk.load(self.name)  # keep_results=False: from its final checkpoint
        return (state if transform is None else transform(state)), rec.last_metrics

    def _release_result(self, why: str) -> None:
        """Let go of a done job's final state (its owner will never ask for it; ``result()``
        then raises ``why``). For the package's own long runs: ``xshare.tune``'s runtime keeps
        a study's trials' values, not their states."""
        from .observe.released import NotKept

        rec = self._rec
        if rec.terminal and rec.host_state is not None:
            rec.on_disk = NotKept(why)  # (before the state goes: see observe/released.py)
            rec.host_state = None

    def pause(self, *, offload: bool = False) -> None:
        """``Runtime.pause`` of this job."""
        self._rt.pause(self, offload=offload)

    def resume(self) -> None:
        """``Runtime.resume`` of this job."""
        self._rt.resume(self)

    def cancel(self) -> None:
        """``Runtime.cancel`` of this job."""
        self._rt.cancel(self)

    def set_priority(self, priority: int) -> None:
        """``Runtime.set_priority`` of this job."""
        self._rt.set_priority(self, priority)

    def __repr__(self) -> str:
        return f"JobHandle({self.name!r}, {self.status()})"
