"""sched/steps.py: how many steps a call runs, and whether a program pays for its compile.
Pure (tests/sched/test_purity.py runs the module with jax unimportable); each row says why."""

from __future__ import annotations

import pytest

from xshare.sched.steps import (MAX_STEPS_PER_CALL, QUANTUM_S, Bounds, fusion_pays, pow2_floor,
                                preemptive_cap, promotion_pays, rolled_k, steps_per_call, until)

K16 = (1, 16)


@pytest.mark.parametrize("bounds, available, want", [
    (Bounds(), K16, 16),                            # nothing bounds it: its largest program
    (Bounds(left=100), (1,), 1),                    # no K-step program: one step
    (Bounds(left=5), K16, 1),                       # 5 steps left: a 16-step call would overrun
    (Bounds(left=16), K16, 16),                     # exactly one call left
    (Bounds(left=40, to_eval=10), K16, 1),          # an evaluation after the 10th step
    (Bounds(left=40, to_eval=16), K16, 16),         # ... after the 16th: the call ends there
    (Bounds(to_checkpoint=3), (1, 2, 4), 2),        # a ladder: the largest that fits
    (Bounds(to_report=1), K16, 1),                  # on_metrics acts on every step
    (Bounds(ready=7), (1, 4, 16), 4),               # 7 batches ready: never wait inside a call
    (Bounds(cap=8), (1, 8, 16), 8),                 # a preemptive policy's cap
    (Bounds(left=0), K16, 1),                       # (never asked for a finished job; still >= 1)
])
def test_steps_per_call(bounds, available, want):
    assert steps_per_call(bounds, available) == want


def test_an_unbounded_limit_is_the_cap():
    assert Bounds().limit() == MAX_STEPS_PER_CALL


@pytest.mark.parametrize("step, every, want", [
    (0, 10, 10),     # from the start: the 10th step ends at a boundary
    (9, 10, 1),      # the next step is the 10th
    (10, 10, 10),    # just past one: a full period
    (5, None, None),  # no such boundary
    (5, 0, None),
])
def test_until(step, every, want):
    assert until(step, every) == want


@pytest.mark.parametrize("step_s, want", [
    (None, 1),           # unknown step time: one step (the safe answer)
    (0.0, 1),
    (QUANTUM_S, 1),      # one step already takes the quantum
    (QUANTUM_S / 3, 2),  # 3 fit: rounded down to a power of two
    (QUANTUM_S / 8, 8),
    (1e-9, MAX_STEPS_PER_CALL),  # tiny steps: the global cap
])
def test_preemptive_cap(step_s, want):
    assert preemptive_cap(step_s) == want


@pytest.mark.parametrize("left, now, after, compile_s, want", [
    (10_000, 100e-6, 50e-6, 0.4, True),    # 0.5 s saved > 0.4 s compile
    (4_000, 100e-6, 50e-6, 0.4, False),    # 0.2 s saved < 0.4 s compile
    (4_000, 100e-6, 50e-6, 0.0, True),     # a cached program is free
    (None, 100e-6, 50e-6, 5.0, True),      # runs until its data ends: any saving pays
    (10_000, 100e-6, 120e-6, 0.0, False),  # slower (the CNN's rolled scan): never
    (10_000, 100e-6, 100e-6, 0.0, False),  # no saving: no move
])
def test_promotion_pays(left, now, after, compile_s, want):
    assert promotion_pays(left, now, after, compile_s) is want


@pytest.mark.parametrize("left, pace, later, want", [
    (10_000, None, 0, True),      # the steps run while it compiles not counted: 0.5 s > 0.4 s
    (10_000, 100e-6, 0, False),   # 4,000 of them run meanwhile: 6,000 x 50 us = 0.3 s < 0.4 s
    (16_000, 100e-6, 0, True),    # 12,000 after it: 0.6 s
    (3_000, 100e-6, 0, False),    # it lands after the last step: nothing to save
    (3_000, 100e-6, 9_000, True),  # ... but later runs are expected to take it: 0.45 s
])
def test_a_background_compile_pays_only_with_the_steps_after_it_lands(left, pace, later, want):
    assert promotion_pays(left, 100e-6, 50e-6, 0.4, pace_s=pace, later_steps=later) is want


def test_fusion_pays_only_when_a_member_step_is_cheaper_than_a_solo_one():
    assert fusion_pays(8 * 3000, solo_step_s=100e-6, fused_member_step_s=30e-6, compile_s=0.5)
    assert not fusion_pays(8 * 3000, solo_step_s=100e-6, fused_member_step_s=110e-6, compile_s=0.0)
    assert not fusion_pays(8 * 50, solo_step_s=100e-6, fused_member_step_s=30e-6, compile_s=0.5)


@pytest.mark.parametrize("step_s, want", [
    (None, 16),                          # not timed yet: the base K
    (77e-6, 32),                         # the hook's fused group at K=16: 32 of them, 2.5 ms a call
    (QUANTUM_S / MAX_STEPS_PER_CALL, 32),  # exactly a quantum's worth of 32 steps
    (QUANTUM_S / MAX_STEPS_PER_CALL * 1.01, 16),  # past it: a call would outlast the quantum
    (1e-3, 16),                          # a 1 ms step: 16 ms calls already, nothing to gain
    (0.0, 16),                           # an unusable time (no fence record): the base K
])
def test_a_short_steps_rolled_form_runs_more_steps_a_call(step_s, want):
    assert rolled_k(16, step_s) == want


def test_rolled_k_never_lowers_the_base():
    assert rolled_k(64, 1e-6) == 64


@pytest.mark.parametrize("bounds, want", [
    (Bounds(), 32),                      # nothing bounds it: all of K
    (Bounds(left=24), 24),               # the last 24 steps: one call, none left one per call
    (Bounds(left=100, to_eval=10), 10),  # stops right at the evaluation
    (Bounds(to_report=1), 1),            # on_metrics acts on every step: one a call
    (Bounds(ready=7), 7),                # 7 batches ready: never wait inside a call
    (Bounds(cap=8, left=5), 5),          # the least of every bound
])
def test_a_rolled_form_runs_any_number_of_steps_up_to_its_k(bounds, want):
    # (A rolled loop's trip count is an operand: multistep.py.) Its K=32 program with an
    # unrolled K=8 one beside it: an unrolled program runs exactly its K.
    assert steps_per_call(bounds, (1, 32), upto=32) == want
    assert steps_per_call(bounds, (1, 8), upto=1) == (8 if want >= 8 else 1)


@pytest.mark.parametrize("n, want", [(0, 1), (1, 1), (2, 2), (3, 2), (31, 16), (32, 32), (33, 32)])
def test_pow2_floor(n, want):
    assert pow2_floor(n) == want
