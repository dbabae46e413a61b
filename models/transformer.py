"""A small character-level Transformer language model (Flax NNX) on a corpus shipped in the repo.

The model: token embedding plus a learned position embedding, ``layers`` pre-LayerNorm blocks
(causal multi-head self-attention, then a 4x GELU MLP, each added back to the residual stream),
a final LayerNorm and a linear head over the characters. The attention is written out with
``einsum`` rather than ``nnx.MultiHeadAttention`` so the model holds parameters only (no RNG
streams or decode caches).

The data: ``models/corpus.txt`` (about 25 KB of original prose written for this repo, in the
public domain), read with ``importlib.resources`` so it works from an installed package. The
vocabulary is the corpus's distinct characters. Batch ``k`` is ``batch`` windows of ``seq + 1``
characters at offsets drawn from ``(seed, k)``: inputs are the first ``seq``, targets the last.
"""

from __future__ import annotations

import functools
import importlib.resources
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import xshare

from .common import HyperparameterError, adam, check_common, check_positive_ints, eval_kwargs, train_job

CORPUS = "corpus.txt"


@functools.lru_cache(maxsize=None)
def corpus() -> tuple[str, np.ndarray]:
    """(the vocabulary as a string of distinct characters, the corpus as int32 token ids)."""
    text = importlib.resources.files(__package__).joinpath(CORPUS).read_text(encoding="utf-8")
    vocab = "".join(sorted(set(text)))
    lookup = {c: i for i, c in enumerate(vocab)}
    ids = np.fromiter((lookup[c] for c in text), dtype=np.int32, count=len(text))
    ids.setflags(write=False)
    return vocab, ids


class CausalSelfAttention(nnx.Module):
    def __init__(self, d_model: int, heads: int, *, rngs: nnx.Rngs):
        self.heads = heads
        self.qkv = nnx.Linear(d_model, 3 * d_model, rngs=rngs)
        self.out = nnx.Linear(d_model, d_model, rngs=rngs)

    def __call__(self, x):                                  # x: (batch, time, d_model)
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
        q, k, v = (a.reshape(b, t, self.heads, d // self.heads) for a in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // self.heads)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return self.out(y.reshape(b, t, d))


class Block(nnx.Module):
    def __init__(self, d_model: int, heads: int, *, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
        self.attn = CausalSelfAttention(d_model, heads, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
        self.up = nnx.Linear(d_model, 4 * d_model, rngs=rngs)
        self.down = nnx.Linear(4 * d_model, d_model, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class CharTransformer(nnx.Module):
    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, seq: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d_model, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq, d_model)))
        self.blocks = nnx.List([Block(d_model, heads, rngs=rngs) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab, rngs=rngs)

    def __call__(self, tokens):                             # tokens: (batch, time) int32
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))                      # (batch, time, vocab) logits


class WindowData:
    """``step -> {"x": (batch, seq) int32, "y": (batch, seq) int32}``: random corpus windows,
    ``y`` shifted one character ahead of ``x``. Deterministic in ``(seed, step)``."""

    def __init__(self, batch: int, seq: int, seed: int):
        self.ids = corpus()[1]
        if len(self.ids) < seq + 2:
            raise ValueError(f"transformer: seq={seq} is longer than the corpus ({len(self.ids)} characters)")
        self.batch, self.seq, self.seed = batch, seq, seed

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng((self.seed, step))
        starts = rng.integers(0, len(self.ids) - self.seq, size=self.batch)
        windows = self.ids[starts[:, None] + np.arange(self.seq + 1)]   # (batch, seq + 1)
        return {"x": np.ascontiguousarray(windows[:, :-1]), "y": np.ascontiguousarray(windows[:, 1:])}


def _lm_loss(model: nnx.Module, batch: dict) -> tuple:
    """Next-character cross-entropy, and the same in bits per character. (Module level, not a
    closure per job: jobs of one shape then share one step function and one trace.)"""
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"bits_per_char": loss / math.log(2)}


def make_job(lr: float = 3e-3, d_model: int = 64, layers: int = 2, heads: int = 4, seq: int = 64,
             batch: int = 16, steps: int = 100, seed: int = 0, name: str | None = None,
             eval_every: int | None = None) -> xshare.JobSpec:
    """A bound char-LM training job: Adam(lr) on a ``layers``-block, ``d_model``-wide Transformer."""
    check_common("transformer", lr=lr, seed=seed, steps=steps, name=name)
    check_positive_ints("transformer", d_model=d_model, layers=layers, heads=heads, seq=seq, batch=batch)
    if d_model % heads:
        raise HyperparameterError(f"transformer: d_model={d_model} must be a multiple of heads={heads}")
    vocab = corpus()[0]
    data = WindowData(batch, seq, seed)
    model = CharTransformer(len(vocab), d_model, layers, heads, seq, rngs=nnx.Rngs(seed))

    step = train_job(_lm_loss, name="transformer")
    return step.bind((model, adam(model, lr)), data, steps=steps,
                     **eval_kwargs(_lm_loss, data, eval_every, name="transformer"),
                     name=name or f"transformer-d{d_model}-s{seed}",
                     meta={"model": "transformer", "lr": lr, "d_model": d_model, "layers": layers,
                           "heads": heads, "seq": seq, "batch": batch, "seed": seed,
                           "vocab": len(vocab)})
