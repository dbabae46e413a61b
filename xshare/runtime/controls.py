"""What callers do to submitted jobs: find their handles, pause, resume, cancel, reprioritize.
A part of ``Runtime`` (its tables: ``_lock``, ``_handles``, ``_by_name``). Every control is an
event applied on the dispatcher thread between two steps (``Dispatcher.call``), the only writer
of a job's run-time state; the caller waits for it to be applied. The controls are typed,
frozen messages (``engine/events.py``), not method names.
"""

from __future__ import annotations

from .engine.events import Cancel, Control, Pause, Resume, SetPriority
from .handle import JobHandle


class Controls:
    """``Runtime``'s job controls (a part of it, as ``Deployments`` is)."""

    @property
    def jobs(self) -> list[JobHandle]:
        """The handles of every job submitted to this runtime, in submission order."""
        with self._lock:
            return list(self._handles.values())

    def handle(self, job: str | int | JobHandle) -> JobHandle:
        """A job's handle by name, id or handle; ``KeyError`` naming the known jobs otherwise."""
        if isinstance(job, JobHandle):
            return job
        with self._lock:
            h = self._by_name.get(job) if isinstance(job, str) else None
            if h is None and isinstance(job, int):
                h = self._handles.get(job)
            if h is not None:
                return h
            names = ", ".join(sorted(self._by_name)) or "(none)"
        raise KeyError(f"no job {job!r} in this runtime; jobs: {names}")

    def pause(self, job: str | int | JobHandle, *, offload: bool = False) -> None:
        """Stop dispatching the job's steps; ``resume`` continues exactly where it stopped.

        With ``offload=True`` the job's state also moves to host memory (``pinned_host`` where
        the device has it) once its in-flight steps finish, and its persistent bytes go back to
        the arena, so a queued job can be admitted in its place. ``resume`` moves it back as
        soon as its lane has room again; the job's results are unchanged by the round trip.
        """
        self._control(Pause(self.handle(job)._rec, bool(offload)))

    def resume(self, job: str | int | JobHandle) -> None:
        """Let a paused job step again (after its state is back on the device, if offloaded)."""
        self._control(Resume(self.handle(job)._rec))

    def cancel(self, job: str | int | JobHandle) -> None:
        """End the job after its in-flight steps; its memory goes to the next queued job."""
        self._control(Cancel(self.handle(job)._rec))

    def set_priority(self, job: str | int | JobHandle, priority: int) -> None:
        """Change a job's priority (larger runs first under ``priority``; ties by arrival).

        Raises:
          ValueError: ``priority`` is not an int.
        """
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority={priority!r} must be an int")
        self._control(SetPriority(self.handle(job)._rec, priority))

    def _control(self, event: Control) -> None:
        self._dispatcher.call(self._dispatcher.control, event)
