"""``optimize_ray``: an Optuna study whose trials run on the runtime actors of a Ray cluster.

What runs where. The driver (the calling process) alone talks to the study: it asks trials,
turns each into a :class:`~xshare.jobs.JobRequest` (plain data: an entry point and
its params, never a closure), reports metric values, asks the pruner and tells the outcomes,
so any Optuna storage works, SQLite included, and no actor needs Optuna. Each of ``actors``
runtime actors (:class:`~xshare.service.ray_actors.RuntimeActor`, one long-lived
``xshare.Runtime`` per device) builds and trains the jobs it is given, fused when ``fuse`` is
on, and writes each job's ``metrics.jsonl`` into the run directory.

How a value reaches ``trial.report``: every ``poll_s`` the driver reads the new rows of each
running trial's ``RUN_DIR/trial-<n>/metrics.jsonl`` (rows are ``{"step": i, "time_s": t,
<metric>: v, ...}`` with ``step`` the 0-based step index, so a row reports at ``step + 1``
steps done, as the in-process driver does; an ``eval/`` row follows the train step it
evaluates). The run directory must therefore be storage every node sees. What it costs: a
value is seen up to one poll after its rows reach the file (the runtime writes rows a batch
at a time, up to 256 rows of an actor's jobs), so a pruned trial trains on for up to one poll
plus that batch past the report that pruned it; the in-process driver decides at the step
boundary instead. ``should_prune()`` cancels the job on its actor (at its next step boundary).

Placement: each new trial goes to the actor with the fewest running trials (ties: the lowest
index). The trials of one study are one entry of one shape, so the count of running trials is
the load; xshare.sched.placement's free-bytes rule would spread them the same way once every
trial has compiled, and wrongly before (an actor's arena shows no bytes for jobs still
compiling). Trials asked together go to each actor in one submit, so a fused group opens with
a slot for each (``group_capacity``).

Outcomes, states and user attributes are those of :func:`xshare.tune.optimize`: a job that
ends done is COMPLETE with the metric's last value, a pruned one PRUNED
(``xshare_pruned_at``), a failed one FAIL (its error in ``xshare_error``); a metric the job
never reports is the same ``ValueError``; Ctrl-C or SIGTERM cancels the running jobs, tells
their trials FAIL, enqueues their parameters again and raises ``Interrupted``. A runtime actor
that dies fails the trials it ran (FAIL, ``xshare_error`` says so) and enqueues their parameters
again: the next trials asked run them on the actors left, from step 0 (a FAIL counts toward
``n_trials`` as ever, so when none is left to start, the next ``optimize_ray`` on the same
storage runs them first). The study goes on with the other actors.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import optuna
from optuna.trial import TrialState

from ._optimize import (ATTR_ERROR, ATTR_JOB, ATTR_STEPS, DEFAULT_CONCURRENCY, ENDED, _Teller,
                        _sigterm_as_interrupt)

log = logging.getLogger("xshare.tune")

POLL_S = 0.5   # how often the driver reads the metrics files and asks which jobs ended


@dataclass(eq=False)
class _Trial:
    trial: optuna.Trial
    name: str
    actor: str
    every: int | None                    # report when steps % every == 0 (None: every value)
    budget: int | None                   # the job's steps (its last report is not judged)
    offset: int = 0                      # bytes of metrics.jsonl read so far
    seen: int = 0                        # steps done as the rows read so far show
    last: tuple[int, float] | None = None
    pruned_at: int | None = None
    missing: list[str] | None = None     # the metrics the job reports, when `metric` is not one
    names: set = field(default_factory=set)     # every metric its rows hold (for the error)
    reported: set = field(default_factory=set)
    request: Any = None                  # its JobRequest, named


class _RayDriver(_Teller):
    def __init__(self, study, request, n_trials, metric, report_every, concurrency, run_dir, actors,
                 runtime, num_cpus, poll_s, timeout, catch, callbacks):
        self.study, self.request, self.metric = study, request, metric
        self.report_every, self.concurrency, self.run_dir = report_every, concurrency, run_dir
        self.n_actors, self.runtime, self.num_cpus, self.poll_s = actors, runtime, num_cpus, poll_s
        self.timeout, self.catch, self.callbacks = timeout, catch, list(callbacks or ())
        self.signals = _sigterm_as_interrupt()
        self.running: dict[str, _Trial] = {}     # job name -> trial
        self.pending: list[_Trial] = []          # asked, not yet submitted (abandon tells them too)
        self.live: dict[str, Any] = {}           # actor name -> handle
        ended = len(study.get_trials(deepcopy=False, states=ENDED))
        self.to_start = max(n_trials - ended, 0)

    # ------------------------------------------------------------------ actors
    def start_actors(self) -> None:
        from xshare.service.ray_actors import actor_class, actor_options

        opts = {"fuse": True, **dict(self.runtime or {})}
        # Each actor's fused groups open with a slot for its share of the running trials and keep
        # it as trials come and go (one group program per shape, as optimize's own runtime has).
        capacity = opts.pop("group_capacity", None) or -(-self.concurrency // self.n_actors)
        unknown = set(opts) - {"memory", "policy", "fuse", "checkpoint_every"}
        if unknown:
            raise TypeError(f"runtime={self.runtime!r}: a runtime actor takes memory, policy, fuse, "
                            f"checkpoint_every and group_capacity; not {', '.join(sorted(unknown))}")
        cls = actor_class()
        for i in range(self.n_actors):
            o = actor_options(i, num_cpus=self.num_cpus)
            # checkpoint_every None: a trial is not resumed elsewhere (an interrupted one is
            # enqueued again as a new trial), so periodic checkpoints would cost for nothing.
            self.live[o["name"]] = cls.options(**o).remote(
                self.run_dir, opts.get("memory"), opts.get("policy", "pack"), opts.get("checkpoint_every"),
                bool(opts["fuse"]), capacity)

    def stop_actors(self) -> None:
        import ray

        for actor in self.live.values():
            try:
                ray.get(actor.stop.remote(), timeout=120)
            except Exception:  # noqa: BLE001 - dead already, or stuck: kill it either way
                pass
            ray.kill(actor)
        self.live.clear()

    def lost(self, actor: str, err: BaseException) -> None:
        """A runtime actor died: its trials are told FAIL and their parameters enqueued again,
        so the sampler's choices are not lost with the machine: the next trials asked, on the
        actors left (or by the next ``optimize_ray`` on this storage), run them from step 0."""
        log.warning("runtime actor %s is gone (%s); its trials fail and are enqueued again", actor,
                    type(err).__name__)
        self.live.pop(actor, None)
        for name, t in list(self.running.items()):
            if t.actor == actor:
                del self.running[name]
                self.abandoned(t.trial, t.seen, f"its runtime actor {actor} died", requeue=True, notify=True)
        if not self.live:
            raise RuntimeError("every runtime actor died; the study stops (its trials were told FAIL "
                               "and their parameters enqueued again)")

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            batch = self.pending = []
            width = self.width(self.concurrency)  # (fewer while the pruner's startup trials run)
            while (self.to_start > 0 and len(self.running) + len(batch) < width
                   and (deadline is None or time.monotonic() < deadline)):
                self.signals.check()
                self.to_start -= 1
                t = self.ask(batch)
                if t is not None:
                    batch.append(t)
            if batch:
                self.submit(batch)
            self.pending = []
            if not self.running:
                return
            self.signals.check()
            self.poll()
            if self.running:
                time.sleep(self.poll_s)

    def ask(self, batch: list[_Trial]) -> _Trial | None:
        """Ask a trial, make its request and pick its actor; None: it ended already."""
        from xshare.jobs.request import JobRequest

        trial = self.study.ask()
        req = self.built(trial, self.request)
        if req is None:
            return None
        if not isinstance(req, JobRequest):  # misuse: never caught
            trial.set_user_attr(ATTR_ERROR, f"request(trial) returned a {type(req).__name__}")
            self.tell(trial, TrialState.FAIL)
            raise TypeError(f"request(trial) must return an xshare.jobs.JobRequest "
                            f"(entry, params, steps); got {type(req).__name__}")
        name = f"trial-{trial.number}"
        every = self.report_every
        if every is None and not self.metric.startswith("eval/"):
            every = max(1, (req.steps or 200) // 20)  # a train metric: 20 reports a trial (as locally)
        load = {a: 0 for a in self.live}
        for t in list(self.running.values()) + batch:
            load[t.actor] = load.get(t.actor, 0) + 1
        actor = min(self.live, key=lambda a: (load[a], list(self.live).index(a)))
        named = JobRequest(entry=req.entry, params=dict(req.params), steps=req.steps, name=name,
                           priority=req.priority)
        return _Trial(trial, name, actor, every, req.steps, request=named)

    def submit(self, batch: list[_Trial]) -> None:
        """One submit per actor for the trials asked together (a fused group opens for all)."""
        import ray

        by_actor: dict[str, list[_Trial]] = {}
        for t in batch:
            by_actor.setdefault(t.actor, []).append(t)
        refs = {a: self.live[a].submit.remote([t.request.to_json() for t in ts]) for a, ts in by_actor.items()}
        failed: BaseException | None = None
        for actor, ref in refs.items():
            ts = by_actor[actor]
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as err:
                for t in ts:
                    self.running[t.name] = t  # (lost() fails them with the actor)
                self.lost(actor, err)
                continue
            except Exception as err:  # noqa: BLE001 - the entry cannot be built: the trials fail
                why = str(getattr(err, "cause", None) or err).strip().splitlines()[-1]
                for t in ts:
                    t.trial.set_user_attr(ATTR_STEPS, 0)
                    t.trial.set_user_attr(ATTR_ERROR, f"its job could not be built: {why}")
                    self.tell(t.trial, TrialState.FAIL)
                if not isinstance(err, self.catch):
                    failed = failed or ValueError(f"trial {ts[0].trial.number}'s job could not be built on "
                                                  f"{actor}: {why}")
                continue
            for t in ts:
                t.trial.set_user_attr(ATTR_JOB, t.name)
                self.running[t.name] = t
        if failed is not None:
            raise failed

    def poll(self) -> None:
        """Report each running trial's new values; finish the trials whose jobs ended."""
        import ray

        by_actor: dict[str, list[str]] = {}
        for name, t in self.running.items():
            by_actor.setdefault(t.actor, []).append(name)
        # Ended jobs first, then the files: a job seen ended has every row written (see
        # RuntimeActor.ended), so its last rows are read before it is told.
        refs = {a: self.live[a].ended.remote(names) for a, names in by_actor.items() if a in self.live}
        ended: dict[str, dict] = {}
        for actor, ref in refs.items():
            try:
                ended.update(ray.get(ref, timeout=60))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
                self.lost(actor, err)
        for name, t in list(self.running.items()):
            self.read(t)
            if t.missing is not None and name not in ended:
                self.cancel(t)
            if name in ended:
                del self.running[name]
                self.finish(t, ended[name])

    def read(self, t: _Trial) -> None:
        # (trial-<n> is its own directory name: the recorder percent-encodes only other characters)
        path = os.path.join(self.run_dir, t.name, "metrics.jsonl")
        try:
            with open(path, "rb") as f:
                f.seek(t.offset)
                chunk = f.read()
        except FileNotFoundError:  # not started yet (compiling, or queued for memory)
            return
        end = chunk.rfind(b"\n") + 1  # a torn last line is read whole at the next poll
        t.offset += end
        want_eval = self.metric.startswith("eval/")
        for line in chunk[:end].splitlines():
            row = json.loads(line)
            steps = int(row["step"]) + 1
            t.seen = max(t.seen, steps)
            names = sorted(k for k in row if k not in ("step", "time_s"))
            t.names.update(names)
            if self.metric not in row:
                # A row of the metric's kind without it: the job never reports it (as locally).
                if t.missing is None and want_eval == any(k.startswith("eval/") for k in names):
                    t.missing = names
                continue
            value = float(row[self.metric])
            t.last = (steps, value)
            if t.pruned_at is not None or t.missing is not None or (t.every is not None and steps % t.every):
                continue
            if steps in t.reported:  # (Optuna keeps the first report of a step)
                continue
            t.reported.add(steps)
            t.trial.report(value, steps)
            # The report after the last step is not judged: stopping then saves nothing.
            if (t.budget is None or steps < t.budget) and t.trial.should_prune():
                t.pruned_at = steps
                self.cancel(t)

    def cancel(self, t: _Trial) -> None:
        try:
            self.live[t.actor].cancel.remote(t.name)  # (not waited for: the next poll sees it end)
        except Exception as err:  # noqa: BLE001 - a dead actor: the next poll fails its trials
            log.warning("could not cancel %s on %s: %s", t.name, t.actor, err)

    def finish(self, t: _Trial, end: dict[str, Any]) -> None:
        self.conclude(t.trial, status=end["status"], steps=int(end.get("steps_done") or t.seen), last=t.last,
                      pruned_at=t.pruned_at, missing=t.missing, reported=t.names, error=end.get("error"))

    # ------------------------------------------------------------------ ending
    def abandon(self, why: str, *, requeue: bool) -> None:
        """Cancel every running trial's job and tell it FAIL (and enqueue its params again)."""
        import ray

        refs = []
        for t in self.running.values():
            if t.actor in self.live:
                try:
                    refs.append(self.live[t.actor].cancel.remote(t.name))
                except Exception:  # noqa: BLE001 - a dead actor
                    pass
        try:
            ray.get(refs, timeout=30)  # cancelled before stop(), which would checkpoint them
        except Exception:  # noqa: BLE001 - ended or dead already
            pass
        # The steps each job ran, from its actor (the rows read so far can be a poll behind).
        steps = {t.name: t.seen for t in self.running.values()}
        by_actor: dict[str, list[str]] = {}
        for t in self.running.values():
            by_actor.setdefault(t.actor, []).append(t.name)
        for actor, names in by_actor.items():
            try:
                ended = ray.get(self.live[actor].ended.remote(names), timeout=30)
            except Exception:  # noqa: BLE001 - a dead actor: the rows read so far tell
                continue
            steps.update({n: int(e["steps_done"]) for n, e in ended.items()})
        for t in list(self.running.values()) + self.pending:
            self.abandoned(t.trial, steps.get(t.name, 0), why, requeue)
        self.running.clear()
        self.pending = []


def check_actors(actors: int, num_cpus: float = 1.0) -> str | None:
    """Why ``actors`` runtime actors cannot all start on the connected cluster, or None. (Ray
    would wait for the missing resources forever: the study would hang at its first submit.)
    Counts the cluster's resources now: an autoscaling cluster that would grow is refused too."""
    import ray

    have = ray.cluster_resources()
    gpus, cpus = int(have.get("GPU", 0)), float(have.get("CPU", 0))
    if gpus:
        if actors > gpus:
            return (f"{actors} runtime actors need {actors} GPUs (one each); the Ray cluster has {gpus}: "
                    f"ask for --actors {gpus} or fewer")
    elif actors * num_cpus > cpus:
        return (f"{actors} runtime actors need {actors * num_cpus:g} CPUs ({num_cpus:g} each); the Ray cluster "
                f"has {cpus:g}: ask for --actors {int(cpus // num_cpus)} or fewer")
    return None


def optimize_ray(study: optuna.Study, request: Callable[[optuna.Trial], Any], n_trials: int, *,
                 metric: str, run_dir: str, actors: int = 2, report_every: int | None = None,
                 concurrency: int | None = None, runtime: dict | None = None, num_cpus: float = 1.0,
                 poll_s: float = POLL_S, timeout: float | None = None,
                 catch: Iterable[type[BaseException]] | type[BaseException] = (),
                 callbacks: Sequence[Callable[[optuna.Study, Any], None]] | None = None) -> optuna.Study:
    """Run ``study``'s trials on ``actors`` runtime actors of the connected Ray cluster
    (``ray.init`` first) until ``n_trials`` of its trials have ended.

    ``request(trial) -> JobRequest``: the trial's job as plain data (``entry``, ``params`` with
    the trial's suggestions, ``steps``); it is named ``trial-<number>``. ``run_dir``: where the
    actors write each job's files, storage every node sees (an absolute path). ``runtime``: the
    actors' ``memory``, ``policy``, ``fuse`` (default True), ``checkpoint_every`` and
    ``group_capacity`` (default: ``concurrency`` shared among the actors). ``num_cpus``: Ray CPUs
    per actor where the cluster has no GPU (on a GPU cluster each actor takes one GPU). The
    other arguments, the outcomes and the interruption are :func:`xshare.tune.optimize`'s (see
    the module docstring for what polling files costs). Returns ``study``.
    """
    if not isinstance(study, optuna.Study):
        raise TypeError(f"study must be an optuna.Study (optuna.create_study(...)); got {type(study).__name__}")
    if len(study.directions) != 1:
        raise ValueError(f"study {study.study_name!r} has {len(study.directions)} objectives; "
                         "xshare.tune runs single-objective studies (one metric)")
    for name, value in (("n_trials", n_trials), ("actors", actors), ("report_every", report_every),
                        ("concurrency", concurrency)):
        if value is None and name in ("report_every", "concurrency"):
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if not isinstance(metric, str) or not metric:
        raise ValueError(f"metric={metric!r} must name a metric the job reports (e.g. 'eval/accuracy')")
    if not isinstance(poll_s, (int, float)) or not math.isfinite(poll_s) or poll_s <= 0:
        raise ValueError(f"poll_s={poll_s!r} must be a positive number of seconds")
    if timeout is not None and (not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0):
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds, or None")
    if not os.path.isabs(run_dir):
        raise ValueError(f"run_dir={run_dir!r} must be an absolute path (the actors may run elsewhere); "
                         f"pass os.path.abspath(run_dir)")
    import ray

    if not ray.is_initialized():
        raise RuntimeError("optimize_ray needs a connected Ray: call ray.init(...) first "
                           "(or use xshare tune SPEC.toml --ray)")
    problem = check_actors(actors, num_cpus)
    if problem:
        raise ValueError(problem)
    catch = (catch,) if isinstance(catch, type) else tuple(catch)
    driver = _RayDriver(study, request, n_trials, metric, report_every, concurrency or DEFAULT_CONCURRENCY,
                        run_dir, actors, runtime, num_cpus, poll_s, timeout, catch, callbacks)
    def run() -> None:
        driver.start_actors()
        driver.run()

    driver.drive(run, driver.stop_actors, who="xshare tune --ray",
                 again="run it again on the same storage to continue")
    return study


__all__ = ["optimize_ray", "check_actors", "POLL_S"]
