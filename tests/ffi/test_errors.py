"""Malformed fence calls raise a clear Python exception, and the process carries on."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xshare import ffi

from . import needs_ffi, ring_for

pytestmark = needs_ffi()

F32x4 = jax.ShapeDtypeStruct((4,), jnp.float32)


@pytest.fixture
def ring():
    yield from ring_for(64, the_test_may_close_it=True)


def raw_begin(results, *args, ring_id, job_id=1, lane_id=-1, ident=None):
    """The custom call as a careless caller could write it, bypassing Python's checks: the
    operands, then the ident (last)."""
    if ident is None:
        ident = np.array([ring_id, job_id, lane_id], np.int32)
    return jax.jit(lambda *a: jax.ffi.ffi_call("xshare_fence_begin", results)(*a))(
        *args, ident)


def still_works(ring):
    # Plain jax work and a fenced step both still run after the error.
    assert float(jnp.sum(jnp.arange(4.0))) == 6.0
    out = jax.jit(lambda x: ffi.end(ffi.begin(x, ring_id=ring, job_id=9), ring_id=ring, job_id=9))(
        jnp.ones(3))
    assert np.array_equal(out, np.ones(3))
    assert list(ffi.drain(ring)["job"])[-2:] == [9, 9]


@pytest.mark.parametrize("ident, described", [
    (np.array([1, 2, 3], np.float32), "float32[3] (12 bytes)"),  # (int64 is int32 without x64)
    (np.array([1, 2], np.int32), "int32[2] (8 bytes)"),
    (np.zeros((0, 3), np.int32), "int32[0,3] (0 bytes)"),
])
def test_malformed_ident_in_a_raw_call(ring, ident, described):
    with pytest.raises(Exception, match=re.escape(
            "xshare_fence_begin: the ident (last argument) must be int32[..., 3] rows of "
            "[ring_id, job_id, lane_id] (build it with xshare.ffi.ident), got " + described)):
        jax.block_until_ready(raw_begin([F32x4], jnp.ones(4), ring_id=ring, ident=ident))
    still_works(ring)


def test_ident_checked_in_python(ring):
    with pytest.raises(TypeError, match=re.escape(
            "ident must be an int32[3] array [ring_id, job_id, lane_id] (build it with "
            "xshare.ffi.ident()), got int64[3]")):
        ffi.begin(jnp.ones(2), ident=np.array([ring, 1, -1], np.int64))
    with pytest.raises(TypeError, match=re.escape("pass either ident=... or ring_id=/job_id=")):
        ffi.begin(jnp.ones(2), ident=ffi.ident(ring, 1), ring_id=ring, job_id=1)
    with pytest.raises(TypeError, match=re.escape("pass the fence identity: ident=")):
        ffi.end(jnp.ones(2), ring_id=ring)
    still_works(ring)


def test_attribute_type_checked_in_python(ring):
    with pytest.raises(TypeError, match=re.escape("ring_id must be an int (int32), got float 1.5")):
        ffi.begin(jnp.ones(2), ring_id=1.5, job_id=1)
    with pytest.raises(TypeError, match=re.escape("job_id must be an int (int32), got str 'a'")):
        ffi.end(jnp.ones(2), ring_id=ring, job_id="a")
    with pytest.raises(ValueError, match=re.escape("job_id must be in [-2147483648, 2147483647]")):
        ffi.fenced(lambda s, b: (s, b), ring_id=ring, job_id=2**31)
    with pytest.raises(ValueError, match=re.escape("lane_id must be in [-1, 2147483647], got -3")):
        ffi.begin(jnp.ones(2), ring_id=ring, job_id=1, lane_id=-3)
    still_works(ring)


def test_unknown_ring_at_trace_time():
    r = ffi.open_ring(4)
    ffi.close_ring(r)
    with pytest.raises(ValueError, match=re.escape(f"unknown ring_id {r}")):
        jax.jit(lambda x: ffi.begin(x, ring_id=r, job_id=1))(jnp.ones(2))


def test_ring_closed_after_compile_fails_at_run_time(ring):
    other = ffi.open_ring(4)
    step = jax.jit(lambda x: ffi.end(ffi.begin(x, ring_id=other, job_id=1), ring_id=other,
                                     job_id=1) * 2)
    compiled = step.lower(jnp.ones(2)).compile()
    ffi.close_ring(other)
    with pytest.raises(Exception, match=re.escape(
            f"xshare_fence_begin: unknown ring_id {other} (never opened, or already closed")):
        jax.block_until_ready(compiled(jnp.ones(2)))
    still_works(ring)


def test_unknown_ring_in_a_raw_call(ring):
    with pytest.raises(Exception, match=re.escape("xshare_fence_begin: unknown ring_id 123456")):
        jax.block_until_ready(raw_begin([F32x4], jnp.ones(4), ring_id=123456))
    still_works(ring)


def test_mismatched_argument_and_result_counts(ring):
    with pytest.raises(Exception, match=re.escape(
            "xshare_fence_begin: an identity fence needs as many results as arguments before "
            "the ident, got 3 arguments (the last is the ident) and 1 results")):
        jax.block_until_ready(raw_begin([F32x4], jnp.ones(4), jnp.ones(4), ring_id=ring))
    still_works(ring)


@pytest.mark.parametrize("result, described", [
    (jax.ShapeDtypeStruct((5,), jnp.float32), "float32[5] (20 bytes)"),
    (jax.ShapeDtypeStruct((4,), jnp.int32), "int32[4] (16 bytes)"),
    (jax.ShapeDtypeStruct((2, 2), jnp.float32), "float32[2,2] (16 bytes)"),
])
def test_result_must_match_argument(ring, result, described):
    with pytest.raises(Exception, match=re.escape(
            "xshare_fence_begin: result 0 must match argument 0 (identity fence): "
            f"argument is float32[4] (16 bytes), result is {described}")):
        jax.block_until_ready(raw_begin([result], jnp.ones(4), ring_id=ring))
    still_works(ring)


def test_bad_lane_in_a_raw_call(ring):
    with pytest.raises(Exception, match=re.escape(
            "xshare_fence_begin: lane_id must be >= 0, or -1 to use the lane set with "
            "set_lane(job_id, lane); got -7 (ident row 0)")):
        jax.block_until_ready(raw_begin([F32x4], jnp.ones(4), ring_id=ring, lane_id=-7))
    still_works(ring)


def test_unknown_ring_as_data_fails_at_run_time_naming_the_ring(ring):
    # With identity as data nothing can check the ring at trace time: the handler does.
    step = jax.jit(ffi.fenced(lambda s, b: (s + b, {"m": b[0]}), donated=False))
    bad = np.array([987654, 1, -1], np.int32)
    with pytest.raises(Exception, match=re.escape(
            "xshare_fence_begin: unknown ring_id 987654 (never opened, or already closed; "
            "ident row 0)")):
        jax.block_until_ready(step(jnp.ones(4), jnp.ones(4), bad))
    still_works(ring)
