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

# Used to rank jobs (SRTF) before their first measured step, and only until the runtime has
# measured any job: then the FLOP rate achieved by measured jobs replaces it, so a new job is
# estimated on the same scale as the running ones it competes with.
ASSUMED_FLOPS_PER_S = 2e10


@dataclass(frozen=True)
class CompiledStep:
    executable: Any                 # jax.stages.Compiled: (state leaves, batch leaves) ->
                                    #   (new state leaves, packed metrics vector)
    footprint: Footprint
    metric_names: tuple[str, ...]   # the packed metrics vector's entries, in order
    flops: float | None             # per step, from cost_analysis(); None when unknown
    state_struct: Any               # pytree of ShapeDtypeStruct of the state and the batch
    batch_struct: Any
    fenced: bool
    state_def: Any                  # treedefs to rebuild the user's pytrees from flat leaves
    batch_def: Any

    def step_time_estimate_s(self, flops_per_s: float | None = None) -> float:
        """Seconds per step from ``cost_analysis()`` FLOPs at ``flops_per_s`` (the rate the
        runtime measured on jobs that already ran, else a generic guess)."""
        if self.flops and self.flops > 0:
            return max(self.flops / (flops_per_s or ASSUMED_FLOPS_PER_S), 1e-6)
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
    state_struct, batch_struct = abstract(state, device), abstract(batch, device)
    state_leaves, state_def = jax.tree.flatten(state_struct)
    batch_leaves, batch_def = jax.tree.flatten(batch_struct)
    names: list[tuple[str, ...]] = []
    flat = _flat_step(fn, state_def, batch_def, names, name)
    body = ffi.fenced(flat, ring_id=ring_id, job_id=job_id) if fenced else flat
    with warnings.catch_warnings():
        # The batch is donated for the fences' sake; when no output can reuse it XLA says so
        # once per compile, which is expected here and not actionable by the user.
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        compiled = jax.jit(body, donate_argnums=(0, 1)).lower(state_leaves, batch_leaves).compile()
    footprint = footprint_from_analysis(
        compiled.memory_analysis(), state_bytes=tree_nbytes(state_struct),
        batch_bytes=tree_nbytes(batch_struct), prefetch=prefetch, job=name)
    return CompiledStep(compiled, footprint, names[0], _flops(compiled), state_struct, batch_struct,
                        fenced, state_def, batch_def)


def _flat_step(fn: Callable, state_def: Any, batch_def: Any, names: list, job: str) -> Callable:
    """``fn`` over flat lists of leaves, with its metrics packed into one float32 vector.

    Why flat: a call walks its argument pytrees on the host, and model states with custom nodes
    (Flax NNX variables) make that walk cost more than a small step's compute. The runtime
    keeps every job's state as a flat list, so each dispatch passes plain lists of arrays.
    Why packed: the runtime reads every step's metrics, and one small array costs one
    transfer where a dict of scalars costs one per leaf. Neither changes what the state is:
    the same ops run on the same values.
    """
    import jax.numpy as jnp

    def step(state_leaves, batch_leaves):
        state = jax.tree.unflatten(state_def, state_leaves)
        batch = jax.tree.unflatten(batch_def, batch_leaves)
        new_state, metrics = fn(state, batch)
        new_leaves, new_def = jax.tree.flatten(new_state)
        if new_def != state_def:
            raise TypeError(f"job {job!r}: the step must return a new state with the structure of "
                            f"the state it was given; got {new_def}, expected {state_def}")
        flat, _ = jax.tree_util.tree_flatten_with_path(metrics)
        names.append(tuple(_key(path) or "value" for path, _ in flat))
        values = [jnp.mean(jnp.asarray(v)).astype(jnp.float32) for _, v in flat]
        return new_leaves, (jnp.stack(values) if values else jnp.zeros((0,), jnp.float32))

    return step


def _key(path: Any) -> str:
    return "/".join(str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path)


def _flops(compiled: Any) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # not every backend implements it
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    flops = (cost or {}).get("flops")
    return float(flops) if flops and flops > 0 else None
