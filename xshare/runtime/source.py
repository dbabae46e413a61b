"""Batches for a job: a uniform view over its data, and a bounded prefetch thread.

The prefetch thread moves batches to the device ahead of the step (``device_put`` is
asynchronous, so the copy overlaps other jobs' steps). The queue is bounded so a fast iterator
cannot pile batches onto the device: its depth is charged to the job as ``staging`` memory.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import jax


@dataclass(frozen=True)
class DataError:
    """The data source raised while producing batch ``step``: fails that job alone."""

    step: int
    error: BaseException


END = object()  # the data ran out (or the job's step count was reached)


class BatchMismatch(Exception):
    """A batch whose pytree structure differs from the one the step was compiled for."""


class BatchSource:
    """Batches ``start .. stop`` of a job's data, whether it is an iterable or ``step -> batch``."""

    def __init__(self, data: Any, *, start: int, stop: int | None):
        self.start, self.stop = start, stop
        self._callable = callable(data) and not hasattr(data, "__iter__")
        self._data = data
        self._iter: Iterator | None = None
        self._peeked: list[Any] = []
        self.next_step = start

    def _open(self) -> None:
        if self._iter is None and not self._callable:
            self._iter = iter(self._data)
            # An iterable cannot seek: a resumed job replays (and drops) the batches before start.
            for _ in range(self.start):
                next(self._iter)

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
        try:
            return next(self._iter)
        except StopIteration:
            return END

    def next(self) -> Any:
        item = self._peeked.pop(0) if self._peeked else self._produce()
        if item is not END:
            self.next_step += 1
        return item


class Prefetcher:
    """Runs ``source`` on a daemon thread, ``device_put``-ting up to ``depth`` batches ahead.

    ``on_ready`` is called (from the prefetch thread) after each put, so idle lane workers wake.
    """

    def __init__(self, source: BatchSource, device: Any, *, depth: int, name: str,
                 on_ready: Callable[[], None], treedef: Any):
        self.source, self.device, self.treedef = source, device, treedef
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._on_ready = on_ready
        self._thread = threading.Thread(target=self._run, name=f"xshare-prefetch-{name}", daemon=True)
        self._head: Any = None  # an item taken off the queue by ``ready`` but not yet consumed

    def start(self) -> None:
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                # Wake the lanes only when the queue was empty: otherwise this job already had
                # a batch waiting and no lane can be idle for want of this one (a wake-up is a
                # lock round trip plus every idle lane thread rescheduled, per batch).
                if self._queue.qsize() <= 1:
                    self._on_ready()
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        while not self._stop.is_set():
            step = self.source.next_step
            try:
                batch = self.source.next()
                if batch is not END:
                    leaves, treedef = jax.tree.flatten(batch)
                    if treedef != self.treedef:
                        raise BatchMismatch(f"batch {step} does not match the compiled step: its structure "
                                            f"is {treedef}, expected {self.treedef}")
                    # Flat leaves: the compiled step takes them so (see compiler._flat_step).
                    # may_alias=False: the runtime donates its batches, so it must own them and
                    # never consume an array the user still holds.
                    batch = jax.device_put(leaves, self.device, may_alias=False)
            except BaseException as err:  # noqa: BLE001 - any failure of user data fails the job
                self._put(DataError(step, err))
                return
            if not self._put(batch) or batch is END:
                return

    def ready(self) -> bool:
        """Whether ``take`` would return at once (a batch, END, or a DataError)."""
        if self._head is None:
            try:
                self._head = self._queue.get_nowait()
            except queue.Empty:
                return False
        return True

    def take(self) -> Any:
        if not self.ready():
            raise RuntimeError("take() without a ready batch")
        item, self._head = self._head, None
        return item

    def close(self) -> None:
        self._stop.set()
