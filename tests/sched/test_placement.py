"""Placement across runtime actors: table tests, without Ray (nor jax)."""

from __future__ import annotations

import re

import pytest

from xshare.sched.placement import ActorView, Placed, Want, place

MiB = 1 << 20


def A(id, cap, free):
    return ActorView(id, cap * MiB, free * MiB)


def W(name, mib=None, priority=0, arrival=0):
    return Want(name, None if mib is None else mib * MiB, priority, arrival)


CASES = [
    # (why, actors, wants, expected placements name -> actor)
    ("the actor with the most free bytes wins",
     [A("a", 100, 10), A("b", 100, 60)], [W("j", 5)], {"j": "b"}),
    ("placing takes the bytes from the tally: a batch spreads",
     [A("a", 100, 50), A("b", 100, 40)], [W("j1", 20, arrival=0), W("j2", 20, arrival=1)],
     {"j1": "a", "j2": "b"}),
    ("an actor whose arena is too small is skipped even if it has the most free",
     [A("small", 30, 30), A("big", 200, 20)], [W("j", 40)], {"j": "big"}),
    ("higher priority chooses first, whatever the arrival order",
     [A("a", 100, 50), A("b", 100, 30)], [W("low", 20, priority=0, arrival=0), W("high", 20, priority=5, arrival=1)],
     {"high": "a", "low": "b"}),
    ("equal priority: earlier arrival chooses first",
     [A("a", 100, 50), A("b", 100, 30)], [W("late", 20, arrival=2), W("early", 20, arrival=1)],
     {"early": "a", "late": "b"}),
    ("no room now anywhere: the roomiest admitting actor still takes it (its runtime queues it)",
     [A("a", 100, 1), A("b", 100, 3)], [W("j", 50)], {"j": "b"}),
    ("unknown footprints spread by count between equal actors",
     [A("a", 100, 100), A("b", 100, 100)], [W("j1", arrival=0), W("j2", arrival=1), W("j3", arrival=2)],
     {"j1": "a", "j2": "b", "j3": "a"}),
    ("ties break by actor id, never by input order",
     [A("z", 100, 50), A("y", 100, 50)], [W("j", 1)], {"j": "y"}),
    ("a fusion group is one want with the group's bytes",
     [A("a", 100, 70), A("b", 100, 60)], [W("group-0", 65), W("solo", 30, arrival=1)],
     {"group-0": "a", "solo": "b"}),
]


@pytest.mark.parametrize("why,actors,wants,expected", CASES, ids=[c[0] for c in CASES])
def test_placement_table(why, actors, wants, expected):
    result = place(wants, actors)
    assert not result.refused, why
    assert {p.name: p.actor for p in result.placed} == expected, why
    # Input order never matters.
    again = place(list(reversed(wants)), list(reversed(actors)))
    assert set(again.placed) == set(result.placed), why


def test_a_job_no_actor_can_admit_is_refused_with_numbers():
    result = place([W("huge", 300), W("ok", 10, arrival=1)], [A("a", 100, 100), A("b", 200, 0)])
    assert result.placed == (Placed("ok", "a"),)
    (r,) = result.refused
    assert (r.name, r.needs_bytes, r.largest_bytes) == ("huge", 300 * MiB, 200 * MiB)
    assert r.reason == ("job 'huge' needs 300.0 MiB of arena but the largest actor (b) has 200.0 MiB in all: "
                        "no actor can ever admit it; give the actors more memory (--memory) or shrink the job")


def test_no_actor_alive_refuses_everything():
    result = place([W("j", 1)], [])
    assert not result.placed
    assert re.search("no runtime actor is alive", result.refused[0].reason)


def test_unknown_bytes_estimate_counts_against_capacity():
    result = place([W("j")], [A("a", 10, 10)], unknown_bytes=20 * MiB)
    assert not result.placed and result.refused[0].needs_bytes == 20 * MiB


def test_duplicate_actor_ids_are_misuse():
    with pytest.raises(ValueError, match="actor ids must be unique"):
        place([W("j", 1)], [A("a", 1, 1), A("a", 1, 1)])


def test_by_actor_groups_names():
    result = place([W("j1", 1, arrival=0), W("j2", 1, arrival=1)], [A("a", 10, 10), A("b", 10, 5)])
    assert result.by_actor() == {"a": ["j1", "j2"]}
