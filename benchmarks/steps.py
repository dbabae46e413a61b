"""The step functions and job builders the benchmarks share.

* ``tiny``: a 16x16 matmul step (a few microseconds of compute): what is left is pure
  dispatch and switching overhead.
* ``mlp``: ``xshare.models.mlp`` (Adam on a 2-hidden-layer MLP); width 256, batch 64 is about
  0.2-0.5 ms per step on one CPU core.

Batches are generated once on the host before timing starts, and a job's data callable just
indexes them, so the measurement excludes data generation (the runtime still ``device_put``s
each batch on its prefetch thread, as it always does).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import xshare
from xshare import ffi

TINY_DIM = 16


@xshare.job(name="tiny")
def tiny_step(state, batch):
    w = state["w"] * 0.99 + 0.01 * jnp.tanh(batch["x"] @ state["w"])
    return {"w": w, "n": state["n"] + 1}, {"loss": jnp.mean(w)}


def tiny_state(seed: int = 0) -> dict[str, Any]:
    w = np.random.default_rng(seed).normal(size=(TINY_DIM, TINY_DIM)).astype(np.float32) / TINY_DIM
    return {"w": jnp.asarray(w), "n": jnp.zeros((), jnp.int32)}


def tiny_batches(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1000 + seed)
    return [{"x": rng.normal(size=(TINY_DIM, TINY_DIM)).astype(np.float32)} for _ in range(n)]


def model_job(model: str, *, steps: int, seed: int = 0, name: str | None = None,
              width: int = 256, batch: int = 64) -> xshare.JobSpec:
    """A job whose data is ``steps`` precomputed host batches (indexing a list: no generation
    cost inside the measured window)."""
    if model == "tiny":
        host = tiny_batches(steps, seed)
        return tiny_step.bind(tiny_state(seed), lambda k, host=host: host[k], steps=steps,
                              name=name or f"tiny-{seed}")
    if model == "mlp":
        from xshare.models import mlp

        spec = mlp.make_job(width=width, batch=batch, steps=steps, seed=seed)
        host = [spec.data(k) for k in range(steps)]
        return spec.replace(data=lambda k, host=host: host[k], name=name or f"mlp-w{width}-{seed}")
    raise ValueError(f"unknown model {model!r}; choose tiny or mlp")


def trainstate_mlps(n: int, *, features: int, width: int, classes: int, activation: Callable,
                    tx: Any, lr: Callable[[int], float], batches: list[dict[str, np.ndarray]],
                    stride: int) -> tuple[Callable, list, list[Callable[[int], Any]]]:
    """``(step, states, data)``: ``n`` Flax Linen ``TrainState``s of one MLP (``features`` ->
    ``width`` -> ``width`` -> ``classes``, ``activation`` after each hidden layer), written as
    users write them: ``tx`` an ``optax.inject_hyperparams`` optimizer, job ``i``'s learning
    rate ``lr(i)`` in its state (one program for all ``n``); the softmax cross-entropy step; job
    ``i``'s batch ``k`` is ``batches[(k + stride * i) % len(batches)]``."""
    import flax.linen as nn
    import optax
    from flax.training import train_state

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = activation(nn.Dense(width)(x))
            x = activation(nn.Dense(width)(x))
            return nn.Dense(classes)(x)

    net = Net()

    def state(i: int) -> Any:
        p = net.init(jax.random.key(i), jnp.ones((1, features)))["params"]
        s = train_state.TrainState.create(apply_fn=net.apply, params=p, tx=tx)
        s.opt_state.hyperparams["learning_rate"] = jnp.asarray(lr(i), jnp.float32)
        return s

    def step(s, b):
        def loss(p):
            return optax.softmax_cross_entropy_with_integer_labels(s.apply_fn({"params": p}, b["x"]), b["y"]).mean()
        value, g = jax.value_and_grad(loss)(s.params)
        return s.apply_gradients(grads=g), {"loss": value}

    return step, [state(i) for i in range(n)], [(lambda k, i=i: batches[(k + stride * i) % len(batches)])
                                                 for i in range(n)]


def device_copy(tree: Any) -> Any:
    """A fresh device copy (a donated loop must not consume the caller's arrays)."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def runtime_accepts(name: str) -> bool:
    return name in inspect.signature(xshare.Runtime.__init__).parameters


def fenced_footprint(spec: xshare.JobSpec, prefetch: int = 2):
    """The footprint the runtime will compute for ``spec`` (fences on: they change XLA's temp)."""
    from xshare.runtime.compiled.compiler import compile_step

    ring = ffi.open_ring(16) if ffi.enabled() else None
    try:
        first = spec.data(0) if callable(spec.data) else next(iter(spec.data))
        return compile_step(spec.fn, spec.state, first, device=jax.devices()[0], name=spec.name,
                            job_id=0, ring_id=ring, prefetch=prefetch).footprint
    finally:
        if ring is not None:
            ffi.close_ring(ring)


def one_lane_kwargs(specs: list[xshare.JobSpec]) -> tuple[dict[str, Any], str]:
    """Runtime arguments that put every job of ``specs`` into ONE lane.

    ``Runtime(max_lanes=1)`` when the runtime has it. Otherwise an arena just too small for a
    second lane: after the first job opens a lane of ``P1 + E1``, the rest must fit beside it
    only as members (``P``) of that lane, never as a new lane (``P + E``). That works for two
    jobs of equal ``E`` (slack ``E/2``); the caller checks the timeline's lanes anyway.
    """
    if runtime_accepts("max_lanes"):
        return {"max_lanes": 1}, "max_lanes=1"
    fps = [fenced_footprint(s) for s in specs]
    e = max(fp.ephemeral for fp in fps)
    mem = sum(fp.resident for fp in fps) + e + min(fp.ephemeral for fp in fps) // 2
    return {"memory": mem}, f"memory={mem} B (one lane fits; Runtime has no max_lanes yet)"
