"""Fused sweeps: members of a vmapped group are bit-identical to the same vmapped step in a
plain loop at the same capacity, independent of the other slots, and each stays a job
(failure, pause/resume, cancel, checkpoint/resume leave the others' results unchanged).

These runtimes use ``fuse="always"``: they test the group machinery itself, which a measurement
(``fuse=True``: a group dissolves where fusing does not pay on this machine) must not change
under them; tests/runtime/test_payoff.py tests the measuring."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xshare
from xshare.runtime.engine.streams import parallel_streams
from xshare.runtime.observe.schema import validate
from tests.helpers import assert_trees_equal, linreg_data, linreg_state, linreg_step, plain_loop

STEPS = 40


def _specs(n, steps=STEPS, dim=8, names="j"):
    return [linreg_step.bind(linreg_state(dim=dim, seed=i), linreg_data(dim=dim, seed=i), steps=steps,
                             name=f"{names}{i}") for i in range(n)]


def vmapped_loop(specs, capacity, steps):
    """The reference: the same step under jax.vmap over `capacity` stacked slots (empty slots
    zero), jitted with donation, in a plain loop."""
    zero_state = jax.tree.map(jnp.zeros_like, specs[0].state)
    zero_batch = jax.tree.map(np.zeros_like, specs[0].data(0))
    states = [s.state for s in specs] + [zero_state] * (capacity - len(specs))
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
    f = jax.jit(jax.vmap(specs[0].fn), donate_argnums=0)
    for k in range(steps):
        batches = [s.data(k) for s in specs] + [zero_batch] * (capacity - len(specs))
        stacked, _ = f(stacked, jax.tree.map(lambda *xs: np.stack(xs), *batches))
    return [jax.tree.map(lambda x, i=i: np.asarray(x[i]), stacked) for i in range(len(specs))]


def _run(specs, **kw):
    with xshare.Runtime(policy="pack", memory="256MiB", fuse="always", **kw) as rt:
        handles = rt.submit_many(specs)
        rt.wait()
    return handles


def test_members_are_bit_identical_to_the_plain_vmapped_loop_and_close_to_unfused():
    specs = _specs(3)
    handles = _run(specs)
    assert all(h.status() == "done" for h in handles), [h.error for h in handles]
    for h, want in zip(handles, vmapped_loop(specs, 4, STEPS)):
        assert_trees_equal(h.result()[0], want)
    for h, spec in zip(handles, specs):  # vmap may reorder reductions: close, not necessarily equal
        got, ref = h.result()[0], plain_loop(spec)[0]
        assert max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                   for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref))) < 1e-4


def test_a_member_does_not_depend_on_what_the_other_slots_hold():
    with_three = _run(_specs(3))
    with_four = _run(_specs(4))  # same capacity (4), one more neighbour
    for a, b in zip(with_three, with_four):
        assert_trees_equal(a.result()[0], b.result()[0])


def _snapshot_running(specs, **kw):
    """The status document once every job ran 20 steps, and the handles (run to the end)."""
    with xshare.Runtime(policy="pack", memory="256MiB", fuse="always", **kw) as rt:
        handles = rt.submit_many(specs)
        while any(h.progress().steps_done < 20 for h in handles):
            time.sleep(0.002)
        snap = rt.snapshot()
        rt.wait()
    return snap, handles


def test_fused_jobs_run_in_one_group_with_one_program():
    specs = _specs(4, steps=200)
    # (one execution stream: one group; with lanes side by side the jobs split over them, below)
    snap, _ = _snapshot_running(specs, parallel_lanes=False)
    groups = snap["groups"]
    assert len(groups) == 1 and sorted(groups[0]["members"]) == [s.name for s in specs]
    assert groups[0]["capacity"] == 4
    assert {j["group"] for j in snap["jobs"]} == {groups[0]["name"]}
    # The group's own row says how its steps ran per call, and why (status schema v1).
    assert sum(groups[0]["steps_per_call"].values()) == groups[0]["steps"] >= 20
    assert groups[0]["programs"]
    assert validate(snap) == []


def test_jobs_fused_together_split_into_a_group_per_parallel_stream_on_one_program():
    """On a CPU whose lanes run side by side, jobs submitted together open one group per
    execution stream (two groups of two on this project's 2-core machine), each on a lane of
    its own, all on one program; every member bit-identical to the vmapped loop at that
    capacity."""
    streams = parallel_streams(jax.devices()[0], True)
    if streams < 2:
        pytest.skip("one core: one execution stream, one group")
    specs = _specs(4, steps=200)
    snap, handles = _snapshot_running(specs)
    groups = snap["groups"]
    assert len(groups) == 2 and [g["capacity"] for g in groups] == [2, 2], groups
    assert sorted(m for g in groups for m in g["members"]) == [s.name for s in specs]
    assert len({g["lane"] for g in groups}) == 2, groups  # (a lane, hence a stream, each)
    assert len({g["program"] for g in groups}) == 1, groups
    for h, spec in zip(handles, specs):
        pair = [s for s in specs if any(spec.name in g["members"] and s.name in g["members"] for g in groups)]
        want = vmapped_loop(pair, 2, 200)[pair.index(spec)]
        assert_trees_equal(h.result()[0], want)


def test_one_member_with_a_bad_batch_fails_alone():
    good = _specs(3)

    def bad_data(k):
        b = linreg_data(dim=8, seed=9)(k)
        return {"x": b["x"][:, :5], "y": b["y"]} if k == 5 else b

    bad = linreg_step.bind(linreg_state(dim=8, seed=9), bad_data, steps=STEPS, name="bad")
    handles = _run(good + [bad])
    assert handles[-1].status() == "failed"
    assert "batch 5 does not match the compiled step" in handles[-1].error
    assert handles[-1].progress().steps_done == 5
    for h, want in zip(handles, vmapped_loop(good, 4, STEPS)):
        assert_trees_equal(h.result()[0], want)


def test_a_member_whose_data_raises_fails_alone():
    good = _specs(2)

    def broken(k):
        if k == 7:
            raise RuntimeError("disk gone at batch 7")
        return linreg_data(dim=8, seed=5)(k)

    bad = linreg_step.bind(linreg_state(dim=8, seed=5), broken, steps=STEPS, name="broken")
    handles = _run(good + [bad])
    assert handles[-1].status() == "failed" and "disk gone at batch 7" in handles[-1].error
    for h, want in zip(handles, vmapped_loop(good, 4, STEPS)):
        assert_trees_equal(h.result()[0], want)


def test_nan_in_one_member_fails_it_alone():
    good = _specs(3)
    poisoned_state = {"w": jnp.full((8, 1), jnp.nan, jnp.float32), "n": jnp.zeros((), jnp.int32)}
    bad = linreg_step.bind(poisoned_state, linreg_data(dim=8, seed=3), steps=STEPS, name="nan",
                           nan_policy="fail")
    handles = _run(good + [bad])
    assert handles[-1].status() == "failed" and "non-finite metric loss" in handles[-1].error
    for h, want in zip(handles, vmapped_loop(good, 4, STEPS)):
        assert_trees_equal(h.result()[0], want)


def test_pause_resume_and_cancel_of_members_leave_the_others_unchanged():
    specs = _specs(4, steps=300)
    with xshare.Runtime(policy="pack", memory="256MiB", fuse="always") as rt:
        handles = rt.submit_many(specs)
        while handles[0].progress().steps_done < 30:
            time.sleep(0.001)
        handles[1].pause()
        paused_at = handles[1].progress().steps_done
        handles[2].cancel()
        time.sleep(0.05)
        assert handles[1].progress().steps_done == paused_at  # masked: no step while paused
        handles[1].resume()
        rt.wait()
    assert handles[2].status() == "cancelled"
    want = vmapped_loop(specs, 4, 300)
    for i in (0, 1, 3):  # the paused member ends exactly where it would have: masking is exact
        assert handles[i].status() == "done"
        assert_trees_equal(handles[i].result()[0], want[i])


def test_a_member_checkpointed_and_resumed_mid_run_ends_as_if_uninterrupted(tmp_path):
    specs = _specs(2, steps=200)
    with xshare.Runtime(policy="pack", memory="256MiB", fuse="always", log_dir=tmp_path,
                        checkpoint_every=10) as rt:
        handles = rt.submit_many(specs)
        while handles[0].progress().steps_done < 50:
            time.sleep(0.001)
        rt.stop()
    assert all(h.status() == "cancelled" for h in handles)
    resumed = _run(_specs(2, steps=200), log_dir=tmp_path, resume=True)
    for h, want in zip(resumed, vmapped_loop(specs, 2, 200)):
        assert h.status() == "done"
        assert_trees_equal(h.result()[0], want)
    rows = [ln for ln in (tmp_path / "j0" / "metrics.jsonl").read_text().splitlines() if ln]
    assert len(rows) == 200  # every step logged once: none lost, none twice


def test_jobs_arriving_over_time_join_a_running_group():
    first = _specs(2, steps=400)
    later = _specs(2, steps=100, names="late")
    with xshare.Runtime(policy="pack", memory="256MiB", fuse="always") as rt:
        handles = rt.submit_many(first)
        while handles[0].progress().steps_done < 50:
            time.sleep(0.001)
        for spec in later:
            handles.append(rt.submit(spec))
            time.sleep(0.01)
        seen = set()
        while not all(h.status() in ("done", "failed") for h in handles):
            seen.update(g["capacity"] for g in rt.snapshot()["groups"])
            time.sleep(0.005)
        rt.wait()
    assert all(h.status() == "done" for h in handles), [h.error for h in handles]
    assert 4 in seen  # the group grew from 2 to 4 slots for the newcomers
    for h, spec in zip(handles, first + later):
        got, ref = h.result()[0], plain_loop(spec)[0]
        assert max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                   for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref))) < 1e-4


def test_fuse_is_off_by_default():
    with xshare.Runtime(memory="256MiB") as rt:
        handles = rt.submit_many(_specs(2, steps=5))
        rt.wait()
        assert rt.snapshot()["groups"] == []
    assert all(h.status() == "done" for h in handles)


def test_the_fusion_plan_groups_same_program_jobs_and_says_why_others_run_alone():
    from xshare.runtime.compiled.sweeps import explain

    def sgd(lr):
        def step(state, batch):
            g = jax.grad(lambda w: jnp.mean((batch["x"] @ w - batch["y"]) ** 2))(state["w"])
            return {"w": state["w"] - lr * g, "n": state["n"] + 1}, {"n": state["n"]}
        return xshare.job(step)

    specs = _specs(3) + [
        sgd(0.01).bind(linreg_state(dim=8), linreg_data(dim=8), steps=5, name="baked-a"),
        sgd(0.02).bind(linreg_state(dim=8), linreg_data(dim=8), steps=5, name="baked-b"),
        linreg_step.bind(linreg_state(dim=4), linreg_data(dim=4), steps=5, name="narrow"),
    ]
    def shaped(k):  # a Python constant that decides a shape: a different program, not a value
        def step(state, batch):
            g = jax.grad(lambda w: jnp.mean((batch["x"] @ w - batch["y"]) ** 2))(state["w"])
            return {"w": state["w"] - 0.01 * jnp.tile(g[:k], (1, 1)).mean() * g, "n": state["n"] + 1}, {"n": state["n"]}
        return xshare.job(step)

    specs += [shaped(2).bind(linreg_state(dim=8), linreg_data(dim=8), steps=5, name="shaped")]
    report = explain(specs)
    # Constants that differ as values (a learning rate baked into the step) are lifted: one group.
    assert report.groups == [["j0", "j1", "j2"], ["baked-a", "baked-b"]]
    assert report.alone["narrow"].startswith(
        "its state or batch shapes differ from j0's (state leaf w: float32[4, 1] vs float32[8, 1])")
    assert report.alone["shaped"].startswith("its step computes something else than ")
    assert "a constant that decides a shape or Python control flow" in report.alone["shaped"]


FIRE = threading.Event()  # the test sets it: the next step's host check raises


def _raise_once_fired(n):
    if FIRE.is_set():
        raise ValueError(f"host check failed at step {int(np.max(n))}")
    return np.zeros((), np.float32)


@xshare.job
def raising_step(state, batch):
    check = jax.pure_callback(_raise_once_fired, jax.ShapeDtypeStruct((), jnp.float32), state["n"],
                              vmap_method="sequential")
    new_state, metrics = linreg_step.fn(state, batch)
    return new_state, {"loss": metrics["loss"] + check}


def test_an_exception_inside_the_fused_step_fails_every_member_a_paused_one_too_and_nothing_else():
    # Longer than the test, until it fires the host check: it raises only once the member is
    # paused (with a fixed raising step, a run of group steps could pass it before the pause).
    FIRE.clear()
    specs = [raising_step.bind(linreg_state(seed=i), linreg_data(seed=i), steps=10**6, name=f"r{i}")
             for i in range(3)]
    other = linreg_step.bind(linreg_state(dim=4), linreg_data(dim=4), steps=50, name="other")
    with xshare.Runtime(policy="pack", memory="256MiB", fuse="always", dispatch_ahead=1) as rt:
        handles = rt.submit_many(specs)
        while handles[2].progress().steps_done < 3:
            time.sleep(0.001)
        handles[2].pause()  # its slot is in the stack the failing step donates
        FIRE.set()
        alone = rt.submit(other)  # another program: a group of its own, untouched
        rt.wait()
    assert [h.status() for h in handles] == ["failed"] * 3
    assert all("fused step of group-0 raised" in h.error for h in handles)
    assert "host check failed at step" in handles[0].error
    assert alone.status() == "done"
    assert_trees_equal(alone.result()[0], plain_loop(other)[0])
    assert rt.snapshot()["groups"] == []


def test_slot_moves_give_the_same_stack_on_the_host_on_the_device_and_while_compiling(monkeypatch):
    """A group forms on the host, moves slots with compiled put/take once it stepped, falls
    back to a host copy while those still compile, and on a CPU device moves a small stack's
    slots through numpy without compiled moves: all must agree exactly."""
    import dataclasses
    from concurrent.futures import Future

    from xshare.runtime.compiled import fusion
    from xshare.runtime.compiled.compiler import PROGRAMS

    device = jax.devices()[0]
    state, data = linreg_state(), linreg_data()
    program = PROGRAMS.get(linreg_step, state, data(0), device=device, fenced=False, compile=False)
    monkeypatch.setattr(fusion, "HOST_MOVES_BYTES", -1)  # compiled moves, as on an accelerator
    fusion._cache.clear()
    ready = fusion.fused_program(program, 4, device, fenced=False, prefetch=1)
    ready.moves.result()
    compiling = dataclasses.replace(ready, moves=Future())
    monkeypatch.undo()
    fusion._cache.clear()
    numpy_moves = fusion.fused_program(program, 4, device, fenced=False, prefetch=1)
    assert numpy_moves.moves is None and numpy_moves.rent is not None  # (CPU, a stack of a few bytes)
    # (none of its host moves paid for yet: the compiled ones, kept by ``ready`` above, not loaded)
    numpy_moves = dataclasses.replace(numpy_moves, rent=fusion.HostMoves(lambda: None, kept=False))
    one = [np.full(x.shape, 7, x.dtype) for x in jax.tree.leaves(state)]

    host = fusion.put(ready, fusion.host_stack(program, 4), one, 2)
    assert fusion.on_host(host)
    on_device = fusion.put(ready, jax.device_put(fusion.host_stack(program, 4), device), one, 2)
    fallback = fusion.put(compiling, jax.device_put(fusion.host_stack(program, 4), device), one, 2)
    through_numpy = fusion.put(numpy_moves, jax.device_put(fusion.host_stack(program, 4), device), one, 2)
    assert not fusion.on_host(on_device) and fusion.on_host(fallback) and fusion.on_host(through_numpy)
    for stack in (host, on_device, fallback, through_numpy):
        for fused in (ready, compiling, numpy_moves):
            assert_trees_equal(fusion.take(fused, stack, 2), one)
            assert all(float(np.abs(np.asarray(x)).max()) == 0 for x in fusion.take(fused, stack, 1))


def test_host_moves_of_a_stack_on_the_device_pay_for_compiled_moves_and_kept_ones_load_at_once(monkeypatch, tmp_path):
    """Ski rental for a CPU group's slot moves: each move of a stack on the device through the
    host (a copy of the whole stack behind the group calls in flight) is timed; once they have
    cost what compiling the moves would, those compile and take over (the stack stays on the
    device, the same values); a later group of the program on this machine loads them at once."""
    from xshare.runtime.compiled import fusion
    from xshare.runtime.compiled.compiler import PROGRAMS
    from xshare.runtime.compiled.executables import EXECUTABLES

    monkeypatch.setattr(EXECUTABLES, "directory", tmp_path / "executables")
    monkeypatch.setattr(fusion, "MOVES_COMPILE_S", 0.0)  # the first timed host move pays for them
    device = jax.devices()[0]
    state, data = linreg_state(seed=3), linreg_data()
    program = PROGRAMS.get(linreg_step, state, data(0), device=device, fenced=False, compile=False)
    fusion._cache.clear()
    fused = fusion.fused_program(program, 8, device, fenced=False, prefetch=1)
    assert fused.moves is None and fused.rent.moves is None  # nothing kept yet, nothing paid
    one = [np.full(x.shape, 5, x.dtype) for x in jax.tree.leaves(state)]
    formed = fusion.put(fused, fusion.host_stack(program, 8), one, 3)
    assert fusion.on_host(formed) and fused.rent.moves is None  # (a host stack: no sync to pay for)
    stepped = jax.device_put(formed, device)
    through_host = fusion.put(fused, stepped, one, 5)
    assert fusion.on_host(through_host) and fused.rent.spent_s > 0 and fused.rent.moves is not None
    fused.rent.moves.result(timeout=120)
    compiled = fusion.put(fused, jax.device_put(formed, device), one, 5)
    assert not fusion.on_host(compiled)  # the compiled put: the stack stays on the device
    for stack in (through_host, compiled):
        assert_trees_equal(fusion.take(fused, stack, 5), one)
        assert_trees_equal(fusion.take(fused, stack, 3), one)
        assert all(float(np.abs(np.asarray(x)).max()) == 0 for x in fusion.take(fused, stack, 0))
    import time
    deadline = time.monotonic() + 60  # (kept on a thread of their own)
    while not fusion._moves_kept(program.key, 8, device, fusion.tree_nbytes(fusion._group_args(program, 8, device, False)[0])) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    fusion._cache.clear()
    again = fusion.fused_program(program, 8, device, fenced=False, prefetch=1)
    assert again.rent.moves is not None  # kept on this machine: loading from the start, nothing paid
    again.rent.moves.result(timeout=60)
    assert not fusion.on_host(fusion.put(again, jax.device_put(formed, device), one, 6))


def test_a_process_that_exits_while_slot_moves_compile_exits_cleanly():
    """put/take compile on a background thread after the group's program: a script that ends
    right then must exit 0, not abort in C++ at interpreter exit (a daemon thread did)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import jax
        from tests.helpers import linreg_data, linreg_state, linreg_step
        from xshare.runtime.compiled import fusion
        from xshare.runtime.compiled.compiler import PROGRAMS
        device = jax.devices()[0]
        program = PROGRAMS.get(linreg_step, linreg_state(), linreg_data()(0), device=device,
                               fenced=False, compile=False)
        fusion.HOST_MOVES_BYTES = -1  # compiled moves, as on an accelerator
        fused = fusion.fused_program(program, 8, device, fenced=False, prefetch=1)
        # (its moves are still compiling as the script ends: they take ~0.1 s)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "FATAL" not in out.stderr


def test_a_groups_last_steps_are_in_the_timeline_after_wait():
    from xshare import ffi
    if not ffi.available():
        pytest.skip("no fences on this machine: the timeline is host-timed")
    steps = 300
    with xshare.Runtime(policy="pack", memory="256MiB", fuse="always", steps_per_call=1) as rt:
        handles = rt.submit_many(_specs(3, steps=steps))
        rt.wait()
        members = {h.id for h in handles}
        group = [r.step for r in rt.timeline() if r.job not in members]
    # One record per group step, the last ones too: they were drained before the group closed
    # (the recorder drains a few times a second; records of a unit gone by then were dropped).
    assert sorted(group) == list(range(steps))


@pytest.mark.parametrize("how", ["raises", "another shape"])
def test_members_failing_inside_a_group_step_shrink_it_without_failing_the_others(how):
    # Two members open a group (2 slots); six more join it (it grows to 8) and fail at one group
    # step, their data raising or giving a batch of another shape, with nothing in flight
    # (dispatch_ahead=0). Each leaves its slot while that step is being assembled, and the last
    # to leave shrinks the group back to its 2-slot program (compiled already: the shrink is
    # free). The step must
    # then run the two members left on that program, in their new slots: it once stacked them
    # at the old capacity and called the 2-slot program with an 8-slot mask, and both failed
    # ("Argument types differ": found by a random sweep with dispatch_ahead=0).
    stays = _specs(2, steps=300, names="stays")

    def bad_at_10(seed):
        data = linreg_data(dim=8, seed=seed)

        def batch(k):
            if k == 10 and how == "raises":
                raise RuntimeError("disk gone at batch 10")
            b = data(k)
            return {"x": b["x"][:, :5], "y": b["y"]} if k == 10 else b
        return batch

    ending = [linreg_step.bind(linreg_state(dim=8, seed=10 + i), bad_at_10(10 + i), steps=300, name=f"bad{i}")
              for i in range(6)]
    for n in (2, 4, 8):  # the group's programs at 2, 4 and 8 slots compiled first: the joiners
        _run(_specs(n, steps=2, names=f"warm{n}_"), dispatch_ahead=0)  # join at once, all six
    with xshare.Runtime(policy="pack", memory="256MiB", fuse="always", dispatch_ahead=0) as rt:
        first = rt.submit_many(stays)
        while any(h.progress().steps_done < 5 for h in first):
            time.sleep(0.001)
        later = rt.submit_many(ending)
        rt.wait()
        groups = rt.snapshot()["groups"]
    for h in later:
        assert h.status() == "failed"
        assert h.error.startswith("its data raised while producing batch 10" if how == "raises"
                                  else "batch 10 does not match the compiled step"), h.error
        assert h.progress().steps_done == 10
    for h, spec in zip(first, stays):
        assert h.status() == "done", (h.error, groups)
        assert h.progress().steps_done == 300
        got, ref = h.result()[0], plain_loop(spec)[0]  # vmapped at 2 slots, 8, then 2: close
        assert max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                   for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref))) < 1e-4
