"""The runtime's table of submitted jobs: their records and handles, by id and by name, whether
the runtime still takes jobs, and who waits for them to end.

Owned by ``Runtime`` and shared with its controls (``controls.py``). Callers' threads add jobs
and look them up; the dispatcher thread reports each end (``ended``). One lock guards the
tables, never held long; the dispatcher owns everything a record says about its run.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Any, Callable, Iterable

from .._errors import XShareError
from .._job import JobSpec
from .engine.records import JobRecord, now_s
from .handle import JobHandle
from .observe.recorder import check_new_names

log = logging.getLogger("xshare.runtime")


class JobTable:
    """Every job submitted to one runtime, in submission order."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.lock = threading.Lock()          # guards the tables below and ``closed``
        self.records: dict[int, JobRecord] = {}
        self.handles: dict[int, JobHandle] = {}
        self.by_name: dict[str, JobHandle] = {}
        self.ids = itertools.count()          # job ids (the dispatcher's groups take theirs here too)
        self.closed = False
        self._ended = threading.Condition()
        # Called (on the dispatcher thread, so: cheap and never raising) as each job ends;
        # xshare.tune's driver wakes on it instead of polling its trials' statuses.
        self.end_listeners: list[Callable[[JobRecord], None]] = []

    def add(self, specs: list[JobSpec], runtime: Any, arrived: Callable[[JobRecord], object]) -> list[JobRecord]:
        """New records and handles (on ``runtime``) for ``specs``; ``arrived(job)`` is called for
        each under the lock, in order (the dispatcher's arrival event, before its compiled one).

        Raises:
          XShareError: the table is closed.
          TypeError: a spec is not a JobSpec.
          ValueError: a name is taken (``check_new_names``).
        """
        jobs: list[JobRecord] = []
        with self.lock:
            if self.closed:
                raise XShareError("this Runtime is closed; create a new one to submit jobs")
            for spec in specs:
                if not isinstance(spec, JobSpec):
                    raise TypeError(f"submit() takes a JobSpec from step.bind(...); got {type(spec).__name__}")
            check_new_names([spec.name for spec in specs], set(self.by_name))
            # Jobs of one step function in one call will most likely share a program: a fused
            # group is opened with room for all of them (it still grows for later arrivals).
            # Closures made by one factory share their code object, so a sweep built by calling
            # make_job N times counts as N, not N times 1.
            codes = [step_code(spec) for spec in specs]
            same: dict = {}
            for code in codes:
                same[code] = same.get(code, 0) + 1
            for spec, code in zip(specs, codes):
                job = JobRecord(id=next(self.ids), spec=spec, arrival_s=now_s() - self.t0,
                                priority=spec.priority, fuse_hint=same[code])
                self.records[job.id] = job
                arrived(job)
                handle = JobHandle(runtime, job)
                self.handles[job.id] = handle
                self.by_name[spec.name] = handle
                jobs.append(job)
        return jobs

    def close(self) -> bool:
        """Take no more jobs; False if the table was closed already."""
        with self.lock:
            if self.closed:
                return False
            self.closed = True
            return True

    def all_handles(self) -> list[JobHandle]:
        with self.lock:
            return list(self.handles.values())

    def lookup(self, job: str | int | JobHandle) -> JobHandle:
        """A job's handle by name, id or handle; ``KeyError`` naming the known jobs otherwise."""
        if isinstance(job, JobHandle):
            return job
        with self.lock:
            h = self.by_name.get(job) if isinstance(job, str) else None
            if h is None and isinstance(job, int):
                h = self.handles.get(job)
            if h is not None:
                return h
            names = ", ".join(sorted(self.by_name)) or "(none)"
        raise KeyError(f"no job {job!r} in this runtime; jobs: {names}")

    def jobs(self) -> tuple[JobRecord, ...]:
        """Every record, in id order (a copy)."""
        with self.lock:
            return tuple(sorted(self.records.values(), key=lambda j: j.id))

    def unfinished(self) -> list[JobRecord]:
        return [j for j in list(self.records.values()) if not j.terminal]

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every job has ended; False on timeout."""
        deadline = None if timeout is None else now_s() + timeout
        with self._ended:
            # Over a copy: callers' threads add records meanwhile (without ``_ended``), and a
            # generator over the live dict raises "dictionary changed size during iteration".
            while any(not j.terminal for j in list(self.records.values())):
                remaining = None if deadline is None else deadline - now_s()
                if remaining is not None and remaining <= 0:
                    return False
                self._ended.wait(timeout=0.5 if remaining is None else min(remaining, 0.5))
        return True

    def wake(self) -> None:
        """Wake every ``wait`` (to look again)."""
        with self._ended:
            self._ended.notify_all()

    def ended(self, job: JobRecord) -> None:
        """``job`` ended (the dispatcher's ``on_end``): wake the waiters, call the listeners."""
        self.wake()
        for listener in list(self.end_listeners):
            try:
                listener(job)
            except Exception:  # runs on the dispatcher thread: never take it down (logged)
                log.exception("xshare: a job-end listener raised")


def step_code(spec: JobSpec) -> Any:
    """What jobs of one step function share (its code object): jobs likely of one program."""
    return getattr(spec.fn, "__code__", None) or id(spec.job)


def by_step_code(jobs: Iterable[JobRecord]) -> list[list[JobRecord]]:
    """``jobs`` grouped by ``step_code``, in first-seen order."""
    groups: dict = {}
    for job in jobs:
        groups.setdefault(step_code(job.spec), []).append(job)
    return list(groups.values())
