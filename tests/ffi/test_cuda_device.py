"""The CUDA fences on a GPU: device timestamps from cudaEvents, idents read back from device
memory. Skipped without a CUDA backend (the suite pins JAX_PLATFORMS=cpu unless it is set:
run with JAX_PLATFORMS=cuda,cpu on a GPU machine)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xshare import ffi

from . import IGNORE_DONATION_WARNING, ring_for
from .test_fences import assert_same_as_plain_step, heavy_step, mlp_batch, mlp_state, mlp_step


def _on_cuda() -> bool:
    try:
        return jax.default_backend() == "gpu" and bool(jax.devices("cuda"))
    except RuntimeError:
        return False


pytestmark = [
    pytest.mark.skipif(not _on_cuda(), reason="no CUDA backend (set JAX_PLATFORMS=cuda,cpu)"),
    IGNORE_DONATION_WARNING,
]


@pytest.fixture
def ring():
    assert ffi.available(), ffi.unavailable_reason()
    assert "cuda" in ffi._state.registered
    yield from ring_for(1 << 12)


def drain_all(ring, expect: int):
    """Everything recorded so far: the outputs are ready, so every fence event completed."""
    rec = ffi.drain(ring)
    assert ffi._state.cuda_lib.xshare_cuda_pending() == 0
    assert len(rec) == expect, rec
    return rec


def test_two_jobs_one_executable_on_the_gpu(ring):
    step = jax.jit(ffi.fenced(mlp_step), donate_argnums=(0, 1))
    ids = {j: jax.device_put(ffi.ident(ring, j, j - 6)) for j in (7, 8)}
    states = {j: mlp_state(seed=j) for j in ids}
    for k in range(10):
        for j in ids:
            states[j], _ = step(states[j], mlp_batch(k), ids[j])
    jax.block_until_ready(states)
    assert step._cache_size() == 1
    rec = drain_all(ring, 40)
    assert list(rec["job"]) == [7, 7, 8, 8] * 10
    assert list(rec["lane"]) == [1, 1, 2, 2] * 10
    assert list(rec["kind"]) == [0, 1] * 20
    t = rec["t_ns"]
    assert (np.diff(t) >= 0).all(), "one stream: fences complete in order"
    assert (t[1::2] > t[0::2]).all(), "begin < end within a step"


def test_device_time_brackets_the_step_and_matches_wall_time(ring):
    d = 2048
    step = jax.jit(ffi.fenced(heavy_step), donate_argnums=(0, 1))
    ident = jax.device_put(ffi.ident(ring, 1))
    data = [jax.device_put({"x": jnp.full((d, d), 0.01 * k, jnp.float32)}) for k in range(20)]
    state = {"w": jnp.eye(d, dtype=jnp.float32), "n": jnp.zeros((), jnp.int32)}
    for k in range(3):
        state, _ = step(state, data[k], ident)
    jax.block_until_ready(state)
    ffi.drain(ring)
    ratios = []
    for _ in range(5):
        t0 = ffi.now_ns()
        for x in data:
            state, metrics = step(state, x, ident)
        jax.block_until_ready((state, metrics))
        wall = ffi.now_ns() - t0
        rec = drain_all(ring, 2 * len(data))
        busy = int((rec["t_ns"][1::2] - rec["t_ns"][0::2]).sum())
        # The anchor's host time is known to within a few microseconds: allow 50 us.
        assert t0 - 50_000 <= rec["t_ns"][0] and rec["t_ns"][-1] <= t0 + wall + 50_000
        assert busy <= wall + 50_000
        ratios.append(busy / wall)
        if busy >= 0.9 * wall:
            break
    assert max(ratios) >= 0.9, f"fence busy time / wall time per run: {ratios}"


def test_results_bit_identical_with_and_without_fences_on_the_gpu(ring):
    ident = jax.device_put(ffi.ident(ring, 1))
    assert_same_as_plain_step(jax.jit(ffi.fenced(mlp_step), donate_argnums=(0, 1)), 6, ident)
    drain_all(ring, 12)


def test_vmapped_idents_are_read_back_per_member(ring):
    members = jax.device_put(np.stack([ffi.ident(ring, j) for j in (1, 2, 3)]))
    out = jax.jit(jax.vmap(lambda v, i: ffi.begin(v, ident=i)))(jnp.ones((3, 4)), members)
    jax.block_until_ready(out)
    assert list(drain_all(ring, 3)["job"]) == [1, 2, 3]


def test_a_closed_ring_loses_the_record_not_the_step(ring):
    other = ffi.open_ring(4)
    step = jax.jit(ffi.fenced(mlp_step), donate_argnums=(0, 1))
    ident = jax.device_put(ffi.ident(other, 1))
    ffi.close_ring(other)
    lost = ffi._state.cuda_lib.xshare_cuda_lost()
    state, _ = step(mlp_state(), mlp_batch(0), ident)  # ring checked on read-back, not here
    jax.block_until_ready(state)
    ffi.poll()
    assert ffi._state.cuda_lib.xshare_cuda_lost() == lost + 2
