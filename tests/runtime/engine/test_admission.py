"""Admission on the real (pure) arena with hand-made jobs: place, queue, refuse, swap."""

from __future__ import annotations

import pytest

from xshare.runtime.engine.states import JobState

from . import fakes
from .engine import Parts

S = JobState


def test_a_job_that_fits_is_placed_on_a_lane_and_starts_running():
    parts = Parts(capacity_mib=4)
    a = fakes.job("a")
    parts.submit(a)
    assert a.state is S.RUNNING and a.lane == 0 and a.in_ledger
    assert parts.placer.put_calls == [("a", 0)] and a.arrays == ["a-state"]
    assert parts.units.running == {a.id: a} and parts.units.changed
    assert parts.started == ["a"] and a.started_s == 1.0 and a.queue_wait_s == 1.0
    assert parts.recorder.said("a") == ["compiled: " + a.footprint.describe() + "; lane 0"]
    assert parts.admission.peak_in_flight_bytes == a.footprint.total


def test_a_job_larger_than_the_arena_is_refused_with_its_size_and_the_fix_and_takes_nothing():
    parts = Parts(capacity_mib=1)
    big, small = fakes.job("big", mib=4), fakes.job("small", mib=0)
    small.footprint = type(small.footprint)(persistent=1000, ephemeral=1000)
    parts.submit(big, small)
    assert big.state is S.FAILED and not big.in_ledger
    assert "job 'big' needs 6.0 MiB" in big.error and "a test arena" in big.error
    assert "lower its batch size or model size, or give the runtime more memory (--memory)" in big.error
    assert type(big.exception).__name__ == "AdmissionError"
    assert small.state is S.RUNNING  # one job's refusal takes down no other
    assert parts.ended == [("big", "failed")] and parts.ledger() == {small.id}


def test_a_job_that_does_not_fit_now_queues_and_is_placed_when_memory_comes_back():
    parts = Parts(capacity_mib=2)
    a, b = fakes.job("a"), fakes.job("b")
    parts.submit(a, b)
    assert (a.state, b.state) == (S.RUNNING, S.QUEUED) and b.in_ledger and b.arrays is None
    assert parts.recorder.said("b")[0].startswith("compiled: ") and "queued: " in parts.recorder.said("b")[0]
    a.steps_done = a.dispatched = 10
    parts.life.settle(a)  # it ran all its steps: it finishes and gives its lane to b
    assert a.state is S.DONE and a.host_state == {"leaves": ["a-state"]}
    assert b.state is S.RUNNING and parts.placer.put_calls == [("a", 0), ("b", 1)]  # (lane ids only grow)
    assert parts.ledger() == {b.id} and set(parts.units.running) == {b.id}


def test_a_job_whose_state_cannot_be_placed_fails_and_gives_its_reservation_back():
    parts = Parts(capacity_mib=2, broken=("a",))
    a, b = fakes.job("a"), fakes.job("b")
    parts.submit(a, b)
    assert a.state is S.FAILED
    assert a.error.startswith("could not place its state on FakeDevice(0): RuntimeError: RESOURCE_EXHAUSTED")
    assert b.state is S.RUNNING and parts.ledger() == {b.id}


def test_a_job_that_must_compile_its_solo_program_and_cannot_fails_alone():
    class Program:
        def with_staging(self, n):
            raise KeyError("no such leaf")

    parts = Parts(capacity_mib=4)
    a = fakes.job("a")
    a.footprint, a.program = None, Program()
    parts.submit(a)
    assert a.state is S.FAILED and a.error.startswith("could not compile its step: KeyError")
    assert parts.ledger() == set()


def test_a_paused_job_swapped_to_the_host_gives_its_bytes_to_the_queue_and_comes_back_when_there_is_room():
    parts = Parts(capacity_mib=2)
    a, b = fakes.job("a"), fakes.job("b")
    parts.submit(a, b)
    a.state = S.PAUSED
    parts.units.stop(a)
    parts.admission.swap_out(a)
    assert a.state is S.SWAPPED and a.host_arrays == ["a-state"] and a.arrays is None
    assert b.state is S.RUNNING  # a's bytes went to the queue
    a.state = S.SWAPPED
    parts.admission.swap_in(a)  # resumed, but b holds the memory now: it waits
    assert a.state is S.QUEUED and parts.admission.swap_waiting == [a]
    b.dispatched = 10
    parts.life.settle(b)
    assert b.state is S.DONE
    assert a.state is S.RUNNING and a.arrays == ["a-state"] and parts.admission.swap_waiting == []
    assert parts.recorder.said("a")[-1] == "state offloaded to host memory"


def test_a_queued_job_paused_leaves_the_queue_and_one_that_ends_is_never_brought_back():
    parts = Parts(capacity_mib=2)
    a, b, c = fakes.job("a"), fakes.job("b"), fakes.job("c")
    parts.submit(a, b, c)
    assert parts.arena.queue == (b.id, c.id)
    parts.admission.unqueue(b)
    assert parts.arena.queue == (c.id,) and not b.in_ledger
    a.state = S.PAUSED
    parts.units.stop(a)
    parts.admission.swap_out(a)
    assert c.state is S.RUNNING
    a.state = S.SWAPPED
    parts.admission.swap_in(a)
    assert parts.admission.swap_waiting == [a]
    parts.life.end(a, parts_cancel())
    assert a.state is S.CANCELLED and parts.admission.swap_waiting == [] and a.id not in parts.ledger()


def test_a_job_joining_a_group_never_touches_the_ledger():
    parts = Parts(capacity_mib=4, join=lambda job: True)
    a = fakes.job("a")
    parts.submit(a)
    assert not a.in_ledger and parts.ledger() == set() and parts.placer.put_calls == []


def parts_cancel():
    from xshare.runtime.engine.states import Event
    return Event.CANCEL


@pytest.mark.parametrize("mib", [1, 3])
def test_the_peak_counts_each_lanes_largest_ephemeral_once(mib):
    # room for a alone plus b's persistent bytes: b joins a's lane and shares its ephemeral bytes
    parts = Parts(capacity_mib=1.5 * mib + 1)
    a, b = fakes.job("a", mib=mib), fakes.job("b", mib=1)
    parts.submit(a, b)
    assert a.lane == b.lane == 0 and b.state is S.RUNNING
    fa, fb = a.footprint, b.footprint
    assert parts.admission.peak_in_flight_bytes == fa.resident + fb.resident + max(fa.ephemeral, fb.ephemeral)
