"""MLflow as the second writer: each job an MLflow run in the run directory's SQLite store,
with every metrics.jsonl row and the job's parameters, read back with MLflow's own client."""

from __future__ import annotations

import json

import pytest

import xshare
from tests.helpers import linreg_data, linreg_state, linreg_step

pytest.importorskip("mlflow")
pytest.importorskip("sqlalchemy")
from mlflow.tracking import MlflowClient


# mlflow's SQLAlchemy store uses a loader strategy SQLAlchemy 2.1 deprecates: the newest end of
# the test matrix (nox -s newest) makes DeprecationWarning an error, and the store would not
# open. Not ours to fix; ours still raise there.
@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated:DeprecationWarning")
def test_each_job_is_an_mlflow_run_with_its_rows_and_params(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "sweep"
    specs = [linreg_step.bind(linreg_state(seed=i), linreg_data(seed=i), steps=12, name=f"m{i}",
                              meta={"params": {"lr": 0.1 * (i + 1), "opt": "sgd"}}) for i in range(2)]
    with xshare.Runtime(memory="64MiB", log_dir=run_dir, writers=["mlflow"]) as rt:
        rt.submit_many(specs)
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("sweep")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"m0", "m1"}
    for i, name in enumerate(("m0", "m1")):
        run = runs[name]
        assert run.info.status == "FINISHED"
        assert run.data.params == {"lr": str(0.1 * (i + 1)), "opt": "sgd"}
        rows = [json.loads(line) for line in (run_dir / name / "metrics.jsonl").read_text().splitlines()]
        history = client.get_metric_history(run.info.run_id, "loss")
        assert sorted((m.step, m.value) for m in history) == [(r["step"], r["loss"]) for r in rows]
