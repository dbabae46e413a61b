"""Hyperparameter search: Optuna studies whose trials run as jobs of one xshare Runtime.

``xshare.tune.optimize(study, objective, n_trials, metric=...)``: ``objective(trial)`` returns a
bound job (``step.bind(...)``) built from ``trial.suggest_*``; its ``metric`` is reported with
``trial.report`` as it is recorded, ``trial.should_prune()`` cancels the job at its next step
boundary, and trials are asked as others end so ``concurrency`` of them run (fused by default).
Needs Optuna: ``pip install 'xshare[tune]'``. ``import xshare`` never imports this package.
"""

from __future__ import annotations

try:
    import optuna as _optuna  # noqa: F401
except ImportError as _err:  # pragma: no cover - exercised in a subprocess test
    raise ImportError("xshare.tune needs Optuna, which is not installed: "
                      "pip install 'xshare[tune]'") from _err

from ._optimize import Interrupted as Interrupted
from ._optimize import optimize as optimize

__all__ = ["optimize", "Interrupted"]
