"""Fusion-group capacity (xshare.sched.capacity): table tests, no jax."""

from __future__ import annotations

import pytest

from xshare.sched.capacity import (floor_capacity, open_capacity, opens_alone, parallel_groups, pow2, shrink_pays,
                                   shrink_target, split_capacity)


@pytest.mark.parametrize("n, want", [(0, 1), (1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16)])
def test_pow2(n, want):
    assert pow2(n) == want


OPEN = [
    # (why, joining, group_capacity, slots)
    ("two jobs submitted together: a group of two", 2, None, 2),
    ("three: rounded up to a power of two", 3, None, 4),
    ("one job (with a mover): never a group of one", 1, None, 2),
    ("a study of concurrency 8: room for all 8 from the first pair", 2, 8, 8),
    ("a refill of one trial under the floor: the floor's capacity (the cached program)", 1, 8, 8),
    ("a floor that is not a power of two rounds up", 1, 6, 8),
    ("a floor of one still means two slots (no group of one)", 1, 1, 2),
    ("more jobs at once than the floor: room for all", 12, 8, 16),
]


@pytest.mark.parametrize("why, joining, floor, want", OPEN, ids=[c[0] for c in OPEN])
def test_open_capacity(why, joining, floor, want):
    assert open_capacity(joining, floor) == want


SPLIT = [
    # (why, joining, streams, group_capacity, groups, slots each)
    ("one stream (a GPU, or lanes one after another): one group of all", 8, 1, None, 1, 8),
    ("two streams (a 2-core CPU): a group of four on each", 8, 2, None, 2, 4),
    ("three jobs on two streams: no group of one, so one group", 3, 2, None, 1, 4),
    ("four jobs on two streams: two groups of two", 4, 2, None, 2, 2),
    ("six on four streams: three groups of two (never a group of one)", 6, 4, None, 3, 2),
    ("five on two streams: four, and the fifth in a group of its own (4-slot steps on each "
     "core at once: about half one 8-slot step on one)", 5, 2, None, 2, 4),
    ("sixteen on eight streams", 16, 8, None, 8, 2),
    ("under a floor (a study) one group: its refills join it without a compile", 8, 2, 8, 1, 8),
]


@pytest.mark.parametrize("why, joining, streams, floor, groups, slots", SPLIT, ids=[c[0] for c in SPLIT])
def test_parallel_groups_and_their_capacity(why, joining, streams, floor, groups, slots):
    assert parallel_groups(joining, streams, floor) == groups
    assert split_capacity(joining, streams, floor) == slots
    assert groups * slots >= joining  # room for every job that joins


ALONE = [
    # (why, together, movers, shared, group_capacity, opens)
    ("submitted with a peer on its program", 2, 0, False, None, True),
    ("a running job of its program can move in", 1, 1, False, None, True),
    ("alone, no floor: it steps its own program (no group of one)", 1, 0, True, None, False),
    ("alone under a floor, a program others run: more trials are coming", 1, 0, True, 8, True),
    ("alone under a floor, a program nobody else runs: a group would stay a group of one",
     1, 0, False, 8, False),
]


@pytest.mark.parametrize("why, together, movers, shared, floor, want", ALONE, ids=[c[0] for c in ALONE])
def test_opens_alone(why, together, movers, shared, floor, want):
    assert opens_alone(together, movers, shared, floor) is want


SHRINK = [
    # (why, members, capacity, group_capacity, target)
    ("members fit in a quarter: repack", 2, 8, None, 2),
    ("three of eight: more than a quarter, keep (no thrashing between sizes)", 3, 8, None, None),
    ("one member of four: a quarter is one slot, but groups have two: keep", 1, 4, None, None),
    ("one of sixteen: two slots", 1, 16, None, 2),
    ("a study's group at its floor never shrinks", 1, 8, 8, None),
    ("a group that grew past the floor shrinks back to it, no lower", 1, 32, 8, 8),
    ("... but only when its members fit in a quarter", 1, 16, 8, None),
]


@pytest.mark.parametrize("why, members, capacity, floor, want", SHRINK, ids=[c[0] for c in SHRINK])
def test_shrink_target(why, members, capacity, floor, want):
    assert shrink_target(members, capacity, floor) == want


PAYS = [
    # (why, target, capacity, steps_left, step_s, compile_s, pays)
    ("many steps left: the smaller program wins its compile back", 2, 8, 10_000, 1e-3, 0.5, True),
    ("a sweep ending in lockstep: few steps left, not worth a compile", 2, 8, 50, 1e-3, 0.5, False),
    ("unbounded jobs (steps=None) always pay", 2, 8, None, 1e-3, 0.5, True),
    ("saved time must reach twice the compile: 1000 x 1 ms x 3/4 = 0.75 s < 2 x 0.5 s", 2, 8, 1000, 1e-3, 0.5, False),
]


@pytest.mark.parametrize("why, target, capacity, left, step_s, compile_s, want", PAYS, ids=[c[0] for c in PAYS])
def test_shrink_pays(why, target, capacity, left, step_s, compile_s, want):
    assert shrink_pays(target, capacity, steps_left=left, step_s=step_s, compile_s=compile_s) is want


def test_floor_capacity():
    assert [floor_capacity(x) for x in (None, 1, 2, 3, 8, 9)] == [0, 2, 2, 4, 8, 16]
