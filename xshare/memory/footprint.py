"""A job's exact memory footprint, read from XLA's analysis of its donated, compiled step.

Why the donated variant: without donation XLA packs temporaries into the outputs and
``temp_size_in_bytes`` is near zero, which would make every job look cheaper than it is.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from .._errors import FootprintUnknown
from .._units import format_bytes


@dataclass(frozen=True)
class Footprint:
    """Bytes a job holds on the device.

    persistent: the state arguments that alias outputs (params, optimizer state): resident for
      the job's whole life. ephemeral: temporaries + the batch + non-aliased outputs (metrics):
      needed only while one of its steps executes. staging: batches prefetched ahead of the
      step (depth x batch bytes), resident while the job runs. code: generated code size.
    """

    persistent: int
    ephemeral: int
    staging: int = 0
    code: int = 0
    temp: int = 0
    # Why ``temp`` is not XLA's own figure (memory_analysis() was implausible), else None.
    note: str | None = None

    @property
    def resident(self) -> int:
        """What the arena charges between steps: state plus prefetched batches."""
        return self.persistent + self.staging

    @property
    def total(self) -> int:
        """Bytes the job needs while a step runs: resident (persistent + staging) + ephemeral."""
        return self.resident + self.ephemeral

    def describe(self) -> str:
        """``"P ... + staging ... + E ..."``, as admission messages say it."""
        return (f"P {format_bytes(self.persistent)} + staging {format_bytes(self.staging)}"
                f" + E {format_bytes(self.ephemeral)}")


def footprint_from_analysis(stats: Any, *, state_bytes: int, batch_bytes: int, prefetch: int,
                            job: str = "?", hlo: Callable[[], str | None] | None = None) -> Footprint:
    """Build a Footprint from ``compiled.memory_analysis()``.

    ``state_bytes``/``batch_bytes`` are the exact sizes of the step's two arguments, computed from
    their shapes; XLA's figures are checked against them so an analysis that reports zeros or -1
    (jax #18954) is refused instead of being taken as "free". ``hlo`` (``compiled.as_text``,
    called only when XLA reports no temporaries) lets a 0 be checked against the program: a
    program with intermediate buffers is charged their sum instead (``plausible.py``).
    """
    if stats is None:
        raise FootprintUnknown(
            f"job {job!r}: XLA returned no memory analysis for its compiled step on this backend, "
            "so xshare cannot know how much memory it needs; pass an explicit footprint or use a "
            "backend that reports memory_analysis()")
    arg = int(getattr(stats, "argument_size_in_bytes", -1))
    out = int(getattr(stats, "output_size_in_bytes", -1))
    alias = int(getattr(stats, "alias_size_in_bytes", -1))
    temp = int(getattr(stats, "temp_size_in_bytes", -1))
    code = int(getattr(stats, "generated_code_size_in_bytes", 0) or 0)
    expected_args = state_bytes + batch_bytes
    if min(arg, out, alias, temp) < 0 or (expected_args > 0 and arg <= 0) or (state_bytes > 0 and out <= 0):
        raise FootprintUnknown(
            f"job {job!r}: XLA's memory analysis is unusable (arguments {arg} B, outputs {out} B, "
            f"aliased {alias} B, temp {temp} B; expected arguments of {expected_args} B). "
            "Refusing to assume zero; this backend does not report footprints (jax #18954)")
    # The state is the persistent share, exactly; everything else XLA reports as arguments is
    # the batch (the batch is donated too, so XLA may alias it into an output: ``out - alias``
    # then already leaves it out).
    persistent = state_bytes
    note = None
    if temp == 0 and hlo is not None:
        from .plausible import implausible_temp

        fixed = implausible_temp(temp, hlo())
        if fixed is not None:
            temp, note = fixed
            # Once per compiled program: the program cache compiles each program once.
            logging.getLogger("xshare.memory").warning("xshare: job %r: %s", job, note)
    non_state_args = max(arg - state_bytes, batch_bytes)
    ephemeral = temp + non_state_args + max(out - alias, 0)
    return Footprint(persistent=persistent, ephemeral=ephemeral, staging=prefetch * batch_bytes,
                     code=code, temp=temp, note=note)
