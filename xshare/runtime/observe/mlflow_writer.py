"""MLflow as a second metric writer (``Runtime(writers=["mlflow"])``): each job an MLflow run.

The tracking store is ``MLFLOW_TRACKING_URI`` when set, else a SQLite file in the run
directory, ``sqlite:///{log_dir}/mlflow.db`` (MLflow's file store is in maintenance mode and
refuses new stores unless told otherwise); the experiment is named after the run directory,
the run after the job, and its parameters are the run's params. A resumed job continues its
run (found by its ``xshare.job`` tag): MLflow keeps a metric's whole history, so the steps run
again after the checkpoint are logged a second time (a chart shows the later values).

``pip install 'xshare[mlflow]'`` (mlflow-skinny, with SQLAlchemy and Alembic for the SQLite
store). Imported when a job opens its writer, never at ``import xshare``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Mapping

from ..._errors import XShareError

_TAG = "xshare.job"
_BATCH = 1000  # MLflow's limit of metrics per log_batch call


class MLflowWriter:
    """One job's MLflow run (see the module docstring)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._client: Any = None
        self._run_id: str | None = None
        self._pending: list = []

    def open(self, job: str, params: Mapping[str, Any], *, first_step: int = 0) -> None:
        try:
            from mlflow.entities import Param, RunStatus
            from mlflow.tracking import MlflowClient
        except ImportError as err:
            raise XShareError("MLflow runs need mlflow: pip install 'xshare[mlflow]'") from err
        run_dir = self.directory.parent
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir.absolute() / 'mlflow.db'}"
        self._client = client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(run_dir.name)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(run_dir.name)
        found = client.search_runs([exp_id], filter_string=f"tags.`{_TAG}` = '{_quote(job)}'", max_results=1)
        if found:  # a resumed job: its run goes on
            self._run_id = found[0].info.run_id
            client.update_run(self._run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            return
        self._run_id = client.create_run(exp_id, run_name=job, tags={_TAG: job}).info.run_id
        if params:
            client.log_batch(self._run_id, params=[Param(str(k), str(v)) for k, v in params.items()])

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        self._pending.extend(Metric(k, float(v), now, int(step)) for k, v in values.items())

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for i in range(0, len(pending), _BATCH):
            self._client.log_batch(self._run_id, metrics=pending[i:i + _BATCH])

    def close(self) -> None:
        if self._run_id is not None:
            self.flush()
            self._client.set_terminated(self._run_id)
            self._run_id = None


def _quote(text: str) -> str:
    return text.replace("\\", "\\\\").replace("'", "\\'")
