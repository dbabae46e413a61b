"""One-line causes for a failed job: what the summary table and ``handle.error`` show."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import error_line
from .engine.records import JobRecord


def dispatch_error(job: JobRecord, step: int, batch: Any, err: Exception) -> str:
    """Say what went wrong at dispatch; ``batch`` is the flat leaves the prefetcher made."""
    assert job.program is not None  # (it was dispatched)
    paths = job.batch_layout.array_paths()
    want = {p: f"{s.dtype}{list(s.shape)}" for p, s in zip(paths, job.program.batch_struct)}
    got = {p: f"{getattr(x, 'dtype', type(x).__name__)}{list(np.shape(x))}" for p, x in zip(paths, batch)}
    if want != got:
        return f"batch {step} does not match the compiled step: expected {want}, got {got}"
    return f"step {step} raised: {short_error(err)}"


def short_error(err: BaseException) -> str:
    """``Type: message`` on one line (``xshare._errors.error_line``)."""
    return error_line(err)
