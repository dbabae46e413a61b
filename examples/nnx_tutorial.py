"""The Flax NNX MNIST tutorial's CNN and train step, run as xshare jobs.

The model and step are the tutorial's (``docs_nnx/mnist_tutorial``: two convolutions with batch
norm and dropout, average pooling, two linear layers; ``nnx.Optimizer`` over optax's AdamW), with
one change: the step returns its metrics instead of updating an ``nnx.MultiMetric``, so each
step's loss and accuracy show in ``metrics.jsonl`` and ``xshare top``. The images are
scikit-learn's 8x8 handwritten digits when scikit-learn is installed (it ships them: no
download), else synthetic digit-like images this script makes. A few learning rates train side
by side in one Runtime, each job its own model:

    python examples/nnx_tutorial.py --steps 300 --lrs 0.005 0.002 0.001 --fuse
"""

from __future__ import annotations

import argparse
from functools import partial

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import xshare

IMAGE, CLASSES = 8, 10


class CNN(nnx.Module):
    """A simple CNN model (the tutorial's, sized by ``IMAGE``)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025, rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear((IMAGE // 4) ** 2 * 64, 256, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.025, rngs=rngs)
        self.linear2 = nnx.Linear(256, CLASSES, rngs=rngs)

    def __call__(self, x):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x)))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)  # flatten
        x = nnx.relu(self.dropout2(self.linear1(x)))
        return self.linear2(x)


def loss_fn(model: CNN, batch):
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch["label"]).mean()
    return loss, logits


@xshare.nnx.job
def train_step(model: CNN, optimizer: nnx.Optimizer, batch):
    """Train for a single step (the tutorial's, returning its metrics)."""
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch)
    optimizer.update(model, grads)  # In-place updates.
    return {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"])}


def digits(seed: int = 0) -> tuple[dict, dict]:
    """(train, test) arrays: images (n, 8, 8, 1) float32 in [0, 1], labels (n,) int32."""
    try:
        from sklearn.datasets import load_digits
        d = load_digits()
        images, labels = (d.images / 16.0).astype(np.float32), d.target.astype(np.int32)
    except ImportError:  # no scikit-learn: noisy strokes, one fixed pattern per class
        rng = np.random.default_rng(1234)
        patterns = (rng.random((CLASSES, IMAGE, IMAGE)) > 0.6).astype(np.float32)
        labels = rng.integers(0, CLASSES, 1800).astype(np.int32)
        images = np.clip(patterns[labels] + 0.3 * rng.normal(size=(1800, IMAGE, IMAGE)), 0, 1)
        images = images.astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(labels))
    images, labels = images[order, :, :, None], labels[order]
    cut = int(0.8 * len(labels))
    return ({"image": images[:cut], "label": labels[:cut]}, {"image": images[cut:], "label": labels[cut:]})


class Batches:
    """``step -> batch``: ``batch_size`` training examples drawn by ``(seed, step)``, so a job is
    reproducible and resumes exactly."""

    def __init__(self, train: dict, batch_size: int, seed: int):
        self.train, self.batch_size, self.seed = train, batch_size, seed

    def __call__(self, step: int) -> dict:
        idx = np.random.default_rng((self.seed, step)).integers(0, len(self.train["label"]), self.batch_size)
        return {"image": self.train["image"][idx], "label": self.train["label"][idx]}


def make_objects(lr: float, seed: int = 0, momentum: float = 0.9) -> tuple[CNN, nnx.Optimizer]:
    model = CNN(rngs=nnx.Rngs(seed))
    return model, nnx.Optimizer(model, optax.adamw(lr, momentum), wrt=nnx.Param)


def test_accuracy(model: CNN, test: dict) -> float:
    model.eval()  # running batch statistics, no dropout
    logits = model(test["image"])
    return float(jnp.mean(jnp.argmax(logits, -1) == test["label"]))


def main(steps: int = 300, lrs: tuple[float, ...] = (0.005, 0.002), batch_size: int = 32,
         fuse: bool = False, seed: int = 0) -> list[dict]:
    train, test = digits(seed)
    specs = [train_step.bind(make_objects(lr, seed), Batches(train, batch_size, seed), steps=steps,
                             name=f"cnn-lr{lr}") for lr in lrs]
    with xshare.Runtime(policy="pack", fuse=fuse) as rt:
        handles = rt.submit_many(specs)
        rt.wait()
    rows = []
    for lr, h in zip(lrs, handles):
        (model, optimizer), metrics = h.result()
        rows.append({"lr": lr, "steps": int(optimizer.step[...]), "train_loss": metrics["loss"],
                     "test_accuracy": test_accuracy(model, test)})
        print(f"{h.name}: {rows[-1]['steps']} steps, train loss {metrics['loss']:.3f}, "
              f"test accuracy {rows[-1]['test_accuracy']:.3f}")
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lrs", type=float, nargs="+", default=[0.005, 0.002])
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--fuse", action="store_true", help="run the jobs as one fused (vmapped) group")
    a = p.parse_args()
    main(a.steps, tuple(a.lrs), a.batch_size, a.fuse)
