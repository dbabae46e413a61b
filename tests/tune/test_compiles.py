"""A fused study compiles one group program per model shape: its groups open with a slot for
each of its ``concurrency`` trials and keep them while pruned trials leave and new ones join
(``Runtime(group_capacity=...)``, which ``optimize`` sets), counted with the runtime's compile
counter."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

optuna = pytest.importorskip("optuna")

import xshare  # noqa: E402
import xshare.tune  # noqa: E402
from xshare.runtime.compiled.compiler import PROGRAMS  # noqa: E402 - what Runtime.compiles reads
from tests.helpers import linreg_data  # noqa: E402

STEPS, TRIALS, CONCURRENCY = 60, 16, 4
optuna.logging.set_verbosity(optuna.logging.WARNING)


def baked(lr: float, dim: int) -> xshare.JobSpec:
    """Linear regression with its learning rate baked in as a Python float, the way users
    write it: each trial is its own literal program until the runtime lifts ``lr``."""
    def step(state, batch):
        def loss_fn(w):
            return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)

        loss, g = jax.value_and_grad(loss_fn)(state["w"])
        return {"w": state["w"] - lr * g}, {"loss": loss}

    state = {"w": jnp.zeros((dim, 1), jnp.float32)}
    return xshare.job(step).bind(state, linreg_data(dim=dim, seed=0), steps=STEPS)


def study():
    return optuna.create_study(direction="minimize", sampler=optuna.samplers.RandomSampler(seed=0),
                               pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0))


@pytest.mark.parametrize("given", ["kwargs", "runtime"])
def test_a_study_compiles_one_group_program_per_shape(given):
    # Two model shapes in pairs of trials: the pruner's two startup trials run first, alone
    # (tune/_optimize.py, width), and open the first shape's group together; the next two open
    # the second's; refills of one or two trials join them as others end. (A startup wave with
    # one trial of a shape would step it on its own program first: one compile more.)
    dims = (5, 9) if given == "kwargs" else (6, 10)

    def objective(trial):
        return baked(trial.suggest_float("lr", 0.001, 0.02), dims[trial.number // 2 % 2])

    rt = None
    if given == "runtime":  # a runtime passed in keeps its settings: the floor is the caller's
        rt = xshare.Runtime(memory="256MiB", fuse="always", group_capacity=CONCURRENCY)
    before = PROGRAMS.compiles
    try:
        s = xshare.tune.optimize(study(), objective, TRIALS, metric="loss", concurrency=CONCURRENCY,
                                 # fuse="always": the group programs are this test's subject; with
                                 # fuse=True each shape's solo program also compiles, once, to
                                 # measure whether fusing pays (tests/runtime/test_payoff.py)
                                 runtime=rt if rt is not None else {"memory": "256MiB", "fuse": "always"})
    finally:
        if rt is not None:
            rt.close()
    compiles = PROGRAMS.compiles - before
    states = [t.state for t in s.trials]
    assert len(states) == TRIALS and optuna.trial.TrialState.FAIL not in states
    assert optuna.trial.TrialState.PRUNED in states  # members left and new trials took their slots
    # One vmapped program per shape at capacity 4: no solo programs, no capacities 2 or 8
    # (before the floor: a program at every size a refill or a grow or a shrink asked for).
    assert compiles == len(dims), f"{compiles} compiles for {len(dims)} shapes"
    # Every trial trained with its own learning rate: the lifted constant reached each slot.
    losses = [t.value for t in s.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(set(losses)) == len(losses)
