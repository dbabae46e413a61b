"""The planner on hand-made units: what the policy sees, when it is asked, which unit steps."""

from __future__ import annotations

from typing import Any

import pytest

from xshare import sched
from xshare.runtime.engine.planner import Pick, Planner
from xshare.runtime.engine.units import Units

from . import fakes


def planner(policy: Any, *jobs: Any, ready: Any = None, owes: Any = None, quantum: int = 1,
            lane: int = 0, waits: Any = None) -> tuple[Planner, Units, fakes.Timeline]:
    units, timeline = Units(), fakes.Timeline()
    for j in jobs:
        j.lane = lane
        units.jobs[j.id] = j
        units.run(j)
    p = Planner(units, policy, timeline, quantum=quantum, slots=1, t0=0.0, clock=lambda: 5.0,
                ready=ready or (lambda unit, make: True), owes=owes or (lambda unit: None),
                waits=waits or (lambda unit: False))
    return p, units, timeline


def walk(p: Planner, n: int) -> list[str]:
    names = []
    for _ in range(n):
        pick = p.next()
        if pick is None:
            names.append("-")
            continue
        names.append(pick.unit.name)
        pick.unit.dispatched += 1
        p.stepped(pick)
    return names


def test_fifo_steps_the_first_arrival_until_it_ends_then_the_next():
    a, b = fakes.job("a", steps=2, arrival=1.0), fakes.job("b", steps=2, arrival=2.0)
    p, units, _ = planner(sched.Fifo(), b, a)
    assert walk(p, 2) == ["a", "a"]
    units.stop(a)  # it ended: the running set changed, so the policy is asked again
    assert walk(p, 2) == ["b", "b"]


def test_pack_interleaves_the_jobs_of_a_lane_quantum_steps_each():
    a, b = fakes.job("a", steps=100, arrival=1.0), fakes.job("b", steps=100, arrival=2.0)
    p, _, _ = planner(sched.Pack(), a, b, quantum=2)
    assert walk(p, 8) == ["a", "a", "b", "b", "a", "a", "b", "b"]


def test_the_policy_is_asked_on_a_change_or_after_its_period_never_per_step():
    asked = []

    class Counting(sched.Pack):
        def pick(self, view, state):
            asked.append(view.now)
            return super().pick(view, state)

    a, b = fakes.job("a", steps=None), fakes.job("b", steps=None)
    p, units, _ = planner(Counting(), a, b)
    walk(p, 300)
    assert len(asked) == 2, asked  # the first plan, then once its period (256 steps) ran out
    units.changed = True
    walk(p, 1)
    assert len(asked) == 3
    assert asked[0] == 5.0  # the view's clock is the one passed in, minus t0


def test_the_view_holds_what_the_policy_needs_and_skips_failed_or_finished_units():
    seen = []

    class Recording(sched.Pack):
        def pick(self, view, state):
            seen.append(view)
            return super().pick(view, state)

    a, b, c = fakes.job("a", priority=3, step_s=0.02), fakes.job("b"), fakes.job("c", steps=0)
    b.error = "its step raised"
    p, _, _ = planner(Recording(), a, b, c)
    assert p.next() == Pick(a, 0, 0)
    (view,) = seen
    assert [v.name for v in view.jobs] == ["a"]
    (v,) = view.jobs
    assert (v.priority, v.steps_left, v.step_time_s, v.lane) == (3, 10, 0.02, 0)


def test_srtf_ranks_a_job_by_its_recent_steps_not_its_first_ones():
    """A job's first steps pay one-time costs (ms). Ranked by an average that kept them, a job
    preempted after two steps looked like the longest job under srtf and waited for every
    other (the jct trace's 1155-step job: 1.7 s of its 2.0 s JCT). The planner ranks by the
    median of its recent steps, the first two left out, and by the program's estimate (as for a
    job that has not started) until it has three of those."""
    short, long_ = fakes.job("short", steps=1000), fakes.job("long", steps=3000, arrival=-1.0)
    short.step_times.clear()
    short.step_times.extend([8e-3, 5e-3])  # its first two: a first run's one-time costs
    short.step_time_s = 6e-3               # what an average of them says
    short.host_gap_s = 4e-3                # its first gaps too
    long_.step_times.clear()
    long_.step_times.extend([2e-4] * 40)
    long_.step_time_s = 2e-4

    class Estimated:  # the program's estimate of a job with too few measured steps
        def step_time_estimate_s(self, flops_per_s):
            return 1e-4

    short.program = Estimated()
    p, units, timeline = planner(sched.Srtf(), long_, short)
    timeline.host_gap_s = 1e-5
    assert p.next().unit is short  # 1000 x (100 + 10 us) left, not 1000 x (6 ms + 4 ms)
    short.step_times.extend([1e-4] * 3)
    assert short.step_estimate_s(None) == 1e-4 and short.host_estimate_s(1e-5) == 4e-3
    short.step_times.clear()
    short.step_times.extend([9e-3, 9e-3] + [3e-4] * 40)
    assert short.step_estimate_s(None) == 3e-4  # the first two left out, the recent median kept


def test_the_view_carries_each_units_form_pace_with_its_batches_or_a_typical_ones():
    """``form_step_s(unit, data_s)`` (the dispatcher's: ``MultiCalls.form_step_s``) is asked
    with the unit's own time to make a batch, or for a unit that has made none the median
    of those that have: a job that had not run ranked ahead of one that had by the price of its
    batches alone. srtf ranks by it where it is less than the unit's own pace."""
    seen, asked = [], []

    class Recording(sched.Srtf):
        def pick(self, view, state):
            seen.append(view)
            return super().pick(view, state)

    old, new, other = (fakes.job("old", steps=2000, step_s=1.4e-3), fakes.job("new", steps=1424, step_s=6e-4),
                       fakes.job("other", steps=5000, step_s=3e-4))
    old.data_s, other.data_s = 100e-6, 60e-6
    forms = {"old": 87e-6, "new": 231e-6, "other": None}

    def form_step_s(unit, data_s):
        asked.append((unit.name, data_s))
        return None if forms[unit.name] is None else forms[unit.name] + data_s

    p, _, _ = planner(Recording(), new, old, other)
    p.form_step_s = form_step_s
    # 2000 x 187 us = 0.37 s against 1424 x 331 us = 0.47 s (by their own paces: 2.8 against
    # 0.85 s; without a batch's cost for the one that made none: 1424 x 231 us = 0.33 s)
    assert p.next().unit is old
    assert sorted(asked) == [("new", 100e-6), ("old", 100e-6), ("other", 60e-6)]  # (the median of two: the upper)
    (view,) = seen
    by = {v.name: v.form_step_s for v in view.jobs}
    assert by["old"] == pytest.approx(187e-6) and by["new"] == pytest.approx(331e-6) and by["other"] is None


def test_a_unit_without_its_batch_is_skipped_for_a_ready_one_unless_the_policy_is_exclusive():
    a, b = fakes.job("a", arrival=1.0), fakes.job("b", arrival=2.0)
    asked = []

    def ready(unit: Any, make: bool) -> bool:
        asked.append((unit.name, make))
        return unit.name == "b"

    p, _, _ = planner(sched.Pack(), a, b, ready=ready)
    assert p.next().unit is b
    # the current unit is asked to make its batch (as a plain loop would); the others only checked
    assert asked == [("a", True), ("a", False), ("b", False)]
    p, _, _ = planner(sched.Fifo(), a, b, ready=ready)
    assert p.next() is None  # exclusive: the device idles for the chosen job's data


def test_a_unit_owing_an_evaluation_is_ready_without_a_train_batch_and_stays_in_the_view():
    a = fakes.job("a", steps=0)
    p, units, _ = planner(sched.Pack(), a, ready=lambda u, make: False, owes=lambda u: "eval batch")
    units.evaluating[a.id] = a
    pick = p.next()
    assert pick is not None and pick.unit is a


def test_a_unit_waiting_for_its_evaluations_results_takes_no_turn_while_the_others_step():
    """Its next step must not pass an evaluation whose result ``on_metrics`` may act on, and the
    dispatcher must not sit in a host sync for it either: the other units step meanwhile."""
    a, b = fakes.job("a", steps=100, arrival=1.0), fakes.job("b", steps=100, arrival=2.0)
    p, units, _ = planner(sched.Pack(), a, b, waits=lambda u: u.id in units.reading)
    units.reading[a.id] = "its results"
    assert walk(p, 4) == ["b", "b", "b", "b"]
    del units.reading[a.id]
    assert "a" in walk(p, 4)
    p, units, _ = planner(sched.Fifo(), a, b, waits=lambda u: u.id in units.reading)
    units.reading[a.id] = "its results"
    assert p.next() is None  # exclusive: the chosen job waits (the dispatcher reads its results)


def test_a_timed_policy_makes_the_device_times_current_before_each_decision():
    a = fakes.job("a")
    p, units, timeline = planner(sched.Fair(), a)
    p.next()
    units.changed = True
    p.next()
    assert timeline.drains == 2
    p, _, timeline = planner(sched.Pack(), fakes.job("b"))
    p.next()
    assert timeline.drains == 0


def test_nothing_running_plans_nothing():
    p, _, _ = planner(sched.Pack())
    assert p.next() is None and not p.plan
