"""Arena.resize: a fused group's reservation grows or shrinks in place at a step boundary."""

from __future__ import annotations

import pytest

from xshare.memory import Admitted, Arena


def test_resize_grows_when_free_allows_and_refuses_without_changing_anything_otherwise():
    arena = Arena(100)
    assert isinstance(arena.admit("g", 20, 10), Admitted)
    assert arena.resize("g", 40, 20)            # 60 <= 100
    assert arena.committed == 60 and arena.footprint("g") == (40, 20)
    assert not arena.resize("g", 80, 30)        # 110 > 100: refused
    assert arena.committed == 60 and arena.footprint("g") == (40, 20)
    arena.check()


def test_resize_shrink_always_fits_and_frees_bytes_for_the_queue():
    arena = Arena(100)
    arena.admit("g", 60, 30)
    assert not isinstance(arena.admit("q", 30, 10), Admitted)   # queued: 40 > 10 free
    assert arena.resize("g", 30, 20)
    assert arena.retry() and arena.lane_of("q") is not None
    arena.check()


def test_resize_counts_a_shared_lane_ephemeral_once():
    arena = Arena(100, max_lanes=1)
    arena.admit("a", 10, 40)
    arena.admit("g", 10, 20)                    # joins a's lane: E stays 40
    assert arena.committed == 60
    assert arena.resize("g", 20, 50)            # lane E becomes 50
    assert arena.committed == 80
    arena.check()


def test_resize_of_a_queued_or_unknown_job_is_refused_clearly():
    arena = Arena(10)
    arena.admit("a", 8, 1)
    arena.admit("q", 5, 1)
    with pytest.raises(ValueError, match="queued, not admitted: there is nothing to resize"):
        arena.resize("q", 1, 1)
    with pytest.raises(KeyError, match="neither admitted nor queued"):
        arena.resize("nope", 1, 1)
    with pytest.raises(ValueError, match="not both zero"):
        arena.resize("a", 0, 0)
