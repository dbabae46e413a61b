"""The compile pool's side of a Runtime: from a submitted spec to a ``Prepared`` event.

Per job (or, in a fused runtime, per batch of jobs of one step function, so their constants are
lifted together): restore its checkpoint, peek its first batch, trace and key its program through
the process-wide cache (or, for a job its family's lifted program already covers, only trace it),
choose the program it runs (``sweeps``), compile what it needs, and post the result to the
dispatcher, which alone writes the job's record.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any

from ..sched.capacity import open_capacity, opens_alone, split_capacity
from .observe import checkpoint, released
from .engine import evaluation
from .compiled import fusion, lifting, multistep
from .causes import short_error
from .compiled.compiler import PROGRAMS, Traced
from .compiled.payoff import FUSION, group_key, unmeasured
from .compiled.leaves import layout_of, promoted
from .engine.groups import GROUP_COMPILING
from .engine.records import JobRecord, Prepared
from .observe.recorder import job_dir
from .engine.source import END, BatchSource
from .engine.streams import parallel_streams
from .compiled.sweeps import Choice

log = logging.getLogger("xshare.runtime")

@dataclasses.dataclass(frozen=True)
class Deferred:
    """``_prepare_program(lower=False)``'s answer for a job its family's program does not cover:
    to be lowered in a second pass, from this trace of its step (None: not traced yet)."""

    traced: Traced | None


class Preparation:
    """What a Runtime's compile pool threads run: from a submitted job to a ``Prepared`` event
    posted to ``dispatcher``. Holds what they read (the runtime's settings, its device, its
    recorder, its ``Sweeps``) and writes nothing of a job's record."""

    def __init__(self, *, config: Any, device: Any, recorder: Any, dispatcher: Any, sweeps: Any,
                 fenced: bool):
        self.config, self.device, self.recorder = config, device, recorder
        self._dispatcher, self._sweeps, self.fenced = dispatcher, sweeps, fenced
        self.streams = parallel_streams(device, config.parallel_lanes)  # (groups split over them)

    def capacity(self, joining: int) -> int:
        """The slots of the groups ``joining`` jobs open (``Groups.join`` opens the same)."""
        return split_capacity(joining, self.streams, self.config.group_capacity)

    def prepare(self, job: JobRecord) -> None:
        """On the compile pool: restore a checkpoint, peek the first batch, compile the program."""
        prepared = self._prepare_program(job)
        if prepared is not None:
            self._dispatcher.post(self._dispatcher.compiled, job, prepared)

    def _prepare_program(self, job: JobRecord, opened: tuple | None = None, *,
                         lower: bool = True, traced: Traced | None = None) -> Any:
        """Restore a checkpoint, peek the first batch, key (and unless fused, compile) the
        job's own program. Nothing here writes the job's record (the dispatcher thread owns
        it): the result goes to the dispatcher as a ``Prepared`` event; None if the job already
        ended (its end is posted). ``opened``: what ``_open`` returned for it, if called already.
        With ``lower=False`` (a fused batch's first pass), a job its family's program does not
        cover is not lowered yet: a ``Deferred`` holding its trace comes back, and the second
        pass hands that trace back as ``traced`` (the step is traced once, not once a pass and again to
        lower it: ~35 ms a digits trial, the GIL held)."""
        if opened is None:
            opened = self._open(job)
            if opened is None:
                return None
        spec, restored, source, first = opened
        post = self._dispatcher.post
        try:
            _, batch_layout = layout_of(first)
            covered, traced = self._covering(spec, first, traced) if self.config.fuse else (None, None)
            if covered is not None:
                choice, promote = covered
                program = choice.program
            elif not lower:
                return Deferred(traced)
            else:
                # Fused: traced and keyed only (the group compiles its own vmapped program).
                choice = None
                program, promote = PROGRAMS.get_promoting(spec.job, spec.state, first, device=self.device,
                                                          fenced=self.fenced, compile=False, traced=traced)
                if not self.config.fuse:
                    device = self.device
                    self._dispatcher.tiers.prefetch(
                        program.key, lambda form: multistep.compile_multi(program, form, device),
                        lambda form: multistep.begun_multi(program, form))
                    program.ensure()
            if promote:  # Python numbers the step changes are carried as arrays
                spec = spec.replace(state=promoted(spec.state, promote))
            _, layout = layout_of(spec.state)
        except Exception as err:  # noqa: BLE001
            post(self._dispatcher.fail_now, job, f"could not compile its step: {short_error(err)}", err)
            return None
        try:
            ev = evaluation.prepare(spec, self.device)  # compiled beside the step
        except Exception as err:  # noqa: BLE001
            post(self._dispatcher.fail_now, job, f"could not compile its eval_step: {short_error(err)}", err)
            return None
        return Prepared(program=program, spec=spec, layout=layout, batch_layout=batch_layout,
                        source=source, restored_metrics=restored, fuse_hint=job.fuse_hint, eval=ev,
                        choice=choice)

    def _open(self, job: JobRecord) -> tuple | None:
        """Restore ``job``'s checkpoint and peek its first batch: ``(spec, restored metrics,
        source, first batch)``, or None if it already ended (its end is posted)."""
        spec, post, restored = job.spec, self._dispatcher.post, None
        try:
            saved = self._restore(job) if self.config.resume else None
        except Exception as err:  # noqa: BLE001 - a broken checkpoint fails its job alone
            post(self._dispatcher.fail_now, job, f"could not resume from its checkpoint: {short_error(err)}", err)
            return None
        try:
            if saved is not None and saved.done:
                done = spec.replace(start_step=saved.step)  # its steps count as done
                self.recorder.open(job, resume_from=saved.step)
                state, on_disk = saved.state, None
                if not self.config.keep_results:  # (xshare serve --resume: its state stays on disk)
                    on_disk = released.on_disk(checkpoint.path_for(self.config.checkpoint_dir, job_dir(job.name)),
                                               saved.step, saved.state)
                    state = None
                post(self._dispatcher.finish_now, job, state, saved.metrics,
                     f"resumed: already done at step {saved.step}", done, on_disk)
                return None
            if saved is not None:
                spec, restored = spec.replace(state=saved.state, start_step=saved.step), saved.metrics
            self.recorder.open(job, resume_from=spec.start_step if self.config.resume else None)
            source = BatchSource(spec.data, start=spec.start_step, stop=spec.steps,
                                 data_state=saved.data_state if saved is not None else None)
            first = source.peek()
            if spec.start_step:
                self.recorder.line(job, f"resumed at step {spec.start_step}" + _data_resumed(source))
        except Exception as err:  # noqa: BLE001 - a broken job fails alone
            post(self._dispatcher.fail_now, job,
                 f"its data raised while producing batch {spec.start_step}: {short_error(err)}", err)
            return None
        if first is END:
            post(self._dispatcher.finish_now, job, spec.state, None, "no batches: done", spec)
            return None
        return spec, restored, source, first

    def _covering(self, spec: Any, first: Any,
                  traced: Traced | None = None) -> tuple[tuple[Choice, frozenset] | None, Traced | None]:
        """A fused runtime's shortcut for a job whose family already has a lifted program that
        covers it (a study's trials after its first wave): its step traced to a jaxpr only, and
        matched to that program (``Sweeps.covering``), without lowering and keying a literal
        program of its own that it would never run. Measured on the digits study (64 trials,
        2-core CPU): tracing and lowering each trial kept the compile pool busy ~10 s of a ~19 s
        run, holding the GIL against the dispatcher; lowering is about half of it. Returns
        ``((choice, promoted) or None, the trace or None)``: None, the full path
        (``PROGRAMS.get`` with that trace, then ``Sweeps.assign``). ``traced``: the job's trace
        from an earlier pass (matched again: a family program may have come since)."""
        if not self._sweeps.lifting():
            return None, traced
        try:
            if traced is None:
                traced = PROGRAMS.trace(spec.job, spec.state, first, device=self.device)
            choice = self._sweeps.covering(lifting.trace(traced.jaxpr), traced.names)
        except Exception:  # noqa: BLE001 - the full path finds (and reports) what is wrong
            return None, None
        return (None if choice is None else (choice, traced.promote)), traced

    def prepare_fused(self, jobs: list[JobRecord]) -> None:
        """On the compile pool, for jobs submitted together to a fused runtime: their programs
        are chosen together (sweeps.py: a sweep that differs only in constants becomes one
        lifted program), then each group program is compiled here, off the dispatcher."""
        fenced = self.fenced
        # Two passes: first every job is traced and matched to its family's program (~20 ms a
        # trial), and a covered one whose group program is compiled is posted at once; then the
        # others are lowered (~100-200 ms each). A study's refill does not wait behind the
        # lowering of a new shape's trials.
        pairs, deferred = [], []
        for job in jobs:
            opened = self._open(job)
            prep = None if opened is None else self._prepare_program(job, opened, lower=False)
            if isinstance(prep, Deferred):
                deferred.append((job, opened, prep.traced))
            elif prep is not None and not self._ready(job, prep, fenced):
                pairs.append((job, prep))
            # (else ended, or posted: a covered trial whose group program is compiled joins now)
        for job, opened, traced in deferred:
            prep = self._prepare_program(job, opened, traced=traced)
            if prep is not None:
                pairs.append((job, prep))
        if not pairs:
            return
        # Jobs a family program already covers were matched on their own (_covering); the
        # others' programs are chosen together.
        todo = [i for i, (_, prep) in enumerate(pairs) if prep.choice is None]
        try:
            assigned = self._sweeps.assign([pairs[i][1].program for i in todo])
        except Exception as err:  # noqa: BLE001 - lifting is an optimization: run unlifted
            log.warning("xshare: constant lifting failed, jobs keep their own programs: %s", short_error(err))
            assigned = [Choice(pairs[i][1].program) for i in todo]
        choices = [prep.choice for _, prep in pairs]
        for i, choice in zip(todo, assigned):
            choices[i] = choice
        together: dict[str, int] = {}
        for choice in choices:
            together[choice.program.key] = together.get(choice.program.key, 0) + 1
        fused, alone = [], []   # (job, prep, whether it fuses)
        for (job, prep), choice in zip(pairs, choices):
            program = choice.program
            # The group it is about to have: the jobs of this call on its program, or one that
            # runs alone now and can move in (sweeps.Choice.peers), or, under a floor
            # (group_capacity), one of a program others run. A lone job runs its solo program.
            # Under a floor every group of the program has the floor's capacity, so once the
            # first is compiled this is a cache hit, however few trials a refill submits.
            prep = _chosen(prep, choice, together[program.key])
            if opens_alone(prep.fuse_hint, 0, choice.shared, self.config.group_capacity) or choice.peers >= 2:
                fused.append((job, prep, True))
            else:
                alone.append((job, prep, False))
        # Fusion only where it pays: a program whose fused step was measured to cost its members
        # more than their own steps, or whose group compile its members' steps would not repay,
        # runs them alone (compiled/payoff.py; measured by engine/fusecheck.py).
        for key, reason in (self._unpaid(fused, fenced) if self.config.fuse_measured else {}).items():
            for job, prep, _ in [item for item in fused if item[1].program.key == key]:
                self.recorder.line(job, f"runs alone: {reason}")
                alone.append((job, dataclasses.replace(prep, unfused=reason), False))
            fused = [item for item in fused if item[1].program.key != key]
        # Jobs that fuse go first, program by program (each program's jobs are posted right
        # after its group program compiles: the rest are cache hits), programs already compiled
        # before those that must compile, lone jobs' solo programs last: no compile holds back
        # jobs whose program is ready (on the digits study, the first wave's four 64-wide trials
        # waited 0.8-1.7 s behind a 128-wide trial's solo compile, and a refill's 64-wide trials
        # ~0.7 s behind the 128-wide family's first group compile).
        first: dict[str, int] = {}
        ready: dict[str, bool] = {}
        for i, (_, prep, _) in enumerate(fused):
            key = prep.program.key
            first.setdefault(key, i)
            if key not in ready:
                ready[key] = fusion.loads(prep.program, self.capacity(prep.fuse_hint),
                                          self.device, fenced=fenced, **self.config.staging)
        fused.sort(key=lambda item: (not ready[item[1].program.key], first[item[1].program.key]))
        # No job waits for a compile when a ready program could run it: jobs whose group program
        # must compile but whose own program is ready (compiled in this process, or kept whole:
        # a relaunch after an unfused run) step alone on it from now, and move into their group
        # once its program is compiled, off every pool (_group_later). Not under fuse="always",
        # which runs every step of theirs fused, nor without a core to spare for that compile.
        later = (self._steps_alone_first(fused, ready)
                 if self.config.fuse_measured and cores_to_spare(self.device.platform) >= 1 else {})
        early = [item for item in fused if item[1].program.key in later]
        fused = [item for item in fused if item[1].program.key not in later]
        for job, prep, _ in early:
            self._post(job, dataclasses.replace(prep, unfused=GROUP_COMPILING), False, fenced)
        for items in later.values():  # (after its jobs are posted: the dispatcher knows them)
            self._group_later(items[0][1], [job for job, _ in items], fenced)
        for job, prep, fuses in fused + alone:
            self._post(job, prep, fuses, fenced)

    def _post(self, job: JobRecord, prep: Prepared, fuses: bool, fenced: bool) -> None:
        """Compile (or load) the program ``job`` starts on, then hand it to the dispatcher."""
        try:
            if not fuses:
                prep.program.ensure()  # alone in its family: it runs its solo program
            else:
                program, capacity, device = prep.program, self.capacity(prep.fuse_hint), self.device
                self._dispatcher.tiers.prefetch(
                    group_key(program.key, capacity),
                    lambda form: multistep.compile_group_multi(program, capacity, form, device),
                    lambda form: multistep.begun_group_multi(program, capacity, form))
                fusion.fused_program(program, capacity, device, fenced=fenced, **self.config.staging)
        except Exception as err:  # noqa: BLE001
            self._dispatcher.post(self._dispatcher.fail_now, job,
                                  f"could not compile its step: {short_error(err)}", err)
            return
        self._dispatcher.post(self._dispatcher.compiled, job, prep)

    def _steps_alone_first(self, fused: list, ready: dict[str, bool]) -> dict[str, list]:
        """Program key -> its (job, prep) pairs, for the programs of ``fused`` whose group
        program must compile while their solo program loads without one (constants not lifted:
        each job runs that very program alone)."""
        out: dict[str, list] = {}
        for job, prep, _ in fused:
            out.setdefault(prep.program.key, []).append((job, prep))
        return {key: items for key, items in out.items()
                if not ready[key] and not any(prep.lifted for _, prep in items) and items[0][1].program.loads()}

    def _group_later(self, prep: Prepared, jobs: list[JobRecord], fenced: bool) -> None:
        """Compile the group program of ``jobs`` (stepping alone meanwhile) on a thread of its
        own, then hand them to the dispatcher to move in at a step boundary. Not on the compile
        pool (its close waits for it) nor the tiers' thread (the jobs' own K-step programs
        would queue behind it); not a daemon: XLA aborts at exit if one is compiling."""
        capacity = self.capacity(prep.fuse_hint)

        def build() -> None:
            try:
                fusion.fused_program(prep.program, capacity, self.device, fenced=fenced, **self.config.staging)
            except Exception as err:  # noqa: BLE001 - they go on alone
                log.warning("xshare: the group program did not compile; its jobs step alone: %s", short_error(err))
                self._dispatcher.post(self._dispatcher.group_ready, prep.program, jobs, False)
                return
            self._dispatcher.post(self._dispatcher.group_ready, prep.program, jobs, True)

        threading.Thread(target=build, name="xshare-compile-group", daemon=False).start()

    def _unpaid(self, fused: list, fenced: bool) -> dict[str, str]:
        """Program key -> why its group would not pay, for the programs ``fused`` would open."""
        by_key: dict[str, list] = {}
        for job, prep, _ in fused:
            by_key.setdefault(prep.program.key, []).append((job, prep))
        out = {}
        for key, items in by_key.items():
            program, hint = items[0][1].program, items[0][1].fuse_hint
            capacity = self.capacity(hint)
            lefts = [job.steps_left for job, _ in items]
            compile_s = fusion.group_compile_s(program, capacity, self.device, fenced=fenced,
                                               staging=self.config.staging)
            reason = FUSION.weigh(key, capacity, min(len(items), capacity), None if None in lefts else sum(lefts), compile_s,
                                  prior=unmeasured(self.device.platform, program.convolves))
            if reason is not None:
                out[key] = reason
        return out

    def _ready(self, job: JobRecord, prep: Prepared, fenced: bool) -> bool:
        """Post now a job its family's lifted program covers, if the group program it would
        join or open is compiled already (a study's refill trial: it waits for no other trial of
        its submit call to be traced). False: it goes through the batch's choice below."""
        choice = prep.choice
        if choice is None or self.config.group_capacity is None or not choice.shared:
            return False  # (whether it fuses, and at what capacity, is decided with the batch)
        if not fusion.cached(choice.program, open_capacity(1, self.config.group_capacity), fenced=fenced,
                             **self.config.staging):
            return False
        self._dispatcher.post(self._dispatcher.compiled, job, _chosen(prep, choice, 1))
        return True

    def _restore(self, job: JobRecord) -> checkpoint.Checkpoint | None:
        """``job``'s checkpoint (its step, state and metrics to continue from), if any."""
        return checkpoint.load(checkpoint.path_for(self.config.checkpoint_dir, job_dir(job.name)),
                               job.spec.state, job=job.name)


def cores_to_spare(platform: str) -> int:
    """Cores left for a compile beside stepping jobs: the dispatcher's thread holds one, and on
    a CPU device XLA runs the steps on another. With none (this project's 2-core CPU) the group
    compile beside the hook's 8 jobs stepping alone cost them as much as waiting for it did:
    8 x 400 steps ran 1.41-1.49 s against 1.17-1.39 s waiting (its lowering holds the GIL the
    dispatcher needs every step; XLA's compile takes the core their steps run on)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # (not on every platform)
        cores = os.cpu_count() or 1
    return cores - 1 - (platform == "cpu")


def _data_resumed(source: BatchSource) -> str:
    """How a resumed job's data reached its first step, for its log."""
    if source.replayed:
        return (f"; its data replayed {source.replayed} batches to get there (it has no "
                "get_state/set_state to resume from)")
    if source.stateful:
        return "; its data iterator resumed from the checkpoint's state (no batch replayed)"
    return ""


def _chosen(prep: Prepared, choice: Choice, together: int) -> Prepared:
    """``prep`` running ``choice``'s program (its lifted values), ``together`` jobs of its
    submit call on that program."""
    return dataclasses.replace(prep, program=choice.program, lifted=choice.lifted, traced=choice.traced,
                               fuse_hint=together, shared=choice.shared)
