"""Identity as data: one program for every job, each job's records carry its own ids."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xshare import ffi

from . import IGNORE_DONATION_WARNING, needs_ffi, ring_for
from .test_fences import assert_same_as_plain_step, mlp_batch, mlp_state, mlp_step

pytestmark = [needs_ffi(), IGNORE_DONATION_WARNING]


@pytest.fixture
def ring():
    yield from ring_for(1 << 10)


def _stablehlo(fn, *args) -> str:
    return jax.jit(fn, donate_argnums=(0, 1)).lower(*args).as_text()


def test_the_program_does_not_depend_on_the_job(ring):
    state, batch = mlp_state(), mlp_batch(0)
    a = _stablehlo(ffi.fenced(mlp_step), state, batch, jnp.asarray(ffi.ident(ring, 1)))
    b = _stablehlo(ffi.fenced(mlp_step), state, batch, jnp.asarray(ffi.ident(ring, 2, 5)))
    assert a == b
    assert a.count("xshare_fence_begin") == 1 and a.count("xshare_fence_end") == 1
    # No attributes on the fences (the old form had ring_id/job_id/lane_id ones).
    calls = [ln for ln in a.splitlines() if "stablehlo.custom_call @xshare_fence_" in ln]
    assert calls and not [ln for ln in calls if re.search(r"(ring|job|lane)_id", ln)], calls
    # The check has teeth: the keyword form bakes the job in, and its programs differ.
    k1 = _stablehlo(ffi.fenced(mlp_step, ring_id=ring, job_id=1), state, batch)
    k2 = _stablehlo(ffi.fenced(mlp_step, ring_id=ring, job_id=2), state, batch)
    assert k1 != k2


def test_two_jobs_share_one_executable_and_record_their_own_ids(ring):
    step = jax.jit(ffi.fenced(mlp_step), donate_argnums=(0, 1))
    ids = {7: jnp.asarray(ffi.ident(ring, 7, 0)), 8: jnp.asarray(ffi.ident(ring, 8, 1))}
    compiled = step.lower(mlp_state(), mlp_batch(0), ids[7]).compile()
    states = {j: mlp_state(seed=j) for j in ids}
    for k in range(3):  # interleaved, as the runtime runs them
        for j in ids:
            states[j], _ = compiled(states[j], mlp_batch(k), ids[j])
    jax.block_until_ready(states)
    rec = ffi.drain(ring)
    assert list(rec["job"]) == [7, 7, 8, 8] * 3
    assert list(rec["lane"]) == [0, 0, 1, 1] * 3
    assert list(rec["kind"]) == [0, 1] * 6
    # Through jit's own cache too: a second job's ident is a cache hit, not a retrace.
    for j in ids:
        states[j], _ = step(states[j], mlp_batch(3), ids[j])
    jax.block_until_ready(states)
    assert step._cache_size() == 1
    assert list(ffi.drain(ring)["job"]) == [7, 7, 8, 8]


def test_data_form_results_equal_the_plain_step(ring):
    ident = jnp.asarray(ffi.ident(ring, 3))
    assert_same_as_plain_step(jax.jit(ffi.fenced(mlp_step), donate_argnums=(0, 1)), 4, ident)
    assert np.array_equal(np.asarray(ident), [ring, 3, -1]), "the ident is not donated"
    assert len(ffi.drain(ring)) == 8


def test_lane_minus_one_reads_the_lane_table_at_run_time(ring):
    step = jax.jit(ffi.fenced(mlp_step), donate_argnums=(0, 1))
    ident = jnp.asarray(ffi.ident(ring, 42))
    ffi.set_lane(42, 6)
    try:
        state, _ = step(mlp_state(), mlp_batch(0), ident)
        jax.block_until_ready(state)
        ffi.set_lane(42, 1)
        state, _ = step(state, mlp_batch(1), ident)
        jax.block_until_ready(state)
    finally:
        ffi.set_lane(42, -1)
    assert list(ffi.drain(ring)["lane"]) == [6, 6, 1, 1]


def test_vmapped_fences_record_each_member_once(ring):
    x = jnp.ones((3, 2))
    members = jnp.stack([jnp.asarray(ffi.ident(ring, j)) for j in (1, 2, 3)])
    jax.block_until_ready(jax.vmap(lambda v, i: ffi.begin(v, ident=i))(x, members))
    assert list(ffi.drain(ring)["job"]) == [1, 2, 3]
    # One ident for the whole batch: vmap broadcasts it; the fence records it once.
    one = jnp.asarray(ffi.ident(ring, 9))
    jax.block_until_ready(jax.vmap(lambda v: ffi.begin(v, ident=one))(x))
    assert list(ffi.drain(ring)["job"]) == [9]


def test_ident_is_validated(ring):
    assert ffi.ident(ring, 5).tolist() == [ring, 5, -1]
    assert ffi.ident(ring, 5, 2).dtype == np.int32
    with pytest.raises(ValueError, match=re.escape("job_id must be in [-2147483648, 2147483647]")):
        ffi.ident(ring, 2**31)
    with pytest.raises(ValueError, match=re.escape("lane_id must be in [-1, 2147483647], got -2")):
        ffi.ident(ring, 1, -2)
    closed = ffi.open_ring(2)
    ffi.close_ring(closed)
    with pytest.raises(ValueError, match=re.escape(f"unknown ring_id {closed}: never opened")):
        ffi.ident(closed, 1)
