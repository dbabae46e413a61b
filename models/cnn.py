"""A small ResNet-style CNN (Flax NNX) on CIFAR-shaped synthetic images it generates itself.

The model: a stride-2 3x3 stem (32x32 -> 16x16), ``blocks`` pre-activation residual blocks
(relu, conv, relu, conv, added back), global average pooling and a linear head. No batch norm:
a residual stack this shallow trains without normalisation. The stem's stride keeps a step in the
tens of milliseconds on a 2-core CPU (the convolutions run at 16x16, a quarter of the work of
32x32).

The data: each class owns a fixed smooth colour pattern (a random 8x8x3 field upsampled to
32x32); an image is its class's pattern, cyclically shifted by up to 4 pixels each way, scaled
by a random contrast, plus Gaussian noise. The shift makes it a job for convolutions, the noise
keeps it from being trivial, and loss falls within a few tens of steps. Batch ``k`` depends only
on ``(seed, k)``: any job can be replayed or resumed exactly.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

import xshare

from .common import adam, check_common, check_positive_ints, classification_loss, eval_kwargs, train_job

IMAGE, CHANNELS_IN, CLASSES = 32, 3, 10
MAX_SHIFT = 4
NOISE = 0.7


class ResidualBlock(nnx.Module):
    """``x + conv(relu(conv(relu(x))))``. The second conv starts at zero, so every block begins
    as the identity and a deeper stack trains as easily as a shallow one."""

    def __init__(self, channels: int, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(channels, channels, (3, 3), padding="SAME", rngs=rngs)
        self.conv2 = nnx.Conv(channels, channels, (3, 3), padding="SAME", rngs=rngs,
                              kernel_init=nnx.initializers.zeros_init())

    def __call__(self, x):
        return x + self.conv2(nnx.relu(self.conv1(nnx.relu(x))))


class ResNet(nnx.Module):
    def __init__(self, channels: int, blocks: int, *, rngs: nnx.Rngs):
        self.stem = nnx.Conv(CHANNELS_IN, channels, (3, 3), strides=(2, 2), padding="SAME", rngs=rngs)
        self.blocks = nnx.List([ResidualBlock(channels, rngs=rngs) for _ in range(blocks)])
        self.head = nnx.Linear(channels, CLASSES, rngs=rngs)

    def __call__(self, x):                       # x: (batch, 32, 32, 3) float32
        x = self.stem(x)                         # (batch, 16, 16, channels)
        for block in self.blocks:
            x = block(x)
        x = nnx.relu(x).mean(axis=(1, 2))        # global average pool
        return self.head(x)


class PatternData:
    """``step -> {"x": (batch, 32, 32, 3) float32, "y": (batch,) int32}``, deterministic."""

    def __init__(self, batch: int, seed: int):
        rng = np.random.default_rng(20_000 + seed)
        coarse = rng.normal(size=(CLASSES, 8, 8, CHANNELS_IN)).astype(np.float32)
        # Nearest-neighbour upsampling 8 -> 32, then a 3x3 box blur (cyclic) to smooth the edges.
        fine = coarse.repeat(4, axis=1).repeat(4, axis=2)
        fine = sum(np.roll(fine, (dy, dx), axis=(1, 2)) for dy in (-1, 0, 1) for dx in (-1, 0, 1)) / 9.0
        self.patterns = (fine / fine.std(axis=(1, 2, 3), keepdims=True)).astype(np.float32)
        self.batch, self.seed = batch, seed

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng((self.seed, step))
        y = rng.integers(0, CLASSES, size=self.batch).astype(np.int32)
        shifts = rng.integers(-MAX_SHIFT, MAX_SHIFT + 1, size=(self.batch, 2))
        contrast = rng.uniform(0.5, 1.0, size=(self.batch, 1, 1, 1)).astype(np.float32)
        # A cyclic shift by (dy, dx) as one gather: pixel (i, j) of the image is pixel
        # (i - dy, j - dx) of the pattern, modulo the image size.
        pos = np.arange(IMAGE)
        rows = (pos[None, :] - shifts[:, :1]) % IMAGE                  # (batch, 32)
        cols = (pos[None, :] - shifts[:, 1:]) % IMAGE
        x = self.patterns[y[:, None, None], rows[:, :, None], cols[:, None, :]]
        x = contrast * x + NOISE * rng.standard_normal(size=x.shape, dtype=np.float32)
        return {"x": x.astype(np.float32), "y": y}


def make_job(lr: float = 1e-3, channels: int = 16, blocks: int = 2, batch: int = 32, steps: int = 100,
             seed: int = 0, name: str | None = None,
             eval_every: int | None = None) -> xshare.JobSpec:
    """A bound CNN training job: Adam(lr) on a ResNet of ``blocks`` residual blocks, ``channels`` wide."""
    check_common("cnn", lr=lr, seed=seed, steps=steps, name=name)
    check_positive_ints("cnn", channels=channels, blocks=blocks, batch=batch)
    model = ResNet(channels, blocks, rngs=nnx.Rngs(seed))

    step = train_job(classification_loss, name="cnn")
    data = PatternData(batch, seed)
    return step.bind((model, adam(model, lr)), data, steps=steps,
                     **eval_kwargs(classification_loss, data, eval_every, name="cnn"),
                     name=name or f"cnn-c{channels}-s{seed}",
                     meta={"model": "cnn", "lr": lr, "channels": channels, "blocks": blocks, "batch": batch,
                           "seed": seed})
