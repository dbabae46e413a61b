"""An MLP classifier (Flax NNX) on synthetic data it generates itself.

The data: inputs are uniform with unit variance, labels come from a fixed random two-layer
"teacher" network, so the task is learnable and loss falls. Batch ``k`` depends only on
``(seed, k)``: any job can be replayed or resumed exactly, and two runs see identical data.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

import xshare

from .common import adam, check_common, check_positive_ints, classification_loss, eval_kwargs, train_job

IN_DIM, CLASSES = 32, 10


class MLP(nnx.Module):
    def __init__(self, width: int, depth: int, *, rngs: nnx.Rngs):
        dims = [IN_DIM] + [width] * depth
        self.hidden = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(dims[:-1], dims[1:])])
        self.out = nnx.Linear(dims[-1], CLASSES, rngs=rngs)

    def __call__(self, x):
        for layer in self.hidden:
            x = nnx.relu(layer(x))
        return self.out(x)


class TeacherData:
    """``step -> {"x", "y"}``: deterministic synthetic classification batches.

    Batches are made ``BLOCK`` steps at a time (one generator and one teacher pass per block,
    the last block kept): a batch costs ~25 us instead of ~45 us one at a time, which matters
    because a small fused sweep spends as long making its data as computing its steps. Batch
    ``k`` depends only on ``(seed, k)``: any step can be replayed or resumed exactly.
    """

    BLOCK = 16

    def __init__(self, batch: int, seed: int):
        rng = np.random.default_rng(10_000 + seed)
        self.w1 = rng.normal(size=(IN_DIM, 64)).astype(np.float32) / np.sqrt(IN_DIM)
        self.w2 = rng.normal(size=(64, CLASSES)).astype(np.float32) / 8.0
        self.batch, self.seed = batch, seed
        self._block, self._x, self._y = -1, None, None

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        block, i = divmod(int(step), self.BLOCK)
        if block != self._block:
            rng = np.random.default_rng((self.seed, block))
            # Uniform on [-sqrt(3), sqrt(3)] (zero mean, unit variance): numpy draws uniform
            # floats ~4x faster than Gaussian ones, and the teacher's labels are as learnable.
            x = rng.random(size=(self.BLOCK, self.batch, IN_DIM), dtype=np.float32)
            x = (x - np.float32(0.5)) * np.float32(2 * np.sqrt(3.0))
            # A stack of per-batch products, not one (BLOCK*batch)-row product: OpenBLAS runs
            # products that large on all its threads, which then spin against the step's own
            # compute on a small machine.
            y = np.argmax(np.tanh(x @ self.w1) @ self.w2, axis=-1).astype(np.int32)
            self._block, self._x, self._y = block, x, y
        # Copies: a caller may keep or modify a batch, and the block is reused for the next.
        return {"x": self._x[i].copy(), "y": self._y[i].copy()}


def make_job(lr: float = 1e-3, width: int = 128, depth: int = 2, batch: int = 64, steps: int = 200,
             seed: int = 0, name: str | None = None,
             eval_every: int | None = None) -> xshare.JobSpec:
    """A bound MLP training job: Adam(lr) on ``depth`` hidden layers of ``width`` units."""
    check_common("mlp", lr=lr, seed=seed, steps=steps, name=name)
    check_positive_ints("mlp", width=width, depth=depth, batch=batch)
    model = MLP(width, depth, rngs=nnx.Rngs(seed))

    step = train_job(classification_loss, name="mlp")
    data = TeacherData(batch, seed)
    return step.bind((model, adam(model, lr)), data, steps=steps,
                     **eval_kwargs(classification_loss, data, eval_every, name="mlp"),
                     name=name or f"mlp-w{width}-s{seed}",
                     meta={"model": "mlp", "lr": lr, "width": width, "depth": depth, "batch": batch,
                           "seed": seed})
