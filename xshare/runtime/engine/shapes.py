"""Batches of another shape than a job's first: stepped on its step's program for that shape.

``jax.jit`` traces a step again for arguments of new shapes, so a loop whose last batch is
short (``range(0, n, batch)`` without dropping the remainder, every epoch's partial batch) just
runs. A job's program is compiled for its first batch's shapes; a later batch of the same
structure but other shapes or dtypes runs on the same step compiled for those (``PROGRAMS``: one
compile per shape per step function, shared by every job of the step, as jax.jit's cache is),
on the job's own state, which keeps its avals. Its next batches of the first shape go back to
its program, K-step forms and fused group included: a step of another shape is a *side step*,
one call, between the job's ordinary ones, with the same donation, fences and accounting.

The side program compiles on the runtime's background thread (the K-step programs' one, see
``tiers.py``); meanwhile only that job waits (off the rotation, or masked in its group), the
other jobs keep stepping. The common case costs nothing: the one-step call rejects a batch
that is not its shapes before it runs (nothing is donated), K-step calls and runs already stop
before a batch that does not fit (``multicall.ready_batches``), and a group checks its members'
batches every step (``multigroup._shape_mismatch``). Dispatcher thread only, except the compile.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Any, Callable

import numpy as np

from ..causes import dispatch_error, short_error
from ..compiled.compiler import PROGRAMS, _avals


def signature(leaves: Any) -> tuple:
    """(shape, dtype) of each of a batch's leaves."""
    return tuple((tuple(np.shape(x)), _dtype(x)) for x in leaves)


def _dtype(x: Any) -> np.dtype:
    dtype = getattr(x, "dtype", None)  # (not ``or``: a dtype without fields is falsy)
    return np.dtype(dtype) if dtype is not None else np.asarray(x).dtype


class OtherShapes:
    """Each job's programs for batches of other shapes than its first, by signature.

    ``program(job, batch, step)`` answers the one to call now (the job's log says so the first
    time), or None while it compiles (the job waits: ``job.waiting``, and ``on_ready(job)`` runs
    on the dispatcher thread once it is compiled), or raises ``ValueError`` with the reason the
    batch cannot run (a step that does not compile for it or returns another state, a program
    larger than the job's reservation when the arena has no room to grow it)."""

    def __init__(self, *, device: Any, arena: Any, staging: int, recorder: Any,
                 submit: Callable[[Callable[[], Any]], Future] | None, post: Callable[..., Any],
                 on_ready: Callable[[Any], None]):
        self.device, self.arena, self.staging, self._recorder = device, arena, staging, recorder
        self._submit, self._post, self._on_ready = submit, post, on_ready

    @staticmethod
    def differs(job: Any, batch: Any) -> bool:
        """Whether ``batch`` (flat leaves) has the job's batch structure but other shapes or
        dtypes than its program was compiled for: a side step, not a failure."""
        program = job.program
        if program is None or type(batch) not in (list, tuple) or len(batch) != len(program.batch_struct):
            return False
        return signature(batch) != program.batch_signature

    def program(self, job: Any, batch: Any, step: int) -> Any:
        """The program for batch ``step`` of ``job`` (its flat leaves ``batch``), None while it
        compiles; ``ValueError`` with the job's failure, in full, if the batch cannot run."""
        sig = signature(batch)
        programs = job.other_programs
        if programs is None:
            programs = job.other_programs = {}
        fut = programs.get(sig)
        if fut is None:
            self._recorder.line(job, f"batch {step} has other shapes than its first ({_shapes(sig)}): its "
                                     "step runs on a program compiled for them, as jax.jit retraces")
            fut = programs[sig] = self._compile(job, batch)
        if not fut.done():
            job.waiting = fut
            return None
        job.waiting = None
        try:
            try:
                program = fut.result()
            except Exception as err:  # (any: the job fails with the reason)
                raise ValueError(f"its step does not compile for those shapes: {short_error(err)}") from err
            self._fits(job, program)
        except ValueError as err:
            raise ValueError(f"{dispatch_error(job, step, batch, err)}; {err}") from err
        return program

    def _compile(self, job: Any, batch: Any) -> Future:
        """The job's step on its state and a batch of ``batch``'s shapes, compiled off the
        dispatcher (on it where the runtime has no background thread)."""
        spec, main = job.spec, job.program
        tree = job.batch_layout.merge(list(batch))
        fenced, device = main.fenced, self.device

        def build() -> Any:
            return PROGRAMS.get(spec.job, spec.state, tree, device=device, fenced=fenced)

        if self._submit is None:
            fut: Future = Future()
            try:
                fut.set_result(build())
            except Exception as err:  # noqa: BLE001 - reported when the job asks
                fut.set_exception(err)
            return fut
        try:
            fut = self._submit(build)
        except RuntimeError:  # (the runtime is closing: its background thread takes no more)
            self._submit = None
            return self._compile(job, batch)
        # (a done callback runs on the compiling thread: the job's record is the dispatcher's)
        fut.add_done_callback(lambda _: self._post(self._landed, job, fut))
        return fut

    def _landed(self, job: Any, fut: Future) -> None:
        if job.waiting is fut:
            job.waiting = None
            if not job.terminal:
                self._on_ready(job)

    def _fits(self, job: Any, program: Any) -> None:
        """The side program runs on the job's own state: its state's avals must be the job's.
        And in the job's lane: a program that needs more (a batch larger than the first, whose
        footprint admission charged) grows the job's reservation if the arena has the room."""
        main = job.program
        n = job.layout.n_arrays
        if _avals(program.state_struct) != _avals(main.state_struct)[:n] or program.metric_names != main.metric_names:
            raise ValueError("its step on those shapes returns a state or metrics of other shapes than "
                             "on its first batch's; give every batch the first's shapes")
        fp = job.footprint
        if job.group is not None or fp is None or not job.in_ledger:
            # (a member's memory is its group's: the group step's temporaries, for every slot,
            # are what a member's step alone needs many times over)
            return
        side = program.with_staging(self.staging)
        staging, ephemeral = max(fp.staging, side.staging), max(fp.ephemeral, side.ephemeral)
        if (staging, ephemeral) == (fp.staging, fp.ephemeral):
            return
        if not self.arena.resize(job.id, fp.persistent + staging, ephemeral):
            raise ValueError(
                f"its step on those shapes needs {fp.persistent + staging + ephemeral:,} bytes with its "
                f"staged batches, more than the {fp.total:,} it was admitted with, and the arena has no "
                "room for more now; make the first batch the largest, pad the others to its shape, "
                "or give the runtime more memory")
        job.footprint = dataclasses.replace(fp, staging=staging, ephemeral=ephemeral)


def _shapes(sig: tuple) -> str:
    return ", ".join(f"{dtype}{list(shape)}" for shape, dtype in sig)
