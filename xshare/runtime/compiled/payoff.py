"""Whether fusing pays, from what was measured: a fused step's cost per member against a solo step.

Fusing is not free everywhere: on this project's CPU a vmapped step of small convolutions costs
each member more than its solo step would (docs/explanation/fusion.md). So the runtime measures,
once per (program, capacity): a group that has run a few steps times its fused program and the
members' solo program on copies of the same state (``engine/fusecheck.py``), and keeps the
verdict here. A verdict that says fusing loses keeps later groups of that program from opening
(``weigh``: the compile pool and ``Runtime.explain`` ask it) and dissolves the group it was
measured on; one that says it pays lets the steps left decide whether the group's compile is
repaid (``sched.steps.fusion_pays``).

Process-wide, and kept beside the persistent compilation cache (``fusion-verdicts.json``) as the
K-step verdicts are (``multistep.Verdicts``): a relaunch knows without measuring again. No jax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ...sched.steps import fusion_pays
from .verdict_store import JsonTable

FILE = "fusion-verdicts.json"
MARGIN = 1.1   # a running group dissolves only if fused costs its members 10% more than alone


@dataclass(frozen=True)
class FusionVerdict:
    """A program's fused step at ``capacity`` slots against its solo step, each measured warm on
    copies of one state (seconds per call, the runtime's per-call host cost included)."""

    capacity: int
    solo_step_s: float
    fused_step_s: float
    # Not kept: where a verdict was judged at each side's fastest K-step form (``judged``), which.
    basis: str = ""

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

    def why_not(self, members: int) -> str:
        """The reason, in numbers, that fusing ``members`` jobs does not pay."""
        return (f"fusing does not pay for this program: a fused step of {self.capacity} slots costs each "
                f"of {members} members {self.member_step_s(members) * 1e6:.0f} us against "
                f"{self.solo_step_s * 1e6:.0f} us for its own step (measured on this machine"
                f"{self.basis and ', ' + self.basis})")


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
        and a group each move to a K-step form where it pays, and at K=16 the per-call host cost
        that fusing shares is mostly gone on both sides: the zoo MLP (width 64, batch 64) costs
        ~100 us a member step fused against ~320 alone one step per call, but ~62 against ~50 at
        K=16 (this CPU), so its sweep ran slower fused than unfused. Where the K-step checks of
        both the program and its group at ``capacity`` ran here (``multistep.VERDICTS``, kept
        beside the cache), the two are compared at each side's fastest kept form instead, as
        the checks timed them (each on a scratch copy, the same way)."""
        verdict = self.get(program_key, capacity)
        if verdict is None or _kstep_verdicts is None:
            return verdict
        solo = fastest(_kstep_verdicts(program_key))
        fused = fastest(_kstep_verdicts(group_key(program_key, capacity)))
        if solo is None or fused is None or (solo[0] == 1 and fused[0] == 1):
            return verdict
        return FusionVerdict(capacity, solo[1], fused[1],
                             basis=f"fused at K={fused[0]} against its own program at K={solo[0]}")

    def put(self, program_key: str, verdict: FusionVerdict) -> None:
        self._table.put((program_key, verdict.capacity), verdict)

    def clear(self) -> None:
        self._table.clear()

    def weigh(self, program_key: str, capacity: int, members: int, member_steps_left: int | None,
              compile_s: float, prior: str | None = None) -> str | None:
        """Why a group of ``members`` jobs at ``capacity`` slots should not open, or None to open
        it (no verdict yet: it opens, and is measured, unless ``prior``, ``unmeasured``'s
        reason, says it loses on this platform before any measurement). ``member_steps_left``:
        the members' steps left, summed (None: open-ended); ``compile_s``: what its program
        costs to compile (0 if compiled)."""
        verdict = self.judged(program_key, capacity)
        if verdict is None:
            return prior
        if not verdict.pays(members):
            return verdict.why_not(members)
        if member_steps_left is not None and not fusion_pays(member_steps_left, verdict.solo_step_s,
                                                             verdict.member_step_s(members), compile_s):
            saved = (verdict.solo_step_s - verdict.member_step_s(members)) * member_steps_left
            return (f"fusing would not repay its program's compile: {member_steps_left} member steps "
                    f"left save {saved:.2f} s against a {compile_s:.2f} s compile")
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


# A program's K-step verdicts by key (``multistep.VERDICTS.of``): multistep sets it when it is
# imported. It needs jax; this module does not, and the group decisions tested without jax judge
# at one step per call.
_kstep_verdicts: Callable[[str], list] | None = None


def judge_with(verdicts_of: Callable[[str], list]) -> None:
    global _kstep_verdicts
    _kstep_verdicts = verdicts_of


def group_key(program_key: str, capacity: int) -> str:
    """The key a fused group's K-step verdicts are kept under (its program at that capacity)."""
    return f"{program_key}/fused{capacity}"


def fastest(verdicts: list) -> tuple[int, float] | None:
    """(K, seconds per step) of the fastest form these K-step verdicts kept (bit-identical and
    faster), or of one step per call if none was; None without a verdict."""
    if not verdicts:
        return None
    best = (1, min(v.single_step_s for v in verdicts))
    for v in verdicts:
        if v.kept and v.multi_step_s < best[1]:
            best = (v.form.k, v.multi_step_s)
    return best


def _decode(r: dict[str, Any]) -> tuple[tuple[str, int], FusionVerdict]:
    """One row of ``fusion-verdicts.json``: the program key and the verdict's fields."""
    verdict = FusionVerdict(int(r["capacity"]), float(r["solo_step_s"]), float(r["fused_step_s"]))
    return (str(r["program"]), verdict.capacity), verdict


def _encode(key: tuple[str, int], verdict: FusionVerdict) -> dict[str, Any]:
    return {"program": key[0], "capacity": verdict.capacity, "solo_step_s": verdict.solo_step_s,
            "fused_step_s": verdict.fused_step_s}


FUSION = FusionVerdicts()
