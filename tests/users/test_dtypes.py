"""(e) A state of int32 counters, a bool flag and bf16 parameters, fed uint8 batches:
bit-identical (dtypes kept) to the same step under ``jax.jit``, under every policy, fused, and
resumed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import xshare
from tests.helpers import plain_loop
from tests.users import harness


def state(seed: int):
    w = np.random.default_rng(seed).normal(size=(8, 4)) / 3
    return {"w": jnp.asarray(w, jnp.bfloat16), "steps": jnp.zeros((), jnp.int32),
            "pixels": jnp.zeros((4,), jnp.int32), "saturated": jnp.zeros((), bool)}


def data(seed: int):
    def batch(step: int):
        rng = np.random.default_rng((seed, step))
        return {"x": rng.integers(0, 256, size=(16, 8), dtype=np.uint8),
                "y": rng.normal(size=(16, 4)).astype(np.float32)}

    return batch


@xshare.job
def train_step(state, batch):
    x = batch["x"].astype(jnp.bfloat16) / 255

    def loss_fn(w):
        return jnp.mean(((x @ w).astype(jnp.float32) - batch["y"]) ** 2)

    loss, g = jax.value_and_grad(loss_fn)(state["w"])
    return {"w": state["w"] - jnp.bfloat16(0.1) * g,
            "steps": state["steps"] + 1,
            "pixels": state["pixels"] + jnp.sum(batch["x"].reshape(4, -1), axis=1, dtype=jnp.int32),
            "saturated": state["saturated"] | jnp.any(batch["x"] == 255)}, {"loss": loss}


def spec(seed: int, steps: int = harness.STEPS, batches=None) -> xshare.JobSpec:
    return train_step.bind(state(seed), batches or data(seed), steps=steps, name=f"dt{seed}")


def reference(seed: int, steps: int = harness.STEPS):
    return plain_loop(spec(seed, steps))[0]


def test_the_reference_keeps_its_dtypes_and_counts():
    ref = reference(0)
    assert {k: str(v.dtype) for k, v in ref.items()} == \
        {"w": "bfloat16", "steps": "int32", "pixels": "int32", "saturated": "bool"}
    assert int(ref["steps"]) == harness.STEPS
    want = sum(data(0)(k)["x"].reshape(4, -1).sum(axis=1, dtype=np.int64) for k in range(harness.STEPS))
    np.testing.assert_array_equal(ref["pixels"], want)


class TestUnderTheRuntime(harness.Checks):
    spec, reference, data = staticmethod(spec), staticmethod(reference), staticmethod(data)
    fused_tolerance = 1e-2  # bfloat16 weights: vmap's reordered reductions show
