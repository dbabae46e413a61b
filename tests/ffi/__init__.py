"""Tests of the XLA FFI fences (xshare.ffi). Shared pieces below."""

from __future__ import annotations

from typing import Iterator

import pytest

from xshare import ffi

# jit's note when a donated input cannot be reused in place: expected of the fenced steps on CPU
IGNORE_DONATION_WARNING = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")


def needs_ffi() -> pytest.MarkDecorator:
    """Skip a module where the fences are unavailable (and say why); calling it checks, once per module."""
    return pytest.mark.skipif(not ffi.available(), reason=f"{ffi.unavailable_reason()}")


def ring_for(capacity: int, *, the_test_may_close_it: bool = False) -> Iterator[int]:
    """A fixture's ring of ``capacity`` records, closed after the test (a generator to yield
    from). ``the_test_may_close_it``: a ring the test closed itself is not an error."""
    r = ffi.open_ring(capacity)
    yield r
    try:
        ffi.close_ring(r)
    except ValueError:
        if not the_test_may_close_it:
            raise
