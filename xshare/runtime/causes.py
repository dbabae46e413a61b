"""One-line causes for a failed job: what the summary table and ``handle.error`` show."""

from __future__ import annotations

from typing import Any

import numpy as np

from .records import JobRecord


def dispatch_error(job: JobRecord, step: int, batch: Any, err: Exception) -> str:
    """Say what went wrong at dispatch; ``batch`` is the flat leaves the prefetcher made."""
    paths = job.batch_layout.array_paths()
    want = {p: f"{s.dtype}{list(s.shape)}" for p, s in zip(paths, job.program.batch_struct)}
    got = {p: f"{getattr(x, 'dtype', type(x).__name__)}{list(np.shape(x))}" for p, x in zip(paths, batch)}
    if want != got:
        return f"batch {step} does not match the compiled step: expected {want}, got {got}"
    return f"step {step} raised: {short_error(err)}"


def short_error(err: BaseException) -> str:
    """``Type: message`` on one line; for XLA's wrapped errors (a host callback's traceback inside
    a JaxRuntimeError) the last line, which names the original exception. The full text goes to
    the job's log."""
    lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
    if not lines:
        return type(err).__name__
    if len(lines) == 1:
        return f"{type(err).__name__}: {lines[0]}"
    return f"{type(err).__name__}: {lines[0][:120]} ... {lines[-1].strip()}"
