"""TensorBoard event files: every metrics.jsonl row of every job (train and eval) read back
with TensorBoard's own event reader, each job's parameters as HParams, a resumed job's rows
once; launch and tune write them by default; the writer protocol takes another tracker."""

from __future__ import annotations

import json
import time

import jax.numpy as jnp
import numpy as np
import pytest

import xshare
from xshare.cli.main import main
from xshare.runtime.observe import writers
from tests.cli.test_spec import fac, write_spec  # noqa: F401  (fac is a fixture)
from tests.helpers import digits_study, linreg_data, linreg_state, linreg_step

pytest.importorskip("tensorboardX")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
from tensorboard.plugins.hparams import plugin_data_pb2  # noqa: E402


def read_run(directory):
    """(scalars {tag: [(step, value)]}, hparams {name: value}) of one TensorBoard run."""
    ea = event_accumulator.EventAccumulator(str(directory), size_guidance={"scalars": 0})
    ea.Reload()
    scalars = {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}
    hparams = {}
    try:
        content = ea.PluginTagToContent("hparams")
    except KeyError:  # no HParams in this run
        content = {}
    if "_hparams_/session_start_info" in content:
        start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
        for name, value in start.session_start_info.hparams.items():
            hparams[name] = getattr(value, value.WhichOneof("kind"))
    return scalars, hparams


def jsonl_series(directory):
    """metrics.jsonl as {tag: [(step, value as float32)]}, the way TensorBoard stores scalars."""
    series: dict = {}
    for line in (directory / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for tag, value in row.items():
            if tag not in ("step", "time_s"):
                series.setdefault(tag, []).append((row["step"], float(np.float32(value))))
    return series


def mse(state, batch):
    return {"mse": jnp.mean((batch["x"] @ state["w"] - batch["y"]) ** 2)}


def _spec(i, steps=23, **kw):
    return linreg_step.bind(linreg_state(seed=i), linreg_data(seed=i), steps=steps, name=f"j{i}",
                            eval_step=mse, eval_data=[linreg_data(seed=50)(0)], eval_every=5,
                            meta={"params": {"lr": 0.1 * (i + 1), "width": 8, "opt": "sgd", "decay": [1, 2]}}, **kw)


def test_every_row_and_each_jobs_hparams_are_in_its_event_files(tmp_path):
    with xshare.Runtime(memory="64MiB", log_dir=tmp_path, writers=["tensorboard"]) as rt:
        rt.submit_many([_spec(0), _spec(1)])
    for i in (0, 1):
        scalars, hparams = read_run(tmp_path / f"j{i}")
        want = jsonl_series(tmp_path / f"j{i}")
        assert set(want) == {"loss", "eval/mse"}
        assert scalars == want
        assert hparams == {"lr": pytest.approx(0.1 * (i + 1)), "width": 8, "opt": "sgd", "decay": "[1, 2]"}


def test_a_resumed_job_has_each_steps_values_once(tmp_path):
    data = linreg_data(seed=3)

    def slow(step):
        time.sleep(0.003)
        return data(step)

    spec = linreg_step.bind(linreg_state(seed=3), slow, steps=120, name="r", meta={"params": {"seed": 3}})
    rt = xshare.Runtime(memory="64MiB", log_dir=tmp_path, checkpoint_every=7, writers=["tensorboard"])
    h = rt.submit(spec)
    while h.progress().steps_done < 20:
        time.sleep(0.005)
    rt.stop()
    rt.close()
    with xshare.Runtime(memory="64MiB", log_dir=tmp_path, resume=True, writers=["tensorboard"]) as rt:
        rt.submit(spec)
    scalars, hparams = read_run(tmp_path / "r")
    assert [s for s, _ in scalars["loss"]] == list(range(120))  # the rows after the checkpoint once
    assert scalars == jsonl_series(tmp_path / "r")
    assert hparams == {"seed": 3}


class Rows:
    """Another tracker through the writer protocol: it keeps what it is given."""

    got: dict = {}

    def __init__(self, directory):
        self.directory = directory

    def open(self, job, params, *, first_step=0):
        self.job = job
        Rows.got[job] = {"params": dict(params), "rows": [], "flushed": 0, "closed": False}

    def scalars(self, step, values):
        Rows.got[self.job]["rows"].append((step, dict(values)))

    def flush(self):
        Rows.got[self.job]["flushed"] = len(Rows.got[self.job]["rows"])

    def close(self):
        Rows.got[self.job]["closed"] = True


class Broken(Rows):
    def scalars(self, step, values):
        raise OSError("the tracker's server is gone")


def test_the_writer_protocol_takes_another_tracker_and_a_failing_one_fails_nothing(tmp_path, caplog):
    assert isinstance(Rows(tmp_path), xshare.Writer)
    with xshare.Runtime(memory="64MiB", log_dir=tmp_path, writers=[Rows, Broken]) as rt:
        h = rt.submit(_spec(0))
    assert h.status() == "done"
    got = Rows.got["j0"]
    assert got["closed"] and got["flushed"] == len(got["rows"]) and got["params"]["width"] == 8
    rows = [json.loads(line) for line in (tmp_path / "j0" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], {k: v for k, v in r.items() if k not in ("step", "time_s")}) for r in rows] == got["rows"]
    assert "writer Broken failed (OSError: the tracker's server is gone); it is off for this job" in caplog.text


def test_bad_writers_are_refused_with_the_fix(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"unknown writer 'wandb'; use one of \['mlflow', 'tensorboard'\]"):
        xshare.Runtime(memory="64MiB", log_dir=tmp_path, writers=["wandb"])
    with pytest.raises(ValueError, match=r"need a log_dir"):
        xshare.Runtime(memory="64MiB", writers=["tensorboard"])
    monkeypatch.setattr(writers.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install 'xshare\[tensorboard\]'"):
        xshare.Runtime(memory="64MiB", log_dir=tmp_path, writers=["tensorboard"])
    assert writers.defaults() == []  # launch and tune: no event files, no error


def test_xshare_launch_writes_event_files_with_the_grid_as_hparams(tmp_path, fac):
    write_spec(tmp_path, f'''
        [runtime]
        memory = "256MiB"
        [[job]]
        entry = "{fac}:make"
        steps = 6
        params = {{ lr = [0.1, 0.2] }}
    ''', name="tiny.toml")
    assert main(["launch", "tiny.toml", "--out", "run"]) == 0
    for job, lr in (("0_lr=0.1", 0.1), ("1_lr=0.2", 0.2)):
        scalars, hparams = read_run(tmp_path / "run" / job)
        assert scalars == jsonl_series(tmp_path / "run" / job)
        assert hparams["lr"] == pytest.approx(lr)


STUDY = digits_study(memory="1GiB", steps=10, eval_every=5, trials=2, concurrency=2)


@pytest.mark.slow  # (launch's test above covers the CLI's default; this one runs a study)
def test_xshare_tune_writes_each_trials_params_as_hparams(tmp_path, monkeypatch):
    optuna = pytest.importorskip("optuna")
    pytest.importorskip("sklearn")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "study.toml").write_text(STUDY)
    assert main(["tune", "study.toml", "--out", "run", "--status-port", "-1"]) == 0
    study = optuna.load_study(study_name="study", storage=f"sqlite:///{tmp_path / 'run' / 'study.db'}")
    assert len(study.trials) == 2
    for t in study.trials:
        scalars, hparams = read_run(tmp_path / "run" / f"trial-{t.number}")
        assert scalars == jsonl_series(tmp_path / "run" / f"trial-{t.number}")
        assert "eval/accuracy" in scalars
        assert hparams == {"lr": pytest.approx(t.params["lr"]), "batch": 32, "eval_every": 5, "width": 16}
