"""The dispatcher's executor: steps in flight, and what retiring them produces.

``_dispatch`` calls a unit's shared executable on its resident state and its next batch (a
group: every stepping member's batch, stacked, idle slots masked) and appends the step to the
pipeline; ``_retire*`` reads the oldest steps' metrics vectors (one wait for the older half),
accounts completed steps, hands metrics rows to the recorder in batches, and applies the
metrics-driven rules (``nan_policy``, observers). Runs on the dispatcher thread only.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import jax
import numpy as np

from . import evaluation, fusecheck
from ..compiled import fusion
from ..causes import dispatch_error, short_error
from .group import Group
from .records import JobRecord
from .source import END, BatchMismatch, DataError
from .states import JobState

log = logging.getLogger("xshare.runtime")

S = JobState


class Executor:
    """Dispatching steps and retiring them. A part of ``Dispatcher``:
    its methods run on the dispatcher thread and share the dispatcher's tables."""

    def _dispatch(self, job: JobRecord, li: int, pos: int) -> None:
        if self.units.evaluating:
            owing = evaluation.owes(self, job)
            if owing is not None:  # an eval batch takes this turn (evaluation.py: scheduling)
                job.now = None
                evaluation.run_batch(self, owing)
                self._took_turn(job, li, pos)
                return
        if job.is_group:
            if job.payoff is not fusecheck.SETTLED and fusecheck.tend(self, job):
                return  # it dissolved: fusing did not pay, its members step alone from now
            if job.tier is None or not self._group_tier(job, li, pos):
                self._dispatch_group(job, li, pos)
            return
        tier = job.tier
        if tier is not None:
            if tier.pending is not None and tier.pending.done() and self._promote(job, li, pos):
                return  # the check ran this turn's steps (tiers.py)
            if tier.multi is not None:
                k = self._steps_this_call(job, tier.available())
                if k > 1:
                    self._dispatch_multi(job, li, pos, k)
                    return
        batch = job.batches.popleft()
        if batch is END or isinstance(batch, DataError):
            self._dispatch_marker(job, batch)
            return
        if self._fed(job):
            self.feeder.request(job)
        program = job.program
        step = job.spec.start_step + job.dispatched
        t = time.monotonic_ns()  # CLOCK_MONOTONIC, the fences' clock too
        try:
            if job.ident is not None:
                outs = program.executable(job.arrays, batch, job.ident)
            else:
                outs = program.executable(job.arrays, batch)
        except Exception as err:  # noqa: BLE001 - e.g. a batch that does not match the compile
            self.life.fail(job, dispatch_error(job, step, batch, err), err)
            self.life.settle(job)
            return
        job.arrays = outs[0]
        job.dispatched += 1
        job.in_flight += 1
        self._took_turn(job, li, pos)
        self._inflight.append((job, step, outs[1], t, 1))
        self._after_steps(job, step, 1)

    def _after_steps(self, job: JobRecord, step: int, k: int) -> None:
        """After steps ``step .. step + k - 1`` of a solo job were dispatched: its evaluation,
        its end, its checkpoint (``k`` never passes one of these boundaries: sched/steps.py)."""
        last = step + k - 1
        if job.eval is not None:
            evaluation.due(self, job, last)
        left = job.steps_left
        if left == 0:
            self.units.changed = True  # it leaves the rotation; it finishes when its steps retire
        elif (self.config.checkpoint_every and (last + 1) % self.config.checkpoint_every == 0 and left
              and not self.recorder.saving(job)):  # (still writing its last one: skip this one)
            # Its next step would consume (donate) this state: copy it out first.
            self._drain_inflight()
            if job.error is None and not job.terminal:
                self.life.save(job, done=False)

    def _took_turn(self, unit: Any, li: int, pos: int) -> None:
        self._seq += 1
        unit.last_seq = self._seq
        current = self.units.lane_current.get(unit.lane)
        if current is unit:
            unit.turn_steps += 1
        else:
            if current is not None:
                current.turn_steps = 0
            self.units.lane_current[unit.lane] = unit
            unit.turn_steps = 1
        self.planner.plan.stepped(li, pos)

    def _dispatch_group(self, group: Group, li: int, pos: int) -> None:
        """One fused step: every stepping member's own batch, stacked; idle slots masked."""
        capacity = group.capacity
        taken: dict[int, tuple[JobRecord, int, list]] = {}
        members, group.now = group.now or group.stepping(), None
        for slot, job in members:
            batch = job.batches.popleft()
            if batch is END or isinstance(batch, DataError):
                self._dispatch_marker(job, batch)
                continue
            step = job.spec.start_step + job.dispatched
            bad = _shape_mismatch(batch, group.zero_batch)
            if bad:
                self.life.fail(job, f"batch {step} does not match the compiled step: {bad}")
                self.life.settle(job)
                continue
            if self._fed(job):
                self.feeder.request(job)
            taken[slot] = (job, step, batch)
        if not taken:
            self.units.changed = True
            return
        mask = np.zeros((capacity,), np.bool_)
        mask[list(taken)] = True
        stacked = [np.stack([taken[s][2][i] if s in taken else zero for s in range(capacity)])
                   for i, zero in enumerate(group.zero_batch)]
        if fusion.on_host(group.arrays):  # its first step: the stack its members joined goes over
            group.arrays = jax.device_put(group.arrays, self.device)
        t = time.monotonic_ns()
        try:
            args = (group.arrays, (stacked, mask)) + ((group.ident,) if group.ident is not None else ())
            outs = group.fused.executable(*args)
        except Exception as err:  # noqa: BLE001 - an error inside the fused step
            # The step's donated inputs, the whole stack, are gone with it: every member fails,
            # the paused ones too (their slots were in the stack). The group dissolves as the
            # last one leaves (Lifecycle.end -> Groups.leave).
            for job in group.members:
                self.life.fail(job, f"fused step of {group.name} raised: {short_error(err)}", err)
                self.life.settle(job)
            return
        group.arrays = outs[0]
        group.steps_run += 1
        group.fused_member_steps += len(taken)
        self.fused_member_steps += len(taken)
        group.in_flight += 1
        steps = {}
        for slot, (job, step, _) in taken.items():
            job.dispatched += 1
            job.in_flight += 1
            if job.eval is not None:
                evaluation.due(self, job, step)
            # (A member whose last step this is stays masked in later group steps, so its
            # final state can be read from its slot whenever it is retired: see placement.state_of.)
            steps[slot] = (job, step)
        self._took_turn(group, li, pos)
        self._inflight.append((group, steps, outs[1], t, 1))
        due = [job for job, step in steps.values() if self.config.checkpoint_every and job.steps_left
               and (step + 1) % self.config.checkpoint_every == 0 and not self.recorder.saving(job)]
        if due:
            self._drain_inflight()
            for job in due:
                if job.error is None and not job.terminal:
                    self.life.save(job, done=False)

    def _dispatch_marker(self, job: JobRecord, batch: Any) -> None:
        if batch is END:
            job.data_done = True
            if job.eval is not None:
                evaluation.data_ended(self, job)
        elif isinstance(batch.error, BatchMismatch):
            self.life.fail(job, str(batch.error))
        else:
            self.life.fail(job, f"its data raised while producing batch {batch.step}: "
                            f"{short_error(batch.error)}", batch.error)
        self.units.changed = True
        self.life.settle(job)

    def _retire_group(self, group: Group, steps: dict, vec: Any, t: int, t_end: int | None, k: int = 1) -> None:
        group.in_flight -= 1
        try:
            values = np.asarray(vec)
        except Exception as err:  # noqa: BLE001
            for job, step in steps.values():
                job.in_flight -= 1
                self.life.fail(job, f"fused group step {step} raised: {short_error(err)}", err)
                self.life.settle(job)
            return
        t_end = t_end or time.monotonic_ns()
        rows = values if k > 1 else values[None]  # (k, capacity, metrics)
        finite = np.isfinite(rows).all(axis=2)  # once for the group, not once per member
        for i in range(k):
            t_i = t + (t_end - t) * (i + 1) // k if k > 1 else t_end
            for slot, (job, step) in steps.items():
                if job.error is None or i == 0:
                    self._retired(job, step + i, rows[i][slot], t_i, finite=bool(finite[i][slot]))
            if self.ring is None:
                self.timeline.host_step(group, t + (t_end - t) * i // k, t_i)
        for job, _ in steps.values():
            job.in_flight -= 1
            if job.in_flight == 0:
                self.life.settle(job)

    def _group_depth(self, group: Group) -> int:
        """Steps in flight behind a group's (``fusion.pipeline_depth``: what its footprint charges)."""
        return fusion.pipeline_depth(self.config.dispatch_ahead, self.config.group_ahead, group.step_batch_bytes)

    def _retire_oldest(self, depth: int | None = None) -> None:
        """Retire the older half of the pipeline with ONE wait, on the newest step among them:
        the older results are ready when it is, and reading them costs a copy each. With the
        default depth (2) that is one step per wait; a deep pipeline (``dispatch_ahead=16`` on
        a device where each wait is a costly hand-off) pays one wait per eight steps."""
        n = max(1, ((self.config.dispatch_ahead if depth is None else depth) + 1) // 2)
        try:
            jax.block_until_ready(self._inflight[min(n, len(self._inflight)) - 1][2])
        except Exception:  # noqa: BLE001 - a failed step: each retire below finds its own
            pass
        t_prev, t_end = self._last_retire_ns, time.monotonic_ns()
        for i in range(min(n, len(self._inflight))):
            # Without fences, steps retired together share the interval evenly (host timing).
            self._retire(t_prev + (t_end - max(t_prev, 0)) * (i + 1) // n if t_prev else None)
        self._last_retire_ns = t_end

    def _retire(self, t_end: int | None = None) -> None:
        job, step, vec, t, k = self._inflight.popleft()
        if job.is_group:
            self._retire_group(job, step, vec, t, t_end, k)
            if self.tiers.enabled and (job.tier is None or not job.tier.considered):
                self._consider_group(job)
            return
        job.in_flight -= 1
        try:
            # A sync point by design: the pipeline is full, so the host waits here while the
            # steps dispatched after this one keep the device busy.
            values = np.asarray(vec)
        except Exception as err:  # noqa: BLE001 - a step that fails on the device fails its job
            self.life.fail(job, f"step {step} raised: {short_error(err)}"
                       if k == 1 else f"steps {step}-{step + k - 1} raised: {short_error(err)}", err)
        else:
            t_end = t_end or time.monotonic_ns()
            if k == 1:
                self._retired(job, step, values, t_end)
                if self.ring is None:
                    self.timeline.host_step(job, t, t_end)
            else:
                self._retired_many(job, step, values, t, t_end)
        if job.in_flight == 0:
            self.life.settle(job)
        if (job.tier is None or not job.tier.considered) and self.tiers.enabled \
                and job.group is None and not job.terminal:
            self._consider(job)  # (at once for a program whose K-step form is known; else after WARM_STEPS)

    def _retired_many(self, job: JobRecord, step: int, values: Any, t: int, t_end: int) -> None:
        """The K rows of one K-step call, one per step, as if each had retired alone (host times
        split evenly over the call: the fences time each inner step themselves)."""
        k = len(values)
        for i in range(k):
            if job.error is not None:
                break  # (nan_policy="fail" at an earlier row: the later rows are not its steps)
            t_i = t + (t_end - t) * (i + 1) // k
            self._retired(job, step + i, values[i], t_i)
            if self.ring is None:
                self.timeline.host_step(job, t + (t_end - t) * i // k, t_i)

    def _retired(self, job: JobRecord, step: int, values: Any, t_end: int, *,
                 finite: bool | None = None) -> None:
        """Account one completed step of ``job`` with its metrics vector."""
        # A step that completed counts even if the job failed after it was dispatched (a
        # later batch was bad): its work is real and its metrics are logged.
        job.steps_done += 1
        job.last_values = values
        if job.spec.observer is not None:
            self._observe(job, step, values, t_end)
        if job.spec.on_metrics is not None:  # this step's own metrics (evaluations notify apart)
            evaluation.notify(self, job, step + 1, {**dict(zip(job.program.metric_names, values.tolist())),
                                                    **(job.extra_metrics or {})})
        if self._log:
            # Handed to the recorder in batches: a queue put per step would wake its thread
            # per step, and the two threads would take turns at the GIL.
            self._rows.append((job, step, t_end / 1e9, values, job.extra_metrics))
            if len(self._rows) >= 256:
                self._flush_rows()
        if job.spec.nan_policy == "fail" and not (np.isfinite(values).all() if finite is None else finite):
            bad = [k for k, v in job.last_metrics.items() if not np.isfinite(v)]
            self.life.fail(job, f"non-finite metric {bad[0]}={job.last_metrics[bad[0]]} at step {step} "
                            "(nan_policy='fail')")

    def _flush_rows(self) -> None:
        rows, self._rows = self._rows, []
        self.recorder.metrics_rows(rows)

    def _drain_inflight(self) -> None:
        while self._inflight:
            self._retire()

    def _observe(self, job: JobRecord, step: int, values: Any, t_end_ns: int) -> None:
        metrics = dict(zip(job.program.metric_names, values.tolist()))
        try:
            extra = job.spec.observer(step, metrics, t_end_ns / 1e9)
            job.extra_metrics = {k: float(v) for k, v in (extra or {}).items()} or None
        except Exception as err:  # noqa: BLE001 - its failure fails the job
            self.life.fail(job, f"its observer raised at step {step}: {short_error(err)}", err)


def _shape_mismatch(batch: list, like: list) -> str | None:
    """Why a member's batch cannot be stacked with its group's (None if it can)."""
    # Per member per group step: the common case (arrays of exactly the compiled shape and
    # dtype) is decided by comparing attributes, without numpy's shape/dtype conversions.
    if len(batch) == len(like) and all(
            getattr(x, "shape", None) == z.shape and getattr(x, "dtype", None) == z.dtype
            for x, z in zip(batch, like)):
        return None
    for i, (x, z) in enumerate(zip(batch, like)):
        if np.shape(x) != z.shape or np.dtype(getattr(x, "dtype", None)) != z.dtype:
            return (f"leaf {i} is {np.dtype(getattr(x, 'dtype', None))}{list(np.shape(x))}, "
                    f"expected {z.dtype}{list(z.shape)}")
    return None

