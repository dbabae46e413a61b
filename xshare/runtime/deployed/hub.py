"""The runtime's deployed models as the dispatcher serves them (:class:`Hub`), and the handle
in-process callers hold (:class:`ModelHandle`). A model itself (its executables, params, queue
and counters) is :class:`xshare.runtime.deployed.models.Deployed`.

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

from ..._errors import AdmissionError, XShareError
from ..._units import format_bytes
from ...memory import Admitted
from ...serving.spec import InferError
from .models import Deployed


class Hub:
    """The runtime's deployed models; the dispatcher calls :meth:`serve_due` between steps."""

    def __init__(self, dispatcher: Any):
        self.dispatcher = dispatcher
        self.models: dict[tuple[str, int], Deployed] = {}  # by (name, version); replaced whole, never mutated
        self.by_name: dict[str, tuple[Deployed, ...]] = {}  # each name's versions, highest first (replaced whole)
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
            if m.timed:
                m.expire(now)  # requests past their timeout fail alone, before a batch could take them
            at = m.due_at()
            if at is not None and at <= now:
                self._run(m)
                return True
        return False

    def wait_s(self, default: float) -> float:
        """How long the idle dispatcher may sleep before a waiting batch falls due."""
        now, wait = time.monotonic(), default
        for m in self._waiting():
            for at in (m.due_at(), m.next_deadline()):
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
        # On the model's lane's stream (engine/streams.py): on a CPU under pack or fair, a batch
        # does not queue behind another lane's training calls already in flight.
        self.dispatcher.executor.streams.enter(m.lane)
        try:
            outs = m.launch(reqs, rows)
        except Exception as err:  # noqa: BLE001 - this batch's requests get 500, nothing else
            self._done.submit(m.finish, reqs, None, err)
            return
        self._done.submit(m.finish, reqs, outs, None)

    def default(self, name: str) -> Deployed | None:
        """The version of ``name`` a request naming none goes to: the highest ready one (else the highest)."""
        versions = self.by_name.get(name, ())
        return next((m for m in versions if m.state == "ready"), versions[0] if versions else None)

    def _index(self) -> None:
        by_name: dict[str, list[Deployed]] = {}
        for m in self.models.values():
            by_name.setdefault(m.name, []).append(m)
        self.by_name = {n: tuple(sorted(v, key=lambda m: -m.version)) for n, v in by_name.items()}
        self._order = tuple(sorted(self.models.values(), key=lambda x: -x.spec.priority))

    def add(self, m: Deployed) -> None:
        if m.key in self.models:
            raise XShareError(f"a model named {m.name!r} is already deployed at version {m.version}; undeploy it "
                              "first, pick another name, or deploy another version (version=N)")
        arena = self.dispatcher.arena
        held = f"the arena holds {format_bytes(arena.capacity)} ({self.dispatcher.admission.capacity_source or 'its budget'})"
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
        self.models = {**self.models, m.key: m}
        self._index()

    def remove(self, key: tuple[str, int]) -> Deployed:
        m = self.models.get(key)
        if m is None:
            raise KeyError(key)
        with m._lock:
            m.state = "leaving"  # no new requests; those already queued are answered
        while m.queue:
            self._run(m)
        self.models = {k: v for k, v in self.models.items() if k != key}
        self._index()
        self.dispatcher.admission.release(m.arena_id)
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
    """A deployed model, for in-process callers (``rt.deploy(spec)``, ``rt.model(name[, version])``).

    A handle from ``deploy`` or ``rt.model(name, version)`` is that version; one from
    ``rt.model(name)`` follows the name's default version (the highest ready one) at each call,
    so its requests go on to the next version down while the highest is undeployed."""

    def __init__(self, hub: Hub, deployed: Deployed, *, pinned: bool = True):
        self._hub, self._d, self._pinned = hub, deployed, pinned

    @property
    def _m(self) -> Deployed:
        if self._pinned:
            return self._d
        m = self._hub.default(self._d.name)
        return m if m is not None else self._d

    @property
    def name(self) -> str:
        """The model's name (its route: ``/v2/models/{name}``)."""
        return self._d.name

    @property
    def version(self) -> int:
        """The version this handle answers with (the highest ready one, unless pinned)."""
        return self._m.version

    def submit(self, inputs: dict[str, Any], *, priority: int = 0, timeout_us: int | None = None) -> Future:
        """Queue one request; its future holds ``{output: rows}`` (or ``InferError``).
        ``priority``: its level, 1 first .. the model's ``priority_levels`` (0: the model's
        default); ``timeout_us``: if its batch has not started within this many microseconds it
        fails alone (``InferError`` 504) and nothing else is affected. Both are Triton's
        schedule-policy request parameters, which HTTP and gRPC requests carry."""
        m = self._m
        try:
            fut = m.enqueue(inputs, priority=priority, timeout_us=timeout_us)
        except InferError as err:
            # The default version began leaving between the look-up and the enqueue: the next one
            # down answers (an undeploy of one version loses no request to the others).
            again = self._m
            if self._pinned or err.code != 503 or m.state == "ready" or again is m:
                raise
            m = again
            fut = m.enqueue(inputs, priority=priority, timeout_us=timeout_us)
        fut.model_version = m.version  # the version that answers (a default handle's may change)
        self._hub.queued(m)
        self._hub.wake()
        return fut

    def infer(self, inputs: dict[str, Any], timeout: float | None = 60.0, *, priority: int = 0,
              timeout_us: int | None = None) -> dict[str, np.ndarray]:
        """Run ``predict`` on these rows in a batch with whatever else waits; returns only their outputs.
        Raises ``InferError`` (its ``code``: 400 bad input, 503 queue full, 500 predict failed,
        504 waited past ``timeout_us``). ``timeout``: seconds this call waits for the answer;
        ``priority`` and ``timeout_us``: as :meth:`submit`."""
        return self.submit(inputs, priority=priority, timeout_us=timeout_us).result(timeout)

    def ready(self) -> bool:
        """Whether the model is deployed and answering (false once it is being undeployed)."""
        return self._m.state == "ready"

    def metadata(self) -> dict[str, Any]:
        """The model's OIP metadata: its name, versions, inputs and outputs with datatypes and
        shapes (``-1`` is the batch)."""
        meta = self._m.metadata()
        if not self._pinned:  # the name's metadata lists every deployed version
            meta["versions"] = [str(m.version) for m in reversed(self._hub.by_name.get(self.name, ()))] or meta["versions"]
        return meta

    def stats(self) -> dict[str, Any]:
        """The model's counters and latencies, as in the status document's ``models[]``."""
        return self._m.stats()

    @property
    def spec(self) -> Any:
        """The ``xshare.model(...)`` spec it was deployed from."""
        return self._m.spec

    def triton_stats(self) -> dict[str, Any]:
        """The counters of Triton's statistics extension (``xshare.serving.extensions``)."""
        return self._m.triton_stats()

    def __repr__(self) -> str:
        return f"ModelHandle({self.name!r}, version {self.version}, {self._m.state})"
