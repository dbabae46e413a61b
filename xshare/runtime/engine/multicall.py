"""The dispatcher's multi-step calls: K steps of a solo job in one executable call, the check
that promotes a job to its K-step program, and when to start compiling one.

``tiers.Tiers`` decides and remembers; this part runs the steps (dispatcher thread only). How
many steps a call runs is ``sched.steps.steps_per_call`` over the job's boundaries, so a call
never passes its last step, an evaluation, a checkpoint, a report a study acts on, the batches
it has, or (preemptive policies) about ``sched.steps.QUANTUM_S`` of device time.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import numpy as np

from ...sched import steps as ksteps
from ..compiled import multistep
from ..causes import dispatch_error
from ..compiled.multistep import MultiStep, Verdict
from .records import JobRecord
from .tiers import Candidate, typical_step_s
from .source import END, DataError, produce

# Fences of the check's K-step calls carry this job id, which no job has, so the timeline does
# not count their inner steps as the job's (it counts the check's single steps, which the job
# keeps).
_SCRATCH_JOB = 2**31 - 1
# Above this many state bytes the check times the K-step call's first run instead of a second
# one on a third copy of the state (a second copy of a large state is not worth a timing).
_TIMED_COPY_BYTES = 256 << 20


class MultiCalls:
    """Multi-step calls. A part of ``Dispatcher``: its methods run on the dispatcher thread."""

    # ------------------------------------------------------------------ how many steps
    def _bounds(self, job: JobRecord) -> ksteps.Bounds:
        step = job.spec.start_step + job.dispatched
        spec = job.spec
        report = None
        if spec.on_metrics is not None:
            every = spec.on_metrics_every
            report = 1 if every is None else ksteps.until(step, every) if every else None
        cap = None
        if self.config.preemptive:
            step_s = job.step_time_s if job.step_time_s is not None or job.tier is None else job.tier.step_s
            # A job keeps the device at least ``quantum`` steps (Runtime's argument) anyway.
            cap = max(ksteps.preemptive_cap(step_s, ksteps.QUANTUM_S / (1 + self.config.dispatch_ahead)), self.config.quantum)
        return ksteps.Bounds(
            left=job.steps_left,
            to_eval=ksteps.until(step, job.eval.every) if job.eval is not None else None,
            to_checkpoint=ksteps.until(step, self.config.checkpoint_every) if self.config.checkpoint_dir is not None else None,
            to_report=report, cap=cap)

    def _steps_this_call(self, job: JobRecord, available: tuple[int, ...]) -> int:
        bounds = self._bounds(job)
        want = ksteps.steps_per_call(bounds, available)
        if want > 1:
            ready = self._ready_batches(job, want)
            if ready < want:
                want = ksteps.steps_per_call(dataclasses.replace(bounds, ready=ready), available)
        return want

    def _ready_batches(self, job: JobRecord, want: int) -> int:
        """Batches ready for the job's next steps, made inline up to ``want`` for jobs whose
        data is cheap (as a plain loop makes them); a marker (the end, a data error) stops the
        count, so its call stops before it."""
        batches = job.batches
        if not self._fed(job):
            while len(batches) < want and job.source is not None:
                produce(job, self.device, blocking=True)
        n, like = 0, job.program.batch_struct
        for batch in batches:
            if n == want or batch is END or isinstance(batch, DataError) or not multistep.matches(batch, like):
                break
            n += 1
        return n

    # ------------------------------------------------------------------ a K-step call
    def _dispatch_multi(self, job: JobRecord, li: int, pos: int, k: int) -> None:
        multi = job.tier.multi
        batches = [job.batches.popleft() for _ in range(k)]
        if self._fed(job):
            self.feeder.request(job, k)
        step = job.spec.start_step + job.dispatched
        stacked = multistep.stack(batches)
        t = time.monotonic_ns()
        try:
            outs = self._call(multi.executable, job.arrays, stacked, job.ident)
        except Exception as err:  # noqa: BLE001 - as for one step: its job fails alone
            self.life.fail(job, dispatch_error(job, step, batches[0], err), err)
            self.life.settle(job)
            return
        job.arrays = outs[0]
        job.dispatched += k
        job.in_flight += 1
        job.tier.steps_at[k] = job.tier.steps_at.get(k, 0) + k
        self._took_turn(job, li, pos)
        self._inflight.append((job, step, outs[1], t, k))
        self._after_steps(job, step, k)

    @staticmethod
    def _call(executable: Any, arrays: Any, batch: Any, ident: Any) -> Any:
        return executable(arrays, batch, ident) if ident is not None else executable(arrays, batch)

    # ------------------------------------------------------------------ promotion
    def _consider(self, job: JobRecord) -> None:
        """Weigh compiling the job's K-step program (tiers.py)."""
        left: int | None = 0
        for unit in self.units.running.values():
            if not unit.is_group and unit.program is job.program and unit.group is None:
                if unit.steps_left is None:
                    left = None
                    break
                left += unit.steps_left
        program, device = job.program, self.device
        self.tiers.consider(self.tiers.tier(job), Candidate(
            key=program.key, compile=lambda form: multistep.compile_multi(program, form, device),
            steps_done=job.steps_done, step_s=typical_step_s(job), steps_left=left,
            gap_s=job.host_gap_s if job.host_gap_s is not None else self.timeline.host_gap_s,
            period=self._period(job)))

    def _period(self, job: JobRecord) -> int | None:
        """The fewest steps between two of the job's boundaries (its K-step program's K is at
        most this, or it would never run a full call)."""
        spec = job.spec
        every = [e for e in (job.eval.every if job.eval is not None else None,
                             self.config.checkpoint_every if self.config.checkpoint_dir is not None else None,
                             (spec.on_metrics_every or None) if spec.on_metrics is not None else None)
                 if e]
        if spec.on_metrics is not None and spec.on_metrics_every is None:
            every.append(1)
        return min(every) if every else None

    def _promote(self, job: JobRecord, li: int, pos: int) -> bool:
        """The job's K-step program finished compiling: adopt it if its form already passed the
        check, else run the check on this turn's steps. True if this turn's steps ran here."""
        multi = self.tiers.take(job)
        if multi is None:
            return False
        known = multistep.VERDICTS.get(job.program.key, multi.form)
        if known is not None:
            keep = self.tiers.keeps(known)
            self.tiers.settle(job.tier, job.program.key, multi, None if keep else known,
                              self._make_room(job, multi) if keep else False)
            return False
        k = multi.k
        if ksteps.steps_per_call(self._bounds(job), (1, k)) < k or self._ready_batches(job, k) < k:
            job.tier.pending = _done(multi)  # no room for K steps at this turn: at a later one
            return False
        self._drain_inflight()  # the state the check copies is the job's newest
        if job.error is not None or job.terminal:
            return True
        verdict = self._check(job, li, pos, multi)
        keep = self.tiers.keeps(verdict)
        self.tiers.settle(job.tier, job.program.key, multi, verdict, self._make_room(job, multi) if keep else False)
        self.recorder.line(job, f"programs: {job.tier.note}")
        return True

    def _check(self, job: JobRecord, li: int, pos: int, multi: MultiStep) -> Verdict:
        """K single steps (the job's own, kept) and the K-step call from copies of the same state
        on the same batches: bit-identical or not, and seconds per step each way."""
        k, program = multi.k, job.program
        step = job.spec.start_step + job.dispatched
        batches = [job.batches.popleft() for _ in range(k)]
        if self._fed(job):
            self.feeder.request(job, k)
        stacked = multistep.stack(batches)  # before the single steps consume (donate) them
        state_bytes = sum(x.nbytes for x in job.arrays)
        copies = [[x.copy() for x in job.arrays] for _ in range(2 if state_bytes <= _TIMED_COPY_BYTES else 1)]
        scratch = self._scratch_ident(job)
        arrays, rows = job.arrays, []
        t = time.monotonic_ns()
        t0 = time.perf_counter()
        for batch in batches:
            arrays, vec = self._call(program.executable, arrays, batch, job.ident)
            rows.append(vec)
        jax.block_until_ready(arrays)
        single_s = (time.perf_counter() - t0) / k
        t_end = time.monotonic_ns()
        job.arrays = arrays
        job.dispatched += k
        job.tier.steps_at[1] = job.tier.steps_at.get(1, 0) + k
        values = np.stack([np.asarray(v) for v in rows])
        self._took_turn(job, li, pos)
        self._retired_many(job, step, values, t, t_end)
        verdict = self._compare(multi, copies, stacked, scratch, arrays, values)
        self._after_steps(job, step, k)
        return dataclasses.replace(verdict, single_step_s=single_s)

    def _scratch_ident(self, unit: Any) -> Any:
        """The fences' identity for the check's K-step calls (None without fences)."""
        if unit.ident is None:
            return None
        from ... import ffi
        return jax.device_put(ffi.ident(self.ring, _SCRATCH_JOB, unit.lane or 0), self.device)

    def _compare(self, multi: MultiStep, copies: list, stacked: list, scratch: Any, arrays: list,
                 values: np.ndarray) -> Verdict:
        try:
            t0 = time.perf_counter()
            state, rows = self._call(multi.executable, copies[0], stacked, scratch)
            jax.block_until_ready(state)
            multi_s = (time.perf_counter() - t0) / multi.k
            why, deviation = multistep.compare(list(arrays), list(state), values, np.asarray(rows))
            if math.isfinite(deviation) and len(copies) > 1:  # time a second (warm) call
                t0 = time.perf_counter()
                jax.block_until_ready(self._call(multi.executable, copies[1], stacked, scratch)[0])
                multi_s = (time.perf_counter() - t0) / multi.k
        except Exception as err:  # noqa: BLE001 - a K-step program that fails is not kept
            return Verdict(multi.form, False, 0.0, 0.0, why=f"it raised {type(err).__name__}: {err}",
                           deviation=math.inf)
        return Verdict(multi.form, why is None, 0.0, multi_s,
                       why=f"not bit-identical to {multi.k} single steps ({why})" if why else "",
                       deviation=deviation)

    def _make_room(self, job: JobRecord, multi: MultiStep) -> bool:
        """Reserve the K-step program's ephemeral bytes (K stacked batches, K metrics rows, its
        temporaries) in the job's lane; False if they do not fit (the job stays at one step)."""
        fp = job.footprint
        ephemeral = max(fp.ephemeral, multi.footprint.ephemeral)
        if ephemeral == fp.ephemeral:
            return True
        if not job.in_ledger or not self.arena.resize(job.id, fp.resident, ephemeral):
            return False
        job.footprint = dataclasses.replace(fp, ephemeral=ephemeral)
        return True


def _done(value: Any) -> Any:
    from concurrent.futures import Future
    fut: Future = Future()
    fut.set_result(value)
    return fut
