"""Batches for a job: a uniform view over its data, ``produce`` (one batch, whichever thread
makes it), and the feeder threads a runtime shares among its jobs for slow data.

Cheap data is made by the dispatcher right before the step, as in a plain loop; slow data is
made ahead by the feeder, at most ``prefetch`` batches per job (charged as ``staging`` memory).
"""

from __future__ import annotations

import os
import queue
from collections import OrderedDict
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import jax
import numpy as np
from jax.tree_util import tree_flatten

from ..._errors import XShareError
from ..compiled.leaves import layout_of


@dataclass(frozen=True)
class DataError:
    """The data source raised while producing batch ``step``: fails that job alone."""

    step: int
    error: BaseException


END = object()  # the data ran out (or the job's step count was reached)


class BatchMismatch(XShareError):
    """A batch whose pytree structure differs from the one the step was compiled for."""


# Iterator states kept per job (a checkpoint asks for the one at its step, which is at most the
# prefetched and in-flight batches behind the newest): a bound, not a working set.
KEEP_STATES = 1024


class BatchSource:
    """Batches ``start .. stop`` of a job's data, whether it is an iterable or ``step -> batch``.

    An iterator with ``get_state``/``set_state`` (Grain's dataset and ``DataLoader`` iterators,
    or any such, duck-typed) is *checkpointable*: its state after each batch is kept, a
    checkpoint at step ``s`` saves ``state_at(s)``, and a resumed job gives it back with
    ``set_state`` and reads only the batches after ``s``. Any other iterable cannot seek: a
    resumed job replays (makes and drops) its first ``start`` batches (``replayed``)."""

    def __init__(self, data: Any, *, start: int, stop: int | None, data_state: Any = None):
        self.start, self.stop = start, stop
        self._callable = callable(data) and not hasattr(data, "__iter__")
        self._data = data
        self._iter: Iterator | None = None
        self._peeked: list[Any] = []
        self.next_step = start
        self.data_state = data_state    # the checkpoint's iterator state at ``start``, if any
        self.stateful = False           # the iterator has get_state/set_state
        self.replayed = 0               # batches made and dropped to reach ``start``
        self._states: OrderedDict[int, Any] = OrderedDict()  # step -> state before its batch

    def _open(self) -> None:
        if self._iter is None and not self._callable:
            self._iter = iter(self._data)
            self.stateful = (callable(getattr(self._iter, "get_state", None))
                             and callable(getattr(self._iter, "set_state", None)))
            it: Any = self._iter  # (an iterator with get_state/set_state: checked above)
            if self.start and self.stateful and self.data_state is not None:
                it.set_state(self.data_state)
            else:
                for _ in range(self.start):
                    next(self._iter)
                self.replayed = self.start
            if self.stateful:
                self._states[self.start] = it.get_state()

    def state_at(self, step: int) -> Any:
        """The iterator's state after ``step`` batches (None: not checkpointable, or unknown)."""
        return self._states.get(step)

    def peek(self) -> Any:
        """The first batch, kept to be served again by ``next`` (the compiler needs its shapes)."""
        if not self._peeked:
            item = self._produce()
            if item is END:
                return END
            self._peeked.append(item)
        return self._peeked[0]

    def _produce(self) -> Any:
        step = self.next_step + len(self._peeked)
        if self.stop is not None and step >= self.stop:
            return END
        if self._callable:
            return self._data(step)
        self._open()
        assert self._iter is not None  # (opened above: not a callable source)
        try:
            batch = next(self._iter)
        except StopIteration:
            return END
        if self.stateful:
            self._states[step + 1] = self._iter.get_state()  # type: ignore[attr-defined]  # (stateful: it has one)
            if len(self._states) > KEEP_STATES:
                self._states.popitem(last=False)
        return batch

    def seekable(self) -> bool:
        """Whether its next batch is ``data(next_step)`` (a ``step -> batch`` callable, none
        peeked and kept): ``produce`` may then call it for several steps in one loop."""
        return self._callable and not self._peeked

    def next(self) -> Any:
        item = self._peeked.pop(0) if self._peeked else self._produce()
        if item is not END:
            self.next_step += 1
        return item


# A job whose batches take longer than this to make is fed by the feeder threads, ahead of its
# steps, so making them overlaps the device's work. Cheaper data is made by the dispatcher right
# before the step, as a plain loop would: handing a batch between threads costs more than that
# (a queue put, a thread wake-up, and the two threads taking turns at the GIL).
FEED_ABOVE_S = 100e-6
FEED_ABOVE_S_CPU = 1e-3  # on CPU the compute competes with the feeder for the same cores


def produce(job: Any, device: Any, *, blocking: bool = True, n: int = 1) -> bool:
    """Produce ``job``'s next ``n`` batches into ``job.batches`` (each a batch as flat leaves,
    ``END``, or a ``DataError``, which ends the run); False if another thread is producing for
    it right now (``blocking=False``).

    The job's feed lock serializes production, so batches land in step order whichever thread
    (a feeder, or the dispatcher when the feeder is behind) makes them. A K-step call's batches
    are made under one hold of it (~1 us a batch less than one call each).
    """
    # Uncontended (the usual case) a non-blocking acquire never gives up the GIL.
    if not job.feed_lock.acquire(False) and not (blocking and job.feed_lock.acquire()):
        return False
    try:
        source = job.source
        if n > 1 and source is not None and not job.data_done and source.seekable() and _stacked(job) \
                and job.batch_layout.plain:
            _produce_stacked(job, source, n)
            return True
        clock, append = time.perf_counter, job.batches.append
        t0 = clock()
        for _ in range(n):
            source = job.source
            if source is None or job.data_done:
                return True  # ended, or ran dry, since it asked
            batch = _next(job, source, device)
            t1 = clock()
            dt, t0 = t1 - t0, t1
            # A slowly rising minimum, not a mean: a thread preempted mid-batch (a shared machine,
            # the GIL) must not make cheap data look expensive, while data that truly got slower
            # raises it by 2% a batch.
            job.data_s = dt if job.data_s is None else min(dt, job.data_s * 1.02)
            append(batch)
            if batch is END or type(batch) is DataError:
                job.source = None  # produce nothing more for it
        return True
    finally:
        if job.terminal:
            # It ended while this thread made its batches: ``Lifecycle.end`` (on the dispatcher)
            # clears them without the feed lock, so that a slow source cannot hold up an end.
            # What was appended after that clear is dropped here. An ended record must not keep a
            # batch (on an accelerator, device memory outside the arena's ledger), nor a
            # DataError whose traceback holds its source and the user's iterator. ``end`` sets
            # the state before it clears, so one of the two clears always comes last.
            job.batches.clear()
        job.feed_lock.release()


def _stacked(job: Any) -> bool:
    """Whether ``job``'s batches are stacked into group or K-step calls (``_next``: then they
    come as tuples of leaves, copied when stacked)."""
    return job.group is not None or (job.tier is not None and job.tier.multi is not None)


def _produce_stacked(job: Any, source: BatchSource, n: int) -> None:
    """``produce``'s ``n`` batches for a K-step or group call, from a ``step -> batch`` source
    whose batches are plain pytrees: what ``_next`` makes of each (a tuple of leaves, a
    ``DataError``, ``END`` at the source's stop) in one loop, with none of its per-batch calls
    and lookups (1.51 -> 1.03 us a batch of the hook's two leaves, ``timeit``; 24,000 of them
    in its fused 8 x 3000). The caller holds the job's feed lock."""
    data, treedef, flatten = source._data, job.batch_layout.treedef, tree_flatten
    append, clock = job.batches.append, time.perf_counter
    first = source.next_step
    last = first + n if source.stop is None else min(first + n, source.stop)
    data_s = job.data_s
    t0 = clock()
    step = first
    try:
        for step in range(first, last):
            leaves, got = flatten(data(step))
            if got != treedef:
                raise _mismatch(step, f"its structure is {got}, expected {treedef}")
            append(tuple(leaves))
            t1 = clock()
            # (produce's slowly rising minimum of a batch's time)
            data_s = t1 - t0 if data_s is None else min(t1 - t0, data_s * 1.02)
            t0 = t1
        else:
            step = last
    except BaseException as err:  # noqa: BLE001 - any failure of user data fails the job
        append(DataError(step, err))
        job.source = None
    source.next_step = step
    job.data_s = data_s
    if job.source is not None and source.stop is not None and step >= source.stop and first + n > step:
        append(END)  # (the step count was reached within the batches asked for)
        job.source = None


def _mismatch(step: int, why: str) -> BatchMismatch:
    return BatchMismatch(f"batch {step} does not match the compiled step: {why}")


def _next(job: Any, source: BatchSource, device: Any) -> Any:
    """``source``'s next batch as ``produce`` queues it (a DataError if the user's data raised,
    or does not match the compiled step)."""
    step = source.next_step
    layout = job.batch_layout  # (before a slow source's next: the job's end drops it meanwhile)
    try:
        batch = source.next()
        if batch is END:
            return END
        if layout.plain:  # the common case: a flatten and a structure check
            leaves, treedef = tree_flatten(batch)
            if treedef != layout.treedef:
                raise _mismatch(step, f"its structure is {treedef}, expected {layout.treedef}")
        else:  # PRNG keys or static leaves in the batch
            leaves, got = layout_of(batch)
            why = layout.difference(got, what="batch")
            if why is not None:
                raise _mismatch(step, why)
        # A group member's leaves are copied when its group call stacks them, and so are a
        # job's on its K-step form: a copy here would be a second one per leaf per step (~3 us
        # of the dispatcher's ~20 a step, zoo MLP at K=16). They come as a tuple, "not the
        # runtime's yet": a call that donates a single batch takes it through ``owned`` first
        # (a K-step job's boundary steps and check, a member that left its group and steps alone).
        if _stacked(job):
            return tuple(leaves)
        return own(leaves, device)
    except BaseException as err:  # noqa: BLE001 - any failure of user data fails the job
        return DataError(step, err)


def own(leaves: list, device: Any) -> list:
    """Batch leaves the runtime owns (it donates every batch, so it must never consume an array
    the user still holds). On CPU a numpy copy is all it takes, and the executable's C++ call
    path takes numpy at a few microseconds where ``device_put`` costs tens; elsewhere the
    ``device_put`` starts the host-to-device copy now, overlapping other jobs' steps."""
    if device.platform == "cpu":
        return [np.array(x, copy=True) if not isinstance(x, jax.Array)
                else jax.device_put(x, device, may_alias=False) for x in leaves]
    return jax.device_put(leaves, device, may_alias=False)


def owned(batch: Any, device: Any) -> Any:
    """``batch`` ready for a call that donates it: leaves made for stacking (a tuple, see
    ``produce``) copied now; anything else (owned leaves, ``END``, a ``DataError``) as it is."""
    return own(list(batch), device) if type(batch) is tuple else batch


class Feeding:
    """Which of a job's batches the dispatcher makes inline, right before its step (as a plain
    loop would), and which the feeder threads make ahead; and whether a unit's next batches are
    there. The planner asks ``ready``, admission calls ``start``, the executing parts ``fed``.

    ``fed(job)``: for data slower than ``FEED_ABOVE_S`` a batch on an accelerator; on CPU only
    for data slower than ``FEED_ABOVE_S_CPU`` (I/O, decoding, a sleep), because there the step's
    own compute keeps the cores busy and a feeder thread contends with the dispatcher for them
    and the GIL: measured on 2 cores, a fused 8-MLP sweep whose ~0.1 ms batches were fed ran at
    half the speed of the same sweep with its batches made inline. Dispatcher thread only.
    """

    def __init__(self, feeder: Any, device: Any, *, prefetch: int):
        self.feeder, self.device, self.prefetch = feeder, device, prefetch
        self.feed_above = FEED_ABOVE_S_CPU if device.platform == "cpu" else FEED_ABOVE_S

    def fed(self, job: Any) -> bool:
        """Whether the feeder threads make this job's batches ahead."""
        return job.data_s is not None and job.data_s > self.feed_above

    def start(self, job: Any) -> None:
        """A job starts stepping: its feeder makes its first batches (admission's ``started``)."""
        job.prefetch_depth = self.prefetch
        want = self.prefetch - len(job.batches)
        if want > 0 and job.source is not None and self.fed(job):
            self.feeder.request(job, want)

    def ready(self, unit: Any, make: bool) -> bool:
        """Whether every member taking part in ``unit``'s next step has its batch (making the
        missing ones if ``make``, as a plain loop would; for fed jobs the feeder is behind,
        its thread was not scheduled: made here too rather than idle, unless the feeder is
        making it right now). The members found are kept in ``unit.now`` for the dispatch that
        follows at once (one walk over a group's slots per step, not three)."""
        members = unit.stepping()
        unit.now = None
        if not members:
            return False
        for _, member in members:
            if not member.batches:
                if make and member.source is not None:
                    produce(member, self.device, blocking=not self.fed(member))
                if not member.batches:
                    return False
        unit.now = members
        return True


class Feeder:
    """A few prefetch threads for every job (not one per job: threads must not grow with jobs).
    Each job is served by one of them (``job.id % workers``), so its batches come in order.

    The dispatcher asks for a job's next batch with ``request(job)`` each time it takes one (and
    ``depth`` times when the job starts); the feeder produces it from the job's source, checks
    its structure, ``device_put``s it (asynchronous: the copy overlaps other jobs' steps) and
    appends it to ``job.batches``. The depth bound is charged to the job as ``staging`` memory.
    A source that raises puts a ``DataError`` in the job's batches instead: that fails the job
    alone. ``on_ready`` is called after a batch lands (the dispatcher wakes only if it idles).
    """

    def __init__(self, device: Any, *, on_ready: Callable[[], None], workers: int = 2):
        self.device = device
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(max(workers, 1))]
        self._on_ready = on_ready
        self._threads = [threading.Thread(target=self._run, args=(q,), name=f"xshare-feeder-{i}",
                                          daemon=True) for i, q in enumerate(self._queues)]
        for t in self._threads:
            t.start()

    def request(self, job: Any, n: int = 1) -> None:
        q = self._queues[job.id % len(self._queues)]
        for _ in range(n):
            q.put(job)

    def close(self) -> None:
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout=5)

    def _run(self, requests: queue.SimpleQueue) -> None:
        while True:
            job = requests.get()
            if job is None:
                return
            if job.data_done or job.terminal or job.source is None:
                continue  # ended (or ran dry) since it asked
            if len(job.batches) >= job.prefetch_depth:
                continue  # the dispatcher made this one itself while we were behind
            try:
                self._produce(job)
            except BaseException:  # never let the one feeder thread die (logged)
                import logging
                logging.getLogger("xshare.runtime").exception("feeder: job %r", job.name)

    def _produce(self, job: Any) -> None:
        produce(job, self.device)
        self._on_ready()


class LazyFeeder:
    """The feeder starts with the first request (a Runtime that never runs a job has none).
    ``device()`` and ``on_ready()`` are asked then: the runtime's device and the dispatcher's
    ``poke`` (the dispatcher may not exist yet when this is made)."""

    def __init__(self, device: Callable[[], Any], on_ready: Callable[[], Callable[[], None]]):
        self._device, self._on_ready = device, on_ready
        self._feeder: Feeder | None = None
        self._lock = threading.Lock()

    def request(self, job: Any, n: int = 1) -> None:
        feeder = self._feeder
        if feeder is None:
            with self._lock:
                if self._feeder is None:
                    # Two threads: data code (numpy, decoding) runs beside the dispatcher; more
                    # would only contend for the GIL with it.
                    self._feeder = Feeder(self._device(), on_ready=self._on_ready(),
                                          workers=min(2, os.cpu_count() or 1))
                feeder = self._feeder
        feeder.request(job, n)

    def close(self) -> None:
        if self._feeder is not None:
            self._feeder.close()
