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
