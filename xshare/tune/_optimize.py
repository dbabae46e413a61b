"""``optimize``: Optuna's ask-and-tell, with each trial a job of one xshare Runtime.

The driver (the calling thread) alone talks to the study: it asks trials, builds their jobs
with the user's objective, submits them, reports metric values and tells the outcomes. The
runtime's dispatcher hands every recorded value to a per-trial ``on_metrics`` hook (cheap: it
queues the value), and the hook's answer is how a pruned job stops: True cancels the job at
that step boundary.

Pruning latency: the hook never waits for storage while the driver keeps up. A report is
decided (``trial.report`` + ``should_prune``) by the driver while the job trains on; the job
stops at the first step boundary after the decision. If the driver has not decided a trial's
previous report when its next one arrives (storage slower than a report interval), the hook
holds the dispatcher there until it has: a pruned trial never runs more than one report
interval past the report that pruned it.

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
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import optuna
from optuna.trial import TrialState

import xshare

log = logging.getLogger("xshare.tune")

DEFAULT_CONCURRENCY = 8     # trials running at once when not given: one fused group of 8
GATE_TIMEOUT_S = 60.0       # the longest a job waits for its previous report's decision
ENDED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)

# Trial user attributes set by optimize (what the CLI's table and the tests read).
ATTR_JOB, ATTR_STEPS, ATTR_ERROR, ATTR_PRUNED_AT = "xshare_job", "xshare_steps", "xshare_error", "xshare_pruned_at"


class Interrupted(KeyboardInterrupt):
    """Raised by ``optimize`` when Ctrl-C or SIGTERM stopped it (running trials told FAIL and
    enqueued again); ``optimize`` again on the same storage continues the study."""


@dataclass(eq=False)
class _Running:
    trial: optuna.Trial
    metric: str
    every: int | None                    # report when step % every == 0 (None: every value)
    budget: int | None = None            # the job's steps (its last report is not judged)
    handle: Any = None
    last: tuple[int, float] | None = None   # the newest value of the metric: (steps, value)
    stop: bool = False                   # the hook's answer: cancel at the next step boundary
    pruned_at: int | None = None
    missing: list[str] | None = None     # the metrics the job reports, when `metric` is not one
    undecided: int = 0                   # reports queued, not yet decided by the driver
    decided: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Teller:
    """What both drivers (this module's and Ray's, ``_ray.py``) tell Optuna, one way: a trial
    whose job could not be built, and how a trial's job ended. A driver has ``study``,
    ``callbacks``, ``metric`` and ``catch``."""

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
        elif status == "done":
            assert last is not None  # (done without a value raised above)
            self.tell(trial, TrialState.COMPLETE, last[1])
        else:
            trial.set_user_attr(ATTR_ERROR, error or f"its job was {status} after {steps} steps")
            self.tell(trial, TrialState.FAIL)

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


class _Driver(_Teller):
    def __init__(self, study, objective, n_trials, metric, report_every, concurrency, runtime,
                 timeout, catch, callbacks):
        self.study, self.objective, self.metric = study, objective, metric
        self.report_every, self.catch, self.callbacks = report_every, catch, list(callbacks or ())
        self.concurrency, self.timeout = concurrency, timeout
        self.signals: _sigterm_as_interrupt = _sigterm_as_interrupt()  # (optimize sets the active one)
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.running: dict[int, _Running] = {}
        self.closing = False
        self.pending: list = []
        ended = len(study.get_trials(deepcopy=False, states=ENDED))
        self.to_start = max(n_trials - ended, 0)
        if isinstance(runtime, xshare.Runtime):
            self.rt, self.owned = runtime, False
        else:
            self.rt, self.owned = None, True
            # A study keeps `concurrency` trials running: each fused group opens with a slot for
            # every one of them and keeps it as pruned trials leave and new ones join (one group
            # program per model shape; runtime/engine/groups.py, sched/capacity.py).
            self.runtime_kwargs = {"fuse": True, "group_capacity": concurrency, **dict(runtime or {})}

    # ------------------------------------------------------------------ the dispatcher's side
    def hook(self, r: _Running) -> Callable[[int, dict], bool]:
        metric, every = self.metric, r.every
        want_eval = metric.startswith("eval/")

        def on_metrics(step: int, metrics: dict) -> bool:
            if r.stop:
                return True
            value = metrics.get(metric)
            if value is None:
                # A notification of the metric's kind without it: the job never reports it.
                if r.missing is None and want_eval == any(k.startswith("eval/") for k in metrics):
                    r.missing, r.stop = sorted(metrics), True
                return r.stop
            r.last = (step, float(value))
            if every is not None and step % every:
                return False
            if r.undecided and not self.closing:
                r.decided.wait(GATE_TIMEOUT_S)  # see the module docstring: pruning latency
            if r.stop:
                return True
            with r.lock:
                r.undecided += 1
                r.decided.clear()
            self.events.put((r, step, float(value)))
            return False

        return on_metrics

    # ------------------------------------------------------------------ the driver's loop
    def run(self) -> None:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            batch = self.pending = []  # asked, not yet submitted (abandon tells them too)
            while (self.to_start > 0 and len(self.running) + len(batch) < self.concurrency
                   and (deadline is None or time.monotonic() < deadline)):
                self.signals.check()
                self.to_start -= 1
                started = self.start_one()
                if started is not None:
                    batch.append(started)
                self.decide(block=False)  # (an objective can take a while: keep reports flowing)
            if batch:
                self.submit(batch)
            self.pending = []
            if not self.running:
                return
            self.decide(block=True)
            self.signals.check()  # (a signal whose KeyboardInterrupt was swallowed: see below)
            for number, r in list(self.running.items()):
                if r.handle.status() in ("done", "failed", "cancelled"):
                    self.decide(block=False)  # its last reports were queued before it ended
                    del self.running[number]
                    self.finish(r)

    def start_one(self) -> tuple[_Running, Any] | None:
        """Ask a trial and build its job (submitted by ``submit``); None: it ended already."""
        trial = self.study.ask()
        spec = self.built(trial, self._job)
        if spec is None:
            return None
        every = self.report_every
        if every is None and not self.metric.startswith("eval/"):
            every = max(1, (spec.steps or 200) // 20)  # a train metric: 20 reports a trial
        r = _Running(trial, self.metric, every, budget=spec.steps)
        r.decided.set()
        # the trial's parameters, with the job's own (a spec's fixed params), as its HParams;
        # on_metrics_every: the steps the hook acts on (the runtime runs several steps per call
        # between them)
        params = {**dict(spec.meta.get("params") or {}), **trial.params}
        return r, spec.replace(name=f"trial-{trial.number}", on_metrics=self.hook(r),
                               on_metrics_every=every if every is not None else 0,
                               meta={**spec.meta, "params": params})

    def _job(self, trial: optuna.Trial) -> Any:
        spec = self.objective(trial)
        if not isinstance(spec, xshare.JobSpec):
            raise TypeError(f"objective(trial) must return a bound job (step.bind(...)); "
                            f"got {type(spec).__name__}")
        if self.metric.startswith("eval/") and spec.eval_step is None:
            raise ValueError(f"metric={self.metric!r} is an evaluation metric, but trial "
                             f"{trial.number}'s job has no eval_step; bind it with eval_step=..., "
                             "eval_data=..., eval_every=K, or tune on a train metric")
        return spec

    def submit(self, batch: list) -> None:
        """Submit the trials asked together in one call: jobs of one step submitted together
        open their fused group at a capacity for all of them (one compile, not one per
        doubling as they arrive one by one)."""
        if self.rt is None:
            self.rt = xshare.Runtime(**self.runtime_kwargs)
        self.rt.add_end_listener(self._wake)
        specs = [spec for _, spec in batch]
        try:
            handles = self.rt.submit_many(specs)
        except ValueError:  # a name is taken in a runtime the caller shares across studies
            specs = [s.replace(name=f"{self.study.study_name}-{s.name}") for s in specs]
            handles = self.rt.submit_many(specs)
        for (r, _), spec, handle in zip(batch, specs, handles):
            r.handle = handle
            r.trial.set_user_attr(ATTR_JOB, spec.name)
            self.running[r.trial.number] = r

    def _wake(self, job: Any) -> None:
        """The runtime's end listener: a job ended, so the driver looks now (a trial's slot is
        refilled ~20 ms sooner than by polling: measured on the digits study, where a pruned
        trial lives ~30 steps, tens of ms)."""
        self.events.put(None)

    def decide(self, *, block: bool) -> None:
        """Report queued values and ask the pruner; a pruned trial's hook answers True. Blocks
        (``block``) until a value arrives or a job ends, at most 20 ms."""
        try:
            item = self.events.get(timeout=0.02) if block else self.events.get_nowait()
        except queue.Empty:
            return
        while True:
            if item is not None:  # (None: a job ended, see _wake; nothing to report)
                self._decide_one(*item)
            try:
                item = self.events.get_nowait()
            except queue.Empty:
                return

    def _decide_one(self, r: _Running, step: int, value: float) -> None:
        if not r.stop:
            r.trial.report(value, step)
            # The report after the last step is not judged: stopping then saves nothing.
            if (r.budget is None or step < r.budget) and r.trial.should_prune():
                r.pruned_at, r.stop = step, True
        with r.lock:
            r.undecided -= 1
            if r.undecided == 0:
                r.decided.set()

    def finish(self, r: _Running) -> None:
        h = r.handle
        progress = h.progress()
        self.conclude(r.trial, status=h.status(), steps=progress.steps_done, last=r.last,
                      pruned_at=r.pruned_at, missing=r.missing, reported=progress.metrics or {},
                      error=h.error)

    # ------------------------------------------------------------------ ending
    def abandon(self, why: str, *, requeue: bool) -> None:
        """Stop every running trial: cancel its job, tell FAIL (and enqueue its params again)."""
        self.closing = True
        for r in self.running.values():
            r.stop = True
            r.decided.set()  # a hook waiting on the driver goes on (and stops its job)
        if self.rt is not None:
            if self.owned:
                self.rt.close()
            else:
                for r in self.running.values():
                    try:
                        r.handle.cancel()
                    except Exception:  # noqa: BLE001 - already ended
                        pass
        for r in list(self.running.values()) + [r for r, _ in self.pending]:
            self.abandoned(r.trial, r.handle.progress().steps_done if r.handle is not None else 0, why, requeue)
        self.running.clear()
        self.pending = []

    def close(self) -> None:
        if self.rt is not None:
            self.rt.remove_end_listener(self._wake)
        if self.owned and self.rt is not None:
            self.rt.close()


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
      concurrency: trials running at once (default 8: one fused group).
      runtime: a ``Runtime`` to use (left open), or keyword arguments for one (default
        ``{"fuse": True, "group_capacity": concurrency}``: trials of one program step as one
        vmapped executable, whose group has a slot for each running trial from the start and
        keeps it when trials end, so a study compiles one group program per model shape). A
        ``Runtime`` passed in keeps its own settings: build it with
        ``Runtime(fuse=True, group_capacity=concurrency)`` for the same.
      timeout: seconds after which no new trial starts (running ones finish).
      catch: exception types from ``objective`` that fail the trial but not the study.
      callbacks: ``callback(study, frozen_trial)`` after each trial is told.

    A job that fails fails its trial (FAIL, its error in the ``xshare_error`` user attribute);
    the study goes on.

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
    driver = _Driver(study, objective, n_trials, metric, report_every, concurrency or DEFAULT_CONCURRENCY,
                     runtime, timeout, catch, callbacks)
    driver.drive(driver.run, driver.close, who="xshare.tune.optimize",
                 again="optimize again on the same storage continues")
    return study


class _sigterm_as_interrupt:
    """SIGTERM raises KeyboardInterrupt while optimize runs (main thread only), so both end
    the study the same way; the previous handlers come back afterwards.

    A KeyboardInterrupt raised by a signal handler lands in whatever Python code the main thread
    runs at that moment, and CPython drops it (\"Exception ignored in ...\") when that is a garbage
    collector callback (jax registers one), a ``__del__`` or a weakref callback: the signal is
    then lost, and the study runs to its end. So the handler also records the signal, and the
    driver raises it again at its next turn (``check``, within a poll of 20 ms). SIGINT gets the
    same handler while Python's default one is installed (a handler of the caller's is left alone)."""

    def __init__(self):
        self.previous: dict = {}
        self.pending = False

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            def handler(signum, frame):
                self.pending = True
                raise KeyboardInterrupt
            self.previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, handler)
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                self.previous[signal.SIGINT] = signal.signal(signal.SIGINT, handler)
        return self

    def check(self) -> None:
        """Raise the KeyboardInterrupt of a signal that was received but never delivered."""
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt

    def __exit__(self, *exc):
        for signum, previous in self.previous.items():
            signal.signal(signum, previous)
        self.previous.clear()
        return False
