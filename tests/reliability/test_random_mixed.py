"""Random sweeps of several programs at once under a small memory budget: Linen ``TrainState``
jobs as the Flax docs write them, of three widths, two batch sizes and two optimizers (SGD with
momentum, Adam), baked in, so a runtime holds up to twelve programs; a budget of tens of KiB, so
jobs wait for admission, and a job too big for the budget alone fails with the reason while the
others run. Random policy, K steps per call, pipeline depth, one stream or parallel lanes,
checkpoints with results kept on disk or in memory, arrivals in waves and random controls
(pause, pause with offload, resume, priority, cancel) from another thread.

What is asserted holds for every interleaving: every job ends; an unfused job that was not
cancelled ends in the plain ``jax.jit`` loop's state bit for bit and its observer sees every
step once, in order, with the plain loop's loss; a fused one sees every step once, close to the
plain loop's (docs/explanation/numerics.md). And a sweep stopped with ``stop(checkpoint=True)``
at a random moment and resumed in a new Runtime ends the same way.

A few seeds run by default; ``-m slow`` runs many more.
"""

from __future__ import annotations

import random
import threading
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import xshare
from xshare.bench.chaos import random_controls
from tests.helpers import loss_recorders
from tests.reliability.test_random_sweeps import train_step  # (the Flax docs' step)

_rng = np.random.default_rng(3)
BATCHES = {size: [{"x": _rng.normal(size=(size, 12)).astype(np.float32),
                   "y": _rng.integers(0, 4, size=(size,)).astype(np.int32)} for _ in range(24)]
           for size in (8, 16)}
TOO_BIG = "but the arena holds"  # (the admission error of a job larger than the whole budget)


class Net(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.tanh(nn.Dense(self.width)(x)))


NETS = {width: Net(width) for width in (24, 40, 64)}
TXS = {"sgd": optax.sgd(0.05, momentum=0.9), "adam": optax.adam(1e-3)}


def initial_state(job: dict):
    net = NETS[job["width"]]
    params = net.init(jax.random.key(job["seed"]), jnp.ones((1, 12)))["params"]
    return train_state.TrainState.create(apply_fn=net.apply, params=params, tx=TXS[job["tx"]])


def data(job: dict):
    batches, offset = BATCHES[job["batch"]], 5 * job["seed"]
    return lambda k: batches[(k + offset) % len(batches)]


_PLAIN = jax.jit(train_step, donate_argnums=0)


def plain_loop(job: dict) -> tuple:
    state = jax.tree.map(lambda x: jnp.array(x, copy=True), initial_state(job))
    losses = []
    for k in range(job["steps"]):
        state, metrics = _PLAIN(state, data(job)(k))
        losses.append(np.asarray(metrics["loss"]))
    return jax.device_get(state), losses


def random_job(r: random.Random, seed: int, steps: int) -> dict:
    return {"seed": seed, "width": r.choice(sorted(NETS)), "tx": r.choice(sorted(TXS)), "batch": r.choice([8, 16]),
            "steps": steps, "priority": r.randint(-2, 2), "wave": r.randint(0, 3)}


def mixed_sweep(seed: int, tmp_path) -> dict:
    """A random sweep of several programs under a small budget; returns what each job saw and
    how it ended."""
    r = random.Random(seed)
    kw: dict = {"policy": r.choice(xshare.POLICIES), "memory": r.choice(["40KiB", "56KiB", "64KiB", "80KiB", "256MiB"]),
                "steps_per_call": r.choice([1, 2, 4, 8, 16, "auto", "auto"])}
    if r.random() < 0.4:
        kw["fuse"] = r.choice([True, "always"])
    if r.random() < 0.3:
        kw["dispatch_ahead"] = r.randint(0, 4)
    if r.random() < 0.3:
        kw.update(checkpoint_dir=tmp_path, checkpoint_every=r.randint(5, 60), keep_results=r.random() < 0.5)
    if r.random() < 0.3:
        kw["parallel_lanes"] = False
    jobs = [random_job(r, seed * 10 + i, r.choice([r.randint(1, 20), r.randint(20, 150), r.randint(150, 400)]))
            for i in range(r.randint(2, 10))]
    seen, observer = loss_recorders(len(jobs))

    step = xshare.job(train_step, name="net")
    specs = [step.bind(initial_state(j), data(j), steps=j["steps"], name=f"j{i}", priority=j["priority"],
                       observer=observer(i)) for i, j in enumerate(jobs)]
    cancelled: set[str] = set()
    waited: set[str] = set()  # jobs seen waiting for memory (status "queued")
    with xshare.Runtime(**kw) as rt:
        handles: list = [None] * len(specs)
        done = threading.Event()
        watcher = threading.Thread(target=_watch, args=(handles, waited, done))
        watcher.start()
        for wave in range(4):  # later waves arrive while the earlier ones run (or wait for memory)
            indices = [i for i, j in enumerate(jobs) if j["wave"] == wave]
            for i, handle in zip(indices, rt.submit_many([specs[i] for i in indices])):
                handles[i] = handle
            time.sleep(r.uniform(0, 0.03))
        budget = iter(range(r.randint(0, 25)))
        random_controls(rt, handles, random.Random(seed + 1), weights=(30, 10, 40, 15, 5),
                        keep_going=lambda: next(budget, None) is not None, sleep_s=(0.0005, 0.01),
                        cancelled=cancelled)
        assert rt.wait(timeout=300), rt.snapshot()
        done.set()
        watcher.join()
        results = {i: h.error if h.status() == "failed" else h.result(timeout=60)
                   for i, h in enumerate(handles) if h.name not in cancelled}
    return {"kw": kw, "jobs": jobs, "seen": seen, "results": results, "waited": waited}


def _watch(handles: list, waited: set, done: threading.Event) -> None:
    while not done.is_set():
        waited.update(h.name for h in list(handles) if h is not None and h.status() == "queued")
        time.sleep(0.0005)


def check(run: dict) -> None:
    exact = "fuse" not in run["kw"]
    for i, job in enumerate(run["jobs"]):
        if i not in run["results"]:
            continue  # cancelled
        where = f"job {i} {job} under {run['kw']}"
        result = run["results"][i]
        if isinstance(result, str):  # failed: only a job larger than the whole budget may
            assert TOO_BIG in result, f"{where}: {result}"
            continue
        state, losses = plain_loop(job)
        steps = [k for k, _ in run["seen"][i]]
        assert steps == list(range(job["steps"])), f"{where}: the observer saw steps {steps[:8]}..."
        got = np.array([loss for _, loss in run["seen"][i]])
        if exact:
            bad = [k for k in range(job["steps"]) if not np.array_equal(got[k], losses[k])]
            assert not bad, f"{where}: losses differ from the plain loop's at steps {bad[:8]}"
            for x, y in zip(jax.tree.leaves(result[0]), jax.tree.leaves(state)):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=where)
        else:
            np.testing.assert_allclose(got, np.array(losses), rtol=1e-3, atol=1e-5, err_msg=where)


def stopped_and_resumed(seed: int, tmp_path) -> None:
    """A random mixed sweep stopped (``stop(checkpoint=True)``) at a random moment, then resumed
    in a new Runtime (``resume=True``): every job ends in the plain loop's state (bit for bit
    unfused, within numerics.md's tolerance fused)."""
    r = random.Random(seed)
    kw: dict = {"policy": r.choice(xshare.POLICIES), "memory": r.choice(["40KiB", "64KiB", "256MiB"]),
                "steps_per_call": r.choice([1, 2, 4, 8, 16, "auto"]), "checkpoint_dir": tmp_path}
    if r.random() < 0.5:
        kw["checkpoint_every"] = r.randint(5, 100)
    if r.random() < 0.3:
        kw["fuse"] = True
    if r.random() < 0.3:
        kw["keep_results"] = False
    jobs = [random_job(r, seed * 10 + i, r.randint(1, 1200)) for i in range(r.randint(1, 6))]
    step = xshare.job(train_step, name="net")

    def specs():
        return [step.bind(initial_state(j), data(j), steps=j["steps"], name=f"j{i}") for i, j in enumerate(jobs)]

    with xshare.Runtime(**kw) as rt:
        handles = rt.submit_many(specs())
        time.sleep(r.uniform(0, 0.3))
        rt.stop(checkpoint=True)
        first = [(h.status(), h.progress().steps_done) for h in handles]
    with xshare.Runtime(**kw, resume=True) as rt:
        handles = rt.submit_many(specs())
        assert rt.wait(timeout=300), rt.snapshot()
        for i, (job, handle) in enumerate(zip(jobs, handles)):
            where = f"job {i} {job} under {kw}, stopped at {first[i]}"
            if handle.status() == "failed":
                assert TOO_BIG in handle.error, f"{where}: {handle.error}"
                continue
            state, _ = plain_loop(job)
            for x, y in zip(jax.tree.leaves(handle.result(timeout=60)[0]), jax.tree.leaves(state)):
                if "fuse" in kw:
                    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-4, atol=1e-5, err_msg=where)
                else:
                    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=where)


@pytest.mark.parametrize("seed", [752, 767])
def test_a_random_sweep_of_several_programs_under_a_small_budget_matches_the_plain_loop(seed, tmp_path):
    run = mixed_sweep(seed, tmp_path)
    check(run)
    assert run["waited"], run["kw"]  # (what these seeds are for: jobs wait for memory)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1000, 1040))
def test_many_random_sweeps_of_several_programs_under_a_small_budget_match_the_plain_loop(seed, tmp_path):
    check(mixed_sweep(seed, tmp_path))


def test_a_random_sweep_of_several_programs_stopped_and_resumed_ends_in_the_plain_loops_state(tmp_path):
    stopped_and_resumed(9, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(300, 320))
def test_many_random_sweeps_of_several_programs_stopped_and_resumed_end_in_the_plain_loops_state(seed, tmp_path):
    stopped_and_resumed(seed, tmp_path)
