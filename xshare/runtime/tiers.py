"""Programs promoted in the background: a job starts on its one-step program and moves to a
K-step one (``multistep.py``) when that is compiled, checked and measured faster.

Like a JIT's tiered compilation: run the cheap version now, compile the better one beside it,
swap at a safe point. Here the safe point is a step boundary of the job, the compile runs on
the runtime's compile pool (never on the dispatcher thread, so no job waits for it), and the
swap is kept only if it passes the check (``Tiers.check``): K single steps and one K-step call
from the same state and the same batches end bit-identical, and the K-step call costs less per
step. Otherwise the job stays where it was, and ``explain()`` says why.

Who does what: ``Tiers`` (this object, owned by the dispatcher) decides when to compile and
keeps each job's ``JobTier``; the executor runs the check's steps and the K-step calls. The
arithmetic of the decisions is pure, in ``xshare/sched/steps.py``.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from ..sched.steps import pow2_floor, promotion_pays
from . import multistep
from .multistep import FORMS, Form, MultiStep, Verdict

log = logging.getLogger("xshare.runtime")

# Steps a job runs on its one-step program before the runtime weighs a promotion: enough for
# its step time and host gap to be measured (the fences' timeline or the host timing).
WARM_STEPS = 8
# A scan's compile costs about one step program's compile (its body is compiled once), an
# unrolled one about K bodies' worth; estimates until this process has measured one.
_ROLLED_FACTOR, _UNROLLED_FACTOR = 1.5, 4.0


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
    steps_at: dict[int, int] = field(default_factory=dict)  # steps run per K (RESULTS: tiers)

    def available(self) -> tuple[int, ...]:
        return (1, self.multi.k) if self.multi is not None else (1,)


class Tiers:
    """When to compile a job's K-step program, and what became of it."""

    def __init__(self, *, device: Any, submit: Callable[[Callable[[], Any]], Future] | None,
                 max_k: int, forced: bool = False, compile_estimate: Callable[[], float | None]):
        self.device = device
        self._submit = submit
        self.max_k = max_k                           # steps per call at most (1: tiers off)
        # The user asked for K (``Runtime(steps_per_call=K)``): compile it for every job without
        # weighing the compile or the measured speed; exactness is still checked.
        self.forced = forced
        self.enabled = max_k > 1 and submit is not None
        self._compile_estimate = compile_estimate   # mean seconds of this process's compiles

    def tier(self, job: Any) -> JobTier:
        tier = job.tier
        if tier is None:
            tier = job.tier = JobTier()
        return tier

    def consider(self, job: Any, steps_left_of_program: int | None, host_gap_s: float | None, *,
                 period: int | None = None) -> None:
        """After the job's warm-up steps: start compiling its next form if the steps its
        program has left (over every live job that runs it) repay the compile. A form already
        checked (by any job, any runtime of the process) is adopted without weighing again.
        ``period``: the fewest steps between two of the job's boundaries (K is at most that)."""
        tier = self.tier(job)
        if not self.enabled or tier.considered or tier.pending is not None or tier.multi is not None:
            return
        tier.considered = True
        program = job.program
        form = next((f for f in self.forms(period) if f not in tier.tried), None)
        if form is None or program is None:
            if not tier.note:
                tier.note = (f"one step per call: its boundaries (evaluation, checkpoint, reports) "
                             f"come every {period} step(s)" if period is not None and period < 2
                             else "one step per call")
            return
        known = multistep.VERDICTS.get(program.key, form)
        if known is None and job.steps_done < WARM_STEPS:
            tier.considered = False  # weighed once its step time is measured
            return
        if self.forced and (known is None or known.exact):
            self._start(tier, program, form)
            return
        if known is not None:
            if known.kept:
                self._start(tier, program, form)
            else:
                tier.tried.append(form)
                tier.note = known.describe()
                tier.considered = False  # weigh the next form
                self.consider(job, steps_left_of_program, host_gap_s)
            return
        step_s = job.step_time_s
        if step_s is None:
            tier.considered = False
            return
        # What a K-step call removes is the host's share of each step: the gap the device
        # waits between steps (measured by the fences, or the host timing without them).
        gap = host_gap_s or 0.0
        now, after = step_s + gap, step_s + gap / form.k
        estimate = (self._compile_estimate() or 0.5) * (_UNROLLED_FACTOR if form.unroll else _ROLLED_FACTOR)
        if promotion_pays(steps_left_of_program, now, after, estimate):
            self._start(tier, program, form)
        else:
            tier.note = (f"one step per call: {form.describe()} would save ~{(now - after) * 1e6:.0f} us/step "
                         f"over {steps_left_of_program} steps left, less than its compile (~{estimate:.2f} s)")

    def forms(self, period: int | None) -> list[Form]:
        """The forms to try, K no larger than ``period`` or this runtime's cap (powers of two)."""
        cap = min(self.max_k, period or self.max_k)
        out = []
        for form in FORMS:
            k = min(form.k, pow2_floor(cap))
            if k >= 2 and Form(k, form.unroll) not in out:
                out.append(Form(k, form.unroll))
        return out

    def _start(self, tier: JobTier, program: Any, form: Form) -> None:
        tier.form = form
        tier.tried.append(form)
        device = self.device
        tier.pending = self._submit(lambda: multistep.compile_multi(program, form, device))

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

    def settle(self, job: Any, multi: MultiStep, verdict: Verdict | None, fits: bool) -> bool:
        """Record what the check found (``verdict`` None: a verdict already known to pass);
        True if the job now runs ``multi``."""
        tier = job.tier
        if verdict is not None:
            multistep.VERDICTS.put(job.program.key, verdict)
        if verdict is not None and not (verdict.exact if self.forced else verdict.kept):
            tier.note = verdict.describe()
            tier.considered = False  # the next form, if any, is weighed at its next turn
            return False
        if not fits:
            tier.note = f"{multi.form.describe()} not kept: its batches do not fit the arena"
            return False
        tier.multi = multi
        verdict = verdict or multistep.VERDICTS.get(job.program.key, multi.form)
        tier.note, tier.step_s = verdict.describe(), verdict.multi_step_s or None
        return True

    def forget(self, job: Any) -> None:
        """The job ended: a compile in flight goes on (the program is shared), its result unused."""
        tier = job.tier
        if tier is not None:
            tier.pending = None


def explain(tier: JobTier | None) -> str:
    """One line for a job's programs: steps run at each K, and why it is where it is."""
    if tier is None:
        return "one step per call"
    steps = ", ".join(f"{n} at K={k}" for k, n in sorted(tier.steps_at.items()))
    return "; ".join(x for x in (steps, tier.note) if x) or "one step per call"
