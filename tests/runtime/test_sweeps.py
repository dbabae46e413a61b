"""Sweeps as users write them: one program per computation, constants lifted for fused groups.

References are the users' own code under ``jax.jit`` in a plain loop. Unfused jobs are
bit-identical; fused members are within the fused tolerance (vmap changes reduction order, and
a lifted constant is an operand XLA cannot fold) and each honours its own hyperparameters.
"""

from __future__ import annotations

import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import xshare
from xshare.runtime.engine.streams import parallel_streams
from xshare.sched.capacity import parallel_groups, split_capacity
from tests.helpers import assert_trees_equal
from xshare.runtime.compiled.compiler import PROGRAMS

TOL = 1e-4


class _MLP(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.relu(nn.Dense(self.width)(x)))


def _state(width: int, tx, seed: int = 0):
    net = _MLP(width)
    params = net.init(jax.random.key(seed), jnp.ones((1, 6)))
    # The Flax docs' pattern: apply_fn and tx are static fields, tx a new object per job.
    return train_state.TrainState.create(apply_fn=net.apply, params=params, tx=tx)


@xshare.job
def ts_step(state, batch):
    def loss(p):
        return jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2)

    value, grads = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=grads), {"loss": value}


def _data(step: int):
    rng = np.random.default_rng(step)
    x = rng.normal(size=(16, 6)).astype(np.float32)
    return {"x": x, "y": np.sin(x.sum(1, keepdims=True)).astype(np.float32)}


def _plain(state, steps: int):
    step = jax.jit(ts_step.fn)
    for k in range(steps):
        state, _ = step(state, _data(k))
    return jax.device_get(state)


def _max_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _moved(a, b) -> float:
    return _max_diff(a.params, b.params)


def test_train_states_with_their_own_tx_objects_are_one_program_and_bit_identical():
    width = 37  # a shape no other test compiles: this test's compile count is its own
    specs = [ts_step.bind(_state(width, optax.sgd(0.01, 0.9), seed=i), _data, steps=20, name=f"ts{i}")
             for i in range(8)]
    before = PROGRAMS.compiles
    with xshare.Runtime(policy="pack") as rt:
        handles = rt.submit_many(specs)
        rt.wait()
    assert PROGRAMS.compiles - before == 1, "8 TrainStates of one shape must be one program"
    for h, spec in zip(handles, specs):
        got = h.result()[0]
        assert isinstance(got, train_state.TrainState) and got.tx is spec.state.tx  # its own statics
        assert int(got.step) == 20
        assert_trees_equal(got.params, _plain(spec.state, 20).params)


@pytest.mark.parametrize("family", ["adam", "sgd-cosine-wd"])
def test_a_sweep_with_baked_hyperparameters_fuses_as_one_program_and_honours_each(family):
    lrs = [0.0, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-4, 1e-4]
    width = 23 if family == "adam" else 29

    def tx(i, lr):
        if family == "adam":
            return optax.adam(lr)
        return optax.chain(optax.add_decayed_weights(1e-4 * (i + 1)),
                           optax.sgd(optax.cosine_decay_schedule(lr, 40), momentum=0.9))

    specs = [ts_step.bind(_state(width, tx(i, lr)), _data, steps=40, name=f"{family}{i}")
             for i, lr in enumerate(lrs)]
    before = PROGRAMS.compiles
    with xshare.Runtime(policy="pack", fuse="always") as rt:
        plan = rt.explain(specs)
        assert plan.groups == [[s.name for s in specs]] and not plan.alone
        streams = parallel_streams(jax.devices()[0], True)
        assert plan.split == [(parallel_groups(8, streams), split_capacity(8, streams))]  # (what it opens, below)
        handles = rt.submit_many(specs)
        groups = set()
        while not all(h.status() in ("done", "failed") for h in handles):
            groups.update(g["name"] for g in rt.snapshot()["groups"])
            time.sleep(0.002)
        rt.wait()
        fused = rt._dispatcher.fused_member_steps
    assert all(h.status() == "done" for h in handles), [h.error for h in handles]
    assert PROGRAMS.compiles - before == 1, "the sweep is one (fused, lifted) program"
    # one group per execution stream that runs beside the others (two on this project's 2-core
    # CPU), every one on that program: sched/capacity.py, parallel_groups
    assert len(groups) == parallel_groups(8, streams) and fused == 8 * 40
    for lr, h, spec in zip(lrs, handles, specs):
        got = h.result()[0]
        ref = _plain(spec.state, 40)
        assert _max_diff(got.params, ref.params) < TOL, lr
        if lr == 0.0:
            assert _moved(got, spec.state) == 0.0  # lr=0 does not move: its own lr was honoured
        else:
            assert _moved(got, spec.state) > 10 * TOL
    # different learning rates ended in different places (no member ran another's constants)
    finals = [h.result()[0].params for h in handles]
    assert min(_max_diff(a, b) for i, a in enumerate(finals) for b in finals[i + 1:]) > TOL


def _loop_step(lr, loop):
    @xshare.job
    def step(state, batch):
        def inner(w, x):
            g = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)
            w = jax.lax.cond(jnp.sum(g) > 0, lambda w: w - lr * g, lambda w: w - 0.5 * lr * g, w)
            return w, jnp.mean(g)

        if loop == "scan":
            w, gs = jax.lax.scan(inner, state["w"], batch["x"])
            return {"w": w}, {"g": gs.mean()}
        # a while loop over the batch's rows, with the constant in its body
        def body(c):
            i, w = c
            return i + 1, inner(w, batch["x"][i])[0]
        _, w = jax.lax.while_loop(lambda c: c[0] < batch["x"].shape[0], body, (0, state["w"]))
        return {"w": w}, {"g": jnp.mean(w)}
    return step


def _scan_rebuildable() -> bool:
    closed = jax.make_jaxpr(lambda c, xs: jax.lax.scan(lambda c, x: (c + x, c), c, xs))(0.0, jnp.ones(3))
    return "num_consts" in closed.jaxpr.eqns[-1].params


@pytest.mark.parametrize("loop", ["while", "scan"])
def test_constants_inside_loops_and_cond_are_lifted(loop):
    def data(k):
        return {"x": np.random.default_rng(k).normal(size=(3, 4, 5)).astype(np.float32)}

    lrs = [0.0, 0.01, 0.05, 0.1]
    w0 = jnp.asarray(np.random.default_rng(0).normal(size=(5, 2)), jnp.float32)
    specs = [_loop_step(lr, loop).bind({"w": w0}, data, steps=10, name=f"{loop}{i}")
             for i, lr in enumerate(lrs)]
    with xshare.Runtime(fuse="always") as rt:
        plan = rt.explain(specs)
        handles = rt.submit_many(specs)
        rt.wait()
    if loop == "scan" and not _scan_rebuildable():
        # jax >= 0.12's scan: the constant cannot be lifted, and the dry run says so
        assert plan.groups == []
        assert "a differing constant sits inside 'scan'" in plan.alone[specs[0].name]
    else:
        assert plan.groups == [[s.name for s in specs]]
    for lr, h, spec in zip(lrs, handles, specs):
        ref, step = {"w": w0}, jax.jit(spec.fn)
        for k in range(10):
            ref, _ = step(ref, data(k))
        got = h.result()[0]
        assert _max_diff(got, ref) < TOL
        assert (_max_diff(got, {"w": w0}) == 0.0) == (lr == 0.0)


def test_a_job_that_ran_alone_moves_into_the_group_a_later_peer_opens():
    width = 41
    def slow_data(step):  # keeps the first job running while the later one compiles
        time.sleep(0.001)
        return _data(step)

    # SGD: over 3000 steps Adam would amplify the fused reduction-order drift (docs/explanation/numerics.md)
    first = ts_step.bind(_state(width, optax.sgd(1e-2)), slow_data, steps=3000, name="first")
    later = ts_step.bind(_state(width, optax.sgd(3e-3)), _data, steps=100, name="later")
    with xshare.Runtime(policy="pack", fuse="always") as rt:
        a = rt.submit(first)
        while a.progress().steps_done < 20:
            time.sleep(0.001)
        assert not rt.snapshot()["groups"]  # no group of one: it runs its own program
        b = rt.submit(later)
        seen = set()
        while not all(h.status() in ("done", "failed") for h in (a, b)):
            for g in rt.snapshot()["groups"]:
                seen.add(g["capacity"])
            time.sleep(0.002)
        rt.wait()
    assert a.status() == b.status() == "done", (a.error, b.error)
    assert seen == {2}, "the later job's group adopted the running one"
    for h, spec, steps in ((a, first, 3000), (b, later, 100)):
        got = h.result()[0]
        assert int(got.step) == steps
        assert _max_diff(got.params, _plain(spec.state, steps).params) < TOL


def test_a_constant_that_decides_a_shape_runs_alone_and_says_why():
    def make(k):
        @xshare.job
        def step(state, batch):
            g = jax.grad(lambda w: jnp.mean((batch["x"][:, :k] @ w[:k]) ** 2))(state["w"])
            return {"w": state["w"] - 0.1 * g}, {"g": jnp.mean(g)}
        return step

    def data(step):
        return {"x": np.random.default_rng(step).normal(size=(8, 6)).astype(np.float32)}

    w0 = jnp.ones((6, 1), jnp.float32)
    specs = [make(k).bind({"w": w0}, data, steps=5, name=f"k{k}") for k in (2, 3)]
    with xshare.Runtime(fuse="always") as rt:
        plan = rt.explain(specs)
        handles = rt.submit_many(specs)
        rt.wait()
    assert plan.groups == []
    assert "a constant that decides a shape or Python control flow" in plan.alone["k3"]
    assert all(h.status() == "done" for h in handles)
    assert not rt.snapshot()["groups"]


def test_explain_given_a_name_says_it_takes_the_specs():
    with xshare.Runtime(memory="256MiB", fuse=True) as rt:
        with pytest.raises(TypeError, match=r"explain\(\) takes the JobSpecs .* got 'j0'"):
            rt.explain("j0")


def test_explain_given_a_handle_says_it_takes_the_specs():
    from tests.helpers import linreg_data, linreg_state, linreg_step

    with xshare.Runtime(memory="256MiB", fuse=True) as rt:
        handle = rt.submit(linreg_step.bind(linreg_state(), linreg_data(), steps=2, name="j0"))
        with pytest.raises(TypeError, match=r"explain\(\) takes the JobSpecs .* not a job's name or handle"):
            rt.explain(handle)  # (before: "'JobHandle' object is not iterable")
        rt.wait()


_TRACED: list = []


@xshare.job
def _counted_step(state, batch):
    _TRACED.append(id(state.tx))  # runs once per trace of a job's step: its own tx object
    return ts_step.fn(state, batch)


def test_a_job_no_family_program_covers_is_traced_once_to_be_matched_and_lowered():
    # A study's second model shape: its trials arrive when a family program already exists, so a
    # fused runtime traces each to match it (prepare._covering), finds no family that covers it,
    # and lowers it in a second pass. That pass and the lowering reuse the first trace (before,
    # such a trial's step ran three times: ~35 ms each for a digits trial, the GIL held).
    with xshare.Runtime(policy="pack", fuse="always") as rt:
        first = [_counted_step.bind(_state(31, optax.adam(lr)), _data, steps=10, name=f"w31-{i}")
                 for i, lr in enumerate((1e-3, 3e-3, 1e-2))]
        rt.submit_many(first)
        rt.wait()
        del _TRACED[:]
        second = [_counted_step.bind(_state(33, optax.adam(lr)), _data, steps=10, name=f"w33-{i}")
                  for i, lr in enumerate((2e-3, 5e-3, 2e-2))]
        handles = rt.submit_many(second)
        rt.wait()
    assert sorted(_TRACED) == sorted(id(spec.state.tx) for spec in second), _TRACED
    for h, spec in zip(handles, second):
        assert _max_diff(h.result()[0].params, _plain(spec.state, 10).params) < TOL
