"""Property tests: random arrivals, departures, retries, swaps and resizes against the ledger.

The machine keeps its own model (footprints, lanes from the answers, arrival order, swapped
jobs) and predicts every placement from it, independently of ``Arena.check``.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from xshare._errors import AdmissionError
from xshare.memory import Admitted, Arena, Queued

SIZES = st.integers(0, 70)


class ArenaMachine(RuleBasedStateMachine):
    @initialize(capacity=st.integers(20, 150), max_lanes=st.none() | st.integers(1, 4))
    def start(self, capacity, max_lanes):
        self.arena = Arena(capacity, max_lanes=max_lanes)
        self.fp = {}  # job -> (P, E), admitted or queued
        self.lane = {}  # admitted job -> lane id
        self.queue = []  # arrival order
        self.swapped = set()
        self.next_id = 0

    # -------------------------------------------------------------- the model

    def lane_e(self, lane_id):
        return max((self.fp[j][1] for j, ln in self.lane.items() if ln == lane_id and j not in self.swapped),
                   default=0)

    def growth(self, job, lane_id):
        p, e = self.fp[job]
        return p + max(0, e - self.lane_e(lane_id))

    def free(self):
        """Free bytes by the model: capacity - resident P - each lane's largest resident E."""
        resident_p = sum(self.fp[j][0] for j in self.lane if j not in self.swapped)
        return self.arena.capacity - resident_p - sum(map(self.lane_e, set(self.lane.values())))

    def expected_place(self, job):
        """What DESIGN's placement rule says for ``job`` in the model's state: ("new", None),
        ("join", lane) or None (queue)."""
        lanes, free = sorted(set(self.lane.values())), self.free()
        max_lanes = self.arena.max_lanes
        if (max_lanes is None or len(lanes) < max_lanes) and sum(self.fp[job]) <= free:
            return ("new", None)
        fits = [(self.growth(job, ln), ln) for ln in lanes if self.growth(job, ln) <= free]
        return ("join", min(fits)[1]) if fits else None

    def took_from_queue(self, admitted):
        """Jobs admitted from the queue come from its head, in arrival order, each placed by the rule."""
        assert [a.job_id for a in admitted] == self.queue[:len(admitted)]
        for a in admitted:
            self.record(a, self.expected_place(a.job_id))
        del self.queue[:len(admitted)]
        if self.queue:
            assert self.expected_place(self.queue[0]) is None, "the queue head fits but was left waiting"

    def record(self, result, expected):
        kind, lane = expected
        assert result.new_lane == (kind == "new"), f"{result} but the rule says {expected}"
        if kind == "new":
            assert result.lane_id not in self.lane.values(), f"new lane {result.lane_id} reuses an id"
        else:
            assert result.lane_id == lane, f"{result} but the best fit is lane {lane}"
        self.lane[result.job_id] = result.lane_id

    def forget(self, job):
        del self.fp[job]
        self.lane.pop(job, None)
        self.swapped.discard(job)
        if job in self.queue:
            self.queue.remove(job)

    # -------------------------------------------------------------- rules

    @rule(p=SIZES, e=SIZES)
    def admit(self, p, e):
        job, self.next_id = self.next_id, self.next_id + 1
        if p + e == 0:
            with pytest.raises(ValueError, match="zero footprint"):
                self.arena.admit(job, p, e)
            return
        if p + e > self.arena.capacity:
            with pytest.raises(AdmissionError):
                self.arena.admit(job, p, e)
            return
        self.fp[job] = (p, e)
        expected = None if self.queue else self.expected_place(job)
        fits_by_bytes = p + e <= self.arena.free
        result = self.arena.admit(job, p, e)
        if fits_by_bytes and not self.queue:
            assert isinstance(result, Admitted), f"fits by bytes with an empty queue, yet {result}"
        if expected is None:
            assert result == Queued(job, result.reason), f"{result} but the rule says queue"
            assert result.reason.startswith(f"needs {p + e} B (P {p} B + E {e} B); {self.arena.free} B free")
            self.queue.append(job)
        else:
            assert isinstance(result, Admitted), f"{result} but the rule says {expected}"
            self.record(result, expected)

    @precondition(lambda self: self.fp)
    @rule(data=st.data())
    def release(self, data):
        job = data.draw(st.sampled_from(sorted(self.fp)))
        admitted = self.arena.release(job)
        self.forget(job)
        self.took_from_queue(admitted)

    @rule()
    def retry(self):
        self.took_from_queue(self.arena.retry())

    @precondition(lambda self: self.lane)
    @rule(data=st.data())
    def swap_out(self, data):
        job = data.draw(st.sampled_from(sorted(self.lane)))
        free = self.arena.free
        self.arena.swap_out(job)  # twice is a no-op: it may be drawn while swapped already
        if job not in self.swapped:
            self.swapped.add(job)
            # Its P goes, and the lane's E shrinks to its other residents' largest.
            assert self.arena.free - free == self.growth(job, self.lane[job])
        else:
            assert self.arena.free == free

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        job = data.draw(st.sampled_from(sorted(self.swapped)))
        growth, free, before = self.growth(job, self.lane[job]), self.arena.free, self.arena.lanes()
        if self.arena.swap_in(job):
            assert growth <= free and self.arena.free == free - growth
            self.swapped.discard(job)
        else:
            assert growth > free, f"swap_in of {growth} B refused with {free} B free"
            assert self.arena.lanes() == before, "a refused swap_in changed the ledger"

    @precondition(lambda self: self.lane)
    @rule(data=st.data(), p=SIZES, e=SIZES)
    def resize(self, data, p, e):
        """A fused group's footprint changes in place: accepted iff its lane's growth fits."""
        job = data.draw(st.sampled_from(sorted(self.lane)))
        if p + e == 0:
            with pytest.raises(ValueError, match="not both zero"):
                self.arena.resize(job, p, e)
            return
        old, free, lane = self.fp[job], self.free(), self.lane[job]
        before = self.lane_size(lane)
        self.fp[job] = (p, e)
        fits = self.lane_size(lane) - before <= free and p + e <= self.arena.capacity
        assert self.arena.resize(job, p, e) is fits
        if not fits:
            self.fp[job] = old

    def lane_size(self, lane_id):
        resident = [j for j, ln in self.lane.items() if ln == lane_id and j not in self.swapped]
        return sum(self.fp[j][0] for j in resident) + self.lane_e(lane_id)

    @precondition(lambda self: self.queue)
    @rule(data=st.data())
    def liveness(self, data):
        """A queued job is admitted once enough is released: release everything else (on a copy,
        in a random order) and it must be in a lane."""
        job = data.draw(st.sampled_from(self.queue))
        arena = copy.deepcopy(self.arena)
        others = data.draw(st.permutations([j for j in self.fp if j != job]))
        for other in others:
            arena.release(other)
            arena.check()
        assert arena.lane_of(job) is not None and arena.queue == ()

    # -------------------------------------------------------------- invariants

    @invariant()
    def consistent(self):
        arena = self.arena
        arena.check()
        lanes = arena.lanes()
        assert [lane.id for lane in lanes] == sorted(set(self.lane.values()))
        seen = [j for lane in lanes for j in lane.jobs]
        assert sorted(seen) == sorted(self.lane), "an admitted job is not in exactly one lane"
        for lane in lanes:
            resident = [j for j in lane.jobs if j not in self.swapped]
            assert lane.persistent == sum(self.fp[j][0] for j in resident)
            assert lane.ephemeral == max((self.fp[j][1] for j in resident), default=0)
            assert lane.size == lane.persistent + lane.ephemeral
            assert set(lane.swapped) == set(lane.jobs) & self.swapped
            assert all(self.lane[j] == lane.id and arena.lane_of(j) == lane.id for j in lane.jobs)
        resident_p = sum(p for j, (p, _) in self.fp.items() if j in self.lane and j not in self.swapped)
        assert arena.committed == resident_p + sum(lane.ephemeral for lane in lanes) <= arena.capacity
        assert arena.free == arena.capacity - arena.committed == self.free()
        assert arena.max_lanes is None or len(lanes) <= arena.max_lanes
        assert arena.queue == tuple(self.queue)
        for j in self.queue:
            assert arena.lane_of(j) is None and arena.footprint(j) == self.fp[j]

    def teardown(self):
        """Every job that fits alone runs: release admitted jobs one by one until none is left;
        each release admits from the queue, so the queue must drain completely."""
        if not hasattr(self, "arena"):
            return
        while self.lane:
            job = min(self.lane)
            admitted = self.arena.release(job)
            self.forget(job)
            self.took_from_queue(admitted)
            self.consistent()
        assert self.arena.queue == (), f"jobs {self.arena.queue} never ran"
        assert self.arena.lanes() == () and self.arena.committed == 0


ArenaMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestArena = ArenaMachine.TestCase
