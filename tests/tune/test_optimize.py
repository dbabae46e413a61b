"""xshare.tune.optimize: trials end COMPLETE, PRUNED or FAIL as they should, values and steps
match what the jobs recorded, parameters reach the jobs, and an interrupted study resumes."""

from __future__ import annotations

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

optuna = pytest.importorskip("optuna")

import xshare  # noqa: E402
import xshare.tune  # noqa: E402
from xshare.tune._optimize import ATTR_ERROR, ATTR_PRUNED_AT, ATTR_STEPS  # noqa: E402
from tests.helpers import linreg_data  # noqa: E402

BUDGET, EVERY = 60, 5
TS = optuna.trial.TrialState
optuna.logging.set_verbosity(optuna.logging.WARNING)


@xshare.job
def sgd_step(state, batch):
    """Linear regression with its learning rate in the state (one program for every trial)."""
    def loss_fn(w):
        return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)

    loss, g = jax.value_and_grad(loss_fn)(state["w"])
    return {"w": state["w"] - state["lr"] * g, "lr": state["lr"]}, {"loss": loss}


def mse(state, batch):
    return {"mse": jnp.mean((batch["x"] @ state["w"] - batch["y"]) ** 2)}


VAL = [linreg_data(seed=0, batch=32)(1000 + k) for k in range(2)]
W0 = np.zeros((8, 1), np.float32)


def make(lr, *, fail_at=None, steps=BUDGET, eval_step=mse):
    data = linreg_data(seed=0)

    def batches(k):
        if fail_at is not None and k == fail_at:
            raise RuntimeError(f"batch {k} is corrupt")
        return data(k)

    state = {"w": jnp.asarray(W0), "lr": jnp.float32(lr)}
    kw = dict(eval_step=eval_step, eval_data=VAL, eval_every=EVERY) if eval_step else {}
    return sgd_step.bind(state, batches, steps=steps, **kw)


def initial_mse():
    return float(np.mean([np.mean((b["x"] @ W0 - b["y"]) ** 2) for b in VAL]))


def study_of(storage=None, name=None, load=False):
    sampler = optuna.samplers.RandomSampler(seed=0)
    pruner = optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0)
    if load:
        return optuna.load_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner)
    return optuna.create_study(direction="minimize", sampler=sampler, pruner=pruner, storage=storage,
                               study_name=name)


def objective(trial):
    lr = trial.suggest_float("lr", 0.0, 0.2)
    return make(lr, fail_at=7 if trial.number == 3 else None)


def test_an_8_trial_study_ends_each_trial_as_it_should():
    study = study_of()
    # Fixed points among the sampled ones: two good trials first (the pruner's startup), a trial
    # whose job fails (number 3) and a learning rate of 0 (number 5), which must not learn.
    for lr in (0.1, 0.05, 0.08, 0.1, 0.07, 0.0):
        study.enqueue_trial({"lr": lr})
    xshare.tune.optimize(study, objective, 8, metric="eval/mse", concurrency=2,
                         runtime={"memory": "64MiB"})
    trials = study.trials
    assert len(trials) == 8 and all(t.state in (TS.COMPLETE, TS.PRUNED, TS.FAIL) for t in trials)
    assert trials[0].state is TS.COMPLETE and trials[1].state is TS.COMPLETE
    # The failing job fails its trial alone, with its error kept.
    assert trials[3].state is TS.FAIL
    assert "batch 7 is corrupt" in trials[3].user_attrs[ATTR_ERROR]
    assert [t.number for t in trials if t.state is TS.FAIL] == [3]
    # lr=0 reaches its job: it never learns (every evaluation is the initial error), so it is pruned.
    zero = trials[5]
    assert zero.params["lr"] == 0.0 and zero.state is TS.PRUNED
    np.testing.assert_allclose(list(zero.intermediate_values.values()), initial_mse(), rtol=1e-6)
    for t in trials:
        if t.state is TS.COMPLETE:
            # Evaluated every EVERY steps and after the last; told the last value it reported.
            assert sorted(t.intermediate_values) == list(range(EVERY, BUDGET + 1, EVERY))
            assert t.value == t.intermediate_values[BUDGET]
            assert t.user_attrs[ATTR_STEPS] == BUDGET
            assert t.value < initial_mse() / 2  # it learned
        if t.state is TS.PRUNED:
            pruned_at = t.user_attrs[ATTR_PRUNED_AT]
            assert max(t.intermediate_values) == pruned_at
            # Cancelled within one report interval of the decision (so before the budget, unless
            # decided in the last interval: the job may reach its end before the cancel lands).
            assert pruned_at < BUDGET and pruned_at <= t.user_attrs[ATTR_STEPS] <= pruned_at + EVERY


def test_a_pruned_trial_stops_at_the_decision_not_at_its_next_report():
    """A pruned trial's job stops at the first step it retires after the driver's decision (its
    hook sees every step's metrics and answers True from then), not at its next evaluation: it
    trains no report interval past the report that pruned it. Its batches after that report
    come slowly (5 ms each), so its next report is >= 0.5 s away while the decision takes a few
    ms; a hook that answered only at reports would let it reach step 200."""
    import time

    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.RandomSampler(seed=0),
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=2))
    for lr in (0.1, 0.08, 0.0):
        study.enqueue_trial({"lr": lr})

    def objective(trial):
        lr = trial.suggest_float("lr", 0.0, 0.2)
        data = linreg_data(seed=0)

        def batches(k):
            if lr == 0.0 and k > 100:
                time.sleep(0.005)
            return data(k)

        state = {"w": jnp.asarray(W0), "lr": jnp.float32(lr)}
        return sgd_step.bind(state, batches, steps=200, eval_step=mse, eval_data=VAL, eval_every=100)

    xshare.tune.optimize(study, objective, 3, metric="eval/mse", concurrency=1, runtime={"memory": "64MiB"})
    pruned = study.trials[2]
    assert [t.state for t in study.trials] == [TS.COMPLETE, TS.COMPLETE, TS.PRUNED]
    assert pruned.user_attrs[ATTR_PRUNED_AT] == 100 and list(pruned.intermediate_values) == [100]
    assert 100 <= pruned.user_attrs[ATTR_STEPS] < 200


def test_the_first_wave_is_the_pruners_startup_trials():
    """MedianPruner judges nothing until n_startup_trials have completed: a trial started before
    then runs to its end unjudged and stays in the median. So the driver runs only the startup
    trials until they complete, then widens to ``concurrency``."""
    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.RandomSampler(seed=0),
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=3))
    completed_when_asked = {}

    def counting(trial):
        completed_when_asked[trial.number] = len(study.get_trials(deepcopy=False, states=(TS.COMPLETE,)))
        return make(trial.suggest_float("lr", 0.05, 0.1))

    xshare.tune.optimize(study, counting, 8, metric="eval/mse", concurrency=6, runtime={"memory": "64MiB"})
    assert [completed_when_asked[n] for n in range(3)] == [0, 0, 0]
    assert all(completed_when_asked[n] >= 3 for n in range(3, 8)), completed_when_asked
    assert [t.state for t in study.trials[:3]] == [TS.COMPLETE] * 3


def test_the_runtime_opens_before_the_first_objective(monkeypatch):
    """Its persistent compilation cache then holds the objective's own compiles (a model's init)
    from the first trial on, not from the first submit."""
    order = []
    real = xshare.Runtime

    class Watched(real):
        def __init__(self, *args, **kwargs):
            order.append("runtime")
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(xshare, "Runtime", Watched)

    def objective(trial):
        order.append("objective")
        return make(trial.suggest_float("lr", 0.05, 0.1), steps=10)

    xshare.tune.optimize(study_of(), objective, 2, metric="eval/mse", concurrency=2, runtime={"memory": "64MiB"})
    assert order[:2] == ["runtime", "objective"] and order.count("runtime") == 1, order


def test_the_studys_own_runtime_keeps_no_trials_final_state_and_a_runtime_passed_in_keeps_them(monkeypatch):
    from xshare._errors import XShareError

    runtimes = []
    real = xshare.Runtime

    class Watched(real):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            runtimes.append(self)

    monkeypatch.setattr(xshare, "Runtime", Watched)
    objective = lambda t: make(t.suggest_float("lr", 0.05, 0.1), steps=10)  # noqa: E731
    xshare.tune.optimize(study_of(), objective, 3, metric="eval/mse", concurrency=2, runtime={"memory": "64MiB"})
    (own,) = runtimes
    done = [h for h in own.jobs if h.status() == "done"]
    assert done and all(h._rec.host_state is None for h in own.jobs)
    with pytest.raises(XShareError, match=r"keeps its trials' values and params in the study.*runtime=xshare"):
        done[0].result()
    with xshare.Runtime(memory="64MiB") as rt:  # the caller's runtime: its jobs' results are the caller's
        xshare.tune.optimize(study_of(), objective, 2, metric="eval/mse", concurrency=2, runtime=rt)
        assert all(h.result()[0]["w"].shape == (8, 1) for h in rt.jobs if h.status() == "done")


def test_the_startup_trials_a_pruner_waits_for():
    from xshare.tune._optimize import _startup_trials

    with pytest.warns(optuna.exceptions.ExperimentalWarning):
        patient = optuna.pruners.PatientPruner(optuna.pruners.MedianPruner(n_startup_trials=4), patience=2)
    assert _startup_trials(patient) == 4
    assert _startup_trials(optuna.pruners.PercentilePruner(25.0, n_startup_trials=7)) == 7
    assert _startup_trials(optuna.pruners.MedianPruner(n_startup_trials=0)) == 0
    for judges_from_the_first in (optuna.pruners.NopPruner(), optuna.pruners.SuccessiveHalvingPruner(),
                                  optuna.pruners.ThresholdPruner(lower=0.0)):
        assert _startup_trials(judges_from_the_first) == 0


def test_the_driver_wakes_on_each_job_end_and_leaves_a_shared_runtime_as_it_found_it():
    """The driver refills a trial's slot when the runtime says its job ended (an end listener),
    not at its next poll; a Runtime passed in keeps only its own listeners afterwards."""
    ended = []

    def bystander(job):
        ended.append(job.name)

    listening = []

    def while_running(study, frozen):  # the driver listens while the study runs
        listening.append(len(rt._jobs.end_listeners))

    study = study_of()
    with xshare.Runtime(memory="64MiB") as rt:
        rt.add_end_listener(bystander)
        xshare.tune.optimize(study, lambda t: make(t.suggest_float("lr", 0.01, 0.2)), 4,
                             metric="eval/mse", concurrency=2, runtime=rt, callbacks=[while_running])
        assert rt._jobs.end_listeners == [bystander]
    assert listening == [2] * 4
    assert len(study.trials) == 4 and all(t.state in (TS.COMPLETE, TS.PRUNED) for t in study.trials)
    # Each job's end is announced once, as it ends.
    assert sorted(ended) == sorted(t.user_attrs["xshare_job"] for t in study.trials)


def test_an_interrupted_study_resumes_on_sqlite_to_exactly_n_trials(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = study_of(storage, "resume")
    interrupt = [True]
    at = []

    def slow(trial):
        lr = trial.suggest_float("lr", 0.01, 0.2)
        # Ctrl-C as the driver starts a trial past the pruner's startup while two others run
        # (the startup trials run first, alone: which trials run beside it is the machine's timing).
        others = len(trial.study.get_trials(deepcopy=False, states=(TS.RUNNING,))) - 1
        if trial.number >= 4 and others == 2 and interrupt and interrupt.pop():
            at.append(trial.number)
            raise KeyboardInterrupt
        return make(lr, steps=400)

    with pytest.raises(xshare.tune.Interrupted):
        xshare.tune.optimize(study, slow, 10, metric="eval/mse", concurrency=3, runtime={"memory": "64MiB"})
    first = study_of(storage, "resume", load=True).trials
    interrupted = [t for t in first if t.state is TS.FAIL]
    # That trial and the two running beside it are the interrupted ones.
    assert len(interrupted) == 3 and interrupted[-1].number == at[0], ([t.number for t in interrupted], at)
    assert all("interrupted" in t.user_attrs[ATTR_ERROR] for t in interrupted)
    assert all(t.state in (TS.COMPLETE, TS.PRUNED) for t in first if t.number < at[0] and t not in interrupted)
    assert sum(t.state is TS.WAITING for t in first) == len(interrupted)  # their params, enqueued

    again = study_of(storage, "resume", load=True)
    xshare.tune.optimize(again, slow, 10, metric="eval/mse", concurrency=3, runtime={"memory": "64MiB"})
    trials = again.trials
    assert sum(t.state in (TS.COMPLETE, TS.PRUNED, TS.FAIL) for t in trials) == 10
    assert not [t for t in trials if t.state in (TS.RUNNING, TS.WAITING)]
    # The interrupted trials' parameters ran again (the enqueued trials, asked first).
    waiting = [t.number for t in first if t.state is TS.WAITING]
    assert sorted(trials[n].params["lr"] for n in waiting) == sorted(t.params["lr"] for t in interrupted)


def test_a_metric_the_job_never_reports_is_an_error_naming_what_it_reports():
    with pytest.raises(ValueError, match=re.escape("metric='eval/acc' is not a metric trial 0's job "
                                                   "reports; it reports: eval/mse")):
        xshare.tune.optimize(study_of(), lambda t: make(0.1), 2, metric="eval/acc",
                             runtime={"memory": "64MiB"})
    with pytest.raises(ValueError, match=re.escape("metric='accuracy' is not a metric trial 0's job "
                                                   "reports; it reports: loss")):
        xshare.tune.optimize(study_of(), lambda t: make(0.1), 2, metric="accuracy",
                             runtime={"memory": "64MiB"})
    with pytest.raises(ValueError, match=re.escape("but trial 0's job has no eval_step")):
        xshare.tune.optimize(study_of(), lambda t: make(0.1, eval_step=None), 2, metric="eval/mse")


def test_a_trial_whose_value_ends_nan_fails_alone_as_in_study_optimize():
    # Trial 1 diverges (a NaN learning rate: every evaluation is NaN). No pruner stops it, so it
    # runs to its end with a NaN value, which Optuna takes from no trial: study.optimize fails
    # such a trial, and so must optimize. It once told it COMPLETE, and Optuna's ValueError ("The
    # value nan is not acceptable") ended the whole study, its running trials with it.
    def diverging(trial):
        lr = trial.suggest_float("lr", 0.05, 0.1)
        return make(float("nan") if trial.number == 1 else lr)

    study = optuna.create_study(direction="minimize", pruner=optuna.pruners.NopPruner())
    xshare.tune.optimize(study, diverging, 4, metric="eval/mse", concurrency=2, runtime={"memory": "64MiB"})
    trials = study.trials
    assert [t.state for t in trials] == [TS.COMPLETE, TS.FAIL, TS.COMPLETE, TS.COMPLETE]
    assert trials[1].user_attrs[ATTR_ERROR] == (f"its job ended with eval/mse=nan at step {BUDGET} (Optuna takes "
                                                "no NaN value: the trial fails, as in study.optimize)")
    assert trials[1].user_attrs[ATTR_STEPS] == BUDGET
    assert all(t.value < initial_mse() / 2 for t in trials if t.state is TS.COMPLETE)


def test_a_train_metric_is_reported_every_report_every_steps():
    study = optuna.create_study(direction="minimize", pruner=optuna.pruners.NopPruner())
    xshare.tune.optimize(study, lambda t: make(t.suggest_float("lr", 0.05, 0.1), eval_step=None), 2,
                         metric="loss", report_every=10, runtime={"memory": "64MiB"})
    for t in study.trials:
        assert t.state is TS.COMPLETE and sorted(t.intermediate_values) == [10, 20, 30, 40, 50, 60]
        assert t.value == t.intermediate_values[60]


def test_multi_objective_studies_and_bad_arguments_are_refused():
    multi = optuna.create_study(directions=["minimize", "maximize"])
    with pytest.raises(ValueError, match="has 2 objectives; xshare.tune.optimize runs single-objective"):
        xshare.tune.optimize(multi, objective, 2, metric="eval/mse")
    with pytest.raises(ValueError, match=re.escape("n_trials=0 must be a positive int")):
        xshare.tune.optimize(study_of(), objective, 0, metric="eval/mse")
    with pytest.raises(ValueError, match=re.escape("concurrency=0 must be a positive int")):
        xshare.tune.optimize(study_of(), objective, 2, metric="eval/mse", concurrency=0)


def test_xshare_tune_without_optuna_says_how_to_install_it():
    code = "import sys; sys.modules['optuna'] = None; import xshare.tune"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "ImportError: xshare.tune needs Optuna, which is not installed: pip install 'xshare[tune]'" in proc.stderr


def test_a_running_trial_is_judged_again_by_what_completed_since_its_report():
    """With trials side by side, a value is often judged while trials started before it still
    run. When one completes, the driver asks the pruner again about each running trial's newest
    value (as a study run one trial at a time would have judged it), and a trial pruned then
    stops at its next report, its pruned step the judged one."""
    from xshare.tune._driver import _Driver, _Running

    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.MedianPruner(n_startup_trials=1))
    first = study.ask()
    first.report(0.3, 10)
    study.tell(first, 0.3)
    good, late = study.ask(), study.ask()
    good.report(0.8, 10)
    late.report(0.3, 10)
    assert not late.should_prune()  # against the first trial alone: 0.3 is the median
    study.tell(good, 0.8)
    driver = _Driver.__new__(_Driver)  # (only its running trials matter here)
    driver.running = {late.number: _Running(late, "score", 5, budget=100, reported=10)}
    driver.rejudge()
    assert driver.running[late.number].stop and driver.running[late.number].pruned_at == 10
    # A trial with no value yet, or whose value came at its last step, is left alone.
    fresh = study.ask()
    driver.running = {fresh.number: _Running(fresh, "score", 5, budget=100)}
    driver.rejudge()
    assert not driver.running[fresh.number].stop


def test_the_driver_judges_its_running_trials_again_when_trials_end(monkeypatch):
    from xshare.tune._driver import _Driver

    calls = []
    real = _Driver.rejudge
    monkeypatch.setattr(_Driver, "rejudge", lambda self: (calls.append(len(self.running)), real(self))[1])
    study = study_of()
    xshare.tune.optimize(study, objective, 6, metric="eval/mse", concurrency=3, runtime={"memory": "64MiB"})
    assert calls and len(study.trials) == 6
    assert all(t.state in (TS.COMPLETE, TS.PRUNED, TS.FAIL) for t in study.trials)
