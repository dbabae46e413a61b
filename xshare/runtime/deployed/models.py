"""Deployed models: a job whose batches are requests (``Runtime.deploy``; spec:
:mod:`xshare.serving.spec`).

A :class:`Deployed` model holds its params on the device (persistent bytes in the arena), one
executable per padded batch size (its largest is the ephemeral reservation), and a bounded
queue of requests that any thread may append to. The dispatcher owns execution: between two
steps it asks :meth:`Hub.serve_due` whether a model's batch is due (``max_batch`` rows waiting,
or the oldest waited ``max_delay_ms``) and, if so, runs the smallest bucket that holds the
waiting rows, padded with zeros; the outputs go to one completion thread that copies them to
the host and hands each request its own rows, so the dispatcher never waits on a transfer.
With nothing queued a model costs one integer read per iteration and no wake-ups.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, InvalidStateError
from typing import Any

import jax
import numpy as np

from ..._errors import XShareError
from ...serving.spec import OIP_DATATYPES, InferError, ModelSpec
from .batching import InferFuture, InferStats, Request, insert_at, next_deadline, oldest_arrival, preferred_rows
from ..causes import short_error

log = logging.getLogger("xshare.serving")

# Latency histogram bounds (seconds): /metrics' xshare_model_request_seconds buckets.
LATENCY_BOUNDS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_RECENT = 2048  # completed requests kept for p50/p99 and requests/s


class Deployed:
    """One deployed model: its executables, resident params, queue and counters."""

    def __init__(self, spec: ModelSpec, device: Any):
        self.spec, self.name, self.device = spec, spec.name, device
        self.version = spec.version
        self.key = (spec.name, spec.version)  # the hub's key: a name may be deployed at several versions
        self.arena_id = f"model:{spec.name}" + (f"/{spec.version}" if spec.version != 1 else "")
        self.lane: int | None = None
        self.state = "loading"       # loading -> ready -> leaving -> gone
        self._lock = threading.Lock()  # guards the queue and its row count (held for O(1) work)
        self.queue: deque[Request] = deque()
        self.queued_rows = 0
        # counters (written by the dispatcher and the completion thread, read by snapshots)
        self.requests_total = self.errors_total = self.rejected_total = 0
        self.batches_total = self.rows_total = self.padded_rows_total = 0
        self.latency_counts = [0] * (len(LATENCY_BOUNDS_S) + 1)
        self.latency_sum_s = 0.0
        self.recent: deque[tuple[float, float]] = deque(maxlen=_RECENT)  # (t_done, latency_s)
        self.compile_s = 0.0
        self.infer_stats = InferStats()  # Triton's statistics extension
        self.timed = 0  # requests waiting with a timeout: the dispatcher looks for expired ones only then
        self._compile()

    # ------------------------------------------------------------------ build (caller's thread)
    def _compile(self) -> None:
        spec = self.spec
        wide = [k for k, (dtype, _) in spec.inputs.items() if np.dtype(dtype).itemsize == 8]
        if wide and not jax.config.jax_enable_x64:  # type: ignore[attr-defined]  # jax sets its options on Config at import (setattr)
            # JAX would quietly compute them in 32 bits and answer INT32/FP32 to an INT64/FP64 request.
            k = wide[0]
            raise XShareError(f"model {spec.name!r}: input {k!r} is {spec.inputs[k][0]}, but JAX runs with 64-bit "
                              "types off and would compute it in 32 bits; set JAX_ENABLE_X64=1 (or "
                              "jax.config.update('jax_enable_x64', True)) before the runtime starts, or declare "
                              "a 32-bit type")
        t = time.perf_counter()
        fn = jax.jit(_throwaway(spec.predict))
        params_avals = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), _dtype_of(a)), spec.params)
        self.executables: dict[int, Any] = {}
        for b in spec.buckets:
            inputs = {k: jax.ShapeDtypeStruct((b, *shape), np.dtype(dtype) if dtype != "bfloat16"
                                              else jax.numpy.bfloat16)
                      for k, (dtype, shape) in spec.inputs.items()}
            try:
                self.executables[b] = _executable(fn.lower(params_avals, inputs), self.device)
            except Exception as err:
                raise XShareError(f"model {spec.name!r}: predict does not compile for a batch of {b} "
                                  f"({type(err).__name__}: {err})") from err
        out = jax.eval_shape(spec.predict, params_avals, inputs)  # the largest bucket's
        self.single_output = not isinstance(out, dict)
        outs = {"output": out} if self.single_output else out
        self.outputs: dict[str, tuple[str, tuple[int, ...]]] = {}
        for k, aval in outs.items():
            if not aval.shape or aval.shape[0] != spec.max_batch:
                raise XShareError(f"model {spec.name!r}: output {k!r} has shape {aval.shape}; every output "
                                  f"needs the batch as its first axis ({spec.max_batch} rows in, "
                                  f"{spec.max_batch} rows out)")
            self.outputs[str(k)] = (str(np.dtype(aval.dtype)), tuple(aval.shape[1:]))
        self.compile_s = time.perf_counter() - t
        self.persistent_bytes = int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(spec.params)))
        self.ephemeral_bytes = _ephemeral(self.executables[spec.max_batch], self.persistent_bytes, inputs, outs)

    def put_params(self) -> None:
        self.params = jax.device_put(self.spec.params, self.device)
        jax.block_until_ready(self.params)

    # ------------------------------------------------------------------ requests (any thread)
    def check(self, inputs: Any) -> tuple[dict[str, np.ndarray], int]:
        """The request's arrays, checked against the model's inputs; ``InferError(400)`` says why."""
        spec = self.spec
        if not isinstance(inputs, dict):
            raise InferError(400, f"inputs must be a dict {{name: array}} with {sorted(spec.inputs)}")
        missing, extra = set(spec.inputs) - set(inputs), set(inputs) - set(spec.inputs)
        if missing or extra:
            raise InferError(400, f"model {self.name!r} takes inputs {sorted(spec.inputs)}; "
                                  f"got {sorted(map(str, inputs))}" + (f" (unknown: {sorted(map(str, extra))})"
                                                                      if extra else ""))
        arrays, rows = {}, None
        for k, (dtype, shape) in spec.inputs.items():
            a = np.asarray(inputs[k])
            if str(a.dtype) != dtype:
                raise InferError(400, f"input {k!r} is {a.dtype}; model {self.name!r} takes {dtype} "
                                      f"({OIP_DATATYPES[dtype]})")
            if a.ndim != len(shape) + 1 or tuple(a.shape[1:]) != shape:
                raise InferError(400, f"input {k!r} has shape {list(a.shape)}; model {self.name!r} takes "
                                      f"[batch, {', '.join(map(str, shape))}]")
            n = a.shape[0]
            if rows is not None and n != rows:
                raise InferError(400, f"input {k!r} has {n} rows but the others have {rows}; every input "
                                      "needs the same batch")
            rows = n
            arrays[k] = a
        if not rows or rows > spec.max_batch:
            raise InferError(400, f"a batch of {rows} rows; model {self.name!r} takes 1..{spec.max_batch} "
                                  "per request (max_batch): split it")
        return arrays, rows

    def level(self, priority: Any) -> int:
        """A request's priority level (Triton's ``priority`` parameter: 1 first, 0 = the default)."""
        spec = self.spec
        if not isinstance(priority, int) or isinstance(priority, bool) or priority < 0:
            raise InferError(400, f"priority {priority!r} must be an int >= 0 (1 is the highest, 0 the default)")
        if not spec.priority_levels:
            if priority:
                raise InferError(400, f"model {self.name!r} has no priority levels, so a request's priority "
                                      f"{priority} means nothing; send none, or deploy it with priority_levels=N")
            return 0
        if priority > spec.priority_levels:
            raise InferError(400, f"priority {priority} is not a level of model {self.name!r}: 1 (highest) .. "
                                  f"{spec.priority_levels}, or 0 for its default ({spec.default_priority_level})")
        return priority or spec.default_priority_level

    def enqueue(self, inputs: Any, *, priority: Any = 0, timeout_us: Any = None) -> InferFuture:
        """Queue one request; ``priority`` (its level) and ``timeout_us`` (how long it may wait
        for its batch to start, in microseconds) are Triton's schedule-policy parameters."""
        arrays, rows = self.check(inputs)
        level = self.level(priority)
        if timeout_us is not None and (not isinstance(timeout_us, int) or isinstance(timeout_us, bool)
                                       or timeout_us < 0):
            raise InferError(400, f"timeout {timeout_us!r} must be an int >= 0 (microseconds; 0 = none)")
        now = time.monotonic()
        req = Request(arrays, rows, now, level=level, timeout_us=timeout_us or None,
                      deadline=now + timeout_us / 1e6 if timeout_us else None)
        with self._lock:
            if self.state != "ready":
                raise InferError(503, f"model {self.name!r} is {self.state}; it takes no requests",
                                 retry_after_s=1.0)
            if self.queued_rows + rows > self.spec.max_queue:
                self.rejected_total += 1
                raise InferError(503, f"model {self.name!r} has {self.queued_rows} rows waiting (max_queue="
                                      f"{self.spec.max_queue}); retry later", retry_after_s=1.0)
            at = insert_at(self.queue, level)
            if at is None:
                self.queue.append(req)
            else:
                self.queue.insert(at, req)
            self.queued_rows += rows
            self.timed += req.deadline is not None
        return req.future

    # ------------------------------------------------------------------ dispatcher thread
    def due_at(self) -> float | None:
        """When the waiting requests must run (monotonic seconds; 0 if a full batch or one of a
        preferred size waits; with ``max_delay_ms=0``, the default, as soon as one arrives)."""
        q, spec = self.queue, self.spec
        if not q:
            return None
        if self.queued_rows >= spec.max_batch or preferred_rows(q, spec.preferred_batch_sizes):
            return 0.0
        oldest = oldest_arrival(q, bool(spec.priority_levels))
        return None if oldest is None else oldest + spec.max_delay_ms / 1e3

    def take(self) -> tuple[list[Request], int]:
        """The first requests (by level, then arrival) that fit in ``max_batch`` rows, and their
        row count; fewer if they make a preferred batch size and not a full batch."""
        taken, rows = [], 0
        spec = self.spec
        with self._lock:
            limit = spec.max_batch
            if self.queued_rows < limit:
                limit = preferred_rows(self.queue, spec.preferred_batch_sizes) or limit
            while self.queue and rows + self.queue[0].rows <= limit:
                req = self.queue.popleft()
                taken.append(req)
                rows += req.rows
                self.timed -= req.deadline is not None
            self.queued_rows -= rows
        return taken, rows

    def next_deadline(self) -> float | None:
        return next_deadline(self.queue) if self.timed else None

    def expire(self, now: float) -> int:
        """Fail the requests that waited past their timeout, each alone (its batch has not
        started; the others wait on); how many."""
        if not self.timed:
            return 0
        with self._lock:
            late = [r for r in self.queue if r.deadline is not None and r.deadline <= now]
            if not late:
                return 0
            gone = set(map(id, late))
            self.queue = deque(r for r in self.queue if id(r) not in gone)
            self.queued_rows -= sum(r.rows for r in late)
            self.timed -= len(late)
        self.infer_stats.failed(late, now)
        for r in late:
            _settle(r.future, exc=InferError(504, f"the request waited {(now - r.t_arrival) * 1e3:.1f} ms in the "
                                                  f"queue of model {self.name!r}, past its timeout of {r.timeout_us} "
                                                  "us; it did not run"))
        return len(late)

    def launch(self, reqs: list[Request], rows: int) -> Any:
        """Run the smallest bucket holding ``rows``: zero padding after the requests' rows."""
        spec = self.spec
        t_start = time.monotonic()
        bucket = spec.buckets[bisect.bisect_left(spec.buckets, rows)]
        batch = {}
        for k, (_dtype, shape) in spec.inputs.items():
            parts = [r.inputs[k] for r in reqs]
            if bucket > rows:
                parts.append(np.zeros((bucket - rows, *shape), parts[0].dtype))
            batch[k] = np.concatenate(parts) if len(parts) > 1 else parts[0]
        self.batches_total += 1
        self.rows_total += rows
        self.padded_rows_total += bucket
        t_ready = time.monotonic()
        for r in reqs:
            r.t_start, r.t_ready = t_start, t_ready
        return self.executables[bucket](self.params, batch)

    # ------------------------------------------------------------------ completion thread
    def finish(self, reqs: list[Request], outs: Any, error: BaseException | None) -> None:
        if error is None:
            try:
                host = {k: np.asarray(v) for k, v in (({"output": outs} if self.single_output else outs)).items()}
            except Exception as err:  # noqa: BLE001 - an error raised while it ran (a callback)
                error = err
        now = time.monotonic()
        if error is not None:
            self.errors_total += len(reqs)
            self.infer_stats.failed(reqs, now)
            log.warning("model %r: a batch of %d request(s) failed: %s", self.name, len(reqs), short_error(error))
            failed = InferError(500, f"model {self.name!r}: predict failed for this batch: {short_error(error)}")
            for r in reqs:
                _settle(r.future, exc=failed)
            return
        start = 0
        answers = []
        for r in reqs:
            # A copy of this request's rows only: the padding and the other requests' rows stay here.
            answers.append({k: v[start:start + r.rows].copy() for k, v in host.items()})
            start += r.rows
        t_out = time.monotonic()
        # Counted before any future settles: a client that reads the stats right after its
        # answer arrives must see its own request in them.
        for r in reqs:
            latency = now - r.t_arrival
            self.latency_counts[bisect.bisect_left(LATENCY_BOUNDS_S, latency)] += 1
            self.latency_sum_s += latency
            self.recent.append((now, latency))
        self.requests_total += len(reqs)
        self.infer_stats.done(reqs, now, t_out)
        for r, answer in zip(reqs, answers):
            _settle(r.future, answer)

    def triton_stats(self) -> dict[str, Any]:
        """The counters behind Triton's statistics document (:mod:`xshare.serving.extensions`)."""
        return self.infer_stats.snapshot()

    def fail_queued(self, message: str) -> None:
        reqs, _ = self.take_all()
        self.infer_stats.failed(reqs, time.monotonic())
        for r in reqs:
            _settle(r.future, exc=InferError(503, message, retry_after_s=1.0))

    def take_all(self) -> tuple[list[Request], int]:
        with self._lock:
            reqs, self.queue = list(self.queue), deque()
            rows, self.queued_rows = self.queued_rows, 0
            self.timed = 0
        return reqs, rows

    # ------------------------------------------------------------------ reading
    def metadata(self) -> dict[str, Any]:
        """The Open Inference Protocol's model metadata (shapes with -1 for the batch)."""
        return {"name": self.name, "versions": [str(self.version)], "platform": "xshare-jax",
                "inputs": [{"name": k, "datatype": OIP_DATATYPES[d], "shape": [-1, *s]}
                           for k, (d, s) in self.spec.inputs.items()],
                "outputs": [{"name": k, "datatype": OIP_DATATYPES.get(d, d.upper()), "shape": [-1, *s]}
                            for k, (d, s) in self.outputs.items()]}

    def stats(self, now: float | None = None) -> dict[str, Any]:
        now = time.monotonic() if now is None else now
        recent = list(self.recent)
        lat = sorted(x for _, x in recent)
        window = [t for t, _ in recent if now - t <= 10.0]
        span = min(10.0, max(now - window[0], 1e-9)) if window else None
        return {
            "name": self.name, "version": self.version, "status": self.state, "priority": self.spec.priority,
            "max_batch": self.spec.max_batch, "max_delay_ms": self.spec.max_delay_ms,
            "buckets": list(self.spec.buckets), "lane": self.lane,
            "persistent_bytes": self.persistent_bytes, "ephemeral_bytes": self.ephemeral_bytes,
            "queue_rows": self.queued_rows, "queue_requests": len(self.queue),
            "requests_total": self.requests_total, "errors_total": self.errors_total,
            "rejected_total": self.rejected_total, "batches_total": self.batches_total,
            "rows_total": self.rows_total,
            "batch_fill": self.rows_total / self.padded_rows_total if self.padded_rows_total else None,
            "requests_per_s": len(window) / span if window and span else 0.0,
            "latency_p50_s": _pct(lat, 0.50), "latency_p99_s": _pct(lat, 0.99),
            "latency_histogram": {"bounds_s": list(LATENCY_BOUNDS_S), "counts": list(self.latency_counts),
                                  "sum_s": self.latency_sum_s, "count": sum(self.latency_counts)},
        }


def _settle(fut: Future, value: Any = None, exc: BaseException | None = None) -> None:
    """Answer a request, unless its caller gave up (an HTTP client that hung up or timed out
    cancels its future): one such request must not keep the rest of its batch unanswered."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)
    except InvalidStateError:
        pass


def _pct(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


# Executables of deployed models by (device, lowered program): models that lower to the same
# program (the same architecture and input shapes, other params) share one executable per batch
# size, as jobs share a CompiledStep. Measured before (benchmarks/serving.py --count): a small
# model cost 5.9 MiB resident, almost all of it its three executables (its params: 86 KiB).
# Weak values: the executables go when the last model using them is undeployed.
_EXECUTABLES: "weakref.WeakValueDictionary[tuple, Any]" = weakref.WeakValueDictionary()
_EXECUTABLES_LOCK = threading.Lock()


def _throwaway(predict: Any) -> Any:
    """``predict`` behind a function that dies with this deploy's compile. JAX's tracing and
    lowering caches hold what they made (jaxprs, MLIR modules) for as long as the function they
    traced lives, and a deployed model's ``predict`` lives as long as the model: lowering it
    directly kept 4.1 MiB per model resident (3 buckets of a small MLP), 70% of what a model
    cost, after its executables were shared. Same name, so the same lowered text."""
    def traced(params, inputs):
        return predict(params, inputs)

    traced.__name__ = getattr(predict, "__name__", "predict")
    return traced


def _executable(lowered: Any, device: Any) -> Any:
    key = (getattr(device, "platform", ""), getattr(device, "id", 0),
           hashlib.sha256(lowered.as_text().encode()).hexdigest())
    with _EXECUTABLES_LOCK:
        hit = _EXECUTABLES.get(key)
    if hit is not None:
        return hit
    compiled = lowered.compile()  # outside the lock: two first deploys may both compile; one wins
    with _EXECUTABLES_LOCK:
        return _EXECUTABLES.setdefault(key, compiled)


def _dtype_of(a: Any) -> Any:
    return getattr(a, "dtype", None) or np.asarray(a).dtype


def _ephemeral(compiled: Any, persistent: int, inputs: dict, outs: dict) -> int:
    """``E`` of the largest bucket: XLA's temp + the batch + the outputs (from memory_analysis);
    where the backend reports nothing (jax #18954), the batch and outputs' own bytes."""
    io = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in (*inputs.values(), *outs.values()))
    try:
        ma = compiled.memory_analysis()
        temp = int(getattr(ma, "temp_size_in_bytes", 0) or 0)
        args = int(getattr(ma, "argument_size_in_bytes", 0) or 0)
        out = int(getattr(ma, "output_size_in_bytes", 0) or 0)
    except Exception:  # noqa: BLE001
        return max(io, 1)
    if temp == 0:  # a zero from a program that has temporaries is not believed (plausible.py)
        from ...memory.plausible import implausible_temp

        fixed = implausible_temp(temp, compiled.as_text())
        temp = fixed[0] if fixed is not None else temp
    measured = temp + max(args - persistent, 0) + out
    return max(measured, io, 1)
