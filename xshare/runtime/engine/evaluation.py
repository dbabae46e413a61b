"""Evaluation during training: ``bind(..., eval_step=fn, eval_data=..., eval_every=K)``.

``eval_step(state, batch) -> metrics`` (scalars) is compiled once per program through the
process-wide program cache (``compiler.PROGRAMS.shared``), so the N jobs of a sweep share one
eval executable. It does not donate its inputs: the state is read, never changed, and the next
train step consumes exactly the arrays it would have consumed without evaluation (a job's final
state is bit-identical with and without ``eval_step``).

Scheduling: after the step that completes a multiple of K steps, and after the last step, the
job *owes* an evaluation. While it does, each turn the policy gives the job (or its fusion
group) runs one eval batch instead of a train step, so other jobs interleave between eval
batches exactly as between steps, and the batches are counted in the job's device time. When
the last eval batch is dispatched, its metrics are on their way to the host (``Units.reading``):
the job (or its group) takes no turn until they are there, while every other unit steps on, and
the dispatcher reads them as soon as they are ready (``poll``; it waits on the oldest only when
nothing else can run). Read at once instead, every evaluation was a host sync of the dispatcher
behind the steps in flight before it: a 64-trial digits study under ``fuse=True`` spent ~1.9 s
of its dispatcher's time there (and 2.0 s more taking lone members' states out of their groups'
stacks, below), the other groups idle. Their mean over the batches (unweighted) is recorded as
``eval/<name>``: in the job's
``progress().metrics`` and the status document (so ``xshare top`` and ``/metrics``), as its own
row in ``metrics.jsonl`` (``step`` = the train step it follows), and through ``on_metrics``.

Fused members: when several members of a group owe an evaluation (a lockstep sweep owes them
at the same step) and share the eval function and equal-length lists of eval batches, one pass
of the *vmapped* eval program over the group's stack evaluates them all, each slot on its own
member's batches (``_GroupPass``). A member that owes one alone (a study's trials join their
group at different steps, so their evaluations seldom fall together) runs the same pass on its
own, the other slots computing copies of its batches, where its slot would come out of a stack
on the device through the host (no compiled slot moves yet): that copied the whole stack after
every group step in flight (~17 ms a time on the digits study's groups). That program compiles on a thread of its own the first time a
group of that capacity asks; until then, for a member that cannot share, and while the group's
stack is still the host copy it was formed in, the member's state is taken out of the stack
(one slot copy) and the solo eval executable runs on it. Either
way the group does not step while its members owe evaluations (its turns run their eval
batches). Like the fused train step, a vmapped evaluation is within float tolerance of the solo
one, not bit-identical (measured: an 8-job fused sweep evaluated every 25 steps ran 3.8x
longer than evaluated only at the end member by member, 1.04x with the shared pass).

The engine calls in at seven places (``due``, ``owes``, ``waits``, ``run_batch``, ``poll``,
``data_ended``, ``release``) and keeps ``Units.evaluating`` (job id -> job owing an evaluation,
until its result is recorded) and ``Units.reading`` (the passes whose results are on their way),
so a runtime without evaluations pays one empty-dict test per step. Who owes what is the units' tables
alone; running eval batches needs a ``Host`` (the executor: the device, the lifecycle, the
metrics rows, and a way to cancel a job at the next step boundary).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

import jax
import numpy as np

from ..causes import short_error
from ..compiled import fusion
from ..compiled.compiler import abstract
from ..compiled.eval_programs import EvalError, EvalProgram, check_eval, eval_names, eval_program  # noqa: F401 (re-exported)
from ..compiled.leaves import layout_of
from .placement import state_of
from .source import END

if TYPE_CHECKING:  # (annotations only: xshare._job imports this module to check eval_step)
    from .lifecycle import Lifecycle
    from .rows import MetricsRows
    from .units import Units

_NO_VALUES = np.zeros((0,), np.float32)  # a metrics row with eval metrics only
group_passes = 0  # shared (vmapped) evaluations of fused members run in this process, ever


class Host(Protocol):
    """What running an evaluation needs of the engine (``executor.Executor`` is one)."""

    units: Units
    device: Any
    life: Lifecycle
    rows: MetricsRows
    cancel_soon: Callable[[Any], None]  # cancel a job at the next step boundary (an event)


# ----------------------------------------------------------------------------- per job
class Evaluation:
    """One job's evaluation: its programs, the pass in progress, and the newest result."""

    def __init__(self, fn: Callable, data: Iterable[Any], every: int | None, state: Any, device: Any):
        self.fn, self.data, self.every, self.device = fn, data, every, device
        arrays, self.state_layout = layout_of(state)
        self.state_leaves = abstract(arrays, device)
        self.n_state = len(arrays)          # a fused job's arrays end with its lifted constants
        self.owed_at: int | None = None   # the train step (index) whose state is evaluated
        self.state: Any = None            # the leaves the pass reads (a member's slot copy)
        self.it: Any = None
        self.next: Any = END
        self.acc: list = []
        self.n = 0                        # eval batches run in this pass
        self.t0 = 0
        self.last: dict[str, float] | None = None   # eval/<name> -> value, the newest evaluation
        self.last_step: int | None = None
        self.shared_pass: Any = None      # a fused group's pass this job leads (_GroupPass)
        self.reading = False              # its pass is dispatched, its results on their way
        self.first = self.program(next(iter(data)))  # compiled beside the train step

    def program(self, batch: Any) -> EvalProgram:
        return eval_program(self.fn, self.state_leaves, self.state_layout, batch, self.device)


def prepare(spec: Any, device: Any) -> Evaluation | None:
    """On the compile pool: the job's evaluation, its first program compiled (None: none)."""
    if spec.eval_step is None:
        return None
    return Evaluation(spec.eval_step, spec.eval_data, spec.eval_every, spec.state, device)


def due(units: Units, job: Any, step: int) -> None:
    """After train step ``step`` (index) of ``job`` was dispatched: does it owe an evaluation?"""
    ev = job.eval
    if (ev.every and (step + 1) % ev.every == 0) or job.steps_left == 0:
        _owe(units, job, step)


def data_ended(units: Units, job: Any) -> None:
    """Its data ran out: the end's evaluation, unless the last step's was already owed."""
    ev = job.eval
    last = job.spec.start_step + job.dispatched - 1
    if ev is not None and job.dispatched and ev.last_step != last and ev.owed_at != last:
        _owe(units, job, last)


def _owe(units: Units, job: Any, step: int) -> None:
    job.eval.owed_at = step
    units.evaluating[job.id] = job
    units.changed = True


def owes(units: Units, unit: Any) -> Any:
    """The job whose eval batch ``unit`` (a job or a fusion group) runs on its next turn."""
    evaluating = units.evaluating
    if not evaluating:
        return None
    members = getattr(unit, "members", None)
    if members is None:
        return unit if unit.id in evaluating and unit.error is None and not unit.eval.reading else None
    running: Callable[[int], Any] = units.jobs.get
    for job in members:
        if job.id in evaluating and job.error is None and running(job.id) is job \
                and job.status == "running" and not job.eval.reading:
            return job
    return None


def waits(units: Units, unit: Any) -> bool:
    """Whether ``unit`` (a job or a fusion group) waits for an evaluation's results on their way
    to the host: it takes no turn until ``poll`` records them (its next step must not pass an
    evaluation whose result ``on_metrics`` or a study may act on)."""
    if not units.reading:
        return False
    members = getattr(unit, "members", None)
    if members is None:
        return unit.id in units.reading
    reading = units.reading
    return any(job.id in reading for job in members)


def poll(d: Host, *, block: bool = False) -> None:
    """Record the evaluations whose results have reached the host; with ``block``, the oldest
    one's whatever its state (the dispatcher has nothing else to run)."""
    for key, reading in list(d.units.reading.items()):
        if key not in d.units.reading:
            continue  # (recorded with a pass read before it: a group pass has several keys)
        if block or reading.ready():
            reading.finish(d)
            if block:
                return


class _Reading:
    """An evaluation pass whose last batch is dispatched: its results on their way to the host."""

    def __init__(self, jobs: list, acc: list, finish: Callable[[Host], None], host_copy: bool):
        self.jobs, self.acc, self._finish = jobs, acc, finish
        if host_copy:  # (off a CPU: the copy starts now; a CPU's arrays are host memory already)
            for v in acc:
                v.copy_to_host_async()

    def ready(self) -> bool:
        for v in self.acc:
            is_ready = getattr(v, "is_ready", None)  # (a jax.Array's; its type stub lacks it)
            if is_ready is not None and not is_ready():
                return False
        return True

    def finish(self, d: Host) -> None:
        for job in self.jobs:
            d.units.reading.pop(job.id, None)
            if job.eval is not None:
                job.eval.reading = False
        self._finish(d)


def _read_later(d: Host, jobs: list, acc: list, finish: Callable[[Host], None]) -> None:
    reading = _Reading(jobs, acc, finish, getattr(d, "host_copy", False))
    for job in jobs:
        job.eval.reading = True
        d.units.reading[job.id] = reading


def run_batch(d: Host, job: Any) -> None:
    """One eval batch of ``job``'s owed evaluation (starting the pass if it has not started);
    after the last batch, its results go on their way to the host (``poll`` records them)."""
    ev = job.eval
    step = ev.owed_at
    if job.group is not None and (ev.shared_pass is not None or ev.state is None):
        if ev.shared_pass is not None or _start_group_pass(d.units, job):
            _group_batch(d, job)
            return
    if ev.state is None:
        try:
            ev.state = list(state_of(job))[:ev.n_state]
            ev.it = iter(ev.data)
            ev.next = next(ev.it, END)
        except Exception as err:  # noqa: BLE001 - its eval data fails its job
            _failed(d, job, f"its eval_data raised at the evaluation after step {step}: "
                            f"{short_error(err)}", err)
            return
        ev.acc, ev.n, ev.t0 = [], 0, time.monotonic_ns()
    batch = ev.next
    try:
        program = ev.program(batch)  # (the memo: batches of the first's shapes hit ev.first)
        ev.acc.append(program.executable(ev.state, _on_device(layout_of(batch)[0], d.device)))
    except Exception as err:  # noqa: BLE001 - a batch that does not fit, an error in eval_step
        _failed(d, job, f"its eval_step failed on eval batch {ev.n} after step {step}: "
                        f"{short_error(err)}", err)
        return
    ev.n += 1
    try:
        ev.next = next(ev.it, END)
    except Exception as err:  # noqa: BLE001
        _failed(d, job, f"its eval_data raised while producing eval batch {ev.n} after step "
                        f"{step}: {short_error(err)}", err)
        return
    if ev.next is END:
        _read_later(d, [job], ev.acc, lambda d: _complete(d, job))


def _complete(d: Host, job: Any) -> None:
    if job.eval is None or job.eval.owed_at is None:
        return  # it ended (or failed) while its results were on their way (``release``)
    ev, step = job.eval, job.eval.owed_at
    names = ev.first.names
    try:
        # The one host sync of an evaluation: every eval batch has run when its results are read.
        values = np.mean(np.stack([np.asarray(v) for v in ev.acc]), axis=0)
    except Exception as err:  # noqa: BLE001
        _failed(d, job, f"its eval_step failed after step {step}: {short_error(err)}", err)
        return
    t_end = time.monotonic_ns()
    job.device_time_s += (t_end - ev.t0) / 1e9
    ev.last = {f"eval/{n}": float(v) for n, v in zip(names, values.tolist())}
    ev.last_step = step
    _end_pass(d.units, job)
    d.rows.add(job, step, t_end / 1e9, _NO_VALUES, ev.last)
    notify(d, job, step + 1, ev.last)
    d.life.settle(job)


def _end_pass(units: Units, job: Any) -> None:
    ev = job.eval
    ev.owed_at, ev.state, ev.it, ev.next, ev.acc, ev.reading = None, None, None, END, [], False
    units.evaluating.pop(job.id, None)
    units.reading.pop(job.id, None)
    units.changed = True


def _failed(d: Host, job: Any, cause: str, err: BaseException) -> None:
    _end_pass(d.units, job)
    d.life.fail(job, cause, err)
    d.life.settle(job)


def release(units: Units, job: Any) -> None:
    """A job ended: drop what its evaluation holds (its last result stays for progress)."""
    ev = job.eval
    units.evaluating.pop(job.id, None)
    units.reading.pop(job.id, None)
    if ev is not None:
        ev.state = ev.it = ev.data = ev.fn = ev.shared_pass = None
        ev.acc, ev.reading, ev.owed_at = [], False, None


def notify(d: Host, job: Any, steps_done: int, metrics: dict) -> None:
    """Hand ``metrics`` to the job's ``on_metrics`` hook; True from it cancels the job at this
    step boundary (an event, applied before the dispatcher dispatches anything else)."""
    fn = job.spec.on_metrics
    if fn is None or job.terminal:
        return
    try:
        stop = fn(steps_done, metrics)
    except Exception as err:  # noqa: BLE001 - its failure fails the job
        d.life.fail(job, f"its on_metrics hook raised after step {steps_done}: {short_error(err)}", err,
                    at_step=steps_done - 1)
        return
    if stop:
        d.cancel_soon(job)


# ----------------------------------------------------------------------------- fused groups
class _GroupPass:
    """One evaluation of several members of a fusion group at once: the vmapped eval program
    over the group's stack, each member's own batch k in its slot (the other slots get a copy,
    their results unused). Members of a lockstep sweep owe their evaluations at the same step;
    this makes that one pass instead of one per member."""

    def __init__(self, members: list, program: Any, stacked: Any, capacity: int, n: int):
        self.members, self.program, self.stacked = members, program, stacked
        self.slots = {m.id: m.slot for m in members}  # each member's slot in the stack it reads
        self.capacity, self.n, self.k = capacity, n, 0
        self.acc: list = []
        self.t0 = time.monotonic_ns()


def _start_group_pass(units: Units, lead: Any) -> bool:
    """Start a shared pass led by ``lead`` if its group's owing members can share one: the same
    eval function, sequences of eval batches of one length and the compiled shapes, and the
    vmapped program compiled already (else each member is evaluated alone)."""
    group = lead.group
    owing = [m for m in group.members if m.id in units.evaluating and m.error is None and m.eval is not None
             and m.eval.state is None and m.eval.shared_pass is None and not m.eval.reading
             and m.eval.fn is lead.eval.fn]
    # One member alone too, once its group has stepped, where its slot would come out through
    # the host (no compiled slot moves: a CPU group's small stack, ``fusion.HostMoves``): that
    # copies the whole stack after every group step in flight. With compiled moves its slot
    # comes out on the device, and its own eval program costs one slot's work, not a stack's.
    arrays = list(group.arrays)
    lone = not fusion.on_host(arrays) and fusion.compiled_moves(group.fused) is None
    if len(owing) < (1 if lone else 2):
        return False
    datas = [m.eval.data for m in owing]
    if not all(isinstance(x, (list, tuple)) for x in datas) or len({len(x) for x in datas}) != 1:
        return False
    program = lead.eval.first
    stacked = program.stacked(group.capacity)
    if stacked is None:
        return False
    like = [(tuple(b.shape), b.dtype) for b in program.structs[1]]
    for x in datas:
        for batch in x:
            if [(tuple(np.shape(v)), np.asarray(v).dtype) for v in layout_of(batch)[0]] != like:
                return False  # a batch of another shape: member by member (their own programs)
    global group_passes
    group_passes += 1
    gp = _GroupPass(owing, program, stacked, group.capacity, len(datas[0]))
    for m in owing:
        m.eval.shared_pass = gp
    return True


def _on_device(leaves: list, device: Any) -> list:
    """An eval batch's leaves for its program. An eval program donates nothing, so on a CPU the
    leaves go as they are: the executable's C++ call path takes a numpy array in a few us, where
    ``device_put`` costs ~50 us a batch (a 64-trial digits study made ~2300 eval batches: 0.15 s
    of its dispatcher's 1.1 s). Elsewhere ``device_put`` starts the host-to-device copy now."""
    if getattr(device, "platform", "cpu") == "cpu":
        return list(leaves)
    return jax.device_put(leaves, device)


def _group_batch(d: Host, lead: Any) -> None:
    gp = lead.eval.shared_pass
    group = lead.group
    if any(m.terminal or m.group is not group for m in gp.members) or group.capacity != gp.capacity:
        # A member left (cancelled, failed) and the group was repacked: start over, the
        # remaining members still owing their evaluation (their states have not changed).
        for m in gp.members:
            if m.eval is not None:
                m.eval.shared_pass = None
        return
    try:
        by_slot = {m.slot: layout_of(m.eval.data[gp.k])[0] for m in gp.members}
        fill = next(iter(by_slot.values()))
        batches = [np.stack([by_slot.get(s, fill)[i] for s in range(gp.capacity)]) for i in range(len(fill))]
        n_state = lead.eval.n_state  # (the stack ends with the lifted constants, if any)
        gp.acc.append(gp.stacked(list(group.arrays)[:n_state], _on_device(batches, d.device)))
    except Exception as err:  # noqa: BLE001 - an error in eval_step fails the members evaluated
        for m in gp.members:
            m.eval.shared_pass = None
            _failed(d, m, f"its eval_step failed on eval batch {gp.k} (fused with its group): "
                          f"{short_error(err)}", err)
        return
    gp.k += 1
    if gp.k < gp.n:
        return
    _read_later(d, list(gp.members), gp.acc, lambda d: _group_complete(d, gp))


def _group_complete(d: Host, gp: _GroupPass) -> None:
    """A group pass's results are on the host: record each member's. A member that ended while
    they were on their way is left out; one whose group was repacked meanwhile gets the result
    of the slot it had (it has not stepped since: its state is the one evaluated)."""
    members = [m for m in gp.members if not m.terminal and m.eval is not None and m.eval.owed_at is not None]
    if not members:
        return
    try:
        values = np.mean(np.stack([np.asarray(v) for v in gp.acc]), axis=0)  # [capacity, M]
    except Exception as err:  # noqa: BLE001
        for m in members:
            m.eval.shared_pass = None
            _failed(d, m, f"its eval_step failed (fused with its group): {short_error(err)}", err)
        return
    t_end = time.monotonic_ns()
    for m in members:
        ev, step = m.eval, m.eval.owed_at
        m.device_time_s += (t_end - gp.t0) / 1e9 / len(members)
        ev.last = {f"eval/{n}": float(v) for n, v in zip(gp.program.names, values[gp.slots[m.id]].tolist())}
        ev.last_step, ev.shared_pass = step, None
        _end_pass(d.units, m)
        d.rows.add(m, step, t_end / 1e9, _NO_VALUES, ev.last)
        notify(d, m, step + 1, ev.last)
        d.life.settle(m)
