"""Multi-step calls: K steps of a solo job in one executable call, the check that promotes a
job to its K-step program, and when to start compiling one.

``tiers.Tiers`` decides and remembers; ``MultiCalls`` runs the steps, on the executor's
pipeline (``executor.Executor``, which makes it; dispatcher thread only). How
many steps a call runs is ``sched.steps.steps_per_call`` over the job's boundaries, so a call
never passes its last step, an evaluation, a checkpoint, a report a study acts on, the batches
it has, or (preemptive policies) about the policy's quantum of device time (``sched.steps``).

Runs share those bounds: several calls of a unit's one-step program in one turn (``chain``,
``run_steps``; ``Executor.run`` and ``GroupCalls.run`` make them).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable

import jax
import numpy as np

from ...sched import steps as ksteps
from ..compiled import multistep
from ..causes import dispatch_error
from ..compiled.multistep import MultiStep, Verdict
from ..config import RuntimeConfig
from .lifecycle import Lifecycle
from .records import JobRecord
from .tiers import WARM_STEPS, Candidate, Tiers, typical_step_s
from .source import END, DataError, Feeding, owned, produce
from .units import Units

if TYPE_CHECKING:  # (the executor makes this part and hands itself in: a cycle for types only)
    from .executor import Executor

# Fences of the check's K-step calls carry this job id, which no job has, so the timeline does
# not count their inner steps as the job's (it counts the check's single steps, which the job
# keeps).
_SCRATCH_JOB = 2**31 - 1
# Above this many state bytes the check times the K-step call's first run instead of a second
# one on a third copy of the state (a second copy of a large state is not worth a timing).
_TIMED_COPY_BYTES = 256 << 20


# Runs: several calls of a unit's one-step program in one turn (``Executor.run``,
# ``GroupCalls.run``, ``chain``). The most calls a run makes: past ~16 the host's per-turn work
# is already a few percent of a run, and a turn stays short (~2 ms of 100 us steps) for the
# controls, evaluations and other jobs that wait for the next turn boundary.
RUN_STEPS = 16
# ... and about this long at most: a run saves the host ~30 us a step, a few percent of a step
# of 1 ms, so a job whose steps take that long keeps one step per turn (and jobs sharing a lane
# alternate step by step, as before runs).
RUN_S = 2e-3


class MultiCalls:
    """K-step calls of solo jobs and their promotion. ``pipeline``: the executor whose steps in
    flight the calls join (``took_turn``, ``inflight``, ``after_steps``, ``retired_many``,
    ``drain``)."""

    def __init__(self, pipeline: Executor, *, units: Units, life: Lifecycle, tiers: Tiers,
                 feeding: Feeding, config: RuntimeConfig, recorder: Any, timeline: Any,
                 device: Any, ring: int | None, arena: Any):
        self.pipeline, self.units, self.life, self.tiers = pipeline, units, life, tiers
        self.feeder, self._fed = feeding.feeder, feeding.fed
        self.config, self.recorder, self.timeline = config, recorder, timeline
        self.device, self.ring, self.arena = device, ring, arena
        # program key -> (verdicts' version, its fastest kept form's pace or None): form_step_s
        self._paces: dict[str, tuple[int, float | None]] = {}

    # ------------------------------------------------------------------ how many steps
    def bounds(self, job: JobRecord) -> ksteps.Bounds:
        """Where the job's next call must stop, its own policy bound included."""
        return self.bounds_under(job, self.preemptive_cap(job) if self.config.preemptive else None)

    def bounds_under(self, job: JobRecord, cap: int | None) -> ksteps.Bounds:
        """``bounds`` with the policy's bound ``cap`` given (a group's, for its members)."""
        step = job.spec.start_step + job.dispatched
        spec = job.spec
        report = None
        if spec.on_metrics is not None:
            every = spec.on_metrics_every
            report = 1 if every is None else ksteps.until(step, every) if every else None
        return ksteps.Bounds(
            left=job.steps_left,
            to_eval=ksteps.until(step, job.eval.every) if job.eval is not None else None,
            to_checkpoint=ksteps.until(step, self.config.checkpoint_every) if self.config.checkpoint_dir is not None else None,
            to_report=report, cap=cap)

    def preemptive_cap(self, job: JobRecord, step_s: float | None = None) -> int:
        """Under a preemptive policy, the most steps one call of ``job`` may run (1 while its
        step time is unknown): about the policy's quantum of device time shared by the calls in flight,
        and at least ``quantum`` steps (Runtime's argument: a job keeps the device that long)."""
        if step_s is None:
            tier = job.tier
            if tier is not None and tier.multi is not None and tier.step_s:
                # A call of its kept form takes K of that form's steps, not K one-step steps: its
                # one-step time (107 us for the trace's 64-wide MLP, against 49 at K=16) capped a
                # K=16 form it had adopted at 8, and the job ran every step one per call. Nor is
                # the cap stricter than the form's adoption (``period``: the measured step time),
                # over the check timing a step a little slower (126 against ~120 us at K=8 for the
                # 128-wide one): the lesser of the two.
                step_s = min(tier.step_s, job.step_time_s or tier.step_s)
            else:
                step_s = job.step_time_s if job.step_time_s is not None or tier is None else tier.step_s
        return call_cap(self.config, step_s)

    def form_step_s(self, unit: Any, data_s: float | None = None) -> float | None:
        """Seconds a step of ``unit`` takes in the fastest multi-step form it runs or may run:
        the form's check's figure (its K-step call over K, host and device together, on batches
        made before the clock) plus ``data_s``, the time to make one of its batches (its own as
        measured, or a typical one's before it has made any), where the dispatcher makes them
        (``Feeding.fed``: else the feeder makes them beside the steps, and the slower of the two
        sets the pace). A kept form (``Tiers.keeps``) whose K fits the preemptive cap at that
        pace; None for a group, a job not prepared yet, one without such a form, or one whose
        boundaries come every step (``period``).

        Policies rank remaining time by it (``sched.srtf.remaining_s``): a job's own step times
        are those of the steps it ran, often one per call beside other jobs' compiles, and are not
        renewed while it waits. A batch's time is its slowly rising minimum (``source.produce``),
        not its mean: on this project's 2-core CPU everything the runtime times while other jobs
        compile is slowed, the check's figure least (the fastest of its rounds); the mean of the
        jct trace's synthetic batches came to ~100 us there against ~25 alone, and ranked with it
        a job that had just made its first batches looked a third dearer than one that had not."""
        program = getattr(unit, "program", None)
        if unit.is_group or program is None:
            return None
        best = self.fastest_pace(program.key)
        if best is None:
            return None
        period = self.period(unit)
        if period is not None and period < 2:
            return None  # its boundaries (a report every step) hold it at one step per call
        if not data_s:
            return best
        return max(best, data_s) if self._fed(unit) else best + data_s

    def fastest_pace(self, program_key: str) -> float | None:
        """The pace (seconds a step) of the program's fastest kept form that fits a call under
        this policy (``form_fits``), as its check timed it; None without one. Kept per program
        until the verdicts change (asked per unit at every policy decision, and at each turn of a
        preemptive unit not timed yet: the machine's table holds every program it checked)."""
        verdicts = multistep.VERDICTS
        known = self._paces.get(program_key)
        if known is None or known[0] != verdicts.version:
            paces = [v.multi_step_s for v in verdicts.of(program_key) if v.multi_step_s > 0 and self.tiers.keeps(v)
                     and (not self.config.preemptive or form_fits(self.config, v))]
            known = self._paces[program_key] = (verdicts.version, min(paces) if paces else None)
        return known[1]

    def steps_this_call(self, job: JobRecord, available: tuple[int, ...], upto: int = 1) -> int:
        bounds = self.bounds(job)
        want = ksteps.steps_per_call(bounds, available, upto)
        if want > 1:
            ready = self.ready_batches(job, want)
            if ready < want:
                want = ksteps.steps_per_call(dataclasses.replace(bounds, ready=ready), available, upto)
        return want

    def ready_batches(self, job: JobRecord, want: int) -> int:
        """Batches ready for the job's next steps, made inline up to ``want`` for jobs whose
        data is cheap (as a plain loop makes them); a marker (the end, a data error) stops the
        count, so its call stops before it."""
        batches = job.batches
        if not self._fed(job) and len(batches) < want and job.source is not None:
            produce(job, self.device, blocking=True, n=want - len(batches))
        assert job.program is not None  # (it steps)
        # By index, not by iterating: the feeder thread appends to the deque meanwhile, and a
        # Python loop over a deque that grows between its steps raises ("deque mutated during
        # iteration", which failed the dispatcher). Only this thread takes from its left (a
        # feeder clears a job's batches only once the job has ended, after its last count), so
        # the first len() entries stay where they are.
        sig, fits = job.program.batch_signature, multistep.fits
        have = min(want, len(batches))
        for n in range(have):
            batch = batches[n]
            if batch is END or type(batch) is DataError or not fits(batch, sig):
                return n
        return have

    # ------------------------------------------------------------------ a K-step call
    def dispatch(self, job: JobRecord, li: int, pos: int, k: int) -> None:
        """K steps of ``job`` in one call of its K-step program."""
        multi = job.tier.multi
        batches = [job.batches.popleft() for _ in range(k)]
        if self._fed(job):
            self.feeder.request(job, k)
        step = job.spec.start_step + job.dispatched
        stacked = multistep.stack(batches, multi.k)
        t = time.monotonic_ns()
        try:
            outs = call(multi.executable, job.arrays, multi.arg(stacked, k), job.ident)
        except Exception as err:  # noqa: BLE001 - as for one step: its job fails alone
            self.life.fail(job, dispatch_error(job, step, batches[0], err), err)
            self.life.settle(job)
            return
        job.arrays = outs[0]
        job.dispatched += k
        job.in_flight += 1
        job.tier.steps_at[k] = job.tier.steps_at.get(k, 0) + k
        pipeline = self.pipeline
        pipeline.took_turn(job, li, pos)
        pipeline.inflight.append((job, step, outs[1], t, k))
        if pipeline.host_copy:
            outs[1].copy_to_host_async()  # (Executor.host_copy)
        pipeline.after_steps(job, step, k)

    # ------------------------------------------------------------------ promotion
    def consider(self, job: JobRecord) -> None:
        """Weigh compiling the job's K-step program (tiers.py)."""
        left: int | None = 0
        for unit in self.units.running.values():
            if not unit.is_group and unit.program is job.program and unit.group is None:
                if unit.steps_left is None:
                    left = None
                    break
                left += unit.steps_left
        step_s = typical_step_s(job)
        if self.config.preemptive and step_s is None:
            # Its K is bounded by its step time (preemptive_cap): weighed once that is measured
            # (the recorder drains the fences' times ~5x a second: a short job asks for them).
            if job.steps_done >= WARM_STEPS:
                self.timeline.drain()
                step_s = typical_step_s(job)
            if step_s is None and job.program is not None and self.fastest_pace(job.program.key) is not None:
                # A form this machine kept whose calls fit at its own checked pace: taken at the
                # first turn (loaded at prepare, ``Tiers.prefetch``), its one-step time the
                # check's. Weighed only after 8 timed steps, every job of the jct trace ran its
                # first 9-135 steps one per call, each switch to a newly arrived job on the
                # critical path.
                step_s = multistep.VERDICTS.step_s(job.program.key)
            if step_s is None:
                return
        program, device = job.program, self.device
        assert program is not None  # (it stepped)
        self.tiers.consider(self.tiers.tier(job), Candidate(
            key=program.key, compile=lambda form: multistep.compile_multi(program, form, device),
            built=lambda form: multistep.built_multi(program, form),
            begun=lambda form: multistep.begun_multi(program, form),
            steps_done=job.steps_done, step_s=step_s, steps_left=left,
            gap_s=job.host_gap_s if job.host_gap_s is not None else self.timeline.host_gap_s,
            period=self.period(job, step_s),
            own_steps=None if job.steps_left is None else job.steps_done + job.steps_left))

    def period(self, job: JobRecord, step_s: float | None = None) -> int | None:
        """The fewest steps between two of the job's boundaries (its K-step program's K is at
        most this, or it would never run a full call); ``step_s``: its median step time, if
        the caller has it (``typical_step_s``)."""
        spec = job.spec
        every = [e for e in (job.eval.every if job.eval is not None else None,
                             self.config.checkpoint_every if self.config.checkpoint_dir is not None else None,
                             (spec.on_metrics_every or None) if spec.on_metrics is not None else None)
                 if e]
        if spec.on_metrics is not None and spec.on_metrics_every is None:
            every.append(1)
        if self.config.preemptive and step_s is None:
            step_s = typical_step_s(job)
        if self.config.preemptive and step_s is not None:
            # Under srtf and priority a call runs at most this many steps: a K-step program
            # longer than that would never run (K=16 for steps of 0.2-1 ms: one step per call).
            # (The median step, not the EMA: a first step's one-time costs would cap K at 1.)
            cap = self.preemptive_cap(job, step_s)
            # A form checked before runs at its own per-step time: it fits if K of those do.
            for v in multistep.VERDICTS.of(job.program.key) if job.program is not None else ():
                if self.tiers.keeps(v) and v.form.k > cap and self.preemptive_cap(job, v.multi_step_s) >= v.form.k:
                    cap = v.form.k
            every.append(cap)
        return min(every) if every else None

    def promote(self, job: JobRecord, li: int, pos: int) -> bool:
        """The job's K-step program finished compiling: adopt it if its form already passed the
        check, else run the check on this turn's steps. True if this turn's steps ran here."""
        multi = self.tiers.take(job)
        if multi is None:
            return False
        assert job.program is not None  # (it stepped)
        known = multistep.VERDICTS.get(job.program.key, multi.form)
        if known is not None and not known.recheck:  # (a recheck: checked below)
            keep = self.tiers.keeps(known)
            self.settled(self.tiers.settle(job.tier, job.program.key, multi, None if keep else known,
                                            self._make_room(job, multi) if keep else False))
            return False
        k = multi.k
        if ksteps.steps_per_call(self.bounds(job), (1, k)) < k or self.ready_batches(job, k) < k:
            job.tier.pending = _done(multi)  # no room for K steps at this turn: at a later one
            return False
        self.pipeline.drain()  # the state the check copies is the job's newest
        if job.error is not None or job.terminal:
            return True
        verdict = self._check(job, li, pos, multi)
        keep = self.tiers.keeps(verdict)
        self.settled(self.tiers.settle(job.tier, job.program.key, multi, verdict,
                                        self._make_room(job, multi) if keep else False))
        self.recorder.line(job, f"programs: {job.tier.note}")
        # The check's steps retired here, not through the pipeline, whose retirement settles a
        # job: if they were its last (or one of their rows failed it), this is the only settle.
        # Without it the job stayed running with every step done, and wait() never returned.
        self.life.settle(job)
        return True

    def _check(self, job: JobRecord, li: int, pos: int, multi: MultiStep) -> Verdict:
        """K single steps (the job's own, kept) and the K-step call from copies of the same state
        on the same batches: bit-identical or not, and seconds per step each way."""
        k, program = multi.k, job.program
        assert program is not None  # (it stepped)
        step = job.spec.start_step + job.dispatched
        batches = [owned(job.batches.popleft(), self.device) for _ in range(k)]  # (donated below)
        if self._fed(job):
            self.feeder.request(job, k)
        stacked = multistep.stack(batches)  # before the single steps consume (donate) them
        state_bytes = sum(x.nbytes for x in job.arrays)
        copies = [state_copy(job.arrays) for _ in range(2 if state_bytes <= _TIMED_COPY_BYTES else 1)]
        scratch = scratch_ident(job, self.ring, self.device)
        arrays, rows = job.arrays, []
        t = time.monotonic_ns()
        t0 = time.perf_counter()
        for batch in batches:
            arrays, vec = call(program.executable, arrays, batch, job.ident)
            rows.append(vec)
        jax.block_until_ready(arrays)
        single_s = (time.perf_counter() - t0) / k
        t_end = time.monotonic_ns()
        job.arrays = arrays
        job.dispatched += k
        job.tier.steps_at[1] = job.tier.steps_at.get(1, 0) + k
        values = np.stack([np.asarray(v) for v in rows])
        pipeline = self.pipeline
        pipeline.took_turn(job, li, pos)
        pipeline.retired_many(job, step, values, t, t_end)
        def singles(state: list) -> list:
            for i in range(k):
                state = call(program.executable, state, [x[i] for x in stacked], scratch)[0]
            return state

        verdict = compare(multi, copies, stacked, scratch, arrays, values, singles)
        pipeline.after_steps(job, step, k)
        return dataclasses.replace(verdict, single_step_s=verdict.single_step_s or single_s)

    def settled(self, runs_multi: bool) -> None:
        """A unit that moved to its K-step program takes longer turns: the policy is asked
        again (fair weighs a turn as up to K of its steps: ``sched.fair``)."""
        if runs_multi:
            self.units.changed = True

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


def call_cap(config: RuntimeConfig, step_s: float | None) -> int:
    """Under a preemptive policy, the most steps one call at ``step_s`` a step may run: about
    the policy's quantum of device time (``RuntimeConfig.call_quantum_s``) shared by the calls
    in flight, and at least ``quantum`` steps."""
    return max(ksteps.preemptive_cap(step_s, config.call_quantum_s / (1 + config.dispatch_ahead)), config.quantum)


def form_fits(config: RuntimeConfig, verdict: Any) -> bool:
    """Whether a call of ``verdict``'s form, K steps at the pace its check measured, fits the
    time one call may take under a preemptive policy (``call_cap``)."""
    return call_cap(config, verdict.multi_step_s) >= verdict.form.k


def _done(value: Any) -> Any:
    from concurrent.futures import Future
    fut: Future = Future()
    fut.set_result(value)
    return fut


def call(executable: Any, arrays: Any, batch: Any, ident: Any) -> Any:
    """One call of a step program (the fences' identity last, when it has one)."""
    return executable(arrays, batch, ident) if ident is not None else executable(arrays, batch)


def state_copy(arrays: Any) -> list:
    """New device buffers holding ``arrays``' values (a call that donates them leaves
    ``arrays`` intact). ``jax.device_put(..., may_alias=False)`` copies without a program;
    ``Array.copy()`` is a jitted copy compiled once per leaf shape, and a check or a fusion
    measurement copying a TrainState's ~6 shapes held the dispatcher ~90 ms on a warm XLA
    cache, ~190 ms on a cold one (every job stalled behind it)."""
    return list(jax.device_put(list(arrays), may_alias=False))


def scratch_ident(unit: Any, ring: int | None, device: Any) -> Any:
    """The fences' identity for a check's or a measurement's calls (None without fences)."""
    if unit.ident is None:
        return None
    assert ring is not None  # (a unit carries the fences' identity only in a fenced runtime)
    from ... import ffi
    return jax.device_put(ffi.ident(ring, _SCRATCH_JOB, unit.lane or 0), device)


def compare(multi: MultiStep, copies: list, stacked: Any, scratch: Any, arrays: list,
            values: np.ndarray, singles: Callable[[list], list] | None = None) -> Verdict:
    """The K-step call from a copy of the state the single steps started from: bit-identical to
    them (``arrays``, ``values``) or not, how far from them (``multistep.compare``'s deviation),
    and its seconds per step: timed warm on the other copy when there is one, in up to
    ``TIMING_ROUNDS`` rounds that alternate it with ``singles`` (the same K steps one call each,
    from and to a state: ``single_step_s``, else 0 for the caller's own timing), the fastest
    round of each counting. A verdict is kept beside the cache for every later process, and one
    round can be off by a whole other thread's burst: a first run on an empty cache measured a
    K=16 form at 306 us/step against 284 one step per call (its compiles beside it), where it is
    27 against 96, and that "slower" stood for every later run of the program on the machine."""
    try:
        t0 = time.perf_counter()
        state, rows = call(multi.executable, copies[0], multi.arg(stacked, multi.k), scratch)
        jax.block_until_ready(state)
        multi_s, single_s = (time.perf_counter() - t0) / multi.k, 0.0
        why, deviation = multistep.compare(list(arrays), list(state), values, np.asarray(rows))
        if math.isfinite(deviation) and len(copies) > 1:
            multi_s, single_s = _timed(multi, copies[1], stacked, scratch, singles)
    except Exception as err:  # noqa: BLE001 - a K-step program that fails is not kept
        return Verdict(multi.form, False, 0.0, 0.0, why=f"it raised {type(err).__name__}: {err}",
                       deviation=math.inf)
    return Verdict(multi.form, why is None, single_s, multi_s,
                   why=f"not bit-identical to {multi.k} single steps ({why})" if why else "",
                   deviation=deviation)


# Rounds of the check's timing, while they have taken less than ``TIMING_BUDGET_S`` in all. What
# disturbed the one-round timing was a wait for the GIL (~5 ms, Python's switch interval, on a
# K=16 call of ~0.5 ms), so a small program's rounds (a few ms) are each a fresh chance; a
# program whose round is longer than the budget is timed once, as before (its check would
# otherwise hold its job, and a fair or srtf policy's turns, for longer).
TIMING_ROUNDS, TIMING_BUDGET_S = 3, 0.02


def _timed(multi: MultiStep, state: list, stacked: Any, scratch: Any,
           singles: Callable[[list], list] | None) -> tuple[float, float]:
    """(K-step call, single step) seconds per step: the fastest of the rounds (see ``compare``),
    on a scratch copy that each call carries on from."""
    best_multi = best_single = math.inf
    start = time.perf_counter()
    for _ in range(TIMING_ROUNDS):
        t0 = time.perf_counter()
        state = call(multi.executable, state, multi.arg(stacked, multi.k), scratch)[0]
        jax.block_until_ready(state)
        best_multi = min(best_multi, (time.perf_counter() - t0) / multi.k)
        if singles is not None:
            t0 = time.perf_counter()
            state = singles(state)
            jax.block_until_ready(state)
            best_single = min(best_single, (time.perf_counter() - t0) / multi.k)
        if time.perf_counter() - start > TIMING_BUDGET_S:
            break
    return best_multi, (best_single if singles is not None else 0.0)


def run_steps(step_s: float) -> int:
    """The most one-step calls a run makes of steps of ``step_s`` seconds (``RUN_STEPS``,
    ``RUN_S``)."""
    return max(1, min(RUN_STEPS, int(RUN_S / step_s))) if step_s > 0 else RUN_STEPS


def chain(executable: Any, arrays: Any, ident: Any, host_copy: bool,
          batches: Iterable[Any]) -> tuple[Any, list, tuple[Any, Exception] | None]:
    """Call ``executable`` once per batch of ``batches``, each call on the state the one before
    returned (a run: ``Executor.run``, ``GroupCalls.run``): ``(the last state, each call's
    metrics, None)``, or at the first call that raises ``(the state before it, the metrics of
    the calls before it, (its batch, the error))``; the batches after it are not taken."""
    rows: list = []
    for batch in batches:
        try:
            outs = call(executable, arrays, batch, ident)
        except Exception as err:  # noqa: BLE001 - the caller fails its job(s)
            return arrays, rows, (batch, err)
        arrays = outs[0]
        rows.append(outs[1])
        if host_copy:
            outs[1].copy_to_host_async()  # (Executor.host_copy)
    return arrays, rows, None
