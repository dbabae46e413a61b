"""Table tests for the arena: placement, release, lane E, swap, defragmentation, misuse.

Layouts are written as ``(offset, size, jobs)`` per lane, sorted by offset; sizes are bytes.
"""

from __future__ import annotations

import re

import pytest

from xshare._errors import AdmissionError
from xshare.memory import Admitted, Arena, LaneInfo, Move, Queued

GiB = 1 << 30


def build(capacity, setup):
    arena = Arena(capacity)
    for op, job, *args in setup:
        getattr(arena, op)(job, *args)
    arena.check()
    return arena


def layout(arena):
    return [(lane.offset, lane.size, lane.jobs) for lane in arena.lanes() if lane.size]


# Four lanes of 20 B with 20 B free after the 2nd, 4th and at the tail once a, c leave.
SPREAD = [("admit", "a", 10, 10), ("admit", "b", 15, 5), ("admit", "c", 10, 10),
          ("admit", "d", 15, 5), ("release", "a"), ("release", "c")]
# Lane 0 = a [0, 40) with no room after it: b [40, 70) sits right there; 30 B free at the tail.
BLOCKED = [("admit", "a", 10, 30), ("admit", "b", 20, 10)]

PLACEMENT = [
    pytest.param(100, [], set(), ("c", 10, 20), Admitted("c", 0, True), [(0, 30, ("c",))],
                 id="empty arena: a new lane of P+E at offset 0"),
    pytest.param(100, [("admit", "a", 10, 10), ("admit", "b", 20, 20), ("admit", "c", 10, 10),
                       ("release", "b")],
                 set(), ("d", 5, 10), Admitted("d", 3, True),
                 [(0, 20, ("a",)), (60, 20, ("c",)), (80, 15, ("d",))],
                 id="new lane goes to the smallest gap that fits (tail 20 B), not the first (40 B)"),
    pytest.param(100, [("admit", "a", 10, 20), ("admit", "x", 5, 10), ("admit", "b", 10, 20),
                       ("admit", "y", 5, 7), ("admit", "z", 3, 10), ("release", "x"), ("release", "y")],
                 set(), ("c", 8, 20), Admitted("c", 2, False),
                 [(0, 30, ("a",)), (45, 38, ("b", "c")), (87, 13, ("z",))],
                 id="no gap holds 28 B: grow the lane leaving least room (b: 12-8) not a (15-8)"),
    pytest.param(100, [("admit", "a", 10, 20), ("admit", "f", 30, 30)],
                 set(), ("c", 4, 35), Admitted("c", 1, False),
                 [(0, 30, ("a",)), (30, 69, ("f", "c"))],
                 id="growth is P + (E - lane E) = 9 B, not P + E = 39 B: the E region is shared"),
    pytest.param(100, BLOCKED, set(), ("c", 10, 35), Admitted("c", 0, False),
                 [(0, 55, ("a", "c")), (70, 30, ("b",))],
                 id="growth of a blocked by neighbour b: b slides up to the end, a grows by 15 B"),
    pytest.param(100, BLOCKED, {"b"}, ("c", 10, 35),
                 Queued("c", "needs 45 B (P 10 B + E 35 B); largest free gap 30 B, 30 B free in all"),
                 [(0, 40, ("a",)), (40, 30, ("b",))],
                 id="growth blocked by a neighbour with a step in flight: queued, nothing moved"),
    pytest.param(100, SPREAD, set(), ("e", 10, 20), Admitted("e", 4, True),
                 [(0, 20, ("b",)), (20, 20, ("d",)), (40, 30, ("e",))],
                 id="60 B free in three 20 B gaps: compaction toward 0 makes room for a 30 B lane"),
    pytest.param(100, SPREAD, {"d"}, ("e", 10, 20), Admitted("e", 4, True),
                 [(0, 20, ("b",)), (20, 30, ("e",)), (60, 20, ("d",))],
                 id="d in flight stays at 60; b slides down in front of it; e takes the 40 B there"),
    pytest.param(100, SPREAD, {"b", "d"}, ("e", 10, 20),
                 Queued("e", "needs 30 B (P 10 B + E 20 B); largest free gap 20 B, 60 B free in all "
                             "but lanes with a step in flight cannot move to gather it"),
                 [(20, 20, ("b",)), (60, 20, ("d",))],
                 id="every lane in flight: no defragmentation, queued with why"),
    pytest.param(100, [("admit", "a", 50, 50)], set(), ("b", 1, 1),
                 Queued("b", "needs 2 B (P 1 B + E 1 B); largest free gap 0 B, 0 B free in all"),
                 [(0, 100, ("a",))], id="full arena: queued"),
    pytest.param(100, [("admit", "a", 50, 40), ("admit", "b", 20, 20)], set(), ("c", 2, 3),
                 Queued("c", "needs 5 B (P 2 B + E 3 B); largest free gap 10 B, 1 job ahead in queue"),
                 [(0, 90, ("a",))], id="fits the 10 B gap but b arrived first: queued behind it"),
]


@pytest.mark.parametrize("capacity, setup, in_flight, job, expected, after", PLACEMENT)
def test_placement(capacity, setup, in_flight, job, expected, after):
    arena = build(capacity, setup)
    assert arena.admit(*job, in_flight=in_flight) == expected
    assert layout(arena) == after
    arena.check()


def test_never_fits_raises_with_the_numbers_and_the_fix():
    arena = Arena(6 * GiB)
    message = ("job 'mlp-3' needs 9.1 GiB (P 2.0 GiB + E 7.1 GiB) but the arena holds 6.0 GiB; "
               "lower its batch size or give the runtime more memory (--memory)")
    with pytest.raises(AdmissionError, match=re.escape(message)):
        arena.admit(3, 2 * GiB, int(7.1 * GiB), name="mlp-3")
    with pytest.raises(AdmissionError, match=re.escape("job 3 needs 6.0 GiB (P 0 B + E 6.0 GiB) ")):
        arena.admit(3, 0, 6 * GiB + 1)
    assert arena.queue == () and arena.lanes() == ()
    assert arena.admit(3, 0, 6 * GiB) == Admitted(3, 0, True)  # exactly the arena: fits


def test_release_frees_the_lane_and_admits_the_queue_in_arrival_order():
    arena = build(100, [("admit", "a", 40, 40)])
    assert [arena.admit(*job) for job in [("b", 30, 30), ("c", 5, 5), ("d", 10, 10)]] == [
        Queued("b", "needs 60 B (P 30 B + E 30 B); largest free gap 20 B, 20 B free in all"),
        Queued("c", "needs 10 B (P 5 B + E 5 B); largest free gap 20 B, 1 job ahead in queue"),
        Queued("d", "needs 20 B (P 10 B + E 10 B); largest free gap 20 B, 2 jobs ahead in queue")]
    assert arena.queue == ("b", "c", "d")
    assert arena.release("a") == [Admitted("b", 1, True), Admitted("c", 2, True), Admitted("d", 3, True)]
    assert layout(arena) == [(0, 60, ("b",)), (60, 10, ("c",)), (70, 20, ("d",))]
    assert arena.queue == () and arena.lane_of("a") is None
    arena.check()


def test_release_stops_at_the_first_queued_job_that_does_not_fit():
    arena = build(100, [("admit", "a", 30, 30), ("admit", "x", 10, 10),
                        ("admit", "b", 40, 40), ("admit", "c", 5, 5)])
    assert arena.queue == ("b", "c")
    assert arena.release("x") == []  # 40 B free: c would fit, but b (80 B) came first
    assert arena.queue == ("b", "c") and layout(arena) == [(0, 60, ("a",))]
    assert arena.release("a") == [Admitted("b", 2, True), Admitted("c", 3, True)]
    assert layout(arena) == [(0, 80, ("b",)), (80, 10, ("c",))]


def test_releasing_the_queue_head_lets_the_next_in():
    arena = build(100, [("admit", "a", 30, 30), ("admit", "b", 40, 40), ("admit", "c", 5, 5)])
    assert arena.footprint("b") == (40, 40) and arena.lane_of("b") is None
    assert arena.release("b") == [Admitted("c", 1, True)]
    assert arena.queue == ()
    with pytest.raises(KeyError, match="'b' is neither admitted nor queued"):
        arena.footprint("b")


def test_retry_admits_once_the_blocking_step_ends():
    arena = build(100, SPREAD)
    assert isinstance(arena.admit("e", 10, 20, in_flight={"b", "d"}), Queued)
    assert arena.retry(in_flight={"b", "d"}) == []
    assert arena.retry(in_flight={"b"}) == [Admitted("e", 4, True)]
    assert layout(arena) == [(20, 20, ("b",)), (40, 20, ("d",)), (60, 30, ("e",))]


def test_lane_ephemeral_shrinks_when_the_largest_E_job_leaves():
    arena = build(100, [("admit", "big", 10, 50), ("admit", "f", 10, 20)])
    # 10 B free after f only: b joins big (growth 10 B) once f slides up to the end.
    assert arena.admit("b", 10, 30) == Admitted("b", 0, False)
    assert arena.lanes()[0] == LaneInfo(0, 0, 70, 50, 20, ("big", "b"))
    arena.release("big")
    assert arena.lanes() == (LaneInfo(0, 0, 40, 30, 10, ("b",)), LaneInfo(1, 70, 30, 20, 10, ("f",)))
    assert arena.committed == 70 and arena.free == 30 and arena.largest_gap == 30
    arena.check()


def test_a_lane_is_freed_when_its_last_job_leaves_and_ids_are_not_reused():
    arena = Arena(100)
    arena.admit("a", 10, 10)
    arena.release("a")
    assert arena.lanes() == () and arena.committed == 0
    assert arena.admit("b", 10, 10) == Admitted("b", 1, True)


# Lane 1 = (z 10+40, b 10+20) at [40, 100), after lane 0 = a [0, 40).
SHARED = [("admit", "a", 10, 30), ("admit", "z", 10, 40), ("admit", "b", 10, 20)]


def test_swap_out_shrinks_the_lane_by_P_and_drops_the_E():
    arena = build(100, SHARED)
    assert arena.lanes()[1] == LaneInfo(1, 40, 60, 40, 20, ("z", "b"))
    arena.swap_out("z")
    assert arena.lanes()[1] == LaneInfo(1, 40, 30, 20, 10, ("z", "b"), swapped=("z",))
    assert arena.lane_of("z") == 1 and arena.committed == 70
    arena.swap_out("z")  # again: no-op
    assert arena.committed == 70
    assert arena.swap_in("z") is True  # 30 B after lane 1: 10 B of P + 20 B more of E
    assert arena.lanes()[1] == LaneInfo(1, 40, 60, 40, 20, ("z", "b"))
    assert arena.swap_in("z") is True  # resident already
    arena.check()


def test_swap_in_waits_until_there_is_room():
    arena = build(100, SHARED)
    arena.swap_out("z")
    assert arena.admit("c", 10, 20) == Admitted("c", 2, True)  # takes the 30 B z left
    before = arena.lanes()
    assert arena.swap_in("z") is False
    assert arena.lanes() == before
    arena.release("c")
    assert arena.swap_in("z") is True
    assert layout(arena) == [(0, 40, ("a",)), (40, 60, ("z", "b"))]


# Lane 0 = (a 10+30, a2 5+10); a swapped out leaves it [0, 15); c [15, 30); w [50, 90).
MIDDLE = [("admit", "a", 10, 30), ("admit", "x", 5, 5), ("admit", "w", 10, 30), ("release", "x"),
          ("admit", "a2", 5, 10), ("swap_out", "a"), ("admit", "c", 5, 10)]


@pytest.mark.parametrize("in_flight, fits, after", [
    pytest.param(set(), True, [(0, 45, ("a", "a2")), (45, 15, ("c",)), (60, 40, ("w",))],
                 id="c and w slide up to the end: 30 B right after lane 0"),
    pytest.param({"w"}, False, [(0, 15, ("a", "a2")), (15, 15, ("c",)), (50, 40, ("w",))],
                 id="w in flight pins it: c can slide up only to 50, 20 B is too little"),
    pytest.param({"c"}, False, [(0, 15, ("a", "a2")), (15, 15, ("c",)), (50, 40, ("w",))],
                 id="c in flight right after lane 0: no room at all"),
])
def test_swap_in_of_a_lane_in_the_middle(in_flight, fits, after):
    arena = build(100, MIDDLE)
    assert layout(arena) == [(0, 15, ("a", "a2")), (15, 15, ("c",)), (50, 40, ("w",))]
    assert arena.swap_in("a", in_flight=in_flight) is fits
    assert layout(arena) == after
    arena.check()


def test_a_lane_with_every_job_swapped_out_holds_nothing_and_reopens_where_it_fits():
    arena = build(100, [("admit", "a", 10, 10), ("admit", "b", 10, 10)])
    arena.swap_out("a")
    assert arena.lanes()[0] == LaneInfo(0, 0, 0, 0, 0, ("a",), swapped=("a",))
    assert arena.committed == 20 and arena.largest_gap == 60
    assert arena.admit("c", 5, 10) == Admitted("c", 2, True)  # best fit: the 20 B a left
    assert arena.swap_in("a") is True
    assert layout(arena) == [(0, 15, ("c",)), (20, 20, ("b",)), (40, 20, ("a",))]
    assert arena.lane_of("a") == 0
    arena.check()


def test_a_parked_lane_reopens_after_defragmentation_when_no_gap_holds_it():
    arena = build(100, [("admit", "a", 15, 15), ("admit", "b", 10, 10), ("admit", "c", 10, 10),
                        ("admit", "d", 10, 20), ("swap_out", "a"), ("admit", "e", 5, 10), ("release", "c")])
    assert layout(arena) == [(0, 15, ("e",)), (30, 20, ("b",)), (70, 30, ("d",))]
    assert arena.swap_in("a", in_flight={"b"}) is False  # b pinned: gaps of 15 B and 20 B + 20 B
    assert arena.swap_in("a") is True  # 35 B free once b and d slide down
    assert layout(arena) == [(0, 15, ("e",)), (15, 20, ("b",)), (35, 30, ("d",)), (65, 30, ("a",))]
    arena.check()


FIVE = [("admit", j, 10, 10) for j in "axbyc"] + [("release", "x"), ("release", "y")]


@pytest.mark.parametrize("in_flight, moves, after", [
    pytest.param(set(), [Move(2, 40, 20), Move(4, 80, 40)],
                 [(0, 20, ("a",)), (20, 20, ("b",)), (40, 20, ("c",))], id="all slide toward 0"),
    pytest.param({"b"}, [Move(4, 80, 60)],
                 [(0, 20, ("a",)), (40, 20, ("b",)), (60, 20, ("c",))],
                 id="b in flight stays; c slides only down to b's end"),
    pytest.param({"a", "b", "c"}, [], [(0, 20, ("a",)), (40, 20, ("b",)), (80, 20, ("c",))],
                 id="everything in flight: nothing moves"),
])
def test_defragment(in_flight, moves, after):
    arena = build(100, FIVE)
    assert arena.defragment(in_flight) == moves
    assert layout(arena) == after
    assert arena.defragment(in_flight) == []  # already compact
    arena.check()


def test_misuse_raises():
    for capacity in (0, -1):
        with pytest.raises(ValueError, match="arena capacity must be a positive number of bytes"):
            Arena(capacity)
    arena = build(100, [("admit", "a", 50, 50), ("admit", "q", 10, 10)])
    with pytest.raises(ValueError, match=re.escape("job 'n' has a negative footprint (P -1 B, E 0 B)")):
        arena.admit("n", -1, 0)
    with pytest.raises(ValueError, match="job id 'a' is already in the arena"):
        arena.admit("a", 1, 1)
    with pytest.raises(ValueError, match="job id 'q' is already in the arena"):
        arena.admit("q", 1, 1)
    with pytest.raises(ValueError, match=re.escape("job 'zero' has a zero footprint")):
        arena.admit(0, 0, 0, name="zero")
    with pytest.raises(KeyError, match="'nope' is neither admitted nor queued"):
        arena.release("nope")
    with pytest.raises(ValueError, match="job 'q' is queued, not admitted"):
        arena.swap_out("q")
    with pytest.raises(ValueError, match="job 'q' is queued, not admitted"):
        arena.swap_in("q")
    assert arena.queue == ("q",) and arena.lane_of("nope") is None
    arena.check()


def test_check_catches_a_broken_invariant():
    arena = build(100, [("admit", "a", 10, 10), ("admit", "b", 10, 10)])
    arena._lanes[1].offset = 10  # overlaps lane 0
    with pytest.raises(AssertionError, match="lanes 0 and 1 overlap"):
        arena.check()
    arena._lanes[1].offset = 20
    arena._lanes[1].size = 25
    with pytest.raises(AssertionError, match="lane 1 has size 25, its jobs need 20"):
        arena.check()


def test_max_lanes_makes_jobs_share_lanes_and_queues_past_it():
    arena = Arena(1000, max_lanes=1)
    assert arena.admit("a", 100, 200) == Admitted("a", 0, True)
    # Room for a second lane, but the cap says share: b joins lane 0 (grows by P only).
    assert arena.admit("b", 100, 150) == Admitted("b", 0, False)
    assert [lane.jobs for lane in arena.lanes()] == [("a", "b")]
    # c alone (P 400 + E 500) fits the arena and even the 600 free bytes as a lane of its own,
    # but a new lane is not allowed, and joining lane 0 needs 400 + (500 - 200) = 700: queued.
    assert isinstance(arena.admit("c", 400, 500), Queued)
    arena.check()


def test_max_lanes_must_be_positive():
    with pytest.raises(ValueError, match=re.escape("max_lanes=0 must be an int >= 1, or None for no limit")):
        Arena(100, max_lanes=0)
