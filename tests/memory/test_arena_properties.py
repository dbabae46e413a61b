"""Property tests: random arrivals, departures, steps, swaps and defragmentations.

The machine keeps its own model (footprints, lanes from the answers, arrival order, steps in
flight, swapped jobs) and checks the arena against it, independently of ``Arena.check``.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from xshare._errors import AdmissionError
from xshare.memory import Admitted, Arena, Queued
from xshare.memory.lanes import Block, compact, gaps, moved, room_after

SIZES = st.integers(0, 70)


class ArenaMachine(RuleBasedStateMachine):
    @initialize(capacity=st.integers(20, 150))
    def start(self, capacity):
        self.arena = Arena(capacity)
        self.fp = {}  # job -> (P, E), admitted or queued
        self.lane = {}  # admitted job -> lane id
        self.queue = []  # arrival order
        self.in_flight = set()
        self.swapped = set()
        self.next_id = 0

    # -------------------------------------------------------------- helpers

    def resident(self):
        return sorted(j for j in self.lane if j not in self.swapped)

    def call(self, fn, *args, **kwargs):
        """Run an arena call; lanes holding a job with a step in flight must not move."""
        kwargs.setdefault("in_flight", frozenset(self.in_flight))
        pinned = {self.lane[j] for j in self.in_flight}
        before = {lane.id: lane.offset for lane in self.arena.lanes() if lane.id in pinned}
        result = fn(*args, **kwargs)
        after = {lane.id: lane.offset for lane in self.arena.lanes() if lane.id in pinned}
        assert after == before, f"a lane with a step in flight moved: {before} -> {after}"
        return result

    def took_from_queue(self, admitted):
        """Jobs admitted from the queue come from its head, in arrival order."""
        assert [a.job_id for a in admitted] == self.queue[:len(admitted)]
        for a in admitted:
            self.lane[a.job_id] = a.lane_id
        del self.queue[:len(admitted)]

    def assert_cannot_fit(self, need, growth):
        """With nothing in flight every lane may move, so a job waits only if neither a new
        lane (``need``) nor growing any lane holding bytes (``growth(lane)``) fits in the free space."""
        free = self.arena.free
        assert need > free, f"{need} B waits with {free} B free and nothing in flight"
        for lane in self.arena.lanes():
            if lane.size:
                assert growth(lane) > free, f"lane {lane.id} could grow by {growth(lane)} B into {free} B"

    def assert_head_waits_for_a_reason(self):
        if self.queue and not self.in_flight:
            p, e = self.fp[self.queue[0]]
            self.assert_cannot_fit(p + e, lambda lane: p + max(0, e - lane.ephemeral))

    # -------------------------------------------------------------- rules

    @rule(p=SIZES, e=SIZES)
    def admit(self, p, e):
        if p + e == 0:
            return
        job, self.next_id = self.next_id, self.next_id + 1
        if p + e > self.arena.capacity:
            with pytest.raises(AdmissionError):
                self.arena.admit(job, p, e)
            return
        queued_before = bool(self.queue)
        result = self.call(self.arena.admit, job, p, e)
        self.fp[job] = (p, e)
        if isinstance(result, Admitted):
            assert not queued_before, "a newcomer overtook the queue"
            self.lane[job] = result.lane_id
        else:
            assert isinstance(result, Queued) and result.job_id == job
            self.queue.append(job)
            if not queued_before:
                self.assert_head_waits_for_a_reason()

    @precondition(lambda self: any(j not in self.in_flight for j in self.fp))
    @rule(data=st.data())
    def release(self, data):
        job = data.draw(st.sampled_from(sorted(j for j in self.fp if j not in self.in_flight)))
        admitted = self.call(self.arena.release, job)
        del self.fp[job]
        self.lane.pop(job, None)
        self.swapped.discard(job)
        if job in self.queue:
            self.queue.remove(job)
        self.took_from_queue(admitted)
        self.assert_head_waits_for_a_reason()

    @rule()
    def retry(self):
        self.took_from_queue(self.call(self.arena.retry))
        self.assert_head_waits_for_a_reason()

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def step_begin(self, data):
        busy = {self.lane[j] for j in self.in_flight}
        idle = [j for j in self.resident() if j not in self.in_flight and self.lane[j] not in busy]
        if idle:  # at most one step in flight per lane
            self.in_flight.add(data.draw(st.sampled_from(idle)))

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def step_end(self, data):
        self.in_flight.discard(data.draw(st.sampled_from(sorted(self.in_flight))))

    @precondition(lambda self: any(j not in self.in_flight for j in self.resident()))
    @rule(data=st.data())
    def swap_out(self, data):
        job = data.draw(st.sampled_from([j for j in self.resident() if j not in self.in_flight]))
        self.arena.swap_out(job)
        self.swapped.add(job)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        job = data.draw(st.sampled_from(sorted(self.swapped)))
        before = self.arena.lanes()
        if self.call(self.arena.swap_in, job):
            self.swapped.discard(job)
            return
        assert self.arena.lanes() == before, "a failed swap_in changed the layout"
        if not self.in_flight:
            p, e = self.fp[job]
            lane = next(lane for lane in before if lane.id == self.lane[job])
            need = p + max(0, e - lane.ephemeral)
            assert need > self.arena.free, f"swap_in of {need} B failed with {self.arena.free} B free"

    @rule()
    def defragment(self):
        before = {lane.id: lane.offset for lane in self.arena.lanes()}
        moves = self.call(self.arena.defragment)
        after = {lane.id: lane.offset for lane in self.arena.lanes()}
        assert {m.lane_id: (m.old_offset, m.new_offset) for m in moves} == {
            i: (before[i], after[i]) for i in after if before[i] != after[i]}
        # Compact: every movable lane starts at 0 or right where the lane before it ends.
        pinned = {self.lane[j] for j in self.in_flight}
        end = 0
        for lane in self.arena.lanes():
            if lane.size:
                assert lane.id in pinned or lane.offset == end, f"lane {lane.id} left a gap before it"
                end = lane.offset + lane.size

    # -------------------------------------------------------------- invariants

    @invariant()
    def consistent(self):
        arena = self.arena
        arena.check()
        lanes = arena.lanes()
        assert [lane.offset for lane in lanes] == sorted(lane.offset for lane in lanes)
        members = {}
        for lane in lanes:
            resident = [j for j in lane.jobs if j not in self.swapped]
            assert lane.size == sum(self.fp[j][0] for j in resident) + max(
                (self.fp[j][1] for j in resident), default=0)
            assert set(lane.swapped) == set(lane.jobs) & self.swapped
            assert 0 <= lane.offset and lane.offset + lane.size <= arena.capacity
            members.update(dict.fromkeys(lane.jobs, lane.id))
        assert members == self.lane
        held = sorted((lane.offset, lane.offset + lane.size) for lane in lanes if lane.size)
        assert all(a[1] <= b[0] for a, b in zip(held, held[1:])), f"lanes overlap: {held}"
        assert arena.committed == sum(lane.size for lane in lanes) <= arena.capacity
        assert arena.queue == tuple(self.queue)
        for j in self.queue:
            assert arena.lane_of(j) is None and arena.footprint(j) == self.fp[j]

    def teardown(self):
        """Every job that fits alone runs: release admitted jobs one by one until none is left;
        each release admits from the queue, so the queue must drain completely."""
        if not hasattr(self, "arena"):
            return
        self.in_flight.clear()
        while self.lane:
            self.release_job(min(self.lane))
        assert self.arena.queue == (), f"jobs {self.arena.queue} never ran"
        assert self.arena.lanes() == () and self.arena.committed == 0

    def release_job(self, job):
        admitted = self.arena.release(job)
        del self.fp[job]
        del self.lane[job]
        self.swapped.discard(job)
        self.took_from_queue(admitted)
        self.assert_head_waits_for_a_reason()
        self.consistent()


ArenaMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestArena = ArenaMachine.TestCase


LAYOUTS = st.lists(st.tuples(st.integers(0, 10), st.integers(1, 20), st.booleans()), max_size=8)


@settings(max_examples=200, deadline=None)
@given(layout=LAYOUTS, tail=st.integers(0, 10), data=st.data())
def test_compaction_plans(layout, tail, data):
    """Plans keep the order, keep pinned blocks put, and gather each segment's free space in
    one piece: at the segment's end, or right after ``toward``."""
    blocks, pinned, cursor = [], set(), 0
    for i, (gap, size, pin) in enumerate(layout):
        blocks.append(Block(i, cursor + gap, size))
        cursor += gap + size
        if pin:
            pinned.add(i)
    capacity = cursor + tail
    toward = data.draw(st.none() | st.sampled_from(range(len(blocks))) if blocks else st.none())
    plan = compact(blocks, capacity, pinned, toward)
    new = moved(blocks, plan)
    assert all(a.end <= b.offset for a, b in zip(new, new[1:])) and (not new or new[-1].end <= capacity)
    assert all(plan[i] == blocks[i].offset for i in pinned)
    # Segments between pinned blocks: their free bytes sit in one gap.
    bounds = [0] + [x for i in sorted(pinned) for x in (blocks[i].offset, blocks[i].end)] + [capacity]
    for start, end in zip(bounds[::2], bounds[1::2]):
        inside = [b for b in new if b.id not in pinned and start <= b.offset < end]
        free = end - start - sum(b.size for b in inside)
        holes = [h for h in gaps(new, capacity) if start <= h[0] < end]
        assert sum(length for _, length in holes) == free and len(holes) <= 1
        if holes and toward is None:
            assert holes[0][0] + free == end, "compaction toward 0 leaves the free space at the end"
    if toward is not None:
        segment_end = next((blocks[i].offset for i in sorted(pinned) if blocks[i].offset >= blocks[toward].end
                            and i != toward), capacity)
        assert room_after(new, capacity, toward) == segment_end - new[toward].end - sum(
            b.size for b in new if b.id not in pinned and b.offset >= new[toward].end and b.offset < segment_end)
