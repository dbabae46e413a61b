"""Users' code under random controls: the Flax NNX tutorial's step, an Equinox MLP and a Linen
``TrainState``, as their docs write them, a few jobs each under a random policy, steps per
call and pipeline depth, paused (some offloaded to the host), resumed and reprioritized at
random from another thread while they run. Every job ends bit-identical to its reference way
(``nnx.jit``, ``eqx.filter_jit``, ``jax.jit``), whatever the interleaving. A run that does not
end within its time names every job's state (a job left waiting is the bug to look for). A few
seeds run by default; ``-m slow`` runs many more."""

from __future__ import annotations

import functools
import random

import pytest

import xshare
from xshare.bench.chaos import random_controls
from tests.users import harness

CASES = ("nnx", "equinox", "linen")


@functools.cache
def case(name: str):
    """The case's module (imported here: Equinox is a test extra)."""
    if name == "nnx":
        from tests.users import test_nnx_tutorial as mod
    elif name == "equinox":
        pytest.importorskip("equinox")
        from tests.users import test_equinox as mod
    else:
        from tests.users import test_linen_trainstate as mod
    return mod


@functools.cache
def reference(name: str, seed: int, steps: int):
    return case(name).reference(seed, steps)


def run(seed: int) -> None:
    r = random.Random(seed)
    name = r.choice(CASES)
    mod = case(name)
    jobs = [(r.randint(0, 3), r.choice([12, 40, 150])) for _ in range(r.randint(2, 5))]
    kw = {"policy": r.choice(xshare.POLICIES), "memory": "512MiB", "steps_per_call": r.choice([1, 2, 4, 16, "auto"])}
    if r.random() < 0.3:
        kw["dispatch_ahead"] = r.randint(0, 3)
    with xshare.Runtime(**kw) as rt:
        handles = rt.submit_many([mod.spec(s, steps).replace(name=f"j{i}") for i, (s, steps) in enumerate(jobs)])
        budget = iter(range(r.randint(0, 25)))
        # pause, offload, resume, priority; no cancel (every job must end to be compared)
        random_controls(rt, handles, random.Random(seed + 1), weights=(30, 10, 40, 15, 0),
                        keep_going=lambda: next(budget, None) is not None, sleep_s=(0.0005, 0.01))
        ended = rt.wait(timeout=120)
        where = f"{name} jobs {jobs} under {kw}"
        assert ended, f"{where}: not ended after 120 s: " + "; ".join(
            f"{j['name']} {j['status']} {j['steps_done']}/{j['steps_total']}" for j in rt.snapshot()["jobs"])
        for h, (s, steps) in zip(handles, jobs):
            assert h.status() == "done", (where, h.name, h.error)
            harness.assert_states_equal(getattr(mod, "canon", lambda x: x)(h.result()[0]), reference(name, s, steps),
                                        what=f"{where}: {h.name}")


@pytest.mark.parametrize("seed", [4, 7, 9])  # (NNX under fair, Equinox under priority, Equinox under srtf)
def test_users_code_under_random_controls_ends_bit_identical_to_its_reference(seed):
    run(seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 160))
def test_many_random_runs_of_users_code_end_bit_identical_to_their_references(seed):
    run(seed)
