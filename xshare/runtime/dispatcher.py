"""The dispatcher: one thread that owns picking, dispatch and every job's run-time state.

Everything that changes a job arrives as an event (a compile finished, pause, resume, cancel,
a priority, stop) through ``post``; the dispatcher applies events between steps, so no lock is
held on the hot path and no other thread touches device state. Per step it does O(1) work:
advance the plan's cursor, take the job's prefetched batch, call the shared executable, and
retire the oldest in-flight step (read its metrics vector, hand the row to the recorder).
The policy is asked again only on events and after each full rotation (see ``plan.py``).

Pipelining: up to ``1 + dispatch_ahead`` steps are in flight, so on an asynchronous device the
stream never waits on Python between steps; on CPU small steps execute inline and retire at once.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

import jax
import numpy as np

from .. import ffi, sched
from .._errors import AdmissionError
from .._units import format_bytes
from ..memory import Admitted
from . import evaluation, fusion
from .causes import dispatch_error, short_error
from .fusion import GROUP_IDS, GROUP_INFLIGHT_BYTES, Group
from .plan import Plan
from .records import JobRecord, now_s
from .source import END, FEED_ABOVE_S, FEED_ABOVE_S_CPU, BatchMismatch, DataError, own, produce
from .states import Event, JobState, transition

log = logging.getLogger("xshare.runtime")

S = JobState


class Dispatcher:
    def __init__(self, *, policy: Any, arena: Any, device: Any, feeder: Any, recorder: Any,
                 timeline: Any, ring: int | None, quantum: int, slots: int, dispatch_ahead: int,
                 prefetch: int, checkpoint_every: int | None, checkpoint_dir: Any, t0: float,
                 capacity_source: str, on_end: Callable[[JobRecord], None], fuse: bool = False,
                 group_ahead: int | None = None):
        self.policy, self.arena, self.device = policy, arena, device
        self.feeder, self.recorder, self.timeline, self.ring = feeder, recorder, timeline, ring
        self.quantum, self.slots, self.ahead, self.prefetch = quantum, slots, dispatch_ahead, prefetch
        self.group_ahead = dispatch_ahead if group_ahead is None else group_ahead
        self.checkpoint_every, self.checkpoint_dir = checkpoint_every, checkpoint_dir
        self.t0, self.capacity_source, self._on_end = t0, capacity_source, on_end
        self.jobs: dict[int, JobRecord] = {}          # every live job, by id
        self._running: dict[int, JobRecord] = {}      # RUNNING jobs: what the policy sees
        self._swap_waiting: list[JobRecord] = []      # resumed, state on the host, no room yet
        self._events: deque = deque()
        self._inflight: deque = deque()
        self._lane_current: dict[int, JobRecord] = {}
        self._policy_state = policy.init()
        self._plan: Plan | None = None
        self._dirty = True
        self._seq = 0
        self._draining = False
        self._exit = False
        self._idle = False
        self._wake = threading.Event()
        self.peak_in_flight_bytes = 0
        self.fuse = fuse
        self.fused_member_steps = 0                    # member steps run in fused groups, ever
        self.groups: dict[int, Group] = {}            # fusion groups, by group id
        self._group_ids = itertools.count(GROUP_IDS)
        self._log = recorder.log_dir is not None
        self._last_retire_ns = 0
        self._feed_above = FEED_ABOVE_S_CPU if device.platform == "cpu" else FEED_ABOVE_S
        self._rows: list = []
        self.evaluating: dict[int, JobRecord] = {}    # jobs owing an evaluation (evaluation.py)
        self.thread = threading.Thread(target=self._main, name="xshare-dispatcher", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ from other threads
    def post(self, fn: Callable, *args: Any) -> Future:
        """Run ``fn(*args)`` on the dispatcher thread between two steps; its result or
        exception lands in the returned future."""
        fut: Future = Future()
        self._events.append((fn, args, fut))
        self._wake.set()
        return fut

    def call(self, fn: Callable, *args: Any, timeout: float | None = 60.0) -> Any:
        if threading.current_thread() is self.thread or not self.thread.is_alive():
            return fn(*args)
        return self.post(fn, *args).result(timeout)

    def poke(self) -> None:
        """A batch landed: wake the dispatcher if it waits for one."""
        if self._idle:
            self._wake.set()

    # ------------------------------------------------------------------ the loop
    def _main(self) -> None:
        while not self._exit:
            try:
                self._iterate()
            except BaseException as err:  # noqa: BLE001 - a bug must not hang every job
                log.error("xshare dispatcher: %s", "".join(traceback.format_exception(err)))
                self._inflight.clear()
                for job in list(self.jobs.values()):
                    self._fail(job, f"the runtime's dispatcher failed: {short_error(err)}", err)
                    job.in_flight = 0
                    self._finalize(job, Event.FAIL)

    def _iterate(self) -> None:
        if self._events:
            self._apply_events()
            return
        pick = None if self._draining else self._next()
        if pick is not None:
            self._dispatch(*pick)
            depth = self._group_depth(pick[0]) if isinstance(pick[0], Group) else self.ahead
            if len(self._inflight) > depth:
                self._retire_oldest(depth)
            return
        if self._inflight:
            self._retire()
            return
        if self._rows:
            self._flush_rows()
        self._idle = True
        # Re-check after announcing idleness: a batch that landed in between has no one to wake.
        if self._events or (not self._draining and self._next() is not None):
            self._idle = False
            return
        self._wake.wait(0.05)
        self._wake.clear()
        self._idle = False

    def _apply_events(self) -> None:
        while self._events:
            fn, args, fut = self._events.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001 - the caller gets it
                fut.set_exception(err)

    # ------------------------------------------------------------------ picking
    def _next(self) -> tuple[JobRecord, int, int] | None:
        plan = self._plan
        if self._dirty or plan is None or plan.left <= 0:
            plan = self._replan()
        if not plan:
            return None
        li, pos = plan.lane, plan.idx[plan.lane]
        job = plan.job_at(li, pos)
        if self.evaluating and evaluation.owes(self, job) is not None:
            return job, li, pos  # its turn runs an eval batch: no train batch needed
        if isinstance(job, Group):
            if self._group_ready(job, make=True):
                return job, li, pos
        else:
            if not job.batches and job.source is not None:
                # Cheap data is made here, right before the step, as a plain loop would; for
                # fed jobs the feeder is behind (its thread was not scheduled): make it here
                # too rather than idle, unless the feeder is making it right now.
                produce(job, self.device, blocking=not self._fed(job))
            if job.batches:
                return job, li, pos
        if self.policy.exclusive:
            # Exclusive policies give the device to the chosen jobs only: one waiting for its
            # data keeps it (the device idles, as under exclusive allocation).
            return None
        for li, pos in plan.candidates():
            job = plan.job_at(li, pos)
            if self.evaluating and evaluation.owes(self, job) is not None:
                return job, li, pos
            if self._group_ready(job, make=False) if isinstance(job, Group) else job.batches:
                return job, li, pos
        return None

    def _group_ready(self, group: Group, *, make: bool) -> bool:
        """Whether every member that takes part in ``group``'s next step has its batch (making
        the missing ones if ``make``). The members found are kept in ``group.now`` for the
        dispatch that follows at once (one walk over the slots per step, not three)."""
        members = group.stepping()
        group.now = None
        if not members:
            return False
        for _, member in members:
            if not member.batches:
                if make and member.source is not None:
                    produce(member, self.device, blocking=not self._fed(member))
                if not member.batches:
                    return False
        group.now = members
        return True

    def _replan(self) -> Plan:
        if getattr(self.policy, "timing", False):
            self.timeline.drain()  # its decision reads device times: make them current
        flops = self.timeline.flops_per_s
        views = []
        for job in self._running.values():
            if job.error is not None or (job.steps_left == 0 and evaluation.owes(self, job) is None):
                continue
            current = self._lane_current.get(job.lane)
            views.append(sched.JobView(
                id=job.id, name=job.name, arrival=job.arrival_s, priority=job.priority,
                steps_done=job.dispatched, steps_left=job.steps_left,
                step_time_s=job.step_estimate_s(flops), device_time_s=job.device_time_s,
                lane=job.lane, last_seq=job.last_seq,
                turn_steps=job.turn_steps if current is job else 0))
        lanes = tuple(sorted({v.lane for v in views}))
        view = sched.View(now=now_s() - self.t0, jobs=tuple(views), lanes=lanes,
                          quantum=self.quantum, slots=self.slots)
        decision, self._policy_state = self.policy.pick(view, self._policy_state)
        rotations = [[self._running[i] for i in decision.order[lane]] for lane in sorted(decision.run)]
        # Asked again after a few full rotations (and on every event): a View costs O(jobs), so
        # this keeps the policy's share of each step's host time small and flat in N.
        rotation = sum(len(r) for r in rotations) * self.quantum
        period = rotation if getattr(self.policy, "timing", False) else max(4 * rotation, len(views), 256)
        plan = Plan(rotations, self.quantum, period=period)
        plan.start_turns(lambda job: job.turn_steps if self._lane_current.get(job.lane) is job else 0)
        self._plan, self._dirty = plan, False
        return plan

    # ------------------------------------------------------------------ stepping
    def _dispatch(self, job: JobRecord, li: int, pos: int) -> None:
        if self.evaluating:
            owing = evaluation.owes(self, job)
            if owing is not None:  # an eval batch takes this turn (evaluation.py: scheduling)
                if isinstance(job, Group):
                    job.now = None
                evaluation.run_batch(self, owing)
                self._took_turn(job, li, pos)
                return
        if isinstance(job, Group):
            self._dispatch_group(job, li, pos)
            return
        batch = job.batches.popleft()
        if batch is END or isinstance(batch, DataError):
            self._dispatch_marker(job, batch)
            return
        if self._fed(job):
            self.feeder.request(job)
        program = job.program
        step = job.spec.start_step + job.dispatched
        t = time.monotonic_ns()  # CLOCK_MONOTONIC, the fences' clock too
        try:
            if job.ident is not None:
                outs = program.executable(job.arrays, batch, job.ident)
            else:
                outs = program.executable(job.arrays, batch)
        except Exception as err:  # noqa: BLE001 - e.g. a batch that does not match the compile
            self._fail(job, dispatch_error(job, step, batch, err), err)
            self._settle(job)
            return
        job.arrays = outs[0]
        job.dispatched += 1
        job.in_flight += 1
        self._took_turn(job, li, pos)
        self._inflight.append((job, step, outs[1], t))
        if job.eval is not None:
            evaluation.due(self, job, step)
        left = job.steps_left
        if left == 0:
            self._dirty = True  # it leaves the rotation; it finishes when its steps retire
        elif self.checkpoint_every and (step + 1) % self.checkpoint_every == 0 and left:
            # Its next step would consume (donate) this state: copy it out first.
            self._drain_inflight()
            if job.error is None and not job.terminal:
                self._save(job, done=False)

    def _took_turn(self, unit: Any, li: int, pos: int) -> None:
        self._seq += 1
        unit.last_seq = self._seq
        current = self._lane_current.get(unit.lane)
        if current is unit:
            unit.turn_steps += 1
        else:
            if current is not None:
                current.turn_steps = 0
            self._lane_current[unit.lane] = unit
            unit.turn_steps = 1
        self._plan.stepped(li, pos)

    def _dispatch_group(self, group: Group, li: int, pos: int) -> None:
        """One fused step: every stepping member's own batch, stacked; idle slots masked."""
        capacity = group.capacity
        taken: dict[int, tuple[JobRecord, int, list]] = {}
        members, group.now = group.now or group.stepping(), None
        for slot, job in members:
            batch = job.batches.popleft()
            if batch is END or isinstance(batch, DataError):
                self._dispatch_marker(job, batch)
                continue
            step = job.spec.start_step + job.dispatched
            bad = _shape_mismatch(batch, group.zero_batch)
            if bad:
                self._fail(job, f"batch {step} does not match the compiled step: {bad}")
                self._settle(job)
                continue
            if self._fed(job):
                self.feeder.request(job)
            taken[slot] = (job, step, batch)
        if not taken:
            self._dirty = True
            return
        mask = np.zeros((capacity,), np.bool_)
        mask[list(taken)] = True
        stacked = [np.stack([taken[s][2][i] if s in taken else zero for s in range(capacity)])
                   for i, zero in enumerate(group.zero_batch)]
        if fusion.on_host(group.arrays):  # its first step: the stack its members joined goes over
            group.arrays = jax.device_put(group.arrays, self.device)
        t = time.monotonic_ns()
        try:
            args = (group.arrays, (stacked, mask)) + ((group.ident,) if group.ident is not None else ())
            outs = group.fused.executable(*args)
        except Exception as err:  # noqa: BLE001 - an error inside the fused step
            # The step's donated inputs, the whole stack, are gone with it: every member fails,
            # the paused ones too (their slots were in the stack). The group dissolves as the
            # last one leaves (_finalize -> _leave_group).
            for job in group.members:
                self._fail(job, f"fused step of {group.name} raised: {short_error(err)}", err)
                self._settle(job)
            return
        group.arrays = outs[0]
        group.steps_run += 1
        group.fused_member_steps += len(taken)
        self.fused_member_steps += len(taken)
        group.in_flight += 1
        steps = {}
        for slot, (job, step, _) in taken.items():
            job.dispatched += 1
            job.in_flight += 1
            if job.eval is not None:
                evaluation.due(self, job, step)
            # (A member whose last step this is stays masked in later group steps, so its
            # final state can be read from its slot whenever it is retired: see _state_of.)
            steps[slot] = (job, step)
        self._took_turn(group, li, pos)
        self._inflight.append((group, steps, outs[1], t))
        due = [job for job, step in steps.values() if self.checkpoint_every and job.steps_left
               and (step + 1) % self.checkpoint_every == 0]
        if due:
            self._drain_inflight()
            for job in due:
                if job.error is None and not job.terminal:
                    self._save(job, done=False)

    def _dispatch_marker(self, job: JobRecord, batch: Any) -> None:
        if batch is END:
            job.data_done = True
            if job.eval is not None:
                evaluation.data_ended(self, job)
        elif isinstance(batch.error, BatchMismatch):
            self._fail(job, str(batch.error))
        else:
            self._fail(job, f"its data raised while producing batch {batch.step}: "
                            f"{short_error(batch.error)}", batch.error)
        self._dirty = True
        self._settle(job)

    def _retire_group(self, group: Group, steps: dict, vec: Any, t: int, t_end: int | None) -> None:
        group.in_flight -= 1
        try:
            values = np.asarray(vec)
        except Exception as err:  # noqa: BLE001
            for job, step in steps.values():
                job.in_flight -= 1
                self._fail(job, f"fused group step {step} raised: {short_error(err)}", err)
                self._settle(job)
            return
        t_end = t_end or time.monotonic_ns()
        finite = np.isfinite(values).all(axis=1)  # once for the group, not once per member
        for slot, (job, step) in steps.items():
            job.in_flight -= 1
            self._retired(job, step, values[slot], t_end, finite=bool(finite[slot]))
            if job.in_flight == 0:
                self._settle(job)
        if self.ring is None:
            self.timeline.host_step(group, t, t_end)

    def _group_depth(self, group: Group) -> int:
        """How many steps may be in flight behind a group's: ``group_ahead``, as long as their
        stacked batches stay under ``GROUP_INFLIGHT_BYTES``. A group step makes N members'
        batches on the host, so host hiccups (a data source making its batches in blocks, the
        GIL) are N times larger than a solo job's; a deeper pipeline lets the device ride them
        out (measured: 32 jobs fused ran 0.98x a hand-written vmap loop at depth 32, 0.89x at 8)."""
        if self.group_ahead <= self.ahead:
            return self.ahead
        return max(self.ahead, min(self.group_ahead, GROUP_INFLIGHT_BYTES // max(group.step_batch_bytes, 1)))

    def _retire_oldest(self, depth: int | None = None) -> None:
        """Retire the older half of the pipeline with ONE wait, on the newest step among them:
        the older results are ready when it is, and reading them costs a copy each. With the
        default depth (2) that is one step per wait; a deep pipeline (``dispatch_ahead=16`` on
        a device where each wait is a costly hand-off) pays one wait per eight steps."""
        n = max(1, ((self.ahead if depth is None else depth) + 1) // 2)
        try:
            jax.block_until_ready(self._inflight[min(n, len(self._inflight)) - 1][2])
        except Exception:  # noqa: BLE001 - a failed step: each retire below finds its own
            pass
        t_prev, t_end = self._last_retire_ns, time.monotonic_ns()
        for i in range(min(n, len(self._inflight))):
            # Without fences, steps retired together share the interval evenly (host timing).
            self._retire(t_prev + (t_end - max(t_prev, 0)) * (i + 1) // n if t_prev else None)
        self._last_retire_ns = t_end

    def _retire(self, t_end: int | None = None) -> None:
        job, step, vec, t = self._inflight.popleft()
        if isinstance(job, Group):
            self._retire_group(job, step, vec, t, t_end)
            return
        job.in_flight -= 1
        try:
            # A sync point by design: the pipeline is full, so the host waits here while the
            # steps dispatched after this one keep the device busy.
            values = np.asarray(vec)
        except Exception as err:  # noqa: BLE001 - a step that fails on the device fails its job
            self._fail(job, f"step {step} raised: {short_error(err)}", err)
        else:
            t_end = t_end or time.monotonic_ns()
            self._retired(job, step, values, t_end)
            if self.ring is None:
                self.timeline.host_step(job, t, t_end)
        if job.in_flight == 0:
            self._settle(job)

    def _retired(self, job: JobRecord, step: int, values: Any, t_end: int, *,
                 finite: bool | None = None) -> None:
        """Account one completed step of ``job`` with its metrics vector."""
        # A step that completed counts even if the job failed after it was dispatched (a
        # later batch was bad): its work is real and its metrics are logged.
        job.steps_done += 1
        job.last_values = values
        if job.spec.observer is not None:
            self._observe(job, step, values, t_end)
        if job.spec.on_metrics is not None:  # this step's own metrics (evaluations notify apart)
            evaluation.notify(self, job, step + 1, {**dict(zip(job.program.metric_names, values.tolist())),
                                                    **(job.extra_metrics or {})})
        if self._log:
            # Handed to the recorder in batches: a queue put per step would wake its thread
            # per step, and the two threads would take turns at the GIL.
            self._rows.append((job, step, t_end / 1e9, values, job.extra_metrics))
            if len(self._rows) >= 256:
                self._flush_rows()
        if job.spec.nan_policy == "fail" and not (np.isfinite(values).all() if finite is None else finite):
            bad = [k for k, v in job.last_metrics.items() if not np.isfinite(v)]
            self._fail(job, f"non-finite metric {bad[0]}={job.last_metrics[bad[0]]} at step {step} "
                            "(nan_policy='fail')")

    def _fed(self, job: JobRecord) -> bool:
        """Whether the feeder threads make this job's batches ahead: for data slower than
        ``FEED_ABOVE_S`` a batch on an accelerator; on CPU only for data slower than
        ``FEED_ABOVE_S_CPU`` (I/O, decoding, a sleep), because there the step's own compute
        keeps the cores busy and a feeder thread contends with the dispatcher for them and
        the GIL: measured on 2 cores, a fused 8-MLP sweep whose ~0.1 ms batches were fed ran
        at half the speed of the same sweep with its batches made inline."""
        return job.data_s is not None and job.data_s > self._feed_above

    def _flush_rows(self) -> None:
        rows, self._rows = self._rows, []
        self.recorder.metrics_rows(rows)

    def _drain_inflight(self) -> None:
        while self._inflight:
            self._retire()

    def _observe(self, job: JobRecord, step: int, values: Any, t_end_ns: int) -> None:
        metrics = dict(zip(job.program.metric_names, values.tolist()))
        try:
            extra = job.spec.observer(step, metrics, t_end_ns / 1e9)
            job.extra_metrics = {k: float(v) for k, v in (extra or {}).items()} or None
        except Exception as err:  # noqa: BLE001 - its failure fails the job
            self._fail(job, f"its observer raised at step {step}: {short_error(err)}", err)

    def _settle(self, job: JobRecord) -> None:
        """A job with nothing in flight: end it if it failed or ran out of steps."""
        if job.in_flight or job.terminal:
            return
        if job.error is not None:
            self._finalize(job, Event.FAIL)
        elif job.steps_left == 0 and job.state in (S.RUNNING, S.PAUSED) and job.id not in self.evaluating:
            self._finish(job)

    # ------------------------------------------------------------------ lifecycle
    def compiled(self, job: JobRecord, program: Any) -> None:
        """The compile pool is done with ``job``: admit it, queue it, or refuse it."""
        if job.terminal:
            return
        job.program = program
        job.compiled_s = now_s() - self.t0
        if program.compiled:  # (a fused job's solo program compiles only if it must run alone)
            job.footprint = program.with_staging(self.prefetch)
        if job.state is S.COMPILING:
            self._admit(job)

    def fail_now(self, job: JobRecord, cause: str, err: BaseException | None) -> None:
        if not job.terminal:
            self._fail(job, cause, err)
            self._settle(job)

    def finish_now(self, job: JobRecord, host_state: Any, metrics: dict | None, note: str) -> None:
        """End a job that never runs a step (no batches, or resumed already finished)."""
        if job.terminal:
            return
        job.host_state, job.restored_metrics = host_state, metrics
        self.recorder.line(job, note)
        self._finalize(job, Event.FINISH)

    def _admit(self, job: JobRecord) -> None:
        if self.fuse and self._join_group(job):
            return
        if job.footprint is None:
            try:
                # A fused job that must run alone compiles its solo program here (rare: a
                # group had no room); every other job was compiled on the compile pool.
                job.footprint = job.program.with_staging(self.prefetch)
            except Exception as err:  # noqa: BLE001
                self._fail(job, f"could not compile its step: {short_error(err)}", err)
                self._finalize(job, Event.FAIL)
                return
        fp = job.footprint
        if fp.resident + fp.ephemeral > self.arena.capacity:
            err = AdmissionError(
                f"job {job.name!r} needs {format_bytes(fp.resident + fp.ephemeral)} ({fp.describe()}) "
                f"but the arena holds {format_bytes(self.arena.capacity)} ({self.capacity_source}); "
                "lower its batch size or model size, or give the runtime more memory (--memory)")
            self._fail(job, str(err), err)
            self._finalize(job, Event.FAIL)
            return
        # A job that truly holds nothing still takes a lane; the arena refuses zero-byte
        # footprints (zero is how "unknown" looks), so charge it 1 byte.
        ephemeral = fp.ephemeral if fp.resident + fp.ephemeral > 0 else 1
        placed = self.arena.admit(job.id, fp.resident, ephemeral, name=job.name)
        job.in_ledger = True
        if isinstance(placed, Admitted):
            self.recorder.line(job, f"compiled: {fp.describe()}; lane {placed.lane_id}")
            self._place(job, placed.lane_id)
        else:
            self.recorder.line(job, f"compiled: {fp.describe()}; queued: {placed.reason}")
            job.state = transition(job.state, Event.QUEUE)

    # ------------------------------------------------------------------ fusion groups
    def _join_group(self, job: JobRecord) -> bool:
        """Put ``job`` in a slot of a group of its program (growing the group, or opening one,
        if memory allows). False: it runs on its own (no room for a group)."""
        key = job.program.key
        same = [g for g in self.groups.values() if g.program.key == key]
        group = next((g for g in same if g.free_slot() is not None), None)
        if group is None and same:
            group = self._grow(same[0])
        if group is None:
            group = self._open_group(job.program, max(2, _pow2(job.fuse_hint)))
        if group is None:
            return False
        slot = group.free_slot()
        try:
            leaves = (job.host_arrays if job.host_arrays is not None
                      else jax.tree.leaves(job.spec.state))
            group.arrays = fusion.put(group.fused, group.arrays, leaves, slot)
        except Exception as err:  # noqa: BLE001
            self._fail(job, f"could not place its state in {group.name}: {short_error(err)}", err)
            self._finalize(job, Event.FAIL)
            return True
        group.slots[slot] = job
        job.group, job.slot, job.lane, job.host_arrays = group, slot, group.lane, None
        self.recorder.line(job, f"compiled: joined {group.name} (slot {slot} of {group.capacity}, "
                                f"lane {group.lane}; group {group.fused.footprint.describe()})")
        self._started(job)
        self._running[group.id] = group
        self._dirty = True
        return True

    def _open_group(self, program: Any, capacity: int) -> Group | None:
        fused = fusion.fused_program(program, capacity, self.device, fenced=self.ring is not None,
                                     prefetch=self.prefetch)
        gid = next(self._group_ids)
        fp = fused.footprint
        if self.arena.queue or fp.resident + fp.ephemeral > self.arena.free:
            return None  # never overtake the queue for a group; its jobs run (or queue) alone
        placed = self.arena.admit(gid, fp.resident, fp.ephemeral, name=f"group-{gid - GROUP_IDS}")
        if not isinstance(placed, Admitted):  # pragma: no cover - checked above
            self.arena.release(gid)
            return None
        arrays = fusion.host_stack(program, capacity)
        ident = (jax.device_put(ffi.ident(self.ring, gid, placed.lane_id), self.device)
                 if self.ring is not None else None)
        group = Group(gid, program, fused, placed.lane_id, arrays, ident)
        self.groups[gid] = group
        return group

    def _grow(self, group: Group) -> Group | None:
        """Double a full group's capacity at this step boundary (a new slot for a joiner)."""
        bigger = fusion.fused_program(group.program, 2 * group.capacity, self.device,
                                      fenced=self.ring is not None, prefetch=self.prefetch)
        if not self._resize(group, bigger):
            return None
        self._drain_inflight()  # the stack is rebuilt from the group's newest state
        group.arrays = fusion.regroup(group.arrays, list(range(group.capacity)), bigger.capacity)
        group.slots += [None] * (bigger.capacity - group.capacity)
        group.fused = bigger
        self._dirty = True
        return group

    def _shrink(self, group: Group) -> None:
        """Repack a group whose members fit in a quarter of its slots into a smaller one: the
        step then costs what its members need (their slots move; their states do not change)."""
        members = [(i, j) for i, j in enumerate(group.slots) if j is not None]
        capacity = max(2, _pow2(len(members)))
        if capacity * 4 > group.capacity or group.in_flight:
            return
        fenced = self.ring is not None
        if not fusion.cached(group.program, capacity, fenced=fenced, prefetch=self.prefetch):
            # Compiling the smaller program (here, on the dispatcher) pays only if the members
            # have enough steps left to win that time back; a sweep ending in lockstep does not.
            lefts = [j.steps_left for _, j in members]
            left = None if any(x is None for x in lefts) else max(lefts, default=0)
            saved_s = (left if left is not None else 10**6) * group.step_estimate_s(
                self.timeline.flops_per_s) * (1 - capacity / group.capacity)
            if saved_s < 2 * group.fused.compile_s:
                return
        smaller = fusion.fused_program(group.program, capacity, self.device,
                                       fenced=self.ring is not None, prefetch=self.prefetch)
        if not self._resize(group, smaller):
            return
        group.arrays = fusion.regroup(group.arrays, [i for i, _ in members], capacity)
        group.slots = [j for _, j in members] + [None] * (capacity - len(members))
        for slot, job in enumerate(group.slots):
            if job is not None:
                job.slot = slot
        group.fused = smaller
        self._dirty = True
        self._admitted(self.arena.retry())  # the bytes it gave back may admit a queued job

    def _resize(self, group: Group, fused: Any) -> bool:
        fp = fused.footprint
        return self.arena.resize(group.id, fp.resident, fp.ephemeral)

    def _leave_group(self, job: JobRecord) -> None:
        group = job.group
        group.slots[job.slot] = None
        job.group = job.slot = None
        with job.feed_lock:
            # Its queued batches were made for stacking, not copied (source.produce): it may
            # step alone next, and a solo step donates its batch, so they are owned now.
            queued = list(job.batches)
            job.batches.clear()
            job.batches.extend(own(b, self.device) if isinstance(b, list) else b for b in queued)
        if group.members:
            self._shrink(group)
            return
        self.groups.pop(group.id, None)
        self._running.pop(group.id, None)
        if self._lane_current.get(group.lane) is group:
            del self._lane_current[group.lane]
        group.arrays = group.ident = None
        self._dirty = True
        self._admitted(self.arena.release(group.id))

    def _started(self, job: JobRecord) -> None:
        job.state = transition(job.state, Event.ADMIT)
        if job.started_s is None:
            job.started_s = now_s() - self.t0
            job.queue_wait_s = job.started_s - (job.compiled_s if job.compiled_s is not None else job.arrival_s)
        job.prefetch_depth = self.prefetch
        want = self.prefetch - len(job.batches)
        if want > 0 and job.source is not None and self._fed(job):
            self.feeder.request(job, want)
        self._account_peak()

    def _state_of(self, job: JobRecord) -> Any:
        """A job's state leaves wherever they are: its own arrays, its group slot, the host."""
        if job.group is not None:
            return fusion.take(job.group.fused, job.group.arrays, job.slot)
        return job.arrays if job.arrays is not None else job.host_arrays

    def _place(self, job: JobRecord, lane: int) -> None:
        """Put an admitted job's state on the device and let the scheduler see it."""
        try:
            if job.host_arrays is not None:  # back from host memory
                kind = self.device.default_memory().kind
                target = jax.sharding.SingleDeviceSharding(self.device, memory_kind=kind)
                job.arrays = jax.device_put(job.host_arrays, target, may_alias=False)
            else:
                # The runtime keeps the state as flat leaves (see compiler._flat_step) and owns
                # its copy: the user's arrays stay valid (bind does not take ownership).
                job.arrays = jax.device_put(jax.tree.leaves(job.spec.state), self.device, may_alias=False)
            if self.ring is not None and (job.ident is None or job.lane != lane):
                job.ident = jax.device_put(ffi.ident(self.ring, job.id, lane), self.device)
        except Exception as err:  # noqa: BLE001
            self._fail(job, f"could not place its state on {self.device}: {short_error(err)}", err)
            self._finalize(job, Event.FAIL)
            return
        job.host_arrays, job.lane = None, lane
        self._running[job.id] = job
        self._dirty = True
        self._started(job)

    def _account_peak(self) -> None:
        """The runtime's own record of device memory that may be in use (from its job records,
        not the arena's books, so it checks the admissions): every resident job holds P +
        staging; every lane holds the largest E among its resident jobs."""
        resident, lane_e = 0, {}
        for job in self._running.values():
            fp = job.fused.footprint if isinstance(job, Group) else job.footprint
            resident += fp.resident
            lane_e[job.lane] = max(lane_e.get(job.lane, 0), fp.ephemeral)
        self.peak_in_flight_bytes = max(self.peak_in_flight_bytes, resident + sum(lane_e.values()))

    def _finish(self, job: JobRecord) -> None:
        try:
            # A device-to-host copy, once per job.
            host = jax.tree.unflatten(job.program.state_def, jax.device_get(self._state_of(job)))
        except Exception as err:  # noqa: BLE001 - the last step failed on the device
            self._fail(job, f"its final state could not be read: {short_error(err)}", err)
            self._finalize(job, Event.FAIL)
            return
        job.host_state = host
        if self.checkpoint_dir is not None:
            self.recorder.checkpoint(job, job.spec.start_step + job.steps_done, host,
                                     job.last_metrics, done=True)
        self._finalize(job, Event.FINISH)

    def _save(self, job: JobRecord, *, done: bool) -> None:
        if self.checkpoint_dir is None:
            return
        self._flush_rows()
        arrays = self._state_of(job)
        if arrays is None:
            return
        host = jax.tree.unflatten(job.program.state_def, jax.device_get(arrays))
        self.recorder.checkpoint(job, job.spec.start_step + job.steps_done, host, job.last_metrics,
                                 done=done)

    def _fail(self, job: JobRecord, cause: str, err: BaseException | None = None) -> None:
        """Record a failure; the job ends once its in-flight steps have retired."""
        if job.error is not None or job.terminal:
            return
        job.error, job.exception = cause, err
        log.warning("job %r failed: %s", job.name, cause)
        self.recorder.line(job, f"FAILED: {cause}")
        if err is not None:
            self.recorder.line(job, "".join(traceback.format_exception(err)))
        if self._running.pop(job.id, None) is not None:
            self._dirty = True

    def _finalize(self, job: JobRecord, event: Event) -> None:
        """Move a job with nothing in flight to its terminal state and give its memory to
        whoever waits for it."""
        if job.terminal:
            return
        job.state = transition(job.state, event)
        job.ended_s = now_s() - self.t0
        self._running.pop(job.id, None)
        if self._lane_current.get(job.lane) is job:
            del self._lane_current[job.lane]
        if job in self._swap_waiting:
            self._swap_waiting.remove(job)
        if job.eval is not None or job.id in self.evaluating:
            evaluation.release(self, job)
        if job.group is not None:
            self._leave_group(job)
        job.arrays = job.host_arrays = job.ident = None  # drop the device buffers
        # ... and the spec's step, initial state and data (its result is host_state): a runtime
        # that has run thousands of jobs must not keep every one's initial arrays and step
        # closure (a model's graph) alive; the program cache's memo is weak on the step.
        job.spec = job.spec.replace(job=None, state=None, data=None, observer=None, eval_step=None,
                                    eval_data=None, on_metrics=None)
        job.source = None
        job.batches.clear()
        self._dirty = True
        if self._rows:
            self._flush_rows()
        self.recorder.line(job, f"{job.state.value} after {job.steps_done} steps")
        self.recorder.close_job(job)
        self.jobs.pop(job.id, None)
        if job.in_ledger:
            job.in_ledger = False
            self._admitted(self.arena.release(job.id))
        job.done_event.set()
        self._on_end(job)

    def _admitted(self, admitted: list) -> None:
        """Place jobs the arena admitted from its queue, then bring back swapped jobs."""
        for placed in admitted:
            job = self.jobs.get(placed.job_id)
            if job is not None:
                self._place(job, placed.lane_id)
        for job in list(self._swap_waiting):
            if self.arena.swap_in(job.id):
                self._swap_waiting.remove(job)
                self._place(job, job.lane)

    # ------------------------------------------------------------------ controls (events)
    def pause(self, job: JobRecord, offload: bool) -> None:
        if job.terminal:
            raise _not_live(job, "paused")
        if job.state is S.QUEUED:
            if job in self._swap_waiting:
                self._swap_waiting.remove(job)
            elif job.in_ledger:  # leave the queue; resume queues it again
                job.in_ledger = False
                self._admitted(self.arena.release(job.id))
        if job.state in (S.RUNNING, S.PAUSED, S.COMPILING, S.QUEUED, S.SWAPPED):
            job.state = transition(job.state, Event.PAUSE)
        self._running.pop(job.id, None)
        self._dirty = True  # (a group member is masked from its group's next step)
        if job.in_flight:
            # Its steps already dispatched finish now, so pause() returns with the job still.
            self._drain_inflight()
        if offload and job.state is S.PAUSED:
            if not job.terminal and job.state is S.PAUSED:
                self._swap_out(job)

    def _swap_out(self, job: JobRecord) -> None:
        if job.group is not None:
            # A member's state leaves its slot for host memory; its memory was the group's, so
            # nothing is freed in the arena unless the group empties or shrinks.
            job.arrays = self._state_of(job)
            self._leave_group(job)
        kinds = {m.kind for m in self.device.addressable_memories()}
        kind = next((k for k in ("pinned_host", "unpinned_host") if k in kinds), None)
        if kind is not None:  # host memory of the device (pinned where it has it)
            host = jax.device_put(job.arrays, jax.sharding.SingleDeviceSharding(self.device, memory_kind=kind))
            jax.block_until_ready(host)
        else:
            host = jax.device_get(job.arrays)
        job.host_arrays, job.arrays = host, None
        if job.in_ledger:
            self.arena.swap_out(job.id)
        job.state = transition(job.state, Event.OFFLOAD)
        self.recorder.line(job, "state offloaded to host memory")
        self._admitted(self.arena.retry())

    def resume(self, job: JobRecord) -> None:
        if job.terminal:
            raise _not_live(job, "resumed")
        if job.state is S.PAUSED:
            job.state = transition(job.state, Event.RESUME)
            if job.error is None and job.group is None:
                self._running[job.id] = job
            self._dirty = True
            self._settle(job)
        elif job.state is S.SWAPPED:
            if job.program is None:
                job.state = transition(job.state, Event.AWAIT_COMPILE)
            elif not job.in_ledger:
                self._admit(job)
            elif self.arena.swap_in(job.id):
                self._place(job, job.lane)
                self.recorder.line(job, "state back on the device")
            else:
                job.state = transition(job.state, Event.QUEUE)
                self._swap_waiting.append(job)

    def cancel(self, job: JobRecord) -> None:
        if job.terminal:
            return
        if self._running.pop(job.id, None) is not None:
            self._dirty = True
        if job.in_flight:
            self._drain_inflight()
        self._finalize(job, Event.CANCEL)

    def set_priority(self, job: JobRecord, priority: int) -> None:
        job.priority = priority
        self._dirty = True

    def stop(self, checkpoint: bool) -> list[str]:
        """Dispatch nothing new, retire what is in flight, checkpoint every live job.
        Returns the names of jobs that could not be checkpointed."""
        self._draining = True
        self._drain_inflight()
        missed = []
        if checkpoint and self.checkpoint_dir is not None:
            for job in list(self.jobs.values()):
                if job.program is None or job.terminal:
                    continue
                try:
                    self._save(job, done=False)
                except Exception as err:  # noqa: BLE001 - report, never hang
                    missed.append(job.name)
                    log.warning("job %r: checkpoint on stop failed: %s", job.name, err)
        return missed

    def shutdown(self) -> None:
        """Cancel every live job and end the thread."""
        self._draining = True
        self._drain_inflight()
        for job in list(self.jobs.values()):
            self._finalize(job, Event.CANCEL)
        self._exit = True


def _not_live(job: JobRecord, what: str):
    from .._errors import XShareError
    return XShareError(f"job {job.name!r} is {job.status}; only live jobs can be {what}")


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _shape_mismatch(batch: list, like: list) -> str | None:
    """Why a member's batch cannot be stacked with its group's (None if it can)."""
    # Per member per group step: the common case (arrays of exactly the compiled shape and
    # dtype) is decided by comparing attributes, without numpy's shape/dtype conversions.
    if len(batch) == len(like) and all(
            getattr(x, "shape", None) == z.shape and getattr(x, "dtype", None) == z.dtype
            for x, z in zip(batch, like)):
        return None
    for i, (x, z) in enumerate(zip(batch, like)):
        if np.shape(x) != z.shape or np.dtype(getattr(x, "dtype", None)) != z.dtype:
            return (f"leaf {i} is {np.dtype(getattr(x, 'dtype', None))}{list(np.shape(x))}, "
                    f"expected {z.dtype}{list(z.shape)}")
    return None
