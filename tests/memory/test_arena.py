"""Table tests for the reservation ledger: placement, queueing, release, lane E, swap, misuse.

Lanes are written as ``(id, size, jobs)``; sizes are bytes.
"""

from __future__ import annotations

import re

import pytest

from xshare._errors import AdmissionError
from xshare.memory import Admitted, Arena, LaneInfo, Queued

GiB = 1 << 30


def build(capacity, setup, **kwargs):
    arena = Arena(capacity, **kwargs)
    for op, job, *args in setup:
        getattr(arena, op)(job, *args)
    arena.check()
    return arena


def layout(arena):
    return [(lane.id, lane.size, lane.jobs) for lane in arena.lanes()]


# Lane 0 = a (10 + 30), lane 1 = b (10 + 40): 10 B free of 100.
TWO = [("admit", "a", 10, 30), ("admit", "b", 10, 40)]

PLACEMENT = [
    pytest.param(100, [], ("c", 10, 20), Admitted("c", 0, True), [(0, 30, ("c",))],
                 id="empty arena: a new lane of P+E"),
    pytest.param(100, [("admit", "a", 10, 30)], ("c", 5, 20), Admitted("c", 1, True),
                 [(0, 40, ("a",)), (1, 25, ("c",))],
                 id="P+E fits in free: a new lane, even though joining lane 0 would grow it by only 5 B"),
    pytest.param(100, TWO, ("c", 5, 35), Admitted("c", 1, False),
                 [(0, 40, ("a",)), (1, 55, ("b", "c"))],
                 id="40 B > 10 B free: best fit joins lane 1 (growth 5 B), not lane 0 (growth 10 B)"),
    pytest.param(100, [("admit", "a", 10, 20), ("admit", "f", 30, 30)], ("c", 4, 35),
                 Admitted("c", 1, False), [(0, 30, ("a",)), (1, 69, ("f", "c"))],
                 id="growth is P + (E - lane E): 9 B into lane 1, not 19 B into lane 0 nor P+E = 39 B"),
    pytest.param(70, [("admit", "a", 10, 20), ("admit", "b", 10, 20)], ("c", 5, 20),
                 Admitted("c", 0, False), [(0, 35, ("a", "c")), (1, 30, ("b",))],
                 id="equal growth (5 B) in both lanes: the lowest lane id wins"),
    pytest.param(100, [("admit", "a", 10, 30), ("admit", "b", 10, 45)], ("c", 5, 5),
                 Admitted("c", 0, False), [(0, 45, ("a", "c")), (1, 55, ("b",))],
                 id="a growth of exactly the free bytes (5 B) fits"),
    pytest.param(100, [("admit", "a", 50, 50)], ("b", 1, 1),
                 Queued("b", "needs 2 B (P 1 B + E 1 B); 0 B free; sharing a lane needs 1 B"), [(0, 100, ("a",))],
                 id="full arena: queued with the numbers"),
    pytest.param(100, [("admit", "a", 10, 30), ("admit", "b", 20, 30)], ("c", 10, 35),
                 Queued("c", "needs 45 B (P 10 B + E 35 B); 10 B free; sharing a lane needs 15 B"),
                 [(0, 40, ("a",)), (1, 50, ("b",))],
                 id="neither a lane nor any growth fits: queued, saying how close sharing comes"),
    pytest.param(100, [("admit", "a", 50, 40), ("admit", "b", 20, 20)], ("c", 2, 3),
                 Queued("c", "needs 5 B (P 2 B + E 3 B); 10 B free, 1 job ahead in queue"),
                 [(0, 90, ("a",))], id="fits the 10 B free but b arrived first: queued behind it"),
]


@pytest.mark.parametrize("capacity, setup, job, expected, after", PLACEMENT)
def test_placement(capacity, setup, job, expected, after):
    arena = build(capacity, setup)
    assert arena.admit(*job) == expected
    assert layout(arena) == after
    assert arena.committed == sum(size for _, size, _ in after) and arena.free == capacity - arena.committed
    arena.check()


def test_queued_reason_in_gibibytes():
    arena = build(16 * GiB, [("admit", "a", 5 * GiB, 5 * GiB)])
    assert arena.admit("big", 7 * GiB, 0) == Queued("big", "needs 7.0 GiB (P 7.0 GiB + E 0 B); 6.0 GiB free")
    assert isinstance(arena.admit("small", 1, 1), Queued)  # 2 B would fit, but "big" is ahead
    assert arena.admit(3, 2 * GiB, int(7.1 * GiB), name="mlp-3") == Queued(
        3, "needs 9.1 GiB (P 2.0 GiB + E 7.1 GiB); 6.0 GiB free, 2 jobs ahead in queue")
    assert arena.queue == ("big", "small", 3)


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
        Queued("b", "needs 60 B (P 30 B + E 30 B); 20 B free; sharing a lane needs 30 B"),
        Queued("c", "needs 10 B (P 5 B + E 5 B); 20 B free, 1 job ahead in queue"),
        Queued("d", "needs 20 B (P 10 B + E 10 B); 20 B free, 2 jobs ahead in queue")]
    assert arena.queue == ("b", "c", "d")
    assert arena.release("a") == [Admitted("b", 1, True), Admitted("c", 2, True), Admitted("d", 3, True)]
    assert layout(arena) == [(1, 60, ("b",)), (2, 10, ("c",)), (3, 20, ("d",))]
    assert arena.queue == () and arena.lane_of("a") is None and arena.free == 10
    arena.check()


def test_the_queue_is_strict_fifo_a_large_head_is_not_overtaken():
    arena = build(100, [("admit", "a", 30, 30), ("admit", "x", 10, 10),
                        ("admit", "b", 40, 40), ("admit", "c", 5, 5)])
    assert arena.queue == ("b", "c")
    assert arena.release("x") == []  # 40 B free: c would fit, but b (80 B) came first
    assert arena.retry() == []
    assert arena.queue == ("b", "c") and layout(arena) == [(0, 60, ("a",))]
    assert arena.release("a") == [Admitted("b", 2, True), Admitted("c", 3, True)]
    assert layout(arena) == [(2, 80, ("b",)), (3, 10, ("c",))]


def test_releasing_the_queue_head_lets_the_next_in():
    arena = build(100, [("admit", "a", 30, 30), ("admit", "b", 40, 40), ("admit", "c", 5, 5)])
    assert arena.footprint("b") == (40, 40) and arena.lane_of("b") is None
    assert arena.release("b") == [Admitted("c", 1, True)]
    assert arena.queue == ()
    with pytest.raises(KeyError, match="'b' is neither admitted nor queued"):
        arena.footprint("b")


def test_release_shrinks_the_lane_E_to_its_remaining_members():
    arena = build(100, [("admit", "big", 10, 50), ("admit", "f", 10, 20)])
    assert arena.admit("b", 10, 30) == Admitted("b", 0, False)  # 10 B free: joins big's E
    assert arena.lanes()[0] == LaneInfo(0, 70, 50, 20, ("big", "b"))
    arena.release("big")
    assert arena.lanes() == (LaneInfo(0, 40, 30, 10, ("b",)), LaneInfo(1, 30, 20, 10, ("f",)))
    assert arena.committed == 70 and arena.free == 30
    arena.check()


def test_a_shrinking_lane_admits_from_the_queue():
    arena = build(100, [("admit", "big", 10, 50), ("admit", "f", 10, 20), ("admit", "b", 10, 30),
                        ("admit", "q", 10, 20)])
    assert arena.queue == ("q",) and arena.free == 0
    assert arena.release("big") == [Admitted("q", 2, True)]  # lane 0 drops 10 B of P + 20 B of E
    assert layout(arena) == [(0, 40, ("b",)), (1, 30, ("f",)), (2, 30, ("q",))]
    arena.check()


def test_a_lane_is_freed_when_its_last_job_leaves_and_ids_are_not_reused():
    arena = Arena(100)
    arena.admit("a", 10, 10)
    arena.release("a")
    assert arena.lanes() == () and arena.committed == 0
    assert arena.admit("b", 10, 10) == Admitted("b", 1, True)


# Lane 0 = a (10 + 15); lane 1 = (z 10 + 40, b 10 + 20): 0 B of 85 free.
SHARED = [("admit", "a", 10, 15), ("admit", "z", 10, 40), ("admit", "b", 10, 20)]


def test_swap_out_drops_P_and_shrinks_E_then_swap_in_restores_them():
    arena = build(85, SHARED)
    assert arena.lanes()[1] == LaneInfo(1, 60, 40, 20, ("z", "b")) and arena.free == 0
    arena.swap_out("z")
    assert arena.lanes()[1] == LaneInfo(1, 30, 20, 10, ("z", "b"), swapped=("z",))
    assert arena.lane_of("z") == 1 and arena.committed == 55
    arena.swap_out("z")  # again: no-op
    assert arena.committed == 55
    assert arena.swap_in("z") is True  # growth 10 B of P + 20 B more of E = the 30 B free
    assert arena.lanes()[1] == LaneInfo(1, 60, 40, 20, ("z", "b"))
    assert arena.swap_in("z") is True  # resident already
    arena.check()


def test_swap_in_waits_until_its_lane_growth_fits():
    arena = build(85, SHARED)
    arena.swap_out("z")
    assert arena.admit("c", 5, 20) == Admitted("c", 2, True)  # takes 25 of the 30 B z left
    before = arena.lanes()
    assert arena.swap_in("z") is False  # needs 30 B, 5 B free
    assert arena.lanes() == before and arena.committed == 80
    arena.release("c")
    assert arena.swap_in("z") is True
    assert layout(arena) == [(0, 25, ("a",)), (1, 60, ("z", "b"))]
    arena.check()


def test_swap_out_leaves_the_queue_to_retry():
    arena = build(85, SHARED + [("admit", "q", 15, 15)])
    arena.swap_out("a")
    assert arena.queue == ("q",) and arena.free == 25  # the runtime calls retry at a step boundary
    assert arena.retry() == [Admitted("q", 1, False)]  # growth 15 B into lane 1 (E 40 covers 15)
    assert arena.swap_in("a") is False  # 10 B free: a's lane needs 25 B again
    arena.check()


def test_a_lane_with_every_job_swapped_out_holds_nothing():
    arena = build(100, [("admit", "a", 10, 10), ("admit", "b", 10, 10)])
    arena.swap_out("a")
    assert arena.lanes()[0] == LaneInfo(0, 0, 0, 0, ("a",), swapped=("a",))
    assert arena.committed == 20 and arena.free == 80
    assert arena.admit("c", 40, 40) == Admitted("c", 2, True)  # uses the bytes a gave back
    assert arena.swap_in("a") is False
    arena.release("c")
    assert arena.swap_in("a") is True and arena.lanes()[0] == LaneInfo(0, 20, 10, 10, ("a",))
    arena.check()


def test_a_queued_job_may_join_a_lane_whose_members_are_all_swapped_out():
    arena = build(100, [("admit", "a", 30, 30), ("admit", "b", 40, 0)], max_lanes=2)
    arena.swap_out("a")
    # At max_lanes: joining either lane grows it by 30 B (lane 1 has no E), the lowest id wins.
    assert arena.admit("c", 10, 20) == Admitted("c", 0, False)
    assert arena.lanes()[0] == LaneInfo(0, 30, 20, 10, ("a", "c"), swapped=("a",))
    assert arena.swap_in("a") is False  # growth 30 + (30 - 20) = 40 B > 30 B free
    arena.check()


def test_max_lanes_makes_jobs_share_lanes_and_queues_past_it():
    arena = Arena(1000, max_lanes=1)
    assert arena.admit("a", 100, 200) == Admitted("a", 0, True)
    # Room for a second lane, but the cap says share: b joins lane 0 (grows by P only).
    assert arena.admit("b", 100, 150) == Admitted("b", 0, False)
    assert layout(arena) == [(0, 400, ("a", "b"))]
    # c needs 900 B > 600 B free; joining lane 0 needs 400 + (500 - 200) = 700 B: queued.
    assert arena.admit("c", 400, 500) == Queued(
        "c", "needs 900 B (P 400 B + E 500 B); 600 B free; sharing a lane needs 700 B")
    # d fits by bytes (P + E = 600 B): at the cap it still gets in, by sharing (growth 400 B).
    arena.release("c")
    assert arena.admit("d", 300, 300) == Admitted("d", 0, False)
    assert layout(arena) == [(0, 800, ("a", "b", "d"))]
    arena.check()


def test_max_lanes_must_be_positive():
    with pytest.raises(ValueError, match=re.escape("max_lanes=0 must be an int >= 1, or None for no limit")):
        Arena(100, max_lanes=0)


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
    with pytest.raises(ValueError, match="job 'q' is queued, not admitted: there is nothing to swap out"):
        arena.swap_out("q")
    with pytest.raises(ValueError, match="job 'q' is queued, not admitted: there is nothing to swap in"):
        arena.swap_in("q")
    assert arena.queue == ("q",) and arena.lane_of("nope") is None
    arena.check()


def test_check_catches_a_broken_invariant():
    arena = build(100, [("admit", "a", 10, 10), ("admit", "b", 10, 10)])
    arena._lanes[1].ephemeral = 15
    with pytest.raises(AssertionError, match=re.escape("lane 1 reserves P 10 + E 15, its resident jobs need P 10 + E 10")):
        arena.check()
    arena._lanes[1].ephemeral = 10
    arena._committed += 1
    with pytest.raises(AssertionError, match="committed 41 B, lanes reserve 40 B"):
        arena.check()
    arena._committed -= 1
    arena._jobs["a"].persistent = 95  # as if it had been admitted with more than the arena holds
    arena._lanes[0].persistent = 95
    arena._committed += 85
    with pytest.raises(AssertionError, match="125 B committed > capacity 100 B"):
        arena.check()
