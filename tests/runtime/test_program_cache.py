"""Compile once per program: N jobs of one program share one executable, and jobs whose
programs differ never share one (same shapes, different step functions or constants)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import jax.numpy as jnp

import xshare
from xshare.runtime.compiled import compiler
from xshare.runtime.compiled.compiler import PROGRAMS
from xshare.runtime.compiled.promotions import Promotions, fingerprint
from tests.helpers import assert_trees_equal, linreg_data, linreg_state, plain_loop


def _sgd_step(lr: float):
    """A new function object per call: a factory, as model zoos and sweeps write them."""
    def step(state, batch):
        def loss_fn(w):
            return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
        loss, g = jax.value_and_grad(loss_fn)(state["w"])
        return {"w": state["w"] - lr * g, "n": state["n"] + 1}, {"loss": loss}
    return step


def _run(specs, **kw):
    before = PROGRAMS.compiles
    with xshare.Runtime(memory="256MiB", **kw) as rt:
        handles = rt.submit_many(specs)
        rt.wait()
    for spec, h in zip(specs, handles):
        assert_trees_equal(h.result()[0], plain_loop(spec)[0])
    return PROGRAMS.compiles - before, handles


def test_eight_jobs_bound_from_one_step_compile_once():
    step = xshare.job(_sgd_step(0.031), name="once")
    specs = [step.bind(linreg_state(dim=7, seed=i), linreg_data(dim=7, seed=i), steps=20, name=f"o{i}")
             for i in range(8)]
    compiles, handles = _run(specs, policy="pack")
    assert compiles == 1
    assert len({h._rec.program.key for h in handles}) == 1


def test_jobs_from_separate_factory_calls_with_the_same_program_share_it():
    specs = [xshare.job(_sgd_step(0.029)).bind(linreg_state(dim=6, seed=i), linreg_data(dim=6, seed=i),
                                               steps=10, name=f"f{i}") for i in range(4)]
    compiles, handles = _run(specs, policy="fifo")
    assert compiles == 1  # four traces (four function objects), one XLA compile
    assert len({h._rec.program.executable for h in handles}) == 1


def test_same_shapes_but_different_constants_are_different_programs():
    # lr is a compile-time constant of each closure: sharing an executable would train one job
    # with the other's learning rate. Each must match its own plain loop (checked in _run).
    specs = [xshare.job(_sgd_step(lr)).bind(linreg_state(dim=5, seed=0), linreg_data(dim=5, seed=0),
                                            steps=15, name=f"lr{lr}") for lr in (0.01, 0.02)]
    compiles, handles = _run(specs, policy="pack")
    assert compiles == 2
    assert handles[0]._rec.program.key != handles[1]._rec.program.key
    assert not jnp.array_equal(handles[0].result()[0]["w"], handles[1].result()[0]["w"])


def test_same_shapes_but_different_step_functions_are_different_programs():
    def other(state, batch):
        loss = jnp.mean(batch["x"] @ state["w"])
        return {"w": state["w"] * 0.5, "n": state["n"] + 1}, {"loss": loss}

    specs = [xshare.job(_sgd_step(0.05)).bind(linreg_state(dim=9), linreg_data(dim=9), steps=5, name="a"),
             xshare.job(other).bind(linreg_state(dim=9), linreg_data(dim=9), steps=5, name="b")]
    compiles, handles = _run(specs, policy="pack")
    assert compiles == 2
    assert handles[0]._rec.program.key != handles[1]._rec.program.key


def test_submit_many_returns_before_compiling():
    step = xshare.job(_sgd_step(0.027))
    specs = [step.bind(linreg_state(dim=11, seed=i), linreg_data(dim=11, seed=i), steps=5, name=f"s{i}")
             for i in range(16)]
    with xshare.Runtime(memory="256MiB") as rt:
        handles = rt.submit_many(specs)
        # The program is new to this process, so nothing can have compiled yet: every job is
        # handed back in the compiling state (compilation runs on the runtime's compile pool).
        assert {h.status() for h in handles} <= {"compiling", "queued", "running"}
        assert handles[-1].status() == "compiling"
        rt.wait()
    assert all(h.status() == "done" for h in handles)


def _cb_a(n):
    return np.float32(1.0)


def _cb_b(n):
    return np.float32(2.0)


def _with_callback(cb):
    def step(state, batch):
        extra = jax.pure_callback(cb, jax.ShapeDtypeStruct((), jnp.float32), state["n"])
        return {"w": state["w"] * extra, "n": state["n"] + 1}, {"extra": extra}
    return xshare.job(step)


def test_steps_that_differ_only_in_their_host_callback_never_share_a_program():
    # Their StableHLO is identical (a callback lowers to an index, not its function): sharing
    # would run one job's callback in the other's step.
    specs = [_with_callback(cb).bind(linreg_state(dim=3), linreg_data(dim=3), steps=3, name=f"cb{i}")
             for i, cb in enumerate((_cb_a, _cb_b))]
    compiles, handles = _run(specs, policy="pack")
    assert compiles == 2
    assert [h.result()[1]["extra"] for h in handles] == [1.0, 2.0]


@pytest.mark.parametrize("options", [{"policy": "pack", "steps_per_call": 8}, {"policy": "pack", "fuse": "always"}],
                         ids=["solo", "fused"])
def test_the_users_step_is_traced_once_for_a_sweep_whatever_is_built_on_it(options, monkeypatch):
    # flax's TrainState carries ``step`` as a Python int that apply_gradients increments: with
    # nothing known of the step, its Python ints are guessed to be counters (promotions.prior)
    # and it is traced once, with ``n`` an array (as jax.jit would carry it). Nothing after
    # that runs the user's Python again: not the later jobs of the sweep, not the fenced
    # program, not the K-step scans the jobs are promoted to, not a fused group's vmap (they
    # replay the jaxpr). (With a float counter the guess misses: see the tests below.)
    monkeypatch.setattr(compiler, "PROMOTIONS", Promotions())
    traces = []

    def step(state, batch):
        traces.append(type(state["n"]).__name__)
        w = state["w"] - 0.01 * jax.grad(lambda w: jnp.mean((batch["x"] @ w - batch["y"]) ** 2))(state["w"])
        return {"w": w, "n": state["n"] + 1}, {"n": state["n"]}

    job = xshare.job(step, name="counted")
    # Solo: long enough for the K-step programs to compile while the jobs run (a run of one-step
    # calls, Executor.run, takes these tiny steps at ~40 us).
    steps = 400 if "fuse" in options else 2000
    specs = [job.bind({"w": linreg_state(dim=4, seed=i)["w"], "n": 0}, linreg_data(dim=4, seed=i),
                      steps=steps, name=f"c{i}") for i in range(5)]
    with xshare.Runtime(memory="256MiB", **options) as rt:
        handles = rt.submit_many(specs)
        rt.wait()
        snap = rt.snapshot()
    assert traces == ["DynamicJaxprTracer"], traces
    if "fuse" in options:
        assert snap["runtime"]["fused_member_steps"] == 5 * steps, snap["runtime"]
    else:  # (the K-step programs were built: the replays were exercised)
        assert all(int(k) > 1 for j in snap["jobs"] for k in j["steps_per_call"] if k != "1"), snap["jobs"]
        assert any(len(j["steps_per_call"]) > 1 for j in snap["jobs"]), [j["steps_per_call"] for j in snap["jobs"]]
    for spec, h in zip(specs, handles):
        final = h.result()[0]
        ref = plain_loop(spec)[0]
        assert int(final["n"]) == int(ref["n"]) == steps
        assert_trees_equal(final["w"], ref["w"])


def _counting_step(traces, *, changes_n=True, loops_on_n=False):
    def step(state, batch):
        traces.append(type(state["n"]).__name__)
        if loops_on_n:  # Python control flow on the number: it can only be static
            for _ in range(state["n"] % 2):
                pass
        w = state["w"] - 0.01 * jax.grad(lambda w: jnp.mean((batch["x"] @ w - batch["y"]) ** 2))(state["w"])
        return {"w": w, "n": state["n"] + 1 if changes_n else state["n"]}, {"loss": jnp.sum(w)}
    return step


def _sweep(step, traces, n=3, steps=30, plain=True, n0=0):
    """Run a sweep of ``step`` (whose traces ``traces`` records) in a Runtime; the traces it
    took, and its handles, each checked against the plain loop (whose own trace is not counted;
    ``plain=False``: a step jax.jit cannot trace, not checked here). ``n0``: the number the
    states start with (an int is a counter to ``promotions.prior``, a float is not)."""
    job = xshare.job(step, name="hinted")  # a new Job: nothing in the trace memo (as a new process)
    specs = [job.bind({"w": linreg_state(dim=4, seed=i)["w"], "n": n0}, linreg_data(dim=4, seed=i),
                      steps=steps, name=f"h{i}") for i in range(n)]
    traces.clear()
    with xshare.Runtime(memory="256MiB", policy="pack") as rt:
        handles = rt.submit_many(specs)
        rt.wait()
    taken = list(traces)
    for spec, h in zip(specs, handles):
        if plain:
            assert_trees_equal(h.result()[0], plain_loop(spec)[0])
    return taken, handles


def test_a_step_whose_promotion_was_learned_before_is_traced_once(tmp_path, monkeypatch):
    """What one process learned (``promotions.json`` beside the compilation cache) spares the
    next its wasted first trace; the program and the results are the same. (A float counter:
    ``promotions.prior`` guesses only ints, so the first process traces it twice.)"""
    monkeypatch.setattr(compiler, "PROMOTIONS", Promotions())
    compiler.PROMOTIONS.persist(str(tmp_path))
    traces: list = []
    step = _counting_step(traces)
    taken, first = _sweep(step, traces, n0=0.0)
    assert taken == ["float", "DynamicJaxprTracer"], taken
    assert (tmp_path / "promotions.json").exists()
    monkeypatch.setattr(compiler, "PROMOTIONS", Promotions())  # a new process, the same cache
    compiler.PROMOTIONS.persist(str(tmp_path))
    taken, again = _sweep(step, traces, n0=0.0)
    assert taken == ["DynamicJaxprTracer"], taken
    for h, g in zip(first, again):
        assert_trees_equal(h.result()[0], g.result()[0])


@pytest.mark.parametrize("kind", ["passes_it_through", "loops_on_it"])
def test_a_hint_the_step_does_not_bear_out_is_dropped_and_the_program_is_the_hint_free_one(kind, monkeypatch):
    """A hint naming a number the step passes through unchanged (or cannot take as an array:
    Python control flow on it) is not followed: the number stays static, as with no hint."""
    monkeypatch.setattr(compiler, "PROMOTIONS", Promotions())
    traces: list = []
    step = _counting_step(traces, changes_n=False, loops_on_n=kind == "loops_on_it")
    state = {"n": 0, "w": linreg_state(dim=4, seed=0)["w"]}  # the sweep's state shape
    key = fingerprint(step, state)
    compiler.PROMOTIONS.learn(key, frozenset({0}))  # "n" is leaf 0 (dict keys sorted)
    assert compiler.PROMOTIONS.hint(key, state) == frozenset({0})
    plain = kind == "passes_it_through"  # (jax.jit cannot trace a Python loop on a traced n)
    taken, handles = _sweep(step, traces, plain=plain)
    assert taken == ["DynamicJaxprTracer", "int"], taken  # hinted first, then hint-free
    assert compiler.PROMOTIONS.hint(key, state) == frozenset()  # and it is forgotten
    assert all(type(h.result()[0]["n"]) is int for h in handles)  # static, as without a hint
    # A new process that knows nothing of the step: ``promotions.prior`` guesses the int is a
    # counter, which the step does not bear out either (one more trace, as above), and the
    # program is the same hint-free one. What that process learned spares the next one that.
    monkeypatch.setattr(compiler, "PROMOTIONS", Promotions())
    unhinted, again = _sweep(step, traces, plain=False)
    assert unhinted == ["DynamicJaxprTracer", "int"], unhinted
    assert compiler.PROMOTIONS.hint(key, state) == frozenset()
    learned, third = _sweep(step, traces, plain=False)
    assert learned == ["int"], learned
    for h, g, k in zip(handles, again, third):
        assert_trees_equal(h.result()[0], g.result()[0])
        assert_trees_equal(h.result()[0], k.result()[0])


def test_a_steps_fingerprint_is_the_same_in_every_process():
    """A hint is only worth keeping if the next process finds it: the fingerprint holds no
    addresses and does not change with the process's string-hash seed."""
    import os
    import subprocess
    import sys

    code = ("from tests.helpers import linreg_state, linreg_step\n"
            "from xshare.runtime.compiled.promotions import fingerprint\n"
            "print(fingerprint(linreg_step.fn, dict(linreg_state(dim=3), n=0)))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    from tests.helpers import linreg_state, linreg_step
    here = fingerprint(linreg_step.fn, dict(linreg_state(dim=3), n=0))
    assert outs == {here}
    assert fingerprint(linreg_step.fn, dict(linreg_state(dim=4), n=0)) != here  # another shape
    assert fingerprint(_sgd_step(0.1), dict(linreg_state(dim=3), n=0)) != here  # another step


def test_states_whose_counter_is_an_array_in_one_and_a_python_int_in_another_share_a_program_and_both_run():
    """A program is shared by the jobs whose steps trace to it, but which state leaves a job
    carries as arrays is the job's own: a ``TrainState`` whose ``step`` is an array (restored,
    or the output of an earlier jit loop) and a fresh one, whose ``step`` is the Python int
    ``TrainState.create`` gives it, trace to one program. The first job's promotions (none)
    were once read off the shared program for the second, whose ``step`` then stayed static:
    it failed at its first step with 13 state leaves where the program takes 14."""
    import flax.linen as nn
    import optax
    from flax.training import train_state

    from tests.reliability.test_random_sweeps import train_step as step  # (the Flax docs' step)

    net, tx = nn.Dense(3), optax.sgd(0.1)
    batches = [{"x": np.full((4, 5), i, np.float32), "y": np.arange(4) % 3} for i in range(3)]
    job = xshare.job(step)

    def fresh(seed):
        params = net.init(jax.random.key(seed), jnp.zeros((1, 5)))["params"]
        return train_state.TrainState.create(apply_fn=net.apply, params=params, tx=tx)

    restored = fresh(0).replace(step=jnp.asarray(7, jnp.int32))  # (as a checkpoint gives it back)
    handles = []
    for state in (restored, fresh(1)):  # one runtime each, in this order: the second reuses the program
        with xshare.Runtime(memory="64MiB") as rt:
            handles.append(rt.submit(job.bind(state, batches, steps=3)))
            rt.wait()
    for state, handle in zip((restored, fresh(1)), handles):
        assert handle.status() == "done", handle.error
        want = state
        for batch in batches:
            want, _ = jax.jit(step)(want, batch)
        assert_trees_equal(jax.tree.leaves(handle.result()[0]), jax.tree.leaves(want))
