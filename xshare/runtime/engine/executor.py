"""The executor: steps in flight, and what retiring them produces.

``Executor.dispatch`` calls a unit's shared executable on its resident state and its next batch
(a fused group's step is ``multigroup.GroupCalls.step``: every stepping member's batch,
stacked, idle slots masked; K steps in one call are ``multicall.MultiCalls`` and ``GroupCalls``)
and appends the step to the pipeline it owns; ``retire*`` reads the oldest steps' metrics
vectors (one wait for the older half), accounts completed steps, buffers metrics rows for the
recorder (``rows.MetricsRows``), and applies the metrics-driven rules (``nan_policy``,
observers). It is also the ``evaluation.Host`` its eval batches run with. The hot path: one
step's dispatch and retirement; dispatcher thread only.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Callable

import jax
import numpy as np

from . import evaluation, fusecheck
from ..compiled import fusion
from ..causes import dispatch_error, short_error
from ..config import RuntimeConfig
from .group import Group
from .lifecycle import Lifecycle
from .multicall import MultiCalls, chain, run_steps
from .multigroup import GroupCalls
from .planner import Planner
from .records import RECENT, JobRecord, median_step_s
from .rows import BATCH, MetricsRows
from .source import END, BatchMismatch, DataError, Feeding, owned
from .shapes import OtherShapes
from .streams import LaneStreams
from .tiers import WARM_STEPS, Tiers
from .units import Units

log = logging.getLogger("xshare.runtime")

# A step in flight: (unit, its step index or a group's {slot: (job, step)}, the metrics
# vector(s) on the device, the host time it was dispatched (ns), steps in the call).
InFlight = tuple[Any, Any, Any, int, int]

RUNS_IN_FLIGHT = 1  # pipeline entries left in flight after a run (``Executor.run``)


def copies_early(device: Any) -> bool:
    """Whether steps' metrics start to the host at dispatch (``Executor.host_copy``)."""
    return getattr(device, "platform", "cpu") != "cpu"


class Executor:
    """Dispatching steps and retiring them: owns the steps in flight (``inflight``) and the
    count of member steps run fused (``fused_member_steps``); runs K-step calls through
    ``multi`` (solo jobs) and ``fused`` (groups), which it makes.

    ``tend(group)``: before a group's step, its fusion measurement (``fusecheck.FuseCheck``):
    True if the group dissolved. ``cancel_soon(job)``: cancel a job at the next step boundary
    (an ``on_metrics`` hook asked)."""

    def __init__(self, *, units: Units, planner: Planner, life: Lifecycle, tiers: Tiers,
                 rows: MetricsRows, feeding: Feeding, config: RuntimeConfig, recorder: Any,
                 timeline: Any, device: Any, ring: int | None, arena: Any, tend: Callable[[Group], bool],
                 cancel_soon: Callable[[Any], None], shapes: OtherShapes):
        self.units, self.planner, self.life, self.tiers, self.rows = units, planner, life, tiers, rows
        self.shapes = shapes  # programs for batches of other shapes than a job's first
        self.feeder, self._fed = feeding.feeder, feeding.fed
        self.config, self.recorder, self.timeline, self.device, self.ring = config, recorder, timeline, device, ring
        self.tend, self.cancel_soon = tend, cancel_soon
        self.inflight: deque[InFlight] = deque()
        # Off a CPU, start each step's metrics on their way to the host as it is dispatched:
        # retirement then finds them there instead of waiting for a device-to-host copy of its
        # own. On an H100 that wait was ~38% of the dispatcher's time (benchmarks/RESULTS.md,
        # "The first GPU run"). A CPU backend's arrays are host memory already, and the call
        # costs ~5 us a step there: not made.
        self.host_copy = copies_early(device)
        # On a CPU a run is one pipeline entry, its batches host memory (run_length).
        self.runs_free = not self.host_copy
        self.fused_member_steps = 0                    # member steps run in fused groups, ever
        # On CPU each lane's calls on an execution stream of its own: lanes run side by side
        # (streams.py; Runtime(parallel_lanes=False) keeps every call on one stream).
        self.streams = LaneStreams(device, parallel=config.parallel_lanes)
        self._seq = 0
        self._last_retire_ns = 0
        parts = dict(units=units, life=life, tiers=tiers, feeding=feeding, config=config,
                     recorder=recorder, timeline=timeline, device=device, ring=ring, arena=arena)
        self.multi = MultiCalls(self, **parts)
        self.fused = GroupCalls(self, self.multi, **parts)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, job: Any, li: int, pos: int) -> None:
        """Run the picked unit's turn: an eval batch it owes, or its next step(s)."""
        if self.units.evaluating:
            owing = evaluation.owes(self.units, job)
            if owing is not None:  # an eval batch takes this turn (evaluation.py: scheduling)
                job.now = None
                self.streams.enter(owing.lane)
                evaluation.run_batch(self, owing)
                self.took_turn(job, li, pos)
                return
        self.streams.enter(job.lane)
        if job.is_group:
            if (job.payoff is not fusecheck.SETTLED or job.payoff_k is not fusecheck.SETTLED) and self.tend(job):
                return  # it dissolved: fusing did not pay, its members step alone from now
            if job.tier is None and self.tiers.enabled:
                # As for a solo job's first turn: a K-step form of the group's program this
                # process checked and built already is adopted now, not at its first retire
                # (a fused group's pipeline is deep: that came 32 group steps late).
                self.fused.consider(job)
            if job.tier is None or not self.fused.tier_turn(job, li, pos):
                self.fused.turn(job, li, pos)
            return
        tier = job.tier
        if tier is None and self.tiers.enabled and job.program is not None:
            # Its first turn: a K-step form this process already checked and built for its
            # program (another job's) is adopted now, not after its first run retires.
            self.multi.consider(job)
            tier = job.tier
        if tier is not None:
            if tier.pending is not None and tier.pending.done() and self.multi.promote(job, li, pos):
                return  # the check ran this turn's steps (tiers.py)
            if tier.multi is not None:
                k = self.multi.steps_this_call(job, tier.available(), tier.upto())
                if k > 1:
                    self.multi.dispatch(job, li, pos, k)
                    return
        n = self.run_length(job)
        if n > 1:
            self.run(job, li, pos, n)
            return
        batch = owned(job.batches.popleft(), self.device)  # (it is donated)
        if batch is END or isinstance(batch, DataError):
            self.dispatch_marker(job, batch)
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
            # (the call checks its operands before it runs: nothing was donated)
            if self.shapes.differs(job, batch):
                self.side_step(job, batch, li, pos)
            else:
                self.life.fail(job, dispatch_error(job, step, batch, err), err)
                self.life.settle(job)
            return
        self.stepped(job, step, outs[0], outs[1], t, li, pos)

    def stepped(self, job: JobRecord, step: int, arrays: Any, vector: Any, t: int, li: int, pos: int) -> None:
        """A solo job's one-step call was made: its new state, its step in flight."""
        job.arrays = arrays
        job.dispatched += 1
        job.in_flight += 1
        self.took_turn(job, li, pos)
        self.inflight.append((job, step, vector, t, 1))
        if self.host_copy:
            vector.copy_to_host_async()
        self.after_steps(job, step, 1)

    def side_step(self, job: JobRecord, batch: list, li: int, pos: int) -> None:
        """One step of a solo job on a batch of another shape than its program's (a short last
        batch): on its step compiled for that shape (``shapes.py``), as ``jax.jit`` would
        retrace. While that compiles the job waits off the rotation, its batch kept first."""
        step = job.spec.start_step + job.dispatched
        try:
            program = self.shapes.program(job, batch, step)
        except ValueError as err:
            self.life.fail(job, str(err), err)
            self.life.settle(job)
            return
        if program is None:  # compiling: it steps again once it is (Dispatcher._shape_ready)
            job.batches.appendleft(batch)
            self.units.stop(job)
            return
        n = job.layout.n_arrays
        arrays, t = list(job.arrays), time.monotonic_ns()
        try:
            outs = program.executable(arrays[:n], batch, *(() if job.ident is None else (job.ident,)))
        except Exception as err:  # noqa: BLE001 - its step raised: it fails alone
            self.life.fail(job, f"step {step} raised: {short_error(err)}", err)
            self.life.settle(job)
            return
        # (the constants its fused program lifts, if any, stay as they were)
        self.stepped(job, step, list(outs[0]) + arrays[n:], outs[1], t, li, pos)

    def run_length(self, job: JobRecord) -> int:
        """How many one-step calls ``job``'s turn runs (``run``): as many as a K-step call of
        it could (``MultiCalls.bounds``: never past a boundary, and under srtf and priority
        about ``QUANTUM_S`` of device time), up to ``RUN_STEPS`` and about ``RUN_S`` of its
        measured steps, with the batches ready (made inline for cheap data).

        On a CPU a run is one entry of the pipeline, as a K-step call is (its batches are host
        memory, as a K-step call's stacked ones are). On an accelerator each of its batches is
        a device buffer until its call ends, so the job's steps in flight stay within
        ``1 + dispatch_ahead``, the in-flight batches its footprint is charged for: older
        entries retire first to make room for a run of half that."""
        # Its first run is its warm-up: it retires before the next, so its step time is
        # measured and the tiers weigh a K-step program after WARM_STEPS steps, not 16. Then a
        # run takes about RUN_S of its steps (and under srtf and priority, ``bounds``' cap).
        step_s = self.measured_step_s(job) if job.steps_done >= WARM_STEPS else None
        want = min(self.multi.bounds(job).limit(), WARM_STEPS if step_s is None else run_steps(step_s))
        if want < 2:
            return 1
        if not self.runs_free:
            budget = self.config.dispatch_ahead + 1
            while self.inflight and budget - self.steps_in_flight(job) < min(want, (budget + 1) // 2):
                self.retire_oldest()
            want = min(want, budget - self.steps_in_flight(job))
            if want < 2:
                return 1
        return self.multi.ready_batches(job, want)

    def measured_step_s(self, unit: Any) -> float | None:
        """The median of a job's (or a fused group's) recent steps, None while too few are
        measured. The fences' times are read now if there are none yet, rather than at the
        recorder's next drain (~5x a second): once per unit."""
        step_s = median_step_s(unit.step_times, last=RECENT)
        if step_s is None:
            self.timeline.drain()
            step_s = median_step_s(unit.step_times, last=RECENT)
        return step_s

    def after_run(self) -> None:
        """After a run (a job's or a fused group's): older entries retire now, not when
        ``dispatch_ahead`` entries are in flight. That many runs are ~100 steps, and what
        retiring does (steps counted, metrics reported, the tiers weighing a K-step program)
        would come that late. Only the run just made stays in flight: on a CPU the one before
        it has run by now (the host is the bound), elsewhere its calls were queued a run ago."""
        while len(self.inflight) > RUNS_IN_FLIGHT:
            self.retire()

    def steps_in_flight(self, job: JobRecord) -> int:
        """The job's steps dispatched and not retired (a call's K counts K)."""
        if not job.in_flight:
            return 0
        return sum(entry[4] for entry in self.inflight if entry[0] is job)

    def run(self, job: JobRecord, li: int, pos: int, n: int) -> None:
        """``n`` steps of ``job`` in one turn, each a call of its one-step program (a *run*).

        What a K-step call saves the host, without a K-step program: one pick of the plan,
        one pipeline entry, one retirement wait and one boundary check for ``n`` steps, where
        one step per turn paid each every step (~30 us a step of a ~100 us step for a small
        Flax net on this project's CPU machine; RESULTS.md). The calls and their operands are
        the ones ``n`` turns would make, in the same order, so the job ends in the same state
        bit for bit; the run is one entry of the pipeline, retired as a K-step call is (one
        metrics row per step). ``run_length`` keeps ``n`` inside every boundary, so only a
        failing call ends a run early: the steps before it count, and the job fails."""
        program = job.program
        assert program is not None  # (it was picked to step: compiled)
        batches, device = job.batches, self.device
        step = job.spec.start_step + job.dispatched
        t = time.monotonic_ns()
        job.arrays, vectors, failed = chain(program.executable, job.arrays, job.ident, self.host_copy,
                                            (owned(batches.popleft(), device) for _ in range(n)))  # (donated)
        done = len(vectors)
        if self._fed(job):
            self.feeder.request(job, done + (failed is not None))
        if done:
            job.dispatched += done
            job.in_flight += 1
            self.took_turn(job, li, pos)
            self.inflight.append((job, step, vectors if done > 1 else vectors[0], t, done))
            self.after_run()
        if failed is not None:
            bad, error = failed
            self.life.fail(job, dispatch_error(job, step + done, bad, error), error)
            self.life.settle(job)
            return
        self.after_steps(job, step, done)

    def after_steps(self, job: JobRecord, step: int, k: int) -> None:
        """After steps ``step .. step + k - 1`` of a solo job were dispatched: its evaluation,
        its end, its checkpoint (``k`` never passes one of these boundaries: sched/steps.py)."""
        last = step + k - 1
        if job.eval is not None:
            evaluation.due(self.units, job, last)
        left = job.steps_left
        if left == 0:
            self.units.changed = True  # it leaves the rotation; it finishes when its steps retire
        elif (self.config.checkpoint_every and (last + 1) % self.config.checkpoint_every == 0 and left
              and not self.recorder.saving(job)):  # (still writing its last one: skip this one)
            # Its next step would consume (donate) this state: copy it out first.
            self.drain()
            if job.error is None and not job.terminal:
                self.life.save(job, done=False)

    def checkpoint_members(self, steps: dict[int, tuple[JobRecord, int]], k: int) -> None:
        """After ``k`` group steps of the members in ``steps`` were dispatched: checkpoint those
        whose last step completes a multiple of ``checkpoint_every``."""
        every = self.config.checkpoint_every
        due = [job for job, step in steps.values() if every and job.steps_left
               and (step + k) % every == 0 and not self.recorder.saving(job)]
        if due:
            self.drain()
            for job in due:
                if job.error is None and not job.terminal:
                    self.life.save(job, done=False)

    def took_turn(self, unit: Any, li: int, pos: int) -> None:
        self._seq += 1
        unit.last_seq = self._seq
        units = self.units
        current: Any = units.lane_current.get(unit.lane)  # (Any: a unit, or None)
        if current is unit:
            unit.turn_steps += 1
        else:
            if current is not None:
                current.turn_steps = 0
            units.lane_current[unit.lane] = unit
            unit.turn_steps = 1
        plan = self.planner.plan
        assert plan is not None  # (a unit was picked from it)
        plan.stepped(li, pos)

    def dispatch_marker(self, job: JobRecord, batch: Any) -> None:
        if batch is END:
            job.data_done = True
            if job.eval is not None:
                evaluation.data_ended(self.units, job)
        elif isinstance(batch.error, BatchMismatch):
            self.life.fail(job, str(batch.error))
        else:
            self.life.fail(job, f"its data raised while producing batch {batch.step}: "
                                f"{short_error(batch.error)}", batch.error)
        self.units.changed = True
        self.life.settle(job)

    # ------------------------------------------------------------------ retire
    def group_depth(self, group: Group) -> int:
        """Steps in flight behind a group's (``fusion.pipeline_depth``: what its footprint charges)."""
        return fusion.pipeline_depth(self.config.dispatch_ahead, self.config.group_ahead, group.step_batch_bytes)

    def retire_oldest(self, depth: int | None = None) -> None:
        """Retire the older half of the pipeline with ONE wait, on the newest step among them:
        the older results are ready when it is, and reading them costs a copy each. With the
        default depth (2) that is one step per wait; a deep pipeline (``dispatch_ahead=16`` on
        a device where each wait is a costly hand-off) pays one wait per eight steps."""
        inflight = self.inflight
        n = max(1, ((self.config.dispatch_ahead if depth is None else depth) + 1) // 2)
        try:
            jax.block_until_ready(inflight[min(n, len(inflight)) - 1][2])
        except Exception:  # noqa: BLE001 - a failed step: each retire below finds its own
            pass
        t_prev, t_end = self._last_retire_ns, time.monotonic_ns()
        for i in range(min(n, len(inflight))):
            # Without fences, steps retired together share the interval evenly (host timing).
            self.retire(t_prev + (t_end - max(t_prev, 0)) * (i + 1) // n if t_prev else None)
        self._last_retire_ns = t_end

    def retire(self, t_end: int | None = None) -> None:
        """Retire the oldest step (or call) in flight."""
        job, step, vec, t, k = self.inflight.popleft()
        if job.is_group:
            self._retire_group(job, step, vec, t, t_end, k)
            if self.tiers.enabled and (job.tier is None or not job.tier.considered):
                self.fused.consider(job)
            return
        job.in_flight -= 1
        try:
            # A sync point by design: the pipeline is full, so the host waits here while the
            # steps dispatched after this one keep the device busy.
            values = np.asarray(vec)
        except Exception as err:  # noqa: BLE001 - a step that fails on the device fails its job
            self._fail_call(job, step, vec, k, t, t_end, err)
        else:
            t_end = t_end or time.monotonic_ns()
            if k == 1:
                self.retired(job, step, values, t_end)
                if self.ring is None:
                    self.timeline.host_step(job, t, t_end)
            else:
                self.retired_many(job, step, values[:k], t, t_end)  # (a rolled call's rows past k: padding)
        if job.in_flight == 0:
            self.life.settle(job)
        if (job.tier is None or not job.tier.considered) and self.tiers.enabled \
                and job.group is None and not job.terminal:
            self.multi.consider(job)  # (at once for a program whose K-step form is known; else after WARM_STEPS)

    def _retire_group(self, group: Group, steps: dict, vec: Any, t: int, t_end: int | None, k: int = 1) -> None:
        group.in_flight -= 1
        try:
            values = np.asarray(vec)
        except Exception as err:  # noqa: BLE001
            self._fail_group_call(group, steps, vec, k, t, t_end, err)
            return
        self._retire_group_rows(group, steps, values[:k] if k > 1 else values[None], t, t_end or time.monotonic_ns())
        for job, _ in steps.values():
            job.in_flight -= 1
            if job.in_flight == 0:
                self.life.settle(job)

    def _fail_group_call(self, group: Group, steps: dict, vec: Any, k: int, t: int, t_end: int | None, err: Exception) -> None:
        """A group call in flight raised on the device: every member fails (the call donated
        the whole stack, so no member's state survives it), naming the group step that raised.
        A run of group calls (``vec`` a list, ``GroupCalls.run``) names the call that raised,
        and the group steps before it, which completed, retire first, as ``_fail_call`` does
        for a solo job's run."""
        done, err, named = completed_calls(vec, k, err)
        if done:
            self._retire_group_rows(group, steps, np.stack(done), t, t_end or time.monotonic_ns())
        for job, step in steps.values():
            job.in_flight -= 1
            self.life.fail(job, f"fused group {named_steps(step + len(done), named)} raised: {short_error(err)}", err)
            self.life.settle(job)

    def _retire_group_rows(self, group: Group, steps: dict, rows: Any, t: int, t_end: int) -> None:
        """Account the rows (k, capacity, metrics) of k group steps that completed."""
        k = len(rows)
        each = {slot: js for slot, js in steps.items() if not self._counted(js[0], rows[:, slot])}
        if each:
            finite = np.isfinite(rows).all(axis=2)  # once for the group, not once per member
            for i in range(k):
                t_i = t + (t_end - t) * (i + 1) // k if k > 1 else t_end
                for slot, (job, step) in each.items():
                    self.retired(job, step + i, rows[i][slot], t_i, finite=bool(finite[i][slot]))
        if self.ring is None:
            for i in range(k):
                t_i = t + (t_end - t) * (i + 1) // k if k > 1 else t_end
                self.timeline.host_step(group, t + (t_end - t) * i // k, t_i)

    def _fail_call(self, job: JobRecord, step: int, vec: Any, k: int, t: int, t_end: int | None,
                   err: Exception) -> None:
        """A call in flight raised on the device: its job fails, naming the step. A run (``vec``
        a list: one vector per one-step call, ``Executor.run``) names the call that raised, and
        the steps before it, which completed, retire as any completed step does. A K-step call
        is one executable: it names its steps."""
        done, err, named = completed_calls(vec, k, err)
        if done:
            self.retired_many(job, step, np.stack(done), t, t_end or time.monotonic_ns())
        self.life.fail(job, f"{named_steps(step + len(done), named)} raised: {short_error(err)}", err)

    def retired_many(self, job: JobRecord, step: int, values: Any, t: int, t_end: int) -> None:
        """The K rows of one K-step call, one per step, as if each had retired alone (host times
        split evenly over the call: the fences time each inner step themselves)."""
        k = len(values)
        counted = self._counted(job, values)
        for i in range(k):
            t_i = t + (t_end - t) * (i + 1) // k
            if not counted:
                self.retired(job, step + i, values[i], t_i)
            if self.ring is None:
                self.timeline.host_step(job, t + (t_end - t) * i // k, t_i)

    def _counted(self, job: JobRecord, rows: Any) -> bool:
        """Count ``rows`` (several steps' metrics of ``job``) at once if nothing reads them one
        by one (no observer, no ``on_metrics``, no metrics log, no ``nan_policy="fail"``, no
        failure to stop at): what ``retired`` would do for each, ~1.5 us a row less (16 rows a
        K=16 call; 128 for a group of 8)."""
        spec = job.spec
        if (job.failed_at is not None or spec.observer is not None or spec.on_metrics is not None
                or self.rows.enabled or spec.nan_policy == "fail"):
            return False
        job.steps_done += len(rows)
        job.last_values = rows[-1]
        return True

    def retired(self, job: JobRecord, step: int, values: Any, t_end: int, *,
                finite: bool | None = None) -> None:
        """Account one completed step of ``job`` with its metrics vector."""
        # A step that completed counts even if the job failed after it was dispatched (a
        # later batch was bad): its work is real and its metrics are logged. But not a step
        # after the one whose own metrics failed it (nan_policy="fail", its observer or
        # on_metrics raising: ``Lifecycle.fail``'s ``at_step``): those were in flight behind
        # it (a later row of its K-step or group call, a later call of its pipeline), and a
        # plain loop that checked each step would have stopped there.
        if job.failed_at is not None and step > job.failed_at:
            return
        job.steps_done += 1
        job.last_values = values
        spec = job.spec
        if spec.observer is not None:
            self._observe(job, step, values, t_end)
        if spec.on_metrics is not None:  # this step's own metrics (evaluations notify apart)
            assert job.program is not None  # (it ran a step)
            evaluation.notify(self, job, step + 1, {**dict(zip(job.program.metric_names, values.tolist())),
                                                    **(job.extra_metrics or {})})
        rows = self.rows
        if rows.enabled:
            # Handed to the recorder in batches (rows.py).
            items = rows.items
            items.append((job, step, t_end / 1e9, values, job.extra_metrics))
            if len(items) >= BATCH:
                rows.flush()
        if spec.nan_policy == "fail" and not (np.isfinite(values).all() if finite is None else finite):
            metrics = job.last_metrics or {}
            bad = [k for k, v in metrics.items() if not np.isfinite(v)]
            self.life.fail(job, f"non-finite metric {bad[0]}={metrics[bad[0]]} at step {step} "
                                "(nan_policy='fail')", at_step=step)

    def drain(self) -> None:
        """Retire every step in flight."""
        while self.inflight:
            self.retire()

    def _observe(self, job: JobRecord, step: int, values: Any, t_end_ns: int) -> None:
        observer = job.spec.observer
        assert job.program is not None and observer is not None  # (it ran a step; retired asked)
        metrics = dict(zip(job.program.metric_names, values.tolist()))
        try:
            extra = observer(step, metrics, t_end_ns / 1e9)
            job.extra_metrics = {k: float(v) for k, v in (extra or {}).items()} or None
        except Exception as err:  # noqa: BLE001 - its failure fails the job
            self.life.fail(job, f"its observer raised at step {step}: {short_error(err)}", err, at_step=step)


def completed_calls(vec: Any, k: int, err: Exception) -> tuple[list, Exception, int]:
    """For a call in flight whose result raised when read: ``(rows, error, named)``. A run
    (``vec`` a list of its ``k`` one-step calls' results) gives the rows of the calls that
    completed before the one that raised, that call's error, and 1 (the error names that one
    step). A K-step call is one executable (no rows; it names its ``k`` steps), as is a run
    whose every row reads (the error was not one call's: named as a whole)."""
    if not (isinstance(vec, list) and len(vec) == k):
        return [], err, k
    done: list = []
    for row in vec:
        try:
            done.append(np.asarray(row))
        except Exception as row_err:  # noqa: BLE001 - the call that raised
            return done, row_err, 1
    return [], err, k


def named_steps(first: int, n: int) -> str:
    """``step 4`` or ``steps 4-11``: the steps an error names."""
    return f"step {first}" if n == 1 else f"steps {first}-{first + n - 1}"
