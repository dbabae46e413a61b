"""The rings, the lane table and the clock, through the Python API (no XLA involved)."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xshare import ffi

from . import needs_ffi, ring_for

pytestmark = needs_ffi()


def _push(ring_id: int, n: int, job: int = 1, lane: int = 0, kind: int = 0) -> None:
    # The C entry point the CUDA stream callbacks use; records "now".
    for _ in range(n):
        assert ffi._state.lib.xshare_record(ring_id, job, lane, kind) == 0


@pytest.fixture
def ring():
    yield from ring_for(8, the_test_may_close_it=True)


def test_drain_is_oldest_first_and_clears(ring):
    _push(ring, 3, job=4, lane=2, kind=1)
    out = ffi.drain(ring)
    assert out.dtype == ffi.RECORD_DTYPE
    assert out.dtype.names == ("seq", "t_ns", "job", "lane", "kind")
    assert list(out["seq"]) == [0, 1, 2]
    assert (np.diff(out["t_ns"]) >= 0).all()
    assert set(out["job"]) == {4} and set(out["lane"]) == {2} and set(out["kind"]) == {1}
    assert len(ffi.drain(ring)) == 0
    _push(ring, 1)
    assert list(ffi.drain(ring)["seq"]) == [3]  # seq keeps counting across drains


@settings(max_examples=40, deadline=None)
@given(capacity=st.integers(1, 16), pushes=st.lists(st.integers(0, 40), min_size=1, max_size=4))
def test_overflow_drops_oldest_and_counts(capacity, pushes):
    r = ffi.open_ring(capacity)
    try:
        total, seen = 0, []
        for n in pushes:  # several push/drain rounds
            _push(r, n)
            total += n
            seen.append(ffi.drain(r))
        kept = np.concatenate(seen)["seq"]
        # every round keeps its newest min(n, capacity) records, in order, with no repeats
        assert (np.diff(kept.astype(np.int64)) > 0).all()
        assert len(kept) == sum(min(n, capacity) for n in pushes)
        assert ffi.dropped(r) == sum(max(0, n - capacity) for n in pushes)
        if total:
            assert kept[-1] == total - 1
    finally:
        ffi.close_ring(r)


def test_ring_ids_are_not_reused():
    a = ffi.open_ring(4)
    ffi.close_ring(a)
    b = ffi.open_ring(4)
    assert b != a
    ffi.close_ring(b)


def test_unknown_ring_is_a_clear_error():
    r = ffi.open_ring(4)
    ffi.close_ring(r)
    msg = f"unknown ring_id {r}: never opened with open_ring(), or closed"
    for call in (ffi.drain, ffi.dropped, ffi.close_ring):
        with pytest.raises(ValueError, match=re.escape(msg)):
            call(r)


def test_bad_arguments():
    with pytest.raises(ValueError, match=re.escape("capacity must be in [1, 2147483647], got 0")):
        ffi.open_ring(0)
    with pytest.raises(TypeError, match=re.escape("capacity must be an int (int32), got float 2.0")):
        ffi.open_ring(2.0)
    with pytest.raises(ValueError, match=re.escape("lane_id must be in [-1, 2147483647], got -2")):
        ffi.set_lane(1, -2)


def test_lane_table(ring):
    lib = ffi._state.lib
    ffi.set_lane(77, 3)
    try:
        _push(ring, 1, job=77, lane=-1)  # -1: look the lane up
        _push(ring, 1, job=77, lane=5)  # explicit lane wins
        _push(ring, 1, job=78, lane=-1)  # no entry: -1
        assert list(ffi.drain(ring)["lane"]) == [3, 5, -1]
        assert lib.xshare_get_lane(77) == 3
    finally:
        ffi.set_lane(77, -1)  # unset
    assert lib.xshare_get_lane(77) == -1


def test_now_ns_is_the_fences_clock(ring):
    # steady_clock is CLOCK_MONOTONIC on Linux: the same clock as time.monotonic_ns().
    t0 = ffi.now_ns()
    m0 = time.monotonic_ns()
    _push(ring, 1)
    t1 = ffi.now_ns()
    (rec,) = ffi.drain(ring)
    assert t0 <= rec["t_ns"] <= t1
    assert abs(m0 - t0) < 50_000_000
