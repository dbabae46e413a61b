"""Runtime(fuse="always", group_capacity=N): a fused group opens with the floor's slots, keeps them as
members leave (no smaller program is compiled), a later job of its program joins it without a
compile, and a member stays bit-identical to the plain vmapped loop at that capacity."""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xshare
from tests.helpers import assert_trees_equal, linreg_data, linreg_state, linreg_step

# Each test runs programs of its own width: the program cache is process-wide, and a test that
# counts compiles must not find another test's programs compiled already.


def _slow(dim, seed, n):
    """``n`` batches, each a millisecond late, as an iterable (steps=None: the job runs until
    they run out, so its remaining steps are unbounded to the shrink rule)."""
    data = linreg_data(dim=dim, seed=seed)
    for k in range(n):
        time.sleep(0.001)
        yield data(k)


def vmapped_loop(spec, capacity, steps):
    """The reference: the step under jax.vmap over ``capacity`` stacked slots (``spec`` in slot
    0, the others zero), jitted with donation, in a plain loop."""
    zero_state = jax.tree.map(jnp.zeros_like, spec.state)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), spec.state, *[zero_state] * (capacity - 1))
    data = linreg_data(dim=spec.state["w"].shape[0], seed=0)
    zero_batch = jax.tree.map(np.zeros_like, data(0))
    f = jax.jit(jax.vmap(spec.fn), donate_argnums=0)
    for k in range(steps):
        batches = [data(k)] + [zero_batch] * (capacity - 1)
        stacked, _ = f(stacked, jax.tree.map(lambda *xs: np.stack(xs), *batches))
    return jax.tree.map(lambda x: np.asarray(x[0]), stacked)


def _watch(rt, handles):
    """The capacities of the runtime's groups seen until ``handles`` end."""
    seen = set()
    while not all(h.status() in ("done", "failed", "cancelled") for h in handles):
        seen.update(g["capacity"] for g in rt.snapshot()["groups"])
        time.sleep(0.002)
    return seen


@pytest.mark.parametrize("floor, after", [(8, {8}), (None, {2})], ids=["floor-8", "no-floor"])
def test_a_group_keeps_the_floors_slots_as_members_leave(floor, after):
    dim = 17 if floor else 19
    steps = 400
    specs = [linreg_step.bind(linreg_state(dim=dim, seed=i), _slow(dim, i, steps), steps=None, name=f"j{i}")
             for i in range(8)]
    # (one execution stream: one group of the eight, as under the floor; with lanes side by
    # side they would open a group per stream: test_fusion.py)
    with xshare.Runtime(policy="pack", memory="256MiB", fuse="always", group_capacity=floor,
                        parallel_lanes=False) as rt:
        handles = rt.submit_many(specs)
        while handles[0].progress().steps_done < 20:
            time.sleep(0.001)
        before = {g["capacity"] for g in rt.snapshot()["groups"]}
        for h in handles[1:]:  # pruned, as a study prunes: cancelled at a step boundary
            h.cancel()
        seen = _watch(rt, handles)
        rt.wait()
    assert handles[0].status() == "done", handles[0].error
    assert all(h.status() == "cancelled" for h in handles[1:])
    # Eight jobs open a group of 8 either way; when seven leave, the floor keeps its 8 slots
    # (no smaller program), where without a floor the lone member is repacked into 2 slots.
    assert before == {8}
    assert seen == after
    if floor:  # never moved: bit-identical to the vmapped loop at capacity 8, slot 0
        assert_trees_equal(handles[0].result()[0], vmapped_loop(specs[0], 8, steps))


def test_a_later_job_of_the_program_joins_the_floors_group_without_a_compile():
    dim, steps = 23, 400
    first = [linreg_step.bind(linreg_state(dim=dim, seed=i), _slow(dim, i, steps), steps=None, name=f"a{i}")
             for i in range(2)]
    # (steps_per_call=1: the group's own K-step program, compiled in the background for its
    # open-ended members, would count as a compile here; this test is about the later job's)
    with xshare.Runtime(policy="pack", memory="256MiB", fuse="always", group_capacity=4, steps_per_call=1) as rt:
        handles = rt.submit_many(first)
        while handles[0].progress().steps_done < 20:
            time.sleep(0.001)
        assert [g["capacity"] for g in rt.snapshot()["groups"]] == [4]  # the floor, not 2
        compiles = rt.compiles
        # Alone in its submit call (a study's refill): it joins the running group's free slot.
        later = rt.submit(linreg_step.bind(linreg_state(dim=dim, seed=5), linreg_data(dim=dim, seed=5),
                                           steps=50, name="later"))
        handles.append(later)
        seen = _watch(rt, handles)
        rt.wait()
        assert rt.compiles == compiles, "the later job compiled a program of its own"
    assert all(h.status() == "done" for h in handles), [h.error for h in handles]
    assert seen == {4}


def test_a_lone_first_job_of_a_program_steps_alone_even_under_a_floor():
    # Nobody else runs its program yet: a group would be a group of one paying for empty slots.
    dim = 29
    spec = linreg_step.bind(linreg_state(dim=dim), _slow(dim, 0, 100), steps=None, name="alone")
    with xshare.Runtime(policy="pack", memory="256MiB", fuse="always", group_capacity=8) as rt:
        h = rt.submit(spec)
        seen = _watch(rt, [h])
        rt.wait()
    assert h.status() == "done", h.error
    assert seen == set()


@pytest.mark.parametrize("bad", [0, -2, 2.0, True, "8"])
def test_group_capacity_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=re.escape(f"group_capacity={bad!r} must be an int >= 1 "
                                                   "(slots per fused group), or None")):
        xshare.Runtime(memory="256MiB", fuse="always", group_capacity=bad)


def _baked(lr: float, dim: int, seed: int, data, steps=None, name=None) -> xshare.JobSpec:
    """Linear regression with ``lr`` baked in as a Python float: a family of literal programs
    that the runtime lifts into one."""
    def step(state, batch):
        loss, g = jax.value_and_grad(lambda w: jnp.mean((batch["x"] @ w - batch["y"]) ** 2))(state["w"])
        return {"w": state["w"] - lr * g}, {"loss": loss}

    return xshare.job(step).bind({"w": linreg_state(dim=dim, seed=seed)["w"]}, data, steps=steps, name=name)


def test_a_later_job_its_familys_program_covers_is_never_lowered_alone_and_computes_the_same(monkeypatch):
    from xshare.runtime.compiled.compiler import PROGRAMS

    dim, steps = 31, 300
    lrs = (0.01, 0.02, 0.03)
    # Runtime A: two jobs lift lr into one program; the third arrives alone while they run and
    # is matched to that program from its jaxpr alone (prepare._covering).
    first = [_baked(lr, dim, i, _slow(dim, i, steps), name=f"a{i}") for i, lr in enumerate(lrs[:2])]
    # (steps_per_call=1: the group's own K-step program, compiled in the background for its
    # open-ended members, would count as a compile here; this test is about the later job's)
    with xshare.Runtime(policy="pack", memory="256MiB", fuse="always", group_capacity=4, steps_per_call=1) as rt:
        handles = rt.submit_many(first)
        while handles[0].progress().steps_done < 20:
            time.sleep(0.001)
        lowered = []
        get = PROGRAMS.get_promoting  # (what PROGRAMS.get calls too)
        monkeypatch.setattr(PROGRAMS, "get_promoting", lambda *a, **k: lowered.append(1) or get(*a, **k))
        later = rt.submit(_baked(lrs[2], dim, 2, linreg_data(dim=dim, seed=2), steps=100, name="later"))
        handles.append(later)
        seen = _watch(rt, handles)
        rt.wait()
        monkeypatch.setattr(PROGRAMS, "get_promoting", get)
    assert all(h.status() == "done" for h in handles), [h.error for h in handles]
    assert lowered == [], "the covered job was lowered on its own"
    assert seen == {4}
    # Runtime B: the same third job submitted with its family (the full path: lowered, then
    # assigned): in a group of the same capacity it computes the same bits.
    together = [_baked(lr, dim, i, linreg_data(dim=dim, seed=i), steps=100, name=f"b{i}")
                for i, lr in enumerate(lrs)]
    with xshare.Runtime(policy="pack", memory="256MiB", fuse="always", group_capacity=4) as rt:
        again = rt.submit_many(together)
        rt.wait()
    assert_trees_equal(later.result()[0], again[2].result()[0])


def test_a_covered_job_is_posted_before_a_new_shapes_job_of_its_call_is_lowered(monkeypatch):
    """A study's refill asks trials of two shapes at once: the one its family's group program
    already covers joins first; the other shape's lowering (and group compile) comes after."""
    from xshare.runtime.compiled.compiler import PROGRAMS

    dim, other = 37, 41
    first = [_baked(lr, dim, i, _slow(dim, i, 300), name=f"a{i}") for i, lr in enumerate((0.01, 0.02))]
    # (steps_per_call=1: the group's own K-step program, compiled in the background for its
    # open-ended members, would count as a compile here; this test is about the later job's)
    with xshare.Runtime(policy="pack", memory="256MiB", fuse="always", group_capacity=4, steps_per_call=1) as rt:
        handles = rt.submit_many(first)
        while handles[0].progress().steps_done < 20:
            time.sleep(0.001)
        order = []
        get, post = PROGRAMS.get_promoting, rt._dispatcher.post  # (what PROGRAMS.get calls too)
        monkeypatch.setattr(PROGRAMS, "get_promoting", lambda job, state, *a, **k: (
            order.append(("lowered", state["w"].shape[0])), get(job, state, *a, **k))[1])
        monkeypatch.setattr(rt._dispatcher, "post", lambda fn, *args: (
            order.append((fn.__name__, args[0].name)) if fn.__name__ == "compiled" else None, post(fn, *args))[1])
        # The new shape first in the call, as the sampler happened to ask it.
        refill = rt.submit_many([
            _baked(0.05, other, 7, linreg_data(dim=other, seed=7), steps=50, name="new-shape"),
            _baked(0.03, dim, 2, linreg_data(dim=dim, seed=2), steps=50, name="covered")])
        handles += refill
        rt.wait()
    assert all(h.status() == "done" for h in handles), [h.error for h in handles]
    assert order.index(("compiled", "covered")) < order.index(("lowered", other)), order
    assert ("lowered", dim) not in order, "the covered job was lowered"
