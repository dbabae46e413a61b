"""Programs promoted in the background: a job starts on its one-step program and moves to a
K-step one (``multistep.py``) when that is compiled, checked and measured faster.

Like a JIT's tiered compilation: run the cheap version now, compile the better one beside it,
swap at a safe point. Here the safe point is a step boundary of the job, the compile runs on
the runtime's compile pool (never on the dispatcher thread, so no job waits for it), and the
swap is kept only if it passes the check (``Tiers.check``): K single steps and one K-step call
from the same state and the same batches end bit-identical, and the K-step call costs less per
step. Otherwise the job stays where it was, and ``explain()`` says why.

Who does what: ``Tiers`` (this object, owned by the dispatcher) decides when to compile and
keeps each job's ``JobTier``; ``multicall.MultiCalls`` and ``multigroup.GroupCalls`` run the
check's steps and the K-step calls. The arithmetic of the decisions is pure, in
``xshare/sched/steps.py``.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from ...sched.capacity import pow2
from ...sched.steps import pow2_floor, promotion_pays, rolled_k
from ..compiled import multistep
from ..compiled.history import HISTORY
from ..compiled.multistep import FORMS, Form, MultiStep, Verdict
from .records import median_step_s

log = logging.getLogger("xshare.runtime")

# Steps a job runs on its one-step program before the runtime weighs a promotion: enough for
# its step time and host gap to be measured (the fences' timeline or the host timing).
WARM_STEPS = 8
# A scan's compile costs about one step program's compile (its body is compiled once), an
# unrolled one about K bodies' worth; estimates until this process has measured one.
_ROLLED_FACTOR, _UNROLLED_FACTOR = 1.5, 4.0


@dataclass(frozen=True)
class Candidate:
    """What the tiers weigh of a job or a fused group (plain data, made by the dispatcher)."""

    key: str                          # verdicts are per key: the program's (a group's: + capacity)
    compile: Callable[[Form], Any]    # compiles its K-step program in a form (on the tier thread)
    steps_done: int
    step_s: float | None              # measured seconds per step (device time)
    steps_left: int | None            # over every live unit of the program (None: open-ended)
    gap_s: float | None               # measured host gap per step
    period: int | None                # fewest steps between two of its boundaries
    own_steps: int | None = None      # the unit's own steps, done and left (None: done + steps_left)
    # Its K-step program in a form if this process built it already (another unit of the
    # program did), else None: then it is taken at once, not compiled on the pool again.
    built: Callable[[Form], Any] | None = None
    # Whether this process has begun compiling that program (built, or compiling now: for
    # another unit of the program, maybe one that has ended since). Its compile is paid.
    begun: Callable[[Form], bool] | None = None
    # A fused group's: its call's host work grows with its members, so its own measured gap is a
    # floor on what a K-step call saves it (``Tiers.consider``).
    group: bool = False


@dataclass(eq=False)
class JobTier:
    """One job's place among its programs (written on the dispatcher thread only)."""

    multi: MultiStep | None = None       # the K-step program it runs; None: one step per call
    pending: Future | None = None        # a K-step program compiling on the pool
    form: Form | None = None             # the form pending or running
    tried: list[Form] = field(default_factory=list)
    considered: bool = False             # weighed once (again when a form fails)
    note: str = ""                       # why it is where it is (explain, status)
    step_s: float | None = None          # measured by the check: seconds per step at K
    capacity: int | None = None          # a fused group's: the capacity its programs are for
    steps_at: dict[int, int] = field(default_factory=dict)  # steps run per K (RESULTS: tiers)

    def available(self) -> tuple[int, ...]:
        return (1, self.multi.k) if self.multi is not None else (1,)

    def upto(self) -> int:
        """Any number of steps up to this runs in one call of its K-step program (1: none)."""
        return self.multi.upto if self.multi is not None else 1


class Tiers:
    """When to compile a job's K-step program, and what became of it."""

    def __init__(self, *, device: Any, submit: Callable[[Callable[[], Any]], Future] | None,
                 max_k: int, forced: bool = False, compile_estimate: Callable[[], float | None],
                 rtol: float | None = None, call_fits: Callable[[multistep.Verdict], bool] | None = None):
        self.device = device
        self._submit = submit
        self.max_k = max_k                           # steps per call at most (1: tiers off)
        # The user asked for K (``Runtime(steps_per_call=K)``): compile it for every job without
        # weighing the compile or the measured speed; exactness is still checked.
        self.forced = forced
        # ``Runtime(steps_per_call_rtol=...)``: a K-step form within this relative difference of
        # K single steps is kept too (None, the default: bit for bit only).
        self.rtol = rtol
        self.enabled = max_k > 1 and submit is not None
        # Under a preemptive policy, whether a form's call (K steps at its checked pace) fits the
        # time one call may take (``multicall.form_fits``); None: every form's does. ``prefetch``
        # loads only a form that fits: a form kept under fifo, K=32, that an srtf job may not
        # run would only hold the one tiers thread the forms the jobs do run wait on.
        self.call_fits = call_fits
        self._rechecked: set[tuple[str, Form]] = set()   # forms this runtime checked again
        self._compile_estimate = compile_estimate   # mean seconds of this process's compiles

    def compile_estimate(self) -> float:
        """What a program not in any cache is expected to cost to compile (seconds)."""
        return self._compile_estimate() or 0.0

    def tier(self, unit: Any) -> JobTier:
        tier = unit.tier
        if tier is None:
            tier = unit.tier = JobTier()
        return tier

    def consider(self, tier: JobTier, c: "Candidate") -> None:
        """Start compiling the unit's next form if the steps its program has left (over every
        live unit that runs it) repay the compile. A form already checked (by any unit, any
        runtime of the process, or an earlier process: ``Verdicts``) is adopted without
        weighing again; one that failed is skipped."""
        if not self.enabled or tier.considered or tier.pending is not None or tier.multi is not None:
            return
        tier.considered = True
        # (before its steps are timed, at a relaunch's first turn: the one-step time its
        # program's check kept, which chooses a rolled form's K as the unit's own would)
        step_s = c.step_s if c.step_s is not None else multistep.VERDICTS.step_s(c.key)
        forms = self._ordered(c.key, c.period, step_s)
        while True:
            form = next((f for f in forms if f not in tier.tried), None)
            if form is None:
                if not tier.note:
                    tier.note = (f"one step per call: its boundaries (evaluation, checkpoint, reports, or "
                                 f"under srtf and priority the time one call may take) come every "
                                 f"{c.period} step(s)" if c.period is not None and c.period < 2
                                 else "one step per call")
                return
            known = multistep.VERDICTS.get(c.key, form)
            if known is not None and self.rtol is not None and not known.measured:
                known = None  # checked before deviations were kept: checked again under the tolerance
            if known is not None and known.recheck and not self.forced and (c.key, form) not in self._rechecked:
                self._rechecked.add((c.key, form))  # once per runtime
                # timed slower, maybe disturbed: checked again (its program is kept: a load)
                tier.note = f"checking {form.describe()} again: {known.describe(self.rtol)}"
                self._start(tier, c, form)
                return
            if known is None or self.keeps(known):
                break  # usable
            tier.tried.append(form)  # checked before and not kept: the next form
            tier.note = known.describe(self.rtol)
        if known is None and c.begun is not None and c.begun(form):
            # Compiled, or compiling, for another unit of its program: nothing left to repay.
            # Weighed as a new compile, a sweep's later jobs under fifo (500 steps each) ran every
            # step one per call beside the K=16 form the first job had started: it finished after
            # that job ended, so no check ran and no verdict told the others (scale.py, N=32, an
            # empty cache: 0.72x the plain loop).
            tier.note = f"taking {form.describe()}, compiled for another job of its program"
            self._start(tier, c, form)
            return
        if known is None and c.steps_done < WARM_STEPS:
            tier.considered = False  # weighed once its step time is measured
            tier.tried = [f for f in tier.tried if f != form]
            return
        if self.forced or known is not None:
            self._start(tier, c, form)
            return
        if c.step_s is None:
            tier.considered = False
            return
        # What a K-step call saves is the per-call cost (dispatch, the call, reading its
        # metrics, the runtime's bookkeeping) of K-1 of every K steps; the step's own work stays.
        # It is not measurable before the program exists (the fences' gap sees only the Python
        # between calls: ~9 us of a measured 115 us saving for a small MLP), so it is what the
        # forms checked so far measured (Verdicts.typical_call_s), never more than most of the step.
        # A fused group expects at least its own measured gap (the host's work per call, which a
        # K-step call pays once for K steps): its call does per-member work a solo call does not
        # (the hook's 8-slot group: a 100 us gap, a K=16 form that saved 112 us a step, where the
        # solo forms kept here saved 45). Weighed by the solo forms' figure alone, the group's
        # K=16 form never compiled, by any run: the hook's fused 8 x 3000 stayed at 2.35x the
        # plain loop from an empty cache, 3.2-3.5x once compiled. Not a solo job's: its gap is
        # under the kept forms' figure when the host is quiet, and over it only when a compile
        # beside it holds the GIL (1 ms a step seen), which would start compiles that do not pay.
        call_s = multistep.VERDICTS.typical_call_s()
        if c.group:
            call_s = max(call_s, c.gap_s or 0.0)
        now = c.step_s + (c.gap_s or 0.0)
        after = now - min(call_s * (1 - 1 / form.k), 0.9 * now)
        estimate = (self._compile_estimate() or 0.5) * (_UNROLLED_FACTOR if form.unroll else _ROLLED_FACTOR)
        # The form is kept for later runs of the program on this machine: the steps its earlier
        # runs here lead us to expect of them count too (compiled/history.py).
        later = 0
        if c.steps_left is not None:
            own = c.own_steps if c.own_steps is not None else c.steps_done + c.steps_left
            later = HISTORY.begin(c.key, tier, own)
        over = f"{c.steps_left} steps left" + (f" and ~{later} its earlier runs here ran without it" if later else "")
        # The steps it runs while the form compiles save nothing: one every ``now`` (its own
        # pace; units of the program on other lanes only run more of them meanwhile).
        if promotion_pays(c.steps_left, now, after, estimate, pace_s=now, later_steps=later):
            tier.note = (f"compiling {form.describe()}: ~{(now - after) * 1e6:.0f} us/step to save over "
                         f"{over}, more than its compile (~{estimate:.2f} s)")
            log.debug("%s", tier.note)
            self._start(tier, c, form)
        else:
            tier.note = (f"one step per call: {form.describe()} would save ~{(now - after) * 1e6:.0f} us/step "
                         f"over {over}, less than its compile (~{estimate:.2f} s, ~{round(estimate / now)} "
                         f"of those steps run while it compiles)")

    def _ordered(self, key: str, period: int | None, step_s: float | None) -> list[Form]:
        """The forms to try, in order: those this machine checked and kept for the unit's
        program first (adopted at once, a load and no check), then those its step time asks
        for. A program kept at K=16 before short steps ran 32 a call keeps its K=16 form: asked
        for K=32 first, a relaunch compiled it and ran every step of a job shorter than that
        compile one per call, beside a kept K=16 form 5x faster."""
        wanted = self.forms(period, step_s)
        kept = self._kept(key, wanted + self.forms(period))
        return kept + [f for f in wanted if f not in kept]

    def _kept(self, key: str, forms: list[Form]) -> list[Form]:
        """Those of ``forms`` this machine checked and kept for the program ``key``."""
        kept = []
        for form in dict.fromkeys(forms):
            known = multistep.VERDICTS.get(key, form)
            if known is not None and self.keeps(known) and not known.recheck:
                kept.append(form)
        return kept

    def prefetch(self, key: str, compile: Callable[[Form], Any], begun: Callable[[Form], bool]) -> None:
        """Load now the K-step form this machine checked and kept for the program ``key`` (any
        thread: the compile pool calls it as soon as a job's program is keyed, before its own
        program loads). ``consider`` takes it at the unit's first turn (``begun``: no compile
        to repay, no check), so the unit runs one step per call only until it lands. Loaded
        after the unit's first program, as before, it landed ~45 ms into the hook's fused
        8 x 3000 run (two groups of 4), which ran its group steps one per call until then."""
        if not self.enabled or self._submit is None:
            return
        # (the forms ``consider`` asks of a unit with no boundary, before its steps are timed)
        kept = self._kept(key, self._ordered(key, None, multistep.VERDICTS.step_s(key)))
        fits = self.call_fits
        if fits is not None:
            verdicts = multistep.VERDICTS
            kept = [f for f in kept if (v := verdicts.get(key, f)) is not None and fits(v)]
        if kept and not begun(kept[0]):
            form = kept[0]
            try:
                self._submit(lambda: compile(form))
            except RuntimeError:  # the runtime is closing
                pass

    def forms(self, period: int | None, step_s: float | None = None) -> list[Form]:
        """The forms to try, powers of two within this runtime's cap: a rolled form's K by the
        unit's one-step time ``step_s`` (``rolled_k``), no more than covers ``period`` (its
        calls run any n <= K steps: a period of 12 takes K=16, one call each); an unrolled
        form's (exactly K steps a call) no larger than ``period``."""
        cap = pow2_floor(self.max_k)
        out = []
        for form in FORMS:
            if form.unroll:
                k = min(form.k, pow2_floor(min(cap, period or cap)))
            else:
                k = min(rolled_k(form.k, step_s), cap, pow2(period) if period else cap)
            if k >= 2 and Form(k, form.unroll) not in out:
                out.append(Form(k, form.unroll))
        return out

    def _start(self, tier: JobTier, c: "Candidate", form: Form) -> None:
        tier.form = form
        tier.tried.append(form)
        # Built already: ready at the unit's next turn. A round trip through the pool would
        # take a turn or more, and a run of one-step calls (Executor.run) takes 16 steps a turn:
        # the unit would run those one per call for nothing.
        ready = c.built(form) if c.built is not None else None
        if ready is not None:
            tier.pending = Future()
            tier.pending.set_result(ready)
            return
        build = c.compile
        assert self._submit is not None  # (only an enabled Tiers starts a compile: it has a pool)
        try:
            tier.pending = self._submit(lambda: build(form))
        except RuntimeError:  # the runtime is closing (its compile thread is shut down)
            tier.pending = None
            self.enabled = False

    def ready(self, job: Any) -> bool:
        """Whether a pending K-step program finished compiling (the dispatcher then checks it
        at the job's next turn)."""
        tier = job.tier
        return tier is not None and tier.pending is not None and tier.pending.done()

    def take(self, job: Any) -> MultiStep | None:
        """The compiled program of a finished compile (None if it failed: noted, not fatal)."""
        tier = job.tier
        fut, tier.pending = tier.pending, None
        try:
            return fut.result()
        except Exception as err:  # noqa: BLE001 - a failed promotion leaves the job where it is
            tier.note = f"{tier.form.describe()} did not compile: {type(err).__name__}: {err}"
            log.info("job %r: %s", job.name, tier.note)
            return None

    def settle(self, tier: JobTier, key: str, multi: MultiStep, verdict: Verdict | None, fits: bool) -> bool:
        """Record what the check found (``verdict`` None: a verdict already known to pass);
        True if the unit now runs ``multi``."""
        if verdict is not None:
            before = multistep.VERDICTS.get(key, multi.form)
            if before is not None and before.recheck:
                verdict = replace(verdict, checks=before.checks + 1)  # (Verdict.recheck)
            multistep.VERDICTS.put(key, verdict)
        if verdict is not None and not self.keeps(verdict):
            tier.note = verdict.describe(self.rtol)
            tier.considered = False  # the next form, if any, is weighed at its next turn
            return False
        if not fits:
            tier.note = f"{multi.form.describe()} not kept: its batches do not fit the arena"
            return False
        tier.multi = multi
        verdict = verdict or multistep.VERDICTS.get(key, multi.form)
        assert verdict is not None  # None was passed for a verdict the caller found in VERDICTS
        tier.note, tier.step_s = verdict.describe(self.rtol), verdict.multi_step_s or None
        return True

    def keeps(self, verdict: Verdict) -> bool:
        """Whether a unit runs a form with this verdict: bit-identical (or within the user's
        ``rtol``) and faster, or only the former where the user named K."""
        return verdict.usable(self.rtol, self.forced)

    def forget(self, job: Any) -> None:
        """The job ended: a compile in flight goes on (the program is shared), its result unused."""
        tier = job.tier
        if tier is not None:
            tier.pending = None


def explain(tier: JobTier | None) -> str:
    """Why a job runs where it runs (which K-step form it kept, or why none)."""
    if tier is None or not tier.note:
        return "one step per call"
    return tier.note


def steps_per_call(unit: Any) -> dict[str, int]:
    """A job's (or a fused group's) steps by how many ran per call: ``{"1": n1, "16": n16}``
    (status, RESULTS). A group's are group steps; a member's count its own steps in its group's
    K-step calls too (``multigroup.GroupCalls``)."""
    multi = {k: n for k, n in (unit.tier.steps_at.items() if unit.tier is not None else ()) if k > 1}
    done = unit.steps_run if unit.is_group else unit.steps_done
    out = {"1": max(int(done) - sum(multi.values()), 0)}
    out.update({str(k): int(n) for k, n in sorted(multi.items())})
    return out


def typical_step_s(unit: Any) -> float | None:
    """The median of a unit's measured step times, its first two left out (a program's first
    runs pay one-time costs: an EMA over a handful of steps still carries them, and a promotion
    weighed on them overestimates what K steps per call would save): every step it keeps."""
    return median_step_s(unit.step_times)
