"""``optimize``: Optuna's ask-and-tell, with each trial a job of one xshare Runtime.

The driver (the calling thread, :mod:`._driver`) alone talks to the study: it asks trials,
builds their jobs with the user's objective, submits them, reports metric values and tells the
outcomes; a per-trial ``on_metrics`` hook's answer is how a pruned job stops (True cancels the
job at that step boundary). How soon a pruned trial stops: ``_driver.py``'s docstring.

Interruption (Ctrl-C, or SIGTERM while ``optimize`` runs in the main thread): every running
trial's job is cancelled and the trial is told FAIL (user attribute ``xshare_error`` says it
was interrupted), and its parameters are enqueued again (``study.enqueue_trial``), so the next
``optimize`` on the same storage reruns them first. ``n_trials`` counts the study's *ended*
trials (COMPLETE, PRUNED, FAIL), including those of earlier calls: calling ``optimize`` again
after an interruption continues until ``n_trials`` have ended, rather than adding ``n_trials``
more as ``study.optimize`` does.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterable, Sequence

import optuna
from optuna.trial import TrialState

import xshare

from ._signals import _sigterm_as_interrupt as _sigterm_as_interrupt  # (the Ray driver's too)

log = logging.getLogger("xshare.tune")

DEFAULT_CONCURRENCY = 8     # trials running at once when not given: one fused group of 8
GATE_TIMEOUT_S = 60.0       # the longest a job waits for its previous report's decision
ENDED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)

# Trial user attributes set by optimize (what the CLI's table and the tests read).
ATTR_JOB, ATTR_STEPS, ATTR_ERROR, ATTR_PRUNED_AT = "xshare_job", "xshare_steps", "xshare_error", "xshare_pruned_at"


class Interrupted(KeyboardInterrupt):
    """Raised by ``optimize`` when Ctrl-C or SIGTERM stopped it (running trials told FAIL and
    enqueued again); ``optimize`` again on the same storage continues the study."""


class _Teller:
    """What both drivers (``optimize``'s, ``_driver.py``, and Ray's, ``_ray.py``) tell Optuna,
    one way: a trial whose job could not be built, and how a trial's job ended. A driver has
    ``study``, ``callbacks``, ``metric`` and ``catch``."""

    _wide = False  # the pruner's startup trials have completed (``width``)

    # Set by each driver's __init__ (declared here so both drivers are checked against them).
    study: optuna.Study
    callbacks: list[Callable[[optuna.Study, Any], None]]
    metric: str
    catch: tuple[type[BaseException], ...]

    def abandon(self, why: str, *, requeue: bool) -> None:
        """Tell every running trial the study stopped (``why``); each driver knows its trials."""
        raise NotImplementedError

    def built(self, trial: optuna.Trial, make: Callable[[optuna.Trial], Any]) -> Any:
        """``make(trial)``: the trial's job (a spec, or a request); None if the trial ended
        already (pruned in its objective, or failed with an error in ``catch``)."""
        try:
            return make(trial)
        except optuna.TrialPruned:
            self.tell(trial, TrialState.PRUNED)
            return None
        except KeyboardInterrupt:  # Ctrl-C inside the objective: this trial too is interrupted
            trial.set_user_attr(ATTR_ERROR, "interrupted in its objective; its parameters were enqueued again")
            self.study.tell(trial, state=TrialState.FAIL)
            self.study.enqueue_trial(trial.params, skip_if_exists=False)
            raise
        except Exception as err:
            trial.set_user_attr(ATTR_ERROR, f"objective raised: {type(err).__name__}: {err}")
            self.tell(trial, TrialState.FAIL)
            if isinstance(err, self.catch) and not _ours(err):
                log.warning("trial %d failed in its objective: %s", trial.number, err)
                return None
            raise

    def conclude(self, trial: optuna.Trial, *, status: str, steps: int, last: tuple | None,
                 pruned_at: int | None, missing: list | None, reported: Iterable[str],
                 error: str | None) -> None:
        """Tell ``trial`` how its job ended: ``status`` done/failed/cancelled after ``steps``;
        ``last`` its newest (step, value) of the metric; ``missing`` the metrics it reported
        where the metric was expected, ``reported`` those it reports (for the error)."""
        trial.set_user_attr(ATTR_STEPS, steps)
        if missing is not None or (status == "done" and last is None):
            seen = missing if missing is not None else sorted(reported)
            trial.set_user_attr(ATTR_ERROR, f"its job never reported {self.metric!r}")
            self.tell(trial, TrialState.FAIL)
            raise ValueError(f"metric={self.metric!r} is not a metric trial {trial.number}'s job "
                             f"reports; it reports: {', '.join(seen) or '(nothing)'}. Name one of those "
                             "(evaluation metrics are eval/<name>, from bind(..., eval_step=...))")
        if pruned_at is not None and status != "failed":
            # (Also when the job reached its end before the cancel landed: the decision stands.)
            trial.set_user_attr(ATTR_PRUNED_AT, pruned_at)
            self.tell(trial, TrialState.PRUNED)
        elif status == "done" and last is not None and not math.isnan(last[1]):
            self.tell(trial, TrialState.COMPLETE, last[1])
        else:
            if status == "done":
                assert last is not None  # (done without a value raised above)
                # Optuna takes no NaN as a trial's value: study.optimize fails a trial whose
                # objective returns one, and so does this (told COMPLETE, it raised out of
                # optimize and took every running trial with it).
                error = (f"its job ended with {self.metric}=nan at step {last[0]} "
                         "(Optuna takes no NaN value: the trial fails, as in study.optimize)")
            trial.set_user_attr(ATTR_ERROR, error or f"its job was {status} after {steps} steps")
            self.tell(trial, TrialState.FAIL)

    def width(self, concurrency: int) -> int:
        """Trials to run at once now: ``concurrency``, or fewer while the pruner waits for its
        startup trials (``n_startup_trials`` of MedianPruner and PercentilePruner, also inside a
        PatientPruner): it judges no trial until that many have completed, so a trial started
        before then runs to its end unjudged, and its value, good or bad, stays in the median
        that judges every later trial. The digits study (MedianPruner(n_startup_trials=5)) at
        concurrency 8 trained 60% more steps than the same study run one trial at a time,
        because the first 8 all completed (benchmarks/RESULTS.md). So the first wave is the
        startup trials, and the study widens to ``concurrency`` once they have completed. (A
        fused study pays one compile more for a model shape that has a single trial in that wave:
        it steps on its own program until more trials of its shape arrive.)"""
        if self._wide:
            return concurrency
        need = _startup_trials(self.study.pruner)
        # (asked on every turn of a driver's loop: once wide, it stays wide without asking the
        # storage again, as completed trials never go back)
        done = len(self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))) if need > 0 else 0
        if done >= need:
            self._wide = True
            return concurrency
        return max(1, min(concurrency, need - done))

    def tell(self, trial: optuna.Trial, state: TrialState, value: float | None = None) -> None:
        frozen = self.study.tell(trial, value, state=state) if state is TrialState.COMPLETE \
            else self.study.tell(trial, state=state)
        for callback in self.callbacks:
            callback(self.study, frozen)

    def drive(self, run: Callable[[], None], cleanup: Callable[[], None], *, who: str, again: str) -> None:
        """``run()`` the study with SIGINT/SIGTERM guarded (``self.signals``); interrupted, the
        running trials are told FAIL and enqueued again (``Interrupted`` says how to continue:
        ``again``); failed, they are told FAIL; ``cleanup()`` in any case."""
        with _sigterm_as_interrupt() as signals:
            self.signals = signals
            try:
                run()
            except KeyboardInterrupt:
                self.abandon("interrupted", requeue=True)
                raise Interrupted(f"{who} was interrupted; running trials were told FAIL and enqueued "
                                  f"again: {again}") from None
            except BaseException:
                self.abandon("stopped: the study raised", requeue=False)
                raise
            finally:
                cleanup()

    def abandoned(self, trial: optuna.Trial, steps: int, why: str, requeue: bool, *,
                  notify: bool = False) -> None:
        """Tell a trial the study stopped under FAIL ("``why`` after ``steps`` steps"), its
        parameters enqueued again with ``requeue`` (and the callbacks called with ``notify``:
        the study goes on); never raises an Exception (the others are told anyway)."""
        try:
            trial.set_user_attr(ATTR_STEPS, steps)
            trial.set_user_attr(ATTR_ERROR, f"{why} after {steps} steps"
                                + ("; its parameters were enqueued again" if requeue else ""))
            if notify:
                self.tell(trial, TrialState.FAIL)
            else:
                self.study.tell(trial, state=TrialState.FAIL)
            if requeue:
                self.study.enqueue_trial(trial.params, skip_if_exists=False)
        except Exception as err:  # noqa: BLE001 - tell the others anyway
            log.warning("could not tell trial %d: %s", trial.number, err)


def _startup_trials(pruner: Any) -> int:
    """The completed trials ``pruner`` waits for before it judges any (0: it judges from the
    first). Optuna keeps it private (``_n_startup_trials``), so a pruner without it counts 0."""
    for _ in range(8):  # (PatientPruner wraps another pruner; a wrapper of wrappers is rare)
        n = getattr(pruner, "_n_startup_trials", None)
        if isinstance(n, int) and not isinstance(n, bool):
            return n
        pruner = getattr(pruner, "_wrapped_pruner", None)
        if pruner is None:
            return 0
    return 0


def _ours(err: BaseException) -> bool:
    """Errors optimize itself raises about the objective's return value (never caught)."""
    text = str(err)
    return "objective(trial) must return" in text or "is an evaluation metric" in text


def optimize(study: optuna.Study, objective: Callable[[optuna.Trial], Any], n_trials: int, *,
             metric: str, report_every: int | None = None, concurrency: int | None = None,
             runtime: "xshare.Runtime | dict | None" = None, timeout: float | None = None,
             catch: Iterable[type[BaseException]] | type[BaseException] = (),
             callbacks: Sequence[Callable[[optuna.Study, Any], None]] | None = None) -> optuna.Study:
    """Run ``study``'s trials as jobs of one Runtime until ``n_trials`` of its trials have ended.

    Args:
      study: an Optuna study with one objective (any sampler, pruner and storage).
      objective: ``objective(trial) -> JobSpec``: a bound job built from ``trial.suggest_*``. It may
        raise ``optuna.TrialPruned`` (the trial is PRUNED) or another error (FAIL; re-raised
        unless its type is in ``catch``).
      n_trials: the study's ended trials (COMPLETE, PRUNED, FAIL) to reach, counting earlier
        calls' (so a call after an interruption continues the study).
      metric: the metric that judges a trial: an evaluation metric (``"eval/accuracy"``, from
        ``bind(..., eval_step=..., eval_every=K)``) or a train metric (``"loss"``). Each new value
        is reported with ``trial.report(value, steps_done)``; the trial's value is the last one.
      report_every: report only values at steps divisible by this (default: every evaluation;
        for a train metric, 20 reports over the job's steps).
      concurrency: trials running at once (default 8: one fused group); fewer until the pruner's
        startup trials (``n_startup_trials``) have completed, which run first.
      runtime: a ``Runtime`` to use (left open), or keyword arguments for one (default
        ``{"fuse": True, "group_capacity": concurrency}``: trials of one program step as one
        vmapped executable, whose group has a slot for each running trial from the start and
        keeps it when trials end, so a study compiles one group program per model shape). A
        ``Runtime`` passed in keeps its own settings: build it with
        ``Runtime(fuse=True, group_capacity=concurrency)`` for the same. The study's own
        runtime lets go of each trial's final state as the trial is told (the study keeps its
        value and params); in a ``Runtime`` passed in, ``rt.handle(name).result()`` has it.
      timeout: seconds after which no new trial starts (running ones finish).
      catch: exception types from ``objective`` that fail the trial but not the study.
      callbacks: ``callback(study, frozen_trial)`` after each trial is told.

    A job that fails fails its trial (FAIL, its error in the ``xshare_error`` user attribute);
    the study goes on. So does a job that ends with its metric NaN: Optuna takes no NaN value,
    and ``study.optimize`` fails such a trial too.

    Returns:
      ``study``, with the trials told.

    Raises:
      ValueError: a multi-objective study, a bad ``n_trials``/``report_every``/``concurrency``/
        ``timeout``, or a metric the job never reports (naming the metrics it does report).
      Interrupted: Ctrl-C or SIGTERM stopped it; running trials were told FAIL and enqueued
        again, so ``optimize`` again on the same storage continues.
    """
    if not isinstance(study, optuna.Study):
        raise TypeError(f"study must be an optuna.Study (optuna.create_study(...)); got {type(study).__name__}")
    if len(study.directions) != 1:
        raise ValueError(f"study {study.study_name!r} has {len(study.directions)} objectives; "
                         "xshare.tune.optimize runs single-objective studies (one metric)")
    for name, value, low in (("n_trials", n_trials, 1), ("report_every", report_every, 1),
                             ("concurrency", concurrency, 1)):
        if value is None and name != "n_trials":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if not isinstance(metric, str) or not metric:
        raise ValueError(f"metric={metric!r} must name a metric the job reports (e.g. 'eval/accuracy')")
    if timeout is not None and (not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0):
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds, or None")
    if runtime is not None and not isinstance(runtime, (dict, xshare.Runtime)):
        raise TypeError(f"runtime must be an xshare.Runtime or a dict of its arguments; got {type(runtime).__name__}")
    catch = (catch,) if isinstance(catch, type) else tuple(catch)
    from ._driver import _Driver  # (it builds on _Teller above)

    driver = _Driver(study, objective, n_trials, metric, report_every, concurrency or DEFAULT_CONCURRENCY,
                     runtime, timeout, catch, callbacks)
    driver.drive(driver.run, driver.close, who="xshare.tune.optimize",
                 again="optimize again on the same storage continues")
    return study
