"""The timeline's host-gap estimate from fence events: what srtf adds to a step's device time."""

from __future__ import annotations

import types
from collections import deque

import numpy as np
import pytest

from xshare.runtime.observe import timing

_EVENT = np.dtype([("seq", "u8"), ("t_ns", "i8"), ("job", "i4"), ("lane", "i4"), ("kind", "i4")])


def events(rows):
    """rows: (t_ns, job, lane, kind) in dispatch order (kind 0 = begin, 1 = end)."""
    out = np.zeros(len(rows), _EVENT)
    for i, (t, job, lane, kind) in enumerate(rows):
        out[i] = (i, t, job, lane, kind)
    return out


def units(*ids):
    table = {i: types.SimpleNamespace(id=i, host_gap_s=None, device_time_s=0.0, steps_recorded=0,
                                      step_times=deque(maxlen=8),
                                      step_time_s=None, program=None, spec=None)
             for i in ids}
    return table, timing.Timeline(None, table.get)


def test_gap_before_each_begin_is_charged_to_the_unit_that_begins():
    table, tl = units(1, 2)
    us = 1_000
    # lane 0: job 1 steps 100 us with 40 us gaps, then job 2 with 10 us gaps
    tl._pair(events([(0, 1, 0, 0), (100 * us, 1, 0, 1), (140 * us, 1, 0, 0), (240 * us, 1, 0, 1),
                     (280 * us, 1, 0, 0), (380 * us, 1, 0, 1),
                     (390 * us, 2, 0, 0), (490 * us, 2, 0, 1), (500 * us, 2, 0, 0), (600 * us, 2, 0, 1)]))
    assert table[1].host_gap_s == pytest.approx(40e-6)
    assert table[2].host_gap_s == pytest.approx(10e-6)
    assert table[1].step_time_s == pytest.approx(100e-6)


def test_gaps_continue_across_drains_and_skip_idleness_and_other_lanes():
    table, tl = units(1, 2)
    us = 1_000
    tl._pair(events([(0, 1, 0, 0), (100 * us, 1, 0, 1)]))
    assert table[1].host_gap_s is None  # no begin after an end yet
    # the next drain: its first begin follows the previous drain's end by 30 us; job 2 runs in
    # lane 1 at the same times (its gaps are measured against lane 1's ends only)
    tl._pair(events([(130 * us, 1, 0, 0), (135 * us, 2, 1, 0), (230 * us, 1, 0, 1), (235 * us, 2, 1, 1),
                     (245 * us, 2, 1, 0), (345 * us, 2, 1, 1)]))
    assert table[1].host_gap_s == pytest.approx(30e-6)
    assert table[2].host_gap_s == pytest.approx(10e-6)
    # a second of idleness (no work) before the next step is not a host cost
    tl._pair(events([(1_345_000 * us, 2, 1, 0), (1_345_100 * us, 2, 1, 1)]))
    assert table[2].host_gap_s == pytest.approx(10e-6)


def test_a_fast_sweeps_timeline_keeps_every_step():
    """The fence ring holds what comes between two of the recorder's drains, for steps that cost
    next to nothing (~100k a second): at a quarter of today's capacity it dropped thousands of
    a 32 x 2,000-step sweep's records, and the timeline lost those steps."""
    import jax.numpy as jnp

    import xshare
    from xshare import ffi

    x = np.ones((4,), np.float32)

    @xshare.job
    def step(s, b):
        return {"w": s["w"] + b}, {"v": s["w"][0]}

    specs = [step.bind({"w": jnp.zeros((4,), jnp.float32)}, lambda k: x, steps=2000, name=f"j{i}")
             for i in range(32)]
    # K=16 from the first steps (not after the tiers' warm-up on a fresh cache): the fastest pace.
    with xshare.Runtime(policy="fifo", memory="256MiB", steps_per_call=16) as rt:
        rt.submit_many(specs)
        rt.wait()
        if rt._workers.ring is None:
            pytest.skip("this runtime runs without fences (its timeline is host-timed)")
        dropped = ffi.dropped(rt._workers.ring)
        timeline = rt.timeline()
    assert dropped == 0
    assert len(timeline) == 32 * 2000
