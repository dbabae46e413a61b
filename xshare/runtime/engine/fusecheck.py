"""Measuring whether a fused group pays, and dissolving one that does not.

A group opened without a verdict for its program (``compiled/payoff.py``), or with one that fusing
lost narrowly (measured again: ``FusionVerdict.recheck``), is measured once it has run
``WARM_STEPS`` steps, if it has enough steps left for the measurement to matter: its members'
solo program compiles in the background (the tier thread),
then, at a step boundary, the dispatcher times the fused program on a copy of the group's stack
and the solo program on a copy of one member's state, the same way (warm calls on zero batches,
the fastest of ``CALLS``, the two sides' calls in turns, plus the measured cost of one
executable call on each side). A group whose step costs each member more than a solo step
would dissolves there: each member moves to a lane of its own with its state and steps alone
from its next step (same steps, same batches: its results do not change), provided the arena
has room for all of them now; otherwise they stay fused. The verdict is kept, so later groups
of the program do not open (and ``Runtime.explain`` says why).

Once the group runs its K-step form, and the program's solo K-step form is kept on this machine
(a load), the two forms are timed together the same way (``_tend_k``): one-step timings are
mostly a call's host cost and vary from round to round, so that verdict (``payoff.k_key``)
decides from then on over the one-step verdict carried to K. Groups of one program opened
together are measured once, and the others dissolve on that group's loss as it does.
``FuseCheck`` is a part of the engine, given the parts it uses (the executor asks its ``tend``
before a group's step); dispatcher thread only.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable

import jax
import numpy as np

from ..compiled import fusion, multistep
from ..compiled.multistep import VERDICTS
from ..compiled.payoff import FUSION, K_MEASURE_STEPS, MEASURE_AFTER, FusionVerdict, k_key
from ..config import RuntimeConfig
from .group import Group
from .multicall import call, scratch_ident, state_copy

if TYPE_CHECKING:
    from .admission import Admission
    from .groups import Groups
    from .tiers import Tiers

WARM_STEPS = 8   # group steps before it is measured (its first steps carry one-time costs)
CALLS = 5        # timed calls each way, in turns; the fastest counts (the least disturbed by other threads)
SETTLED = True   # Group.payoff once measured (or known): nothing more to do


class FuseCheck:
    """Measures fused groups once and dissolves those that lose (see the module's docstring).

    ``background(fn)``: run ``fn`` on the tier thread (None: no measurements); ``drain()``: retire
    every step in flight (the copies are of a group's newest state)."""

    def __init__(self, *, config: RuntimeConfig, background: Callable[[Callable[[], Any]], Future] | None,
                 timeline: Any, tiers: Tiers, arena: Any, recorder: Any, groups: Groups,
                 admission: Admission, drain: Callable[[], None], device: Any, ring: int | None):
        self.config, self.background, self.timeline, self.tiers = config, background, timeline, tiers
        self.arena, self.recorder, self.groups, self.admission = arena, recorder, groups, admission
        self.drain, self.device, self.ring = drain, device, ring
        self._measuring: dict[tuple, Group] = {}  # (K, program key, capacity) -> the group measured

    def tend(self, group: Group) -> bool:
        """Before a group step: start or finish its measurement. True if the group dissolved (its
        members step alone from now; this turn runs nothing)."""
        state = group.payoff
        if state is SETTLED:
            return self._tend_k(group)
        if state is None:
            if group.steps_run < WARM_STEPS:
                return False
            # Known already: nothing to measure, unless it was a narrow loss this group
            # opened to measure again (payoff.FusionVerdict.recheck).
            if self._another_measuring(1, group):
                return False  # its verdict decides this group too: looked at again next turn
            known = FUSION.judged(group.program.key, group.capacity)
            if (not self.config.fuse_measured or self.background is None
                    or (known is not None and (known.k > 1 or known.carried or not known.recheck(len(group.members))))):
                group.payoff = SETTLED  # (a verdict at K is measured again at K: _tend_k)
                # A loss found by the group measured beside this one (both opened before it was
                # known): this one dissolves as that one did.
                return (self.config.fuse_measured and known is not None and known.k == 1 and not known.carried
                        and known.loses(len(group.members)) and self.dissolve(group, known))
            if group.step_time_s is None:
                self.timeline.drain()  # its steps' fence times (the recorder drains them only ~5x a second)
                if group.step_time_s is None:
                    return False  # not measured yet: its steps are still in flight
            if not _worth(self.tiers.compile_estimate(), group):
                group.payoff = SETTLED
                return False
            # The solo program (not compiled when every job of the program fused) compiles on the
            # tier thread; the group steps on meanwhile.
            group.payoff = self.background(group.program.ensure)
            self._measuring[(1, group.program.key, group.capacity)] = group
            return False
        if state is SETTLED or not state.done():
            return False
        group.payoff = SETTLED
        return self._finish(group, state, 1)

    def _tend_k(self, group: Group) -> bool:
        """Once the group runs its K-step form: time it against the solo program's kept K-step
        form, together (``measure`` at K), unless a verdict timed so stands for the program."""
        state = group.payoff_k
        if state is SETTLED:
            return False
        if state is None:
            tier = group.tier
            if tier is None or tier.multi is None:
                return False  # not on a K-step form (yet)
            form = tier.multi.form
            if self._another_measuring(form.k, group):
                return False  # its verdict decides this group too: looked at again next turn
            group.payoff_k = SETTLED
            if not self.config.fuse_measured or self.background is None:
                return False
            program, members = group.program, group.members
            lefts = [job.steps_left for job in members]
            left = None if None in lefts else sum(lefts)
            known = FUSION.get(k_key(program.key, form.k), group.capacity)
            if known is not None and not known.recheck(len(members), left):
                # (a loss found by the group measured beside this one: it dissolves as that one did)
                return known.loses(len(members)) and self.dissolve(group, known)
            if known is None and left is not None and left / max(len(members), 1) < K_MEASURE_STEPS:
                return False
            solo = _solo_form(program.key, form)
            if solo is None:
                return False  # its members would run one step per call alone: the one-step verdict stands
            device = self.device
            # (kept: a load from the cache, on the tier thread; the group steps on meanwhile)
            group.payoff_k = self.background(lambda: multistep.compile_multi(program, solo, device))
            self._measuring[(form.k, program.key, group.capacity)] = group
            return False
        if not state.done():
            return False
        group.payoff_k = SETTLED
        multi = group.tier.multi if group.tier is not None else None
        if multi is None or multi.k == 1:  # (it left its K-step form meanwhile: nothing to time)
            self._forget(group)
            return False
        return self._finish(group, state, multi.k)

    def _finish(self, group: Group, solo: Future, k: int) -> bool:
        """The solo side of ``group``'s measurement is ready: measure, and dissolve on a loss."""
        self._forget(group)
        verdict = self.measure(group, solo, k)
        if verdict is None or not verdict.loses(len(group.stepping()) or len(group.members)):
            return False
        return self.dissolve(group, verdict)

    def _another_measuring(self, k: int, group: Group) -> bool:
        """Whether another open group of this runtime is being measured for the same program and
        capacity at ``k`` steps a call (1: the one-step check). Groups opened together (one per
        core) would each time the same thing, ~40 ms of the dispatcher at K=32 for the zoo MLP."""
        other = self._measuring.get((k, group.program.key, group.capacity))
        if other is None or other is group or other.arrays is None:
            return False
        return (other.payoff if k == 1 else other.payoff_k) is not SETTLED

    def _forget(self, group: Group) -> None:
        """``group``'s measurement ended: no other group waits on it."""
        for key in [key for key, g in self._measuring.items() if g is group]:
            del self._measuring[key]

    def measure(self, group: Group, solo: Future, k: int = 1) -> FusionVerdict | None:
        """Time the fused and the solo program on copies, in turns (None: not measurable now: the
        solo program failed to compile, no member has a state to copy, the copy would not fit in
        the arena, or the group no longer runs its K-step form). ``k`` 1: the one-step programs
        (``solo``: the solo program's compile); else the group's K-step form against the solo
        program's kept one (``solo``: its load), kept under ``k_key``, costs per step."""
        if solo.exception() is not None or not group.members:
            return None
        self.drain()  # the copies are of the newest state
        if not group.members or fusion.on_host(group.arrays):
            return None
        multi = group.tier.multi if group.tier is not None else None
        if k > 1 and (multi is None or multi.k != k):
            return None
        if sum(x.nbytes for x in group.arrays) > self.arena.free:
            return None  # no room beside the group for a copy of its stack: keep it, unmeasured
        scratch = scratch_ident(group, self.ring, self.device)
        capacity, zeros, key = group.capacity, group.zero_batch, group.program.key
        mask = np.ones((capacity,), np.bool_)
        if k == 1:
            fused_exe, fused_arg = group.fused.executable, ([np.zeros((capacity, *z.shape), z.dtype) for z in zeros], mask)
            solo_exe, solo_k = group.program.executable, 1

            def solo_arg() -> Any:
                return [z.copy() for z in zeros]
        else:
            assert multi is not None  # (checked above)
            alone = solo.result()
            fused_exe = multi.executable
            fused_arg = multi.arg(([np.zeros((k, capacity, *z.shape), z.dtype) for z in zeros], mask), k)
            solo_exe, solo_k, key = alone.executable, alone.k, k_key(key, k)
            stacked = alone.arg([np.zeros((alone.k, *z.shape), z.dtype) for z in zeros], alone.k)

            def solo_arg() -> Any:
                return stacked  # (a K-step program does not donate its batches)
        fused_s, solo_s = _fastest_pair(
            (lambda copy: call(fused_exe, copy, fused_arg, scratch), state_copy(group.arrays)),
            (lambda copy: call(solo_exe, copy, solo_arg(), scratch),
             list(fusion.take(group.fused, group.arrays, group.members[0].slot))))
        # What one executable call costs beyond its work (the K-step checks measure it; CALL_S
        # before any): a fused call pays it once for all its members, each side once per call.
        # Not the timeline's host gap, which also holds the time the device waited for data.
        per_call = VERDICTS.typical_call_s()
        verdict = FUSION.measured(key, FusionVerdict(capacity, (solo_s + per_call) / solo_k,
                                                     (fused_s + per_call) / k, k=k))
        members = len(group.members)
        at, own, per = ("", "its own step", "") if k == 1 else (f" at K={k}", f"its own K={solo_k} form", " a step")
        for job in group.members:
            self.recorder.line(job, f"fusion measured{at}: a fused step of {capacity} slots costs each of {members} "
                                    f"members {verdict.member_step_s(members) * 1e6:.0f} us, {own} "
                                    f"{verdict.solo_step_s * 1e6:.0f} us{per}")
        return verdict

    def dissolve(self, group: Group, verdict: FusionVerdict) -> bool:
        """Every member leaves ``group`` for a lane of its own, if all of them fit in the arena
        now (False: they stay fused, and a line in their logs says why)."""
        members = group.members
        staging = self.config.prefetch + self.config.dispatch_ahead
        footprints = [group.program.with_staging(staging) for _ in members]
        need = sum(fp.resident + fp.ephemeral for fp in footprints)
        if self.arena.queue or need > self.arena.free:
            for job in members:
                self.recorder.line(job, f"{verdict.why_not(len(members))}; its members stay fused: the arena "
                                        "has no room for each alone now")
            return False
        states = [list(fusion.take(group.fused, group.arrays, job.slot)) for job in members]
        self.groups.dissolve(group)
        for job, fp, state in zip(members, footprints, states):
            job.footprint, job.host_arrays = fp, state
            self.recorder.line(job, f"left {group.name} to step alone: {verdict.why_not(len(members))}")
            self.admission.rehome(job)
        return True


def _solo_form(program_key: str, form: multistep.Form) -> multistep.Form | None:
    """The K-step form the program's jobs run alone, as this machine checked and kept it: the
    group's own form if kept, else the largest kept (None: none kept)."""
    kept = [v.form for v in VERDICTS.of(program_key) if v.kept]
    if form in kept:
        return form
    return max(kept, key=lambda f: (f.k, not f.unroll), default=None)


def _worth(compile_s: float, group: Group) -> bool:
    """Whether measuring can pay: the group has at least ``MEASURE_AFTER`` times the solo
    program's compile (``compile_s``, the tiers' estimate) left to run (an open-ended group
    always has). On this 2-core machine the compile competes with the group for the cores, so a
    short group (the hook's 8 x 400 steps: ~0.3 s left) is left fused, unmeasured; the verdict
    comes from a longer run of the program."""
    left, step_s = group.steps_left, group.step_time_s
    if left is None:
        return True
    return step_s is not None and left * step_s >= MEASURE_AFTER * compile_s


def _fastest_pair(*sides: tuple[Any, list]) -> list[float]:
    """Each side's fastest of ``CALLS`` warm calls, each on the state its previous call
    returned, the sides' calls taking turns: a compile or another thread that slows the machine
    for a while slows both sides' calls, not the ones of whichever side ran then (timed one side
    after the other, a first run's zoo sweep measured a solo step at 596 us and, a group later,
    at 402)."""
    best = [float("inf")] * len(sides)
    arrays = [a for _, a in sides]
    for _ in range(CALLS):
        for i, (call_, _) in enumerate(sides):
            t0 = time.perf_counter()
            arrays[i] = call_(arrays[i])[0]
            jax.block_until_ready(arrays[i])
            best[i] = min(best[i], time.perf_counter() - t0)
    return best
