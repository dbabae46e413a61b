"""An inference job: a model answering batched requests that arrive as a Poisson process.

The job's state is the model's parameters, and its step returns them unchanged: it only
computes predictions. The runtime donates a job's state to every step, and returning the very
arrays it was given is the correct answer to that (XLA aliases each donated input buffer to the
output it flows to unchanged, so nothing is copied and the next step gets the same buffers).

Requests: request ``i`` arrives at ``t0 + a_i``, where the gaps ``a_i - a_{i-1}`` are exponential
with mean ``1 / rate`` (a Poisson process of ``rate`` requests per second) drawn from a seeded
RNG, and ``t0`` is the moment of the data's first call. Step ``k`` serves requests
``k * batch .. (k + 1) * batch - 1``: the data callable (run by the runtime on the job's
prefetch thread) sleeps until the last of them has arrived, remembers their arrival times, and
returns their inputs. Requests are generated deterministically from ``(seed, step)`` like every
other job's data.

**Latency of a request = the time the step that served it completed (``t_done``, as the
runtime's observer reports it) minus the request's arrival time.** It therefore includes the
wait for the rest of its batch to arrive, any time the job waited for its turn on the device
(this is what sharing costs an inference job), and the step itself. Percentiles are exact and
taken over **all requests served so far** (not a sliding window), so a job's last metrics
summarise its whole run.

The clock starts at the data's first call, which the runtime makes when it compiles the job (it
needs the first batch's shapes). Requests that "arrive" while the job compiles or waits for
admission are served late, exactly as a server that is not yet up would serve them; submit an
inference job after the jobs whose compile time it should not pay for (``submit_many`` and
``xshare launch`` compile in order).
"""

from __future__ import annotations

import bisect
import threading
import time
from typing import Callable, Mapping

import jax
import numpy as np
from flax import nnx

import xshare

from . import cnn, mlp
from .common import HyperparameterError, check_common, check_positive_ints

MODELS = ("mlp", "cnn")


class PoissonRequests:
    """``step -> {"x": inputs}`` that waits for the batch's requests to arrive, plus the
    ``observer`` that turns their arrival times into latency percentiles.

    ``clock`` and ``sleep`` are injectable for tests; the runtime's ``t_done`` is on
    ``time.monotonic()``'s clock, the default.
    """

    def __init__(self, inputs: Callable[[int], np.ndarray], *, batch: int, rate: float, seed: int,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self.inputs, self.batch, self.rate = inputs, batch, rate
        self.clock, self.sleep = clock, sleep
        self._rng = np.random.default_rng(30_000 + seed)   # the gaps, one stream drawn in order
        self._offsets = np.zeros(0)                         # a_i, seconds after t0
        self._t0: float | None = None
        self._lock = threading.Lock()                       # prefetch thread vs lane worker
        self._pending: dict[int, np.ndarray] = {}           # step -> its requests' arrival times
        self._latencies: list[float] = []                   # seconds, sorted: exact percentiles
        self.served = 0

    def _offsets_upto(self, n: int) -> np.ndarray:
        """a_0 .. a_{n-1}; extends the (deterministic) stream in chunks as steps ask for more."""
        while len(self._offsets) < n:
            gaps = self._rng.exponential(1.0 / self.rate, size=max(n - len(self._offsets), 4096))
            last = self._offsets[-1] if len(self._offsets) else 0.0
            self._offsets = np.concatenate([self._offsets, last + np.cumsum(gaps)])
        return self._offsets[:n]

    def arrivals(self, step: int) -> np.ndarray:
        """Arrival times (on ``clock``) of step ``step``'s requests; starts the clock if needed."""
        lo, hi = step * self.batch, (step + 1) * self.batch
        with self._lock:
            offsets = self._offsets_upto(hi)
            if self._t0 is None:
                # The first batch asked for (step 0, or the resume point) starts the clock, as if
                # the request just before it had arrived now.
                self._t0 = self.clock() - (offsets[lo - 1] if lo > 0 else 0.0)
            return self._t0 + offsets[lo:hi]

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        arrived = self.arrivals(step)
        wait = arrived[-1] - self.clock()
        if wait > 0:
            self.sleep(wait)        # on the prefetch thread: the device runs other jobs meanwhile
        with self._lock:
            self._pending[step] = arrived
        return {"x": self.inputs(step)}

    def observer(self, step: int, metrics: Mapping[str, float], t_done: float) -> dict[str, float]:
        """Latency percentiles over all requests served so far (runs under the runtime's lock:
        ``insort`` keeps it O(log n) comparisons plus one memmove per request)."""
        with self._lock:
            arrived = self._pending.pop(step)
        latencies = t_done - arrived
        for x in latencies:
            bisect.insort(self._latencies, float(x))
        self.served += len(latencies)
        return {"latency_p50_ms": 1e3 * _percentile(self._latencies, 0.50),
                "latency_p99_ms": 1e3 * _percentile(self._latencies, 0.99),
                "batch_latency_ms": 1e3 * float(latencies.mean()),
                "requests": float(self.served)}


def _percentile(ordered: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default) on a sorted list."""
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _model(model: str, batch: int, seed: int) -> tuple[nnx.Module, Callable[[int], np.ndarray]]:
    """The network (freshly initialised: serving cost does not depend on the weights' values)
    and the request inputs, taken from the matching training job's data."""
    if model == "mlp":
        data = mlp.TeacherData(batch, seed)
        return mlp.MLP(128, 2, rngs=nnx.Rngs(seed)), lambda step: data(step)["x"]
    if model == "cnn":
        data = cnn.PatternData(batch, seed)
        return cnn.ResNet(16, 2, rngs=nnx.Rngs(seed)), lambda step: data(step)["x"]
    raise HyperparameterError(f"inference: model={model!r}; choose one of {', '.join(MODELS)}")


def make_job(model: str = "mlp", rate: float = 200.0, batch: int = 8, steps: int = 200, seed: int = 0,
             name: str | None = None) -> xshare.JobSpec:
    """A bound inference job: ``model`` answering ``steps`` batches of ``batch`` requests that
    arrive at ``rate`` requests/s. Metrics per step: ``mean_max_prob`` (the mean confidence of
    the batch's predictions) and, from the observer, ``latency_p50_ms``, ``latency_p99_ms``
    (over all requests so far), ``batch_latency_ms`` (this step's mean) and ``requests``."""
    check_common("inference", seed=seed, steps=steps, name=name)
    check_positive_ints("inference", batch=batch)
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not rate > 0:
        raise HyperparameterError(f"inference: rate={rate!r} must be a positive number of requests per second")
    net, inputs = _model(model, batch, seed)
    graphdef, params = nnx.split(net, nnx.Param)

    def infer(params, batch):
        probs = jax.nn.softmax(nnx.merge(graphdef, params)(batch["x"]), axis=-1)
        # The same arrays back: donated in, aliased out, never copied.
        return params, {"mean_max_prob": probs.max(axis=-1).mean()}

    infer.__name__ = f"infer_{model}"
    requests = PoissonRequests(inputs, batch=batch, rate=float(rate), seed=seed)
    return xshare.job(infer, name=f"infer-{model}").bind(
        params, requests, steps=steps, name=name or f"infer-{model}-s{seed}", observer=requests.observer,
        meta={"model": f"infer-{model}", "rate": rate, "batch": batch, "seed": seed})


# ------------------------------------------------------------------------------ deployable model

def make_model(model: str = "mlp", max_batch: int = 64, max_delay_ms: float = 0.0, priority: int = 10,
               seed: int = 0, name: str | None = None) -> xshare.ModelSpec:
    """A deployable model (``xshare serve --model xshare.models.inference:make_model``, ``xshare
    deploy``, ``rt.deploy``): ``model`` (mlp or cnn, freshly initialised from ``seed``) answering
    real requests over the Open Inference Protocol. Input ``x`` is one example of the matching
    training job's data (mlp: ``float32[32]``; cnn: ``float32[32, 32, 3]``); outputs ``probs``
    (softmax over the classes) and ``label`` (int32 argmax)."""
    check_common("inference", seed=seed, steps=1, name=name)
    check_positive_ints("inference", max_batch=max_batch)
    net, inputs = _model(model, 1, seed)
    graphdef, params = nnx.split(net, nnx.Param)
    example = np.asarray(inputs(0))

    def predict(params, batch):
        probs = jax.nn.softmax(nnx.merge(graphdef, params)(batch["x"]), axis=-1)
        return {"probs": probs, "label": probs.argmax(axis=-1).astype(np.int32)}

    predict.__name__ = f"predict_{model}"
    host_params = jax.tree.map(np.asarray, params)  # plain arrays: the runtime places its own copy
    return xshare.model(predict, host_params, inputs={"x": (str(example.dtype), example.shape[1:])},
                        name=name or f"{model}-s{seed}", max_batch=max_batch, max_delay_ms=max_delay_ms,
                        priority=priority)
