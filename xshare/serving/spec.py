"""``xshare.model(...)``: what a deployed model is, as plain data (no jax here).

A model is a pure ``predict(params, inputs) -> outputs`` over a batch: ``inputs`` is a dict of
arrays whose first axis is the batch, ``outputs`` a dict of arrays (or one array, named
``"output"``) with the same first axis. The runtime compiles it ahead for a few padded batch
sizes (:attr:`ModelSpec.buckets`) and runs the smallest that holds the requests waiting.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

from .._errors import XShareError

# The Open Inference Protocol's datatypes for the numpy dtypes a model may take or return.
OIP_DATATYPES = {
    "bool": "BOOL", "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32", "uint64": "UINT64",
    "int8": "INT8", "int16": "INT16", "int32": "INT32", "int64": "INT64",
    "float16": "FP16", "float32": "FP32", "float64": "FP64", "bfloat16": "BF16",
}
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


class InferError(XShareError):
    """A request the runtime refuses or could not answer; ``code`` is its HTTP status (400 bad
    input, 404 unknown model, 503 queue full or model leaving, 500 the batch's predict raised)."""

    def __init__(self, code: int, message: str, *, retry_after_s: float | None = None):
        super().__init__(message)
        self.code, self.message, self.retry_after_s = code, message, retry_after_s


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model to deploy with ``Runtime.deploy`` (built by :func:`model`)."""
    predict: Callable[[Any, dict[str, Any]], Any]
    params: Any
    inputs: dict[str, tuple[str, tuple[int, ...]]]
    name: str
    max_batch: int = 64
    max_delay_ms: float = 0.0
    priority: int = 10
    buckets: tuple[int, ...] = (1, 4, 16, 64)
    max_queue: int = 512           # rows waiting at most; beyond it a request gets 503
    preferred_batch_sizes: tuple[int, ...] = ()  # a batch of one of these rows runs at once (Triton's)
    priority_levels: int = 0       # per-request priority 1 (first) .. priority_levels; 0: one level
    default_priority_level: int = 0  # the level of a request that names none
    version: int = 1               # several versions of a name may be deployed; the highest ready answers

    def datatype(self, input_name: str) -> str:
        """The Open Inference Protocol datatype (``"FP32"``, ...) of input ``input_name``."""
        return OIP_DATATYPES[self.inputs[input_name][0]]


def model(predict: Callable[[Any, dict[str, Any]], Any], params: Any,
          inputs: dict[str, tuple[str, tuple[int, ...]]], *, name: str | None = None,
          max_batch: int = 64, max_delay_ms: float = 0.0, priority: int = 10,
          buckets: tuple[int, ...] | None = None, max_queue: int | None = None,
          preferred_batch_sizes: tuple[int, ...] = (), priority_levels: int = 0,
          default_priority_level: int | None = None, version: int = 1) -> ModelSpec:
    """A model spec for ``Runtime.deploy``: ``predict(params, inputs) -> outputs`` served in batches.

    Args:
      predict: pure JAX over a batch: ``inputs`` is a dict of arrays whose first axis is the
        batch; it returns a dict of arrays (or one array, named ``output``) with the same first
        axis.
      params: the pytree ``predict`` takes first; placed on the device once.
      inputs: ``{name: (dtype, shape)}``, the shape of *one* row (the batch axis is added).
      name: the model's name and route (``/v2/models/{name}``; default: ``predict``'s name).
      max_batch: the most rows one execution takes.
      max_delay_ms: how long the oldest waiting request may wait for others to join its batch
        (Triton's ``max_queue_delay_microseconds``). The default, 0, is Triton's default: the
        batcher does not delay; it runs what is waiting (up to ``max_batch``) as soon as the
        device is free, so requests that arrive while a batch runs form the next one.
      priority: between models, the higher goes first; a due batch always goes before
        training steps (at the next iteration boundary).
      buckets: padded batch sizes compiled ahead (default 1, 4, 16, ``max_batch``).
      max_queue: rows that may wait (default ``8 * max_batch``); more get 503 + Retry-After.
      preferred_batch_sizes: as Triton's dynamic batcher's: when the oldest requests add up to
        one of these row counts, that batch runs at once, without waiting ``max_delay_ms``.
      priority_levels: requests may name a ``priority`` from 1 (first) to this (Triton's
        schedule-policy parameter); within a model, a higher level is taken first, arrival
        order within a level.
      default_priority_level: the level of requests that name none (default: the middle level).
      version: a model name may be deployed at several versions
        (``/v2/models/{name}/versions/{v}``); a request naming no version goes to the highest
        ready one.

    Returns:
      A :class:`ModelSpec`.

    Raises:
      ValueError: a bad name, size, dtype or shape (the message names it and the valid choices).
      TypeError: ``predict`` is not callable.

    Example:
        ```python
        m = rt.deploy(xshare.model(predict, params, inputs={"x": ("float32", (64,))}, name="digits"))
        m.infer({"x": batch})
        ```
    """
    if not callable(predict):
        raise TypeError(f"predict={predict!r} must be callable as predict(params, inputs) -> outputs")
    name = name if name is not None else getattr(predict, "__name__", "model")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(f"model name {name!r} must be 1-128 characters of letters, digits, '_', '.', '-' "
                         "(it is a URL path segment), starting with a letter or digit")
    for label, value, low in (("max_batch", max_batch, 1), ("priority", priority, None)):
        if not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low):
            raise ValueError(f"{label}={value!r} must be an int" + (f" >= {low}" if low is not None else ""))
    if not isinstance(max_delay_ms, (int, float)) or isinstance(max_delay_ms, bool) or max_delay_ms < 0:
        raise ValueError(f"max_delay_ms={max_delay_ms!r} must be a number >= 0 (milliseconds)")
    if not isinstance(inputs, dict) or not inputs:
        raise ValueError(f"inputs={inputs!r} must be a non-empty dict {{name: (dtype, shape)}}, "
                         "e.g. {'x': ('float32', (64,))}")
    norm: dict[str, tuple[str, tuple[int, ...]]] = {}
    for key, decl in inputs.items():
        try:
            dtype, shape = decl
            dtype = str(getattr(dtype, "name", dtype))
            shape = tuple(int(d) for d in shape)
        except (TypeError, ValueError):
            raise ValueError(f"inputs[{key!r}]={decl!r} must be (dtype, shape), e.g. ('float32', (64,))") from None
        if dtype not in OIP_DATATYPES:
            raise ValueError(f"inputs[{key!r}] has dtype {dtype!r}; choose one of {', '.join(OIP_DATATYPES)}")
        if any(d < 1 for d in shape):
            raise ValueError(f"inputs[{key!r}] has shape {shape}; every dimension must be >= 1")
        norm[str(key)] = (dtype, shape)
    if buckets is None:
        buckets = tuple(b for b in (1, 4, 16) if b < max_batch) + (max_batch,)
    buckets = tuple(sorted({int(b) for b in buckets}))
    if not buckets or buckets[0] < 1 or buckets[-1] != max_batch:
        raise ValueError(f"buckets={buckets!r} must be batch sizes >= 1 whose largest is max_batch={max_batch}")
    max_queue = 8 * max_batch if max_queue is None else max_queue
    if not isinstance(max_queue, int) or max_queue < max_batch:
        raise ValueError(f"max_queue={max_queue!r} must be an int >= max_batch={max_batch} (rows that may wait)")
    preferred = tuple(sorted({int(b) for b in preferred_batch_sizes}))
    if any(b < 1 or b > max_batch for b in preferred):
        raise ValueError(f"preferred_batch_sizes={preferred_batch_sizes!r} must be row counts in 1..max_batch={max_batch}")
    if not isinstance(priority_levels, int) or isinstance(priority_levels, bool) or priority_levels < 0:
        raise ValueError(f"priority_levels={priority_levels!r} must be an int >= 0 (0: requests name no priority)")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ValueError(f"version={version!r} must be an int >= 1")
    if default_priority_level is None:
        default_priority_level = (priority_levels + 1) // 2
    if priority_levels and not (isinstance(default_priority_level, int) and 1 <= default_priority_level <= priority_levels):
        raise ValueError(f"default_priority_level={default_priority_level!r} must be in 1..priority_levels={priority_levels}")
    return ModelSpec(predict, params, norm, name, max_batch, float(max_delay_ms), priority, buckets, max_queue,
                     preferred, priority_levels, default_priority_level if priority_levels else 0, version)


__all__ = ["ModelSpec", "model", "InferError", "OIP_DATATYPES"]
