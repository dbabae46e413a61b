"""Whether fusing pays, from what was measured: a fused step's cost per member against a solo step.

Fusing is not free everywhere: on this project's CPU a vmapped step of small convolutions costs
each member more than its solo step would (docs/explanation/fusion.md). So the runtime measures,
once per (program, capacity): a group that has run a few steps times its fused program and the
members' solo program on copies of the same state (``engine/fusecheck.py``), and keeps the
verdict here. A verdict that says fusing loses keeps later groups of that program from opening
(``weigh``: the compile pool and ``Runtime.explain`` ask it) and dissolves the group it was
measured on; one that says it pays lets the steps left decide whether the group's compile is
repaid (``sched.steps.fusion_pays``). A narrow loss is measured again by later runs, as a K-step
form timed slower is (``FusionVerdict.recheck``).

Process-wide, and kept beside the persistent compilation cache (``fusion-verdicts.json``) as the
K-step verdicts are (``multistep.Verdicts``): a relaunch knows without measuring again. No jax.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from ...sched.steps import fusion_pays
from ..config import COLD_COMPILE_S
from .history import HISTORY
from .verdict_store import RECHECKS, JsonTable

FILE = "fusion-verdicts.json"
MARGIN = 1.1   # a running group dissolves only if fused costs its members 10% more than alone
# A verdict that fusing loses by less than this (a member's fused step over its solo step) is
# measured again by later groups of the program, up to RECHECKS measurements in all.
RECHECK_MARGIN = 1.25
# A group is measured only with this many solo compiles' worth of its steps left (the measurement
# waits for the solo program's compile: ``engine/fusecheck.py``); a recheck opens no group
# shorter than that for a cold compile, which would fuse at the loss and measure nothing.
MEASURE_AFTER = 2.0
# A group is measured at its K-step form (both sides' forms kept beside the cache: the
# measurement loads them, compiling nothing) only with this many group steps left: it reaches
# that form after its warm steps and its form's check (~50-100 group steps), and the
# measurement's 2 x CALLS calls of K steps each must be a small part of what is left.
K_MEASURE_STEPS = 1024


@dataclass(frozen=True)
class FusionVerdict:
    """A program's fused step at ``capacity`` slots against its solo step, each measured warm on
    copies of one state (seconds per call, the runtime's per-call host cost included)."""

    capacity: int
    solo_step_s: float
    fused_step_s: float
    # Not kept: where a verdict was carried to each side's best K-step form (``judged``), which.
    basis: str = ""
    # How many measurements of the program at this capacity there have been (the latest stands).
    checks: int = 1
    # The steps per call both sides were timed at, together (``k_key``; its costs are per step,
    # the per-call host cost paid once per K): 1 for the check at one step per call.
    k: int = 1
    # Not kept: judged from the one-step check carried by each side's K-step check (``judged``),
    # not timed at K: measured at K when a group of the program runs its form (``recheck``).
    carried: bool = False

    def member_step_s(self, members: int) -> float:
        """What one fused step costs each of ``members`` members."""
        return self.fused_step_s / max(members, 1)

    def pays(self, members: int) -> bool:
        """Whether a member step costs less fused than alone, with ``members`` stepping."""
        return self.member_step_s(members) < self.solo_step_s

    def loses(self, members: int) -> bool:
        """Whether a running group should dissolve: a member step costs clearly more fused than
        alone (``MARGIN``: a group is not broken up over a difference the measurement's noise
        could make)."""
        return self.member_step_s(members) > MARGIN * self.solo_step_s

    def recheck(self, members: int, member_steps_left: int | None = None) -> bool:
        """Whether the next group of the program opens anyway, to be measured again: fusing lost,
        but by less than ``RECHECK_MARGIN``, it was measured fewer than ``RECHECKS`` times, and
        the group has steps enough to be measured (``member_steps_left``, over its ``members``,
        at the fused step's cost: ``MEASURE_AFTER`` cold compiles' worth; None: open-ended).
        One measurement times each side for a few calls, one side after the other, on a shared
        2-core machine where a compile or another process beside it can slow either: kept beside
        the cache, a disturbed "loses" would keep every later run of the program unfused, as a
        disturbed K-step check once did (``multistep.Verdict.recheck``, and the zoo sweep's
        verdict judged from two moments: benchmarks/RESULTS.md). A clear loss (the CNNs: 2-3x)
        is never measured again; a narrow one costs a recheck the group's steps, which cost its
        members about what their own would; a group too short to be measured (the hook's 8 x
        400 steps) would pay that and learn nothing, so it does not open."""
        if self.k > 1 or self.carried:
            # Measured at K (engine/fusecheck.py): both K-step forms are kept, so the
            # measurement compiles nothing; it needs only the steps to reach the group's form. A
            # carried verdict is measured there once whatever its one-step checks' count (a
            # first run's zoo sweep: carried, fusing lost 58 us a member against 53 and the
            # sweep ran unfused from then on; fused it ran 1.2-1.5x faster on this machine).
            long_enough = member_steps_left is None or member_steps_left / max(members, 1) >= K_MEASURE_STEPS
            counted = self.carried or self.checks < RECHECKS
        else:
            long_enough = (member_steps_left is None or member_steps_left / max(members, 1) * self.fused_step_s
                           >= MEASURE_AFTER * COLD_COMPILE_S)
            counted = self.checks < RECHECKS
        return (counted and not self.pays(members) and long_enough
                and self.member_step_s(members) < RECHECK_MARGIN * self.solo_step_s)

    def why_not(self, members: int) -> str:
        """The reason, in numbers, that fusing ``members`` jobs does not pay."""
        basis = self.basis or (f"fused at K={self.k} against its own K-step form, timed together" if self.k > 1 else "")
        return (f"fusing does not pay for this program: a fused step of {self.capacity} slots costs each "
                f"of {members} members {self.member_step_s(members) * 1e6:.0f} us against "
                f"{self.solo_step_s * 1e6:.0f} us for its own step (measured on this machine"
                f"{basis and ', ' + basis})")


class FusionVerdicts:
    """(program key, capacity) -> FusionVerdict; read from and written to ``persist``'s directory."""

    def __init__(self) -> None:
        self._table: JsonTable[tuple[str, int], FusionVerdict] = JsonTable(FILE, _decode, _encode)

    def persist(self, directory: str | None) -> None:
        self._table.persist(directory)

    def get(self, program_key: str, capacity: int) -> FusionVerdict | None:
        return self._table.get((program_key, capacity))

    def judged(self, program_key: str, capacity: int) -> FusionVerdict | None:
        """The verdict a group's opening goes by. Measured at one step per call; but a solo job
        and a group each move to a K-step form where it pays, and at K=16 most of the per-call
        host cost that fusing shares is gone on both sides. Where the K-step checks of both the
        program and its group at ``capacity`` ran here (``multistep.VERDICTS``, kept beside the
        cache), each side's cost is carried to the form that saves it most (``at_k``).

        Only ratios timed together are trusted: the fusion check's (solo and fused, one after the
        other on copies of one state) and each K-step check's own (one step per call and K per
        call, likewise). The two sides' K-step checks run at different moments, seconds or runs
        apart, and on a shared 2-core machine a compile beside one of them skews it: compared
        with each other directly, a first run's checks timed the zoo MLP at 59 us a step alone
        and 83 a member fused 4 ways at K=16, and that verdict, kept beside the cache, kept every
        later run of the sweep unfused, at 1.64-1.77 s against 1.28-1.56 s fused (timed together
        in one script the two forms cost 82-90 and 61-70 us: benchmarks/RESULTS.md).

        Carried is still an estimate from three timings at three moments, and the one-step
        timings it starts from are the noisiest (a call's host cost, ~150-270 us a call here,
        is most of them): the zoo MLP's carried verdict said a member step cost 58 us fused 4
        ways at K=32 against 53 alone, while the two forms timed together cost 42-49 and 50-61
        and the sweep ran 1.2-1.5x faster fused. So where a group of the program has run its
        K-step form beside the solo program's kept one, both timed together at K
        (``engine/fusecheck.py``, kept under ``k_key``), that verdict decides."""
        verdict = self.get(program_key, capacity)
        if verdict is None or _kstep_verdicts is None:
            return verdict
        fused = k_gain(_kstep_verdicts(group_key(program_key, capacity)))
        if fused is not None and fused[0] > 1:
            direct = self.get(k_key(program_key, fused[0]), capacity)
            if direct is not None:  # both K-step forms timed together: what a carried one estimates
                return direct
        solo = k_gain(_kstep_verdicts(program_key), prefer_k=fused[0] if fused is not None else None)
        if solo is None or fused is None or (solo[0] == 1 and fused[0] == 1):
            return verdict
        call_s = _call_s() if _call_s is not None else 0.0
        return FusionVerdict(capacity, at_k(verdict.solo_step_s, *solo, call_s),
                             at_k(verdict.fused_step_s, *fused, call_s),
                             basis=(f"fused at K={fused[0]} against its own program at K={solo[0]}: each side "
                                    f"as the fusion check timed both, scaled by its own K-step check"),
                             checks=verdict.checks, carried=True)

    def put(self, program_key: str, verdict: FusionVerdict) -> None:
        self._table.put((program_key, verdict.capacity), verdict)

    def measured(self, program_key: str, verdict: FusionVerdict) -> FusionVerdict:
        """Keep a new measurement: it replaces the one before, and counts (``checks``)."""
        before = self.get(program_key, verdict.capacity)
        if before is not None:
            verdict = replace(verdict, checks=before.checks + 1)
        self.put(program_key, verdict)
        return verdict

    def clear(self) -> None:
        self._table.clear()

    def weigh(self, program_key: str, capacity: int, members: int, member_steps_left: int | None,
              compile_s: float, prior: str | None = None) -> str | None:
        """Why a group of ``members`` jobs at ``capacity`` slots should not open, or None to open
        it (no verdict yet: it opens, and is measured, unless ``prior``, ``unmeasured``'s
        reason, says it loses on this platform before any measurement). ``member_steps_left``:
        the members' steps left, summed (None: open-ended); ``compile_s``: what its program
        costs to compile (0 if compiled). A narrow loss whose group program is compiled (or kept
        beside the cache) opens the group, to be measured again (``FusionVerdict.recheck``)."""
        verdict = self.judged(program_key, capacity)
        if verdict is None:
            return prior
        if not verdict.pays(members):
            return (None if compile_s == 0.0 and verdict.recheck(members, member_steps_left)
                    else verdict.why_not(members))
        if member_steps_left is None:
            return None
        # The group's program is kept beside the cache for later runs of the program here, as a
        # K-step form is: the steps its earlier runs lead us to expect of them count too
        # (history.py). Weighed on this run alone, a sweep whose fused program the cache had lost
        # (a new fence library, or an evicted entry) ran unfused on every later run: the hook's
        # 8 x 3000 saved 0.49 s a run against a 0.50 s compile, and no run ever compiled it.
        runs = HISTORY.get(program_key)
        later = runs.expected_steps() if runs is not None else 0
        if not fusion_pays(member_steps_left, verdict.solo_step_s, verdict.member_step_s(members), compile_s,
                           later_steps=later):
            saved = (verdict.solo_step_s - verdict.member_step_s(members)) * (member_steps_left + later)
            over = f"{member_steps_left} member steps left" + (f" and ~{later} its earlier runs here ran without it"
                                                                if later else "")
            return f"fusing would not repay its program's compile: {over} save {saved:.2f} s against a {compile_s:.2f} s compile"
        return None


def unmeasured(platform: str, convolves: bool) -> str | None:
    """Why a program whose fusion nothing has measured yet should not open a group anyway, or
    None (it opens, and is measured). On a CPU a step that convolves: vmapped, each convolution
    becomes a grouped one (``feature_group_count`` = members), which XLA:CPU computes at about
    the members' count times one member's cost. Measured on this project's CPU, a 3x3, 16-channel
    convolution's gradient on 32 16x16 images costs 3.4 ms a member alone, 5.8 ms a member fused
    4 ways and 10.2 ms 8 ways; the 2-block ResNet sweep ran at 0.30x of its unfused runtime fused
    (benchmarks/RESULTS.md). Opening such a group to measure it costs the first run its compile
    and its slower steps (0.75x). A verdict this machine measured before still decides
    (``weigh``); ``fuse="always"`` fuses such a program anyway, unmeasured."""
    if platform == "cpu" and convolves:
        return ("fusing would not pay for this program on a CPU: vmapped, its convolutions become grouped "
                "convolutions, which XLA:CPU runs at about the members' count times each member's own cost "
                "(fuse='always' fuses it anyway)")
    return None


# A program's K-step verdicts by key (``multistep.VERDICTS.of``) and the per-call host cost they
# measure (``multistep.VERDICTS.typical_call_s``): multistep sets them when it is imported. It
# needs jax; this module does not, and the group decisions tested without jax judge at one step
# per call.
_kstep_verdicts: Callable[[str], list] | None = None
_call_s: Callable[[], float] | None = None


def judge_with(verdicts_of: Callable[[str], list], call_s: Callable[[], float] | None = None) -> None:
    global _kstep_verdicts, _call_s
    _kstep_verdicts, _call_s = verdicts_of, call_s


def group_key(program_key: str, capacity: int) -> str:
    """The key a fused group's K-step verdicts are kept under (its program at that capacity)."""
    return f"{program_key}/fused{capacity}"


def k_key(program_key: str, k: int) -> str:
    """The key a fusion verdict timed at ``k`` steps per call is kept under (``fusecheck``)."""
    return f"{program_key}@k{k}"


def is_group_key(key: str) -> bool:
    """Whether K-step verdicts kept under ``key`` are a fused group's (``group_key``)."""
    return "/fused" in key


def k_gain(verdicts: list, prefer_k: int | None = None) -> tuple[int, float] | None:
    """``(K, multi / single)`` of the form these K-step verdicts kept (bit-identical and faster)
    that a unit of the program runs: the one at ``prefer_k`` steps per call if kept (the other
    side's, so that both sides are carried to the same K), else the largest K kept (a rolled
    form before an unrolled one of the same K: what the tiers take for a unit with no boundary).
    ``(1, 1.0)`` if none was kept; None without a verdict.

    Not the form whose check found the smallest ratio: each check times its one-step side and
    its K-step side once, and the smallest ratio is most often the check whose one-step side a
    compile beside it slowed (the zoo MLP's K=32 check: 478 us one step a call where its K=16
    check timed 260), which made the solo side look three times cheaper at K than one step a
    call, and fusing lose (134 us a member against 97) where timed together it pays (84 against
    100 at K=32)."""
    if not verdicts:
        return None
    kept = [v for v in verdicts if v.kept and v.single_step_s > 0]
    if not kept:
        return 1, 1.0
    same = [v for v in kept if v.form.k == prefer_k]
    best = max(same or kept, key=lambda v: (v.form.k, not v.form.unroll))
    return best.form.k, best.multi_step_s / best.single_step_s


def at_k(step_s: float, k: int, ratio: float, call_s: float) -> float:
    """A side's cost per call at K steps per call, from ``step_s``, its cost one step per call as
    the fusion check timed it (the runtime's per-call host cost ``call_s`` included): the call's
    own work shrinks by ``ratio`` (``k_gain``), and the per-call cost is paid once per K steps."""
    if k == 1:
        return step_s
    # The per-call cost is part of the step it was measured in: never most of it (as the tiers
    # weigh a promotion), or a figure from another moment would leave the step no work to scale.
    call_s = min(call_s, 0.9 * step_s)
    return (step_s - call_s) * ratio + call_s / k


def _decode(r: dict[str, Any]) -> tuple[tuple[str, int], FusionVerdict]:
    """One row of ``fusion-verdicts.json``: the program key and the verdict's fields."""
    verdict = FusionVerdict(int(r["capacity"]), float(r["solo_step_s"]), float(r["fused_step_s"]),
                            checks=int(r.get("checks", 1)), k=int(r.get("k", 1)))
    return (str(r["program"]), verdict.capacity), verdict


def _encode(key: tuple[str, int], verdict: FusionVerdict) -> dict[str, Any]:
    return {"program": key[0], "capacity": verdict.capacity, "solo_step_s": verdict.solo_step_s,
            "fused_step_s": verdict.fused_step_s, "checks": verdict.checks, "k": verdict.k}


FUSION = FusionVerdicts()
