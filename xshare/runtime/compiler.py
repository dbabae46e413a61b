"""Ahead-of-time compilation of a job's step: donated state and batch, FFI fences, footprint.

Compiling before admission is what lets the runtime place a job from XLA's exact figures
instead of a profile run: ``memory_analysis()`` of the donated executable is the footprint.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np

from .. import ffi
from ..memory.footprint import Footprint, footprint_from_analysis

# Only used to rank jobs (SRTF) before their first measured step: a rough CPU core's rate.
# Measured device time replaces it after one step, so its accuracy does not matter much.
ASSUMED_FLOPS_PER_S = 2e10


@dataclass(frozen=True)
class CompiledStep:
    executable: Any                 # jax.stages.Compiled: (state, batch) -> (state, metrics)
    footprint: Footprint
    flops: float | None             # per step, from cost_analysis(); None when unknown
    state_struct: Any               # pytree of ShapeDtypeStruct the executable accepts
    batch_struct: Any
    fenced: bool

    @property
    def step_time_estimate_s(self) -> float:
        if self.flops and self.flops > 0:
            return max(self.flops / ASSUMED_FLOPS_PER_S, 1e-6)
        return 1e-3


def tree_nbytes(tree: Any) -> int:
    return int(sum(np.dtype(x.dtype).itemsize * math.prod(x.shape) for x in jax.tree.leaves(tree)))


def abstract(tree: Any, device: Any) -> Any:
    """Shape/dtype/placement of every leaf, without touching its data."""
    sharding = jax.sharding.SingleDeviceSharding(device)

    def one(x: Any) -> jax.ShapeDtypeStruct:
        x = x if hasattr(x, "shape") and hasattr(x, "dtype") else np.asarray(x)
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)

    return jax.tree.map(one, tree)


def compile_step(fn: Callable, state: Any, batch: Any, *, device: Any, name: str, job_id: int,
                 ring_id: int | None, prefetch: int) -> CompiledStep:
    """Lower and compile ``fn(state, batch)`` with both arguments donated.

    The batch is donated too: the runtime owns every batch it prefetched, and donating it makes
    the begin fence's aliasing zero-copy for all inputs.
    """
    fenced = ring_id is not None
    body = ffi.fenced(fn, ring_id=ring_id, job_id=job_id) if fenced else fn
    state_struct, batch_struct = abstract(state, device), abstract(batch, device)
    with warnings.catch_warnings():
        # The batch is donated for the fences' sake; when no output can reuse it XLA says so
        # once per compile, which is expected here and not actionable by the user.
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        compiled = jax.jit(body, donate_argnums=(0, 1)).lower(state_struct, batch_struct).compile()
    footprint = footprint_from_analysis(
        compiled.memory_analysis(), state_bytes=tree_nbytes(state_struct),
        batch_bytes=tree_nbytes(batch_struct), prefetch=prefetch, job=name)
    return CompiledStep(compiled, footprint, _flops(compiled), state_struct, batch_struct, fenced)


def _flops(compiled: Any) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # not every backend implements it
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    flops = (cost or {}).get("flops")
    return float(flops) if flops and flops > 0 else None
