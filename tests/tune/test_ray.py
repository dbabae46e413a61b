"""``xshare tune --ray``: trials on two local Ray runtime actors end COMPLETE or PRUNED as they
should, the values told are the last rows of each trial's metrics.jsonl, and a pruned trial's
job stops before its budget."""

from __future__ import annotations

import json

import pytest

optuna = pytest.importorskip("optuna")
pytest.importorskip("sklearn")
ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'xshare[ray]')")

from xshare.cli.main import main  # noqa: E402
from xshare.jobs.request import JobRequest  # noqa: E402
from xshare.tune._optimize import ATTR_ERROR, ATTR_JOB, ATTR_PRUNED_AT, ATTR_STEPS  # noqa: E402
from tests.helpers import digits_study  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)
TS = optuna.trial.TrialState

SPEC = digits_study(memory="512MiB", steps=30, eval_every=10, trials=4, concurrency=4, tune='pruner = "none"')


def rows(run_dir, name):
    return [json.loads(line) for line in (run_dir / name / "metrics.jsonl").read_text().splitlines()]


def evals(run_dir, name, metric="eval/accuracy"):
    """{steps done: value} of the metric's rows (a row's step is the 0-based step it follows)."""
    return {r["step"] + 1: r[metric] for r in rows(run_dir, name) if metric in r}


@pytest.mark.slow
def test_xshare_tune_ray_runs_a_digits_study_on_two_actors(local_ray, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "study.toml").write_text(SPEC)
    assert main(["tune", "study.toml", "--ray", "--actors", "2", "--out", "run", "--status-port", "-1"]) == 0
    out = capsys.readouterr().out
    run = tmp_path / "run"
    study = optuna.load_study(study_name="study", storage=f"sqlite:///{run / 'study.db'}")
    assert len(study.trials) == 4
    assert [t.state for t in study.trials] == [TS.COMPLETE] * 4, [t.user_attrs for t in study.trials]
    for t in study.trials:
        assert t.user_attrs[ATTR_JOB] == f"trial-{t.number}" and t.user_attrs[ATTR_STEPS] == 30
        seen = evals(run, f"trial-{t.number}")
        assert sorted(seen) == [10, 20, 30]
        assert seen == pytest.approx(t.intermediate_values)  # every value recorded was reported
        assert t.value == seen[30]  # the last row's value, exactly
        assert set(t.params) == {"lr"}
    assert f"best: trial {study.best_trial.number} value {study.best_trial.value:.4g}" in out
    assert (run / "study.png").is_file()
    assert study.best_value > 0.5  # the digits learned (chance is 0.1): the jobs really trained
    # Where it ran goes with the record: --resume continues on Ray with the same actors, unless
    # --no-ray (the study is done, so neither runs a trial more).
    assert json.loads((run / "tune.json").read_text())["placement"] == {"ray": True, "address": None, "actors": 2}
    capsys.readouterr()
    assert main(["tune", "--resume", "run", "--status-port", "-1"]) == 0
    captured = capsys.readouterr()
    assert "this run started on Ray: resuming with --ray --actors 2" in captured.err
    assert "on Ray: 2 runtime actor(s)" in captured.out
    assert main(["tune", "--resume", "run", "--no-ray", "--status-port", "-1"]) == 0
    captured = capsys.readouterr()
    assert "--no-ray: resuming in this process" in captured.err and "on Ray:" not in captured.out
    assert len(optuna.load_study(study_name="study", storage=f"sqlite:///{run / 'study.db'}").trials) == 4


@pytest.mark.slow
def test_a_pruner_that_always_prunes_stops_every_job_before_its_budget(local_ray, tmp_path):
    from xshare.tune._ray import optimize_ray

    budget = 4000  # far more steps than run in a few polls: a pruned job must stop well before
    # Accuracy is never above 1.1: every judged report prunes (the first at step 10).
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0),
                                pruner=optuna.pruners.ThresholdPruner(lower=1.1))

    def request(trial):
        lr = trial.suggest_float("lr", 1e-3, 3e-2, log=True)
        return JobRequest("xshare.models.digits:make_job",
                          {"lr": lr, "batch": 32, "eval_every": 10, "width": 16}, steps=budget)

    optimize_ray(study, request, 4, metric="eval/accuracy", run_dir=str(tmp_path), actors=2, concurrency=4,
                 runtime={"memory": "512MiB"}, poll_s=0.1)
    trials = study.trials
    assert len(trials) == 4 and sum(t.state in (TS.COMPLETE, TS.PRUNED, TS.FAIL) for t in trials) == 4
    for t in trials:
        assert t.state == TS.PRUNED, (t.number, t.state, t.user_attrs)
        assert t.user_attrs[ATTR_PRUNED_AT] == 10  # pruned at its first report
        steps = t.user_attrs[ATTR_STEPS]
        assert steps < budget, f"trial {t.number}: its job ran {steps} of {budget} steps after it was pruned"
        assert max(r["step"] for r in rows(tmp_path, f"trial-{t.number}")) + 1 == steps
        assert t.intermediate_values == pytest.approx({10: evals(tmp_path, f"trial-{t.number}")[10]})


@pytest.mark.slow
def test_a_metric_the_jobs_never_report_is_a_clear_error(local_ray, tmp_path):
    from xshare.tune._ray import optimize_ray

    study = optuna.create_study(direction="maximize")

    def request(trial):
        trial.suggest_float("lr", 1e-3, 3e-2, log=True)
        return JobRequest("xshare.models.digits:make_job", {"batch": 32, "eval_every": 10, "width": 16}, steps=20)

    with pytest.raises(ValueError, match=r"metric='eval/acc' is not a metric trial 0's job reports; "
                                         r"it reports: eval/accuracy, eval/loss"):
        optimize_ray(study, request, 1, metric="eval/acc", run_dir=str(tmp_path), actors=1,
                     runtime={"memory": "512MiB"}, poll_s=0.1)
    (t,) = study.trials
    assert t.state == TS.FAIL and t.user_attrs[ATTR_ERROR] == "its job never reported 'eval/acc'"


@pytest.mark.slow
def test_an_interrupt_fails_and_enqueues_the_running_trials_and_stops_the_actors(local_ray, tmp_path):
    import xshare.tune
    from xshare.tune._ray import optimize_ray

    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))

    def request(trial):
        lr = trial.suggest_float("lr", 1e-3, 3e-2, log=True)
        steps = 20 if trial.number == 0 else 4000  # trial 0 ends first; trial 1 is running then
        return JobRequest("xshare.models.digits:make_job",
                          {"lr": lr, "batch": 32, "eval_every": 10, "width": 16}, steps=steps)

    def ctrl_c(study, frozen):  # as if Ctrl-C landed when the first trial ended
        raise KeyboardInterrupt

    with pytest.raises(xshare.tune.Interrupted):
        optimize_ray(study, request, 4, metric="eval/accuracy", run_dir=str(tmp_path), actors=2, concurrency=2,
                     runtime={"memory": "512MiB"}, poll_s=0.1, callbacks=[ctrl_c])
    states = {t.number: t.state for t in study.trials}
    assert states == {0: TS.COMPLETE, 1: TS.FAIL, 2: TS.WAITING}, states
    failed, again = study.trials[1], study.trials[2]
    assert failed.user_attrs[ATTR_ERROR].startswith("interrupted after ")
    assert failed.user_attrs[ATTR_ERROR].endswith("; its parameters were enqueued again")
    assert again.system_attrs["fixed_params"] == failed.params  # the next run on this storage reruns them first
    left = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("xshare-runtime-")]
    assert left == []  # the actors were stopped


@pytest.mark.slow
def test_a_dead_actors_trial_fails_and_its_parameters_run_again_on_the_actor_left(local_ray, tmp_path):
    from xshare.service.ray_actors import ACTOR_PREFIX, NAMESPACE
    from xshare.tune._ray import optimize_ray

    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))

    def request(trial):
        lr = trial.suggest_float("lr", 1e-3, 3e-2, log=True)
        steps = 4000 if trial.number == 1 else 20  # trial 1 still trains when trial 0 ends
        return JobRequest("xshare.models.digits:make_job",
                          {"lr": lr, "batch": 32, "eval_every": 10, "width": 16}, steps=steps)

    told = []

    def kill_trial_1s_actor(study, frozen):  # trial 0 on actor 0, trial 1 on actor 1 (fewest running)
        told.append((frozen.number, frozen.state))
        if frozen.number == 0:
            ray.kill(ray.get_actor(f"{ACTOR_PREFIX}1", namespace=NAMESPACE))

    optimize_ray(study, request, 4, metric="eval/accuracy", run_dir=str(tmp_path), actors=2, concurrency=2,
                 runtime={"memory": "512MiB"}, poll_s=0.1, callbacks=[kill_trial_1s_actor])
    states = {t.number: t.state for t in study.trials}
    assert states == {0: TS.COMPLETE, 1: TS.FAIL, 2: TS.COMPLETE, 3: TS.COMPLETE}, states
    lost = study.trials[1]
    assert lost.user_attrs[ATTR_ERROR].startswith(f"its runtime actor {ACTOR_PREFIX}1 died after ")
    assert lost.user_attrs[ATTR_ERROR].endswith("; its parameters were enqueued again")
    # Its parameters ran again, from step 0, on the actor left (the first trial asked after the
    # death was seen: 2 or 3, as the refill and the poll that finds the death fall); the
    # callbacks heard of each trial once.
    (again,) = [t for t in study.trials[2:] if t.system_attrs.get("fixed_params") == lost.params]
    assert again.params == lost.params and again.state == TS.COMPLETE and again.user_attrs[ATTR_STEPS] == 20
    assert sorted(told) == [(0, TS.COMPLETE), (1, TS.FAIL), (2, TS.COMPLETE), (3, TS.COMPLETE)]


def test_bad_actors_exits_2_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "study.toml").write_text(SPEC)
    assert main(["tune", "study.toml", "--ray", "--actors", "0", "--out", "run", "--status-port", "-1"]) == 2
    assert "--actors 0 must be >= 1 (runtime actors to start)" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.toml"]


def test_more_actors_than_the_cluster_holds_exits_2_and_leaves_nothing(local_ray, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "study.toml").write_text(SPEC)
    # (Ray would wait forever for a third CPU: the study would hang at its first submit)
    assert main(["tune", "study.toml", "--ray", "--actors", "3", "--out", "run", "--status-port", "-1"]) == 2
    assert ("3 runtime actors need 3 CPUs (1 each); the Ray cluster has 2: ask for --actors 2 or fewer"
            in capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.toml"]


def test_a_relative_run_dir_is_refused_with_the_fix(tmp_path):
    from xshare.tune._ray import optimize_ray

    with pytest.raises(ValueError, match=r"run_dir='run' must be an absolute path .*os\.path\.abspath"):
        optimize_ray(optuna.create_study(), lambda t: None, 1, metric="loss", run_dir="run")
