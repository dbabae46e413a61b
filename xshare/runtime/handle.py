"""``JobHandle``: the user's view of one submitted job (status, progress, result, controls)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._errors import JobCancelled, JobFailed
from .records import CANCELLED, FAILED, JobRecord, Progress, now_s

if TYPE_CHECKING:
    from .runtime import Runtime


class JobHandle:
    """The user's handle on a submitted job. Thread-safe; cheap to poll."""

    def __init__(self, runtime: "Runtime", record: JobRecord):
        self._rt, self._rec = runtime, record

    @property
    def name(self) -> str:
        return self._rec.name

    @property
    def id(self) -> int:
        return self._rec.id

    def status(self) -> str:
        """queued | running | paused | done | failed | cancelled"""
        return self._rec.status

    def progress(self) -> Progress:
        with self._rt._cv:
            return self._rec.progress(now_s() - self._rt.t0)

    @property
    def error(self) -> str | None:
        return self._rec.error

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job ends (done, failed or cancelled); False on timeout."""
        return self._rec.done_event.wait(timeout)

    def result(self, timeout: float | None = None) -> tuple[Any, dict[str, float] | None]:
        """(final state as numpy arrays on the host, last metrics). Raises JobFailed/JobCancelled."""
        if not self.wait(timeout):
            raise TimeoutError(f"job {self.name!r} still {self.status()} after {timeout} s")
        if self._rec.status == FAILED:
            raise JobFailed(self.name, self._rec.error or "unknown error")
        if self._rec.status == CANCELLED:
            raise JobCancelled(f"job {self.name!r} was cancelled at step {self._rec.steps_done}")
        return self._rec.host_state, self._rec.last_metrics

    def pause(self, *, offload: bool = False) -> None:
        self._rt.pause(self, offload=offload)

    def resume(self) -> None:
        self._rt.resume(self)

    def cancel(self) -> None:
        self._rt.cancel(self)

    def set_priority(self, priority: int) -> None:
        self._rt.set_priority(self, priority)

    def __repr__(self) -> str:
        return f"JobHandle({self.name!r}, {self.status()})"
