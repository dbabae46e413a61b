"""``xshare.run``: run bound jobs in one Runtime and return their results, in order."""

from __future__ import annotations

from typing import Any, Iterable

from .._errors import XShareError
from .._job import JobSpec
from .runtime import Runtime


def run(specs: Iterable[JobSpec], *, policy: str = "pack", memory: int | str | None = None,
        return_exceptions: bool = False, **runtime_kwargs: Any) -> list[tuple[Any, Any] | BaseException]:
    """Run ``specs`` in one Runtime and return each job's ``(state, metrics)``, in order.

    Args:
      specs: bound jobs (``step.bind(...)``).
      policy: the scheduling policy (see ``xshare.POLICIES``).
      memory: the arena's size, as for :class:`Runtime`.
      return_exceptions: put a failed job's exception in its slot instead of raising.
      **runtime_kwargs: any other :class:`Runtime` argument (``fuse=True``, ``log_dir=...``).

    Returns:
      One ``(final state, last metrics)`` per spec, in order (or the exception, with
      ``return_exceptions=True``).

    Raises:
      JobFailed: a job failed (raised after every job has ended, so the others' work is not
        lost). AdmissionError or JobCancelled likewise.
    """
    with Runtime(policy=policy, memory=memory, **runtime_kwargs) as rt:
        handles = rt.submit_many(specs)
        rt.wait()
    results: list[Any] = []
    for h in handles:
        try:
            results.append(h.result())
        except XShareError as err:
            if not return_exceptions:
                raise
            results.append(err)
    return results
