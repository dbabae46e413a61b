"""Interleaving is real: steps of different jobs alternate on the device before any job ends."""

from __future__ import annotations

import xshare
from tests.helpers import linreg_data, linreg_state, linreg_step


def _first_finish_index(order, steps):
    seen = {}
    for i, job in enumerate(order):
        seen[job] = seen.get(job, 0) + 1
        if seen[job] == steps:
            return i
    raise AssertionError("no job finished")


def test_steps_of_different_jobs_alternate_before_any_job_finishes():
    steps = 150
    specs = [linreg_step.bind(linreg_state(seed=i), linreg_data(seed=i), steps=steps, name=f"j{i}")
             for i in range(3)]
    with xshare.Runtime(policy="pack", memory="256MiB") as rt:
        handles = rt.submit_many(specs)
        rt.wait()
    order = [rec.job for rec in rt.timeline()]
    assert len(order) == 3 * steps
    cut = _first_finish_index(order, steps)
    before = order[:cut]
    # Every job ran before the first one finished, and the device switched jobs many times.
    assert {h.id for h in handles} <= set(before)
    switches = sum(1 for a, b in zip(before, before[1:]) if a != b)
    assert switches >= 10, f"only {switches} switches before the first job finished: {order[:60]}"


def test_round_robin_inside_one_lane_alternates_every_quantum():
    """With everything paused until all jobs are placed, one lane's round-robin is exact."""
    steps = 20
    specs = [linreg_step.bind(linreg_state(seed=i), linreg_data(seed=i), steps=steps, name=f"j{i}")
             for i in range(2)]
    with xshare.Runtime(policy="pack", memory="256MiB", quantum=2, max_lanes=1) as rt:
        handles = []
        for s in specs:
            h = rt.submit(s)
            h.pause()
            handles.append(h)
        for h in handles:
            h.resume()
        rt.wait()
    order = [rec.job for rec in rt.timeline()]
    ids = [h.id for h in handles]
    # Runs of exactly `quantum` steps, alternating, until the end.
    runs = []
    for job in order:
        if runs and runs[-1][0] == job:
            runs[-1][1] += 1
        else:
            runs.append([job, 1])
    assert all(n == 2 for _, n in runs), runs
    assert [j for j, _ in runs[:4]] in ([ids[0], ids[1]] * 2, [ids[1], ids[0]] * 2)
