"""Random Optuna studies through ``xshare.tune.optimize``: random pruners (median, percentile,
successive halving, Hyperband, threshold, none), samplers, concurrency, report intervals, train or
evaluation metrics, runtimes owned or shared; trials whose objective raises or prunes, whose data
raises, and whose learning rate is NaN (a diverging trial). Whatever happens, ``optimize``
returns with every trial ended as Optuna's own ``study.optimize`` would end it: a trial whose
objective or data failed is FAIL with its error kept, a pruned one says where, a complete one
ran its budget, and no trial's end takes down another. Random studies found a NaN-valued trial
ending the whole study (``test_optimize.py``, the NaN test). A few seeds run by default;
``-m slow`` runs many more."""

from __future__ import annotations

import math
import random

import pytest

optuna = pytest.importorskip("optuna")

import xshare  # noqa: E402
import xshare.tune  # noqa: E402
from xshare.tune._optimize import ATTR_ERROR, ATTR_PRUNED_AT, ATTR_STEPS  # noqa: E402
from tests.tune.test_optimize import make  # noqa: E402

TS = optuna.trial.TrialState
optuna.logging.set_verbosity(optuna.logging.ERROR)
TROUBLE = (None,) * 6 + ("objective", "data", "nan", "pruned")


def study(seed: int) -> None:
    r = random.Random(seed)
    pruner = r.choice([lambda: optuna.pruners.MedianPruner(n_startup_trials=r.randint(0, 3)),
                       optuna.pruners.SuccessiveHalvingPruner, lambda: optuna.pruners.HyperbandPruner(max_resource=60),
                       optuna.pruners.NopPruner, lambda: optuna.pruners.PercentilePruner(25.0),
                       lambda: optuna.pruners.ThresholdPruner(upper=5.0)])()
    sampler = r.choice([optuna.samplers.RandomSampler(seed=seed),
                        optuna.samplers.TPESampler(seed=seed, n_startup_trials=3)])
    s = optuna.create_study(direction="minimize", sampler=sampler, pruner=pruner)
    n, budget, every = r.randint(3, 14), r.choice([20, 60, 100]), r.choice([1, 5, 7, 25])
    metric = r.choice(["eval/mse", "loss"])
    trouble = {t: r.choice(TROUBLE) for t in range(n)}
    fail_at = {t: r.randrange(budget) for t in range(n)}

    def objective(trial):
        lr = trial.suggest_float("lr", 0.0, 0.2)
        what = trouble[trial.number]
        if what == "objective":
            raise ValueError("objective broke")
        if what == "pruned":
            raise optuna.TrialPruned()
        spec = make(float("nan") if what == "nan" else lr, steps=budget,
                    fail_at=fail_at[trial.number] if what == "data" else None)
        return spec.replace(eval_every=every) if metric == "eval/mse" else spec

    runtime = r.choice([{"memory": "64MiB"}, {"memory": "64MiB", "fuse": False},
                        {"memory": "64MiB", "steps_per_call": r.choice([1, 4, 16])}])
    shared = xshare.Runtime(**runtime) if r.random() < 0.3 else None
    where = (f"seed {seed}: {n} trials of {budget} steps, {metric} every {every}, "
             f"{type(pruner).__name__}, runtime {runtime}{' (shared)' if shared else ''}")
    try:
        xshare.tune.optimize(s, objective, n, metric=metric, concurrency=r.randint(1, 8),
                             runtime=shared if shared is not None else runtime, catch=(ValueError,),
                             report_every=every if metric == "loss" else None)
    finally:
        if shared is not None:
            shared.close()
    assert len(s.trials) == n, where
    for t in s.trials:
        what, attrs = trouble[t.number], t.user_attrs
        at = f"{where}: trial {t.number} ({what or 'fine'}) ended {t.state.name}, {attrs}"
        if what == "pruned":
            assert t.state is TS.PRUNED, at
            continue
        if what == "objective" or (what == "data" and t.state is not TS.PRUNED):
            assert t.state is TS.FAIL and ATTR_ERROR in attrs, at
        if what == "data" and t.state is TS.PRUNED:  # pruned before its bad batch
            assert attrs[ATTR_STEPS] <= fail_at[t.number], at
        if what is None:
            assert t.state in (TS.COMPLETE, TS.PRUNED), at
        if t.state is TS.COMPLETE:
            assert attrs[ATTR_STEPS] == budget and math.isfinite(t.value), at
        if t.state is TS.PRUNED:
            assert attrs[ATTR_PRUNED_AT] == max(t.intermediate_values) <= attrs[ATTR_STEPS], at
        if t.state is TS.FAIL and what == "nan":
            assert "nan" in attrs[ATTR_ERROR], at


@pytest.mark.parametrize("seed", [5, 9])  # (9: a NaN trial runs to its end; it ended the study once)
def test_a_random_study_ends_every_trial_as_optuna_would(seed):
    study(seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 140))
def test_many_random_studies_end_every_trial_as_optuna_would(seed):
    study(seed)
