"""Several steps per call: how many, and whether a faster program is worth its compile.

Pure decisions (no jax, no clock, no device), table-tested in ``tests/sched/test_steps.py``.
The runtime measures and passes everything in; it applies what comes back. See
``docs/explanation/multi-step.md`` for the whole mechanism (programs, tiers, the exactness check).

* ``steps_per_call``: a unit that has a K-step program runs K steps in one executable call,
  but never past its next *boundary*: its last step, an evaluation, a checkpoint, a report that
  ``on_metrics`` (a study) acts on, the batches it has ready, and under a preemptive policy the
  time an urgent arrival may wait.
* ``preemptive_cap``: under ``srtf`` and ``priority`` a call in flight cannot be preempted, so
  a newly urgent job waits for it. The cap keeps a call within the policy's quantum of device
  time (``QUANTUM_S``, ``SRTF_QUANTUM_S``; or one step, if one step is longer), so the wait is
  about what one step cost before.
* ``promotion_pays``: move a job to a program it has not got yet only if its remaining steps
  repay the compile, from measured step times and a compile-time estimate.
* ``fusion_pays``: the same rule for a fused group, with the per-member saving measured.
"""

from __future__ import annotations

from dataclasses import dataclass

# The most steps one call runs. A rolled scan's compile does not grow with K, but the stacked
# batches (charged to the job's footprint) and the granularity of control do; past ~32 the
# host's per-call cost is already a small share of the call (measured in RESULTS.md, "speed
# against K").
MAX_STEPS_PER_CALL = 32

# Under a preemptive policy, the device time the calls in flight may take (shared by them: 4 ms
# each with dispatch_ahead=1): an urgent arrival waits at most about this long (or one step,
# when a single step is longer). Why 8 ms: it is what lets small steps keep their fast K-step
# forms. At 2 ms (1 ms a call) the jct trace's 128-wide MLP (126 us a step at K=16, 156-220 one
# per call on this CPU) was held to K=4 or one step per call, and srtf's average JCT came out
# no better than fifo's (64-73% of its zero-overhead oracle); at 8 ms it runs K=16 and srtf
# reaches 91-97% (benchmarks/RESULTS.md). 8 ms is still under one frame at 60 Hz and far under
# Salus's switch granularity (a whole iteration), and a serving request waits for one call
# under every policy anyway. This is ``priority``'s quantum (urgent jobs and served models next
# to training) and the bound of throughput policies' rolled K (``rolled_k``); a policy may name
# its own (``Policy.quantum_s``).
QUANTUM_S = 8e-3

# ``srtf``'s quantum: twice ``QUANTUM_S`` (8 ms a call with dispatch_ahead=1). srtf preempts to
# cut average completion time, not to answer within a frame, and a job's arrival waits at most
# ~16 ms against JCTs of 0.1-10 s. At 8 ms, on a slow evening of the project's CPU (steps ~2x
# their fast-hour times), the jct trace's 128-wide MLP fit only K=8 a call (331 us a step as
# checked), and K=8 calls were shorter than the host's work between them (its batches are made
# 16 at a time, ~3 ms a block): the device idled every other call, the w128 jobs ran 45-60%
# slower than under fifo's K=16, srtf's makespan was 1.2x fifo's, and srtf reached 66-74% of
# its zero-overhead oracle. At 16 ms it runs fifo's forms, its makespan came within 2-12% of
# fifo's, and it reached 94%, 89% and 77% in three runs in the same hours (benchmarks/RESULTS.md).
SRTF_QUANTUM_S = 16e-3


@dataclass(frozen=True)
class Bounds:
    """How far a unit may run from its current step (each: steps from now; None: no bound).

    Attributes:
      left: steps until its last one (None: until its data ends).
      to_eval: steps until the next step after which an evaluation is owed.
      to_checkpoint: steps until the next step after which a checkpoint is written.
      to_report: steps until the next step whose metrics ``on_metrics`` acts on.
      ready: batches ready now (a unit never waits inside a call for its data).
      cap: the policy's bound (``preemptive_cap``), or None.
    """

    left: int | None = None
    to_eval: int | None = None
    to_checkpoint: int | None = None
    to_report: int | None = None
    ready: int | None = None
    cap: int | None = None

    def limit(self) -> int:
        """The most steps this call may run (at least 1: a unit picked to step steps once)."""
        bounds = [b for b in (self.left, self.to_eval, self.to_checkpoint, self.to_report,
                              self.ready, self.cap) if b is not None]
        return max(1, min(bounds)) if bounds else MAX_STEPS_PER_CALL


def steps_per_call(bounds: Bounds, available: tuple[int, ...], upto: int = 1) -> int:
    """The largest K among ``available`` (the unit's programs: 1 and its multi-step K) that
    does not pass any of ``bounds``; 1 when none does. ``upto``: a rolled K-step program runs
    any number of steps up to its K in one call, so any count up to it is available too (a call
    stops right at the bound rather than leaving the steps before it one per call)."""
    limit = bounds.limit()
    fits = [k for k in available if 1 <= k <= limit]
    return max(max(fits) if fits else 1, min(limit, upto))


def until(step: int, every: int | None) -> int | None:
    """Steps from ``step`` (the index of the next step to run) to the end of the next step
    whose index + 1 is a multiple of ``every``: the boundary ``every`` makes (None: no bound).

    >>> until(0, 10), until(9, 10), until(10, 10), until(5, None)
    (10, 1, 10, None)
    """
    if not every:
        return None
    return every - (step % every)


def preemptive_cap(step_s: float | None, quantum_s: float = QUANTUM_S) -> int:
    """Under a preemptive policy: the most steps in a call so that it takes about
    ``quantum_s`` of device time, as a power of two (1 while the step time is unknown)."""
    if step_s is None or step_s <= 0:
        return 1
    k = int(quantum_s // step_s)
    return 1 if k < 2 else min(pow2_floor(k), MAX_STEPS_PER_CALL)


def rolled_k(base: int, step_s: float | None) -> int:
    """A rolled K-step form's K: ``base``, or ``MAX_STEPS_PER_CALL`` for a step so short that
    that many of them (at its one-step time ``step_s``; None: unknown) take at most
    ``QUANTUM_S``. A call's host work (the dispatcher's turn, the call, reading its metrics: ~0.2
    ms for a fused group of 4 on this project's CPU) is paid once per call: for the hook's group,
    77 us a group step at K=16, it was ~15% of each call's time, half that at 32. The bound keeps
    a call as short as a preemptive policy's quantum, so a pause, a cancel or a new arrival
    under fifo and pack waits no longer than under srtf; a longer step gains little from more
    steps per call anyway (its call's host work is a smaller share of it). A rolled call runs
    any number of steps up to K (``steps_per_call``'s ``upto``), so a larger K leaves no steps
    before a boundary to run one per call."""
    if step_s is None or step_s <= 0 or MAX_STEPS_PER_CALL * step_s > QUANTUM_S:
        return base
    return max(base, MAX_STEPS_PER_CALL)


def promotion_pays(steps_left: int | None, step_s_now: float, step_s_next: float,
                   compile_s: float, *, pace_s: float | None = None, later_steps: int = 0) -> bool:
    """Whether moving to a program with per-step time ``step_s_next`` (from ``step_s_now``)
    repays ``compile_s`` over the steps left (None: unknown, the data decides: it pays if the
    saving per step is positive, since an open-ended job runs on). A compile already paid (a
    cached program) has ``compile_s`` = 0.

    A program compiled in the background is not there until its compile ends: the steps run
    meanwhile, one every ``pace_s`` seconds (None: not counted), save nothing. Only those after
    it, and the ``later_steps`` that later runs are expected to take on it (it is kept for them),
    repay it. Counted as the whole of the steps left, a sweep of 8 x 2,000 steps under pack from
    an empty cache compiled its K-step form with ~0.8 s of steps left; the compile, slowed by the
    steps beside it, landed with a sixth of them to go, and the sweep ran slower than without it
    (0.80x the plain loop, against 0.88x)."""
    saving = step_s_now - step_s_next
    if saving <= 0:
        return False
    if steps_left is None:
        return True
    meanwhile = int(compile_s / pace_s) if pace_s and compile_s > 0 else 0
    return (max(steps_left - meanwhile, 0) + later_steps) * saving > compile_s


def fusion_pays(member_steps_left: int, solo_step_s: float, fused_member_step_s: float,
                compile_s: float, *, later_steps: int = 0) -> bool:
    """Whether a fused group pays: the steps its members have left (summed), and the member
    steps later runs are expected to take on its program (kept for them), times what a member
    step saves against a solo step, against the group program's compile."""
    return promotion_pays(member_steps_left, solo_step_s, fused_member_step_s, compile_s,
                          later_steps=later_steps)


def pow2_floor(n: int) -> int:
    """The largest power of two <= ``n`` (1 for n < 2)."""
    return 1 << (max(n, 1).bit_length() - 1)
