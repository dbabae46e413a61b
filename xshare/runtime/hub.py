"""The runtime's deployed models as the dispatcher serves them (:class:`Hub`), and the handle
in-process callers hold (:class:`ModelHandle`). A model itself (its executables, params, queue
and counters) is :class:`xshare.runtime.models.Deployed`.

Between two training steps the dispatcher asks :meth:`Hub.serve_due` whether a model's batch is
due and runs it; it looks only at models with requests waiting, so resident idle models cost it
nothing (docs: models.py).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from .._errors import AdmissionError, XShareError
from .._units import format_bytes
from ..memory import Admitted
from .models import Deployed


class Hub:
    """The runtime's deployed models; the dispatcher calls :meth:`serve_due` between steps."""

    def __init__(self, dispatcher: Any):
        self.dispatcher = dispatcher
        self.models: dict[str, Deployed] = {}       # by name; replaced whole, never mutated in place
        self._order: tuple[Deployed, ...] = ()      # by priority, highest first
        # The models with requests waiting. The dispatcher asks between every two training steps
        # whether a batch is due: looking at every deployed model there cost O(models) per step
        # (1024 resident models: ~1024 reads a step); with nothing queued this is one read.
        self._pending: set[Deployed] = set()
        self._pending_lock = threading.Lock()
        self._done = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xshare-serve-done")

    # -------------------------------------------------------------- any thread
    def queued(self, m: Deployed) -> None:
        """``m`` has a request waiting (called after its ``enqueue``)."""
        with self._pending_lock:
            self._pending.add(m)

    def wake(self) -> None:
        self.dispatcher.poke()

    # -------------------------------------------------------------- dispatcher thread
    def serve_due(self) -> bool:
        """Run one due batch (the highest-priority model's first); whether one ran."""
        if not self._pending:
            return False
        now = time.monotonic()
        for m in self._waiting():
            at = m.due_at()
            if at is not None and at <= now:
                self._run(m)
                return True
        return False

    def wait_s(self, default: float) -> float:
        """How long the idle dispatcher may sleep before a waiting batch falls due."""
        now, wait = time.monotonic(), default
        for m in self._waiting():
            at = m.due_at()
            if at is not None:
                wait = min(wait, max(at - now, 0.0))
        return wait

    def _waiting(self) -> list[Deployed]:
        """The models with requests waiting, highest priority first."""
        with self._pending_lock:
            # A model emptied some other way (undeployed, drained) leaves here; one whose
            # request is appended but not yet announced is non-empty, so it stays.
            self._pending.difference_update([m for m in self._pending if not m.queue])
            return sorted(self._pending, key=lambda m: -m.spec.priority)

    def _run(self, m: Deployed) -> None:
        reqs, rows = m.take()
        with self._pending_lock:
            # Under the lock a request enqueued after take() either is seen here (the model
            # stays pending) or adds the model again after this discard (queued() waits).
            if not m.queue:
                self._pending.discard(m)
        if not reqs:
            return
        try:
            outs = m.launch(reqs, rows)
        except Exception as err:  # noqa: BLE001 - this batch's requests get 500, nothing else
            self._done.submit(m.finish, reqs, None, err)
            return
        self._done.submit(m.finish, reqs, outs, None)

    def add(self, m: Deployed) -> None:
        if m.name in self.models:
            raise XShareError(f"a model named {m.name!r} is already deployed; undeploy it first or pick "
                              "another name")
        arena = self.dispatcher.arena
        held = f"the arena holds {format_bytes(arena.capacity)} ({self.dispatcher.capacity_source or 'its budget'})"
        need = m.persistent_bytes + m.ephemeral_bytes
        if need > arena.capacity:
            # Checked here rather than left to the arena, whose refusal speaks of a job and its
            # batch size: a model's fix is its params or its max_batch (E is its largest bucket).
            raise AdmissionError(
                f"model {m.name!r} can never fit: it needs {format_bytes(need)} (P {format_bytes(m.persistent_bytes)} "
                f"params + E {format_bytes(m.ephemeral_bytes)} for a batch of {m.spec.max_batch}) but {held}; "
                "deploy a smaller model or a lower max_batch, or give the runtime more memory (--memory)")
        placed = arena.admit(m.arena_id, m.persistent_bytes, m.ephemeral_bytes, name=m.arena_id)
        if not isinstance(placed, Admitted):
            # A model is for now or never: waiting in the job queue would leave clients hanging.
            # So the refusal says what frees room, since nothing will retry it by itself.
            arena.release(m.arena_id)
            raise AdmissionError(
                f"model {m.name!r} does not fit now: it {placed.reason}; {held}. A model is deployed at once "
                "or refused, never queued: undeploy a model or wait for training jobs to end, then deploy it "
                "again; or lower its max_batch, or give the runtime more memory (--memory)")
        m.lane = placed.lane_id  # stays "loading" (taking no requests) until its params are placed
        self.models = {**self.models, m.name: m}
        self._order = tuple(sorted(self.models.values(), key=lambda x: -x.spec.priority))

    def remove(self, name: str) -> Deployed:
        m = self.models.get(name)
        if m is None:
            raise KeyError(name)
        with m._lock:
            m.state = "leaving"  # no new requests; those already queued are answered
        while m.queue:
            self._run(m)
        self.models = {k: v for k, v in self.models.items() if k != name}
        self._order = tuple(x for x in self._order if x is not m)
        self.dispatcher._admitted(self.dispatcher.arena.release(m.arena_id))
        m.state = "gone"
        return m

    def drain(self) -> None:
        """Answer every queued request (a graceful stop)."""
        for m in self._order:
            with m._lock:
                m.state = "leaving"
            while m.queue:
                self._run(m)

    def close(self) -> None:
        for m in self._order:
            with m._lock:
                m.state = "gone"
            m.fail_queued(f"model {m.name!r}: the runtime is closing")
        self._done.shutdown(wait=True)


class ModelHandle:
    """A deployed model, for in-process callers (``rt.deploy(spec)``)."""

    def __init__(self, rt: Any, deployed: Deployed):
        self._rt, self._m = rt, deployed

    @property
    def name(self) -> str:
        """The model's name (its route: ``/v2/models/{name}``)."""
        return self._m.name

    def submit(self, inputs: dict[str, Any]) -> Future:
        """Queue one request; its future holds ``{output: rows}`` (or ``InferError``)."""
        fut = self._m.enqueue(inputs)
        self._rt._dispatcher.serving.queued(self._m)
        self._rt._dispatcher.poke()
        return fut

    def infer(self, inputs: dict[str, Any], timeout: float | None = 60.0) -> dict[str, np.ndarray]:
        """Run ``predict`` on these rows in a batch with whatever else waits; returns only their outputs.
        Raises ``InferError`` (its ``code``: 400 bad input, 503 queue full, 500 predict failed)."""
        return self.submit(inputs).result(timeout)

    def ready(self) -> bool:
        """Whether the model is deployed and answering (false once it is being undeployed)."""
        return self._m.state == "ready"

    def metadata(self) -> dict[str, Any]:
        """The model's OIP metadata: its name, inputs and outputs with datatypes and shapes (``-1`` is the batch)."""
        return self._m.metadata()

    def stats(self) -> dict[str, Any]:
        """The model's counters and latencies, as in the status document's ``models[]``."""
        return self._m.stats()

    def __repr__(self) -> str:
        return f"ModelHandle({self.name!r}, {self._m.state})"
