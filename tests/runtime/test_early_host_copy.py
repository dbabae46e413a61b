"""Metrics started to the host at dispatch (``Executor.host_copy``: on by default off a CPU,
where retiring a step otherwise waits for a device-to-host copy of its own). This machine has
no GPU, so the tests force it on over the CPU backend: every call's metrics are copied early
(solo steps, K-step calls, fused group steps), and nothing else changes: the same final
states and the same metrics rows as the plain loop."""

from __future__ import annotations

import json
import sys

import jax
import numpy as np
import pytest
from jax._src.array import ArrayImpl

import xshare
from xshare.runtime.engine import executor
from tests.helpers import assert_trees_equal, linreg_data, linreg_state, linreg_step, plain_loop
from tests.users.harness import vmapped_loop

STEPS = 48


@pytest.fixture
def copied(monkeypatch):
    """Force the early copy on; record the shape of every array the engine asks it of (jax's
    own callers, such as ``jax.device_get``, are not counted)."""
    shapes: list[tuple] = []
    real = ArrayImpl.copy_to_host_async

    def counting(self):
        if sys._getframe(1).f_globals["__name__"].startswith("xshare.runtime.engine."):
            shapes.append(self.shape)
        return real(self)

    monkeypatch.setattr(executor, "copies_early", lambda device: True)
    monkeypatch.setattr(ArrayImpl, "copy_to_host_async", counting)
    return shapes


def make(seed: int, steps: int = STEPS):
    return linreg_step.bind(linreg_state(seed=seed), linreg_data(seed=seed), steps=steps, name=f"lin{seed}")


def test_copies_early_only_off_a_cpu():
    assert executor.copies_early(jax.devices("cpu")[0]) is False
    assert executor.copies_early(type("Gpu", (), {"platform": "gpu"})()) is True


def test_every_solo_step_is_copied_early_and_rows_and_state_are_the_plain_loops(copied, tmp_path):
    with xshare.Runtime(memory="256MiB", steps_per_call=1, log_dir=tmp_path) as rt:
        handle = rt.submit(make(5))
        rt.wait()
    assert len(copied) == STEPS and all(shape == copied[0] for shape in copied), copied
    assert_trees_equal(handle.result()[0], plain_loop(make(5))[0])
    spec = make(5)
    f = jax.jit(spec.fn, donate_argnums=0)
    state, losses = jax.tree.map(np.array, spec.state), []
    for k in range(STEPS):
        state, m = f(state, spec.data(k))
        losses.append(np.float32(m["loss"]))
    rows = [json.loads(line) for line in (tmp_path / "lin5" / "metrics.jsonl").read_text().splitlines()]
    assert [np.float32(r["loss"]) for r in rows] == losses


def test_k_step_calls_and_fused_group_steps_are_copied_early(copied):
    # A K-step call's metrics are K rows: copied as one (8, ...) array. The tiers adopt K=8 in
    # the background, so a run may end before it: up to three runs, as test_multistep does
    # (and long enough for the compile: until then its one-step calls run ~16 a turn).
    for _ in range(3):
        copied.clear()
        with xshare.Runtime(memory="256MiB", steps_per_call=8) as rt:
            handle = rt.submit(make(6, 600))
            rt.wait()
            rt._tier_pool.shutdown(wait=True)
        if handle._rec.tier is not None and handle._rec.tier.steps_at.get(8):
            break
    calls = handle._rec.tier.steps_at
    assert calls.get(8), calls
    # (+1: the exactness check's own K-step call, which is dispatched like the others)
    assert calls[8] // 8 <= sum(1 for shape in copied if shape[:1] == (8,)) <= calls[8] // 8 + 1, (copied, calls)
    assert_trees_equal(handle.result()[0], plain_loop(make(6, 600))[0])

    copied.clear()
    with xshare.Runtime(memory="256MiB", fuse="always", steps_per_call=1) as rt:
        handles = rt.submit_many([make(i) for i in range(3)])
        rt.wait()
        group_steps = handles[0]._rec.group.steps_run if handles[0]._rec.group is not None else None
    assert len(copied) >= STEPS, len(copied)  # one per group step (a member alone would add more)
    if group_steps is not None:
        assert len(copied) == group_steps
    for h, want in zip(handles, vmapped_loop([make(i) for i in range(3)], 4, STEPS)):
        assert_trees_equal(h.result()[0], want)


def test_a_fused_groups_k_step_calls_and_their_check_with_the_copy_on(copied):
    # The group's K-step check hands its rows to the pipeline from the host (a numpy stack):
    # only the calls' own device rows are copied early.
    for _ in range(3):
        copied.clear()
        with xshare.Runtime(memory="256MiB", fuse="always", steps_per_call=8) as rt:
            handles = rt.submit_many([make(i, 96) for i in range(3)])
            rt.wait()
            rt._tier_pool.shutdown(wait=True)
        if all(h._rec.tier is not None and h._rec.tier.steps_at.get(8, 0) >= 48 for h in handles):
            break
    assert all(h._rec.tier.steps_at.get(8, 0) >= 48 for h in handles), [h._rec.tier for h in handles]
    assert any(shape[:1] == (8,) for shape in copied), copied  # (8, capacity, metrics): K-step group calls
    for h, want in zip(handles, vmapped_loop([make(i, 96) for i in range(3)], 4, 96)):
        assert_trees_equal(h.result()[0], want)
