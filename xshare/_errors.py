"""Exceptions users may catch. Expected outcomes (queued, rejected) are typed; misuse raises."""

from __future__ import annotations


class XShareError(Exception):
    """Base class of every error xshare raises on purpose."""


class AdmissionError(XShareError):
    """A job can never fit in the runtime's arena, whatever else leaves it."""


class FootprintUnknown(XShareError):
    """XLA's memory analysis did not report a usable footprint for a job's step."""


class JobFailed(XShareError):
    """A job ended in failure; ``__cause__`` holds the original exception."""

    def __init__(self, job: str, cause: str):
        super().__init__(f"job {job!r} failed: {cause}")
        self.job = job
        self.cause = cause


class JobCancelled(XShareError):
    """``result()`` of a job that was cancelled before it finished."""


class SpecError(XShareError):
    """A launch spec (TOML or --set grid) is malformed; the message names the job and the fix."""


def error_line(err: BaseException | str, *, with_type: bool = True) -> str:
    """One line for an error, the one rule every summary uses (``handle.error``, launch's table,
    the service's refusals, the Ray driver): ``Type: message`` for a one-line message; for a
    long one (XLA wraps a host callback's traceback in a JaxRuntimeError) its first line, cut,
    and its last, which names the original exception. The full text goes to the job's log."""
    text = err if isinstance(err, str) else str(err)
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    kind = "" if isinstance(err, str) or not with_type else f"{type(err).__name__}: "
    if not lines:
        return type(err).__name__ if not isinstance(err, str) else ""
    if len(lines) == 1:
        return kind + lines[0]
    return f"{kind}{lines[0][:120]} ... {lines[-1]}"

