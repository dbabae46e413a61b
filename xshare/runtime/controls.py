"""What callers do to submitted jobs: find their handles, pause, resume, cancel, reprioritize.
Owned by ``Runtime`` (whose public methods of the same names delegate here), over its job table
(``jobtable.py``) and its dispatcher. Every control is an event applied on the dispatcher thread
between two steps (``Dispatcher.call``), the only writer of a job's run-time state; the caller
waits for it to be applied. The controls are typed, frozen messages (``engine/events.py``), not
method names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .engine.events import Cancel, Control, Pause, Resume, SetPriority
from .handle import JobHandle
from .jobtable import JobTable

if TYPE_CHECKING:
    from .engine.dispatcher import Dispatcher


class Controls:
    """``Runtime``'s job controls: the methods ``Runtime.jobs``, ``handle``, ``pause``,
    ``resume``, ``cancel`` and ``set_priority`` call (their docstrings are the users')."""

    def __init__(self, table: JobTable, dispatcher: Dispatcher) -> None:
        self._table = table
        self._dispatcher = dispatcher

    @property
    def jobs(self) -> list[JobHandle]:
        return self._table.all_handles()

    def handle(self, job: str | int | JobHandle) -> JobHandle:
        return self._table.lookup(job)

    def pause(self, job: str | int | JobHandle, *, offload: bool = False) -> None:
        self._control(Pause(self.handle(job)._rec, bool(offload)))

    def resume(self, job: str | int | JobHandle) -> None:
        self._control(Resume(self.handle(job)._rec))

    def cancel(self, job: str | int | JobHandle) -> None:
        self._control(Cancel(self.handle(job)._rec))

    def set_priority(self, job: str | int | JobHandle, priority: int) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority={priority!r} must be an int")
        self._control(SetPriority(self.handle(job)._rec, priority))

    def _control(self, event: Control) -> None:
        """Apply ``event`` on the dispatcher thread and wait for it."""
        self._dispatcher.call(self._dispatcher.control, event)
