"""The driver of ``optimize``: Optuna's ask-and-tell, with each trial a job of one xshare Runtime.

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
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import optuna

import xshare

from ._optimize import ATTR_JOB, ENDED, GATE_TIMEOUT_S, _Teller
from ._signals import _sigterm_as_interrupt


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
    reported: int | None = None          # the step of its newest value told to the study
    missing: list[str] | None = None     # the metrics the job reports, when `metric` is not one
    undecided: int = 0                   # reports queued, not yet decided by the driver
    decided: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)


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
        if self.rt is None:
            # Before the first objective: the runtime turns on JAX's persistent compilation
            # cache (Runtime(compilation_cache=True)), and from here it holds the objective's
            # own compiles too. The digits study's model inits compile ~30 small programs per
            # process (~2 s); on a machine that ran the study before, they load instead.
            self.rt = xshare.Runtime(**self.runtime_kwargs)
        while True:
            batch = self.pending = []  # asked, not yet submitted (abandon tells them too)
            width = self.width(self.concurrency)  # (fewer while the pruner's startup trials run)
            while (self.to_start > 0 and len(self.running) + len(batch) < width
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
            ended = False
            for number, r in list(self.running.items()):
                if r.handle.status() in ("done", "failed", "cancelled"):
                    self.decide(block=False)  # its last reports were queued before it ended
                    del self.running[number]
                    self.finish(r)
                    ended = True
            if ended:
                self.rejudge()

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
        assert self.rt is not None  # (run opens it first)
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
            r.reported = step
            # The report after the last step is not judged: stopping then saves nothing.
            if (r.budget is None or step < r.budget) and r.trial.should_prune():
                r.pruned_at, r.stop = step, True
        with r.lock:
            r.undecided -= 1
            if r.undecided == 0:
                r.decided.set()

    def rejudge(self) -> None:
        """Trials ended: ask the pruner again about every running trial's newest reported value.

        A pruner judges a value against the trials completed by then (MedianPruner: their
        median at that step). One trial at a time, every earlier trial has ended when a value is
        reported; with trials running side by side, a value is often judged while the trials
        started before it still run, against fewer completed ones, and a trial kept then runs
        on to its next report unjudged by what completed in between. Asking again when a trial
        ends judges it by what the study knows now, as ``should_prune`` may be asked at any
        time. A trial pruned here stops at its next report. (On the digits study at concurrency 8,
        which trains ~35% more steps than one trial at a time, the effect is within run-to-run
        noise: most of those steps are trials of one wave, which complete together and so
        cannot judge each other; it prunes where trials end at different times.)"""
        for r in self.running.values():
            if r.stop or r.reported is None or (r.budget is not None and r.reported >= r.budget):
                continue
            if r.trial.should_prune():
                r.pruned_at, r.stop = r.reported, True

    def finish(self, r: _Running) -> None:
        h = r.handle
        progress = h.progress()
        if self.owned:
            # The study keeps each trial's value and params, never its state, and no one else
            # holds this runtime: a long study of a large model must not keep every trial's
            # final state until it ends (12.5 MiB a trial for a 1024-wide MLP with Adam).
            h._release_result("xshare.tune.optimize's own runtime keeps its trials' values and "
                              "params in the study, not their final states; pass "
                              "runtime=xshare.Runtime(...) to keep them")
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
