"""Small deterministic jobs and the plain-loop reference every equivalence test compares to."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import xshare


@xshare.job
def linreg_step(state, batch):
    """A tiny regression step: cheap to compile, exact on CPU."""
    def loss_fn(w):
        return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)

    loss, g = jax.value_and_grad(loss_fn)(state["w"])
    return {"w": state["w"] - 0.05 * g, "n": state["n"] + 1}, {"loss": loss}


def linreg_state(dim: int = 8, seed: int = 0):
    return {"w": jnp.asarray(np.random.default_rng(seed).normal(size=(dim, 1)), jnp.float32),
            "n": jnp.zeros((), jnp.int32)}


def linreg_data(dim: int = 8, batch: int = 16, seed: int = 0):
    true_w = np.random.default_rng(1000 + seed).normal(size=(dim, 1)).astype(np.float32)

    def data(step: int):
        x = np.random.default_rng((seed, step)).normal(size=(batch, dim)).astype(np.float32)
        return {"x": x, "y": (x @ true_w).astype(np.float32)}

    return data


def plain_loop(spec: xshare.JobSpec, steps: int | None = None):
    """The reference: the same step, jitted with donation, in a plain Python loop."""
    state = jax.tree.map(lambda x: jnp.array(x, copy=True), spec.state)
    step = jax.jit(spec.fn, donate_argnums=(0,))
    data = spec.data if callable(spec.data) else None
    it = None if data else iter(spec.data)
    metrics = None
    for k in range(steps if steps is not None else spec.steps):
        batch = data(k) if data else next(it)
        state, metrics = step(state, batch)
    return jax.device_get(state), jax.device_get(metrics)


def assert_trees_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@xshare.job
def heavy_step(state, batch):
    """A step of a few milliseconds on CPU: long enough that scheduling latencies are small
    next to it (used where a test counts steps around an event)."""
    h = batch["x"]
    for _ in range(4):
        h = jnp.tanh(h @ state["w"])
    loss = jnp.mean(h ** 2)
    return {"w": state["w"] * 0.999 + 1e-4 * (h.T @ h), "n": state["n"] + 1}, {"loss": loss}


def heavy_state(dim: int = 256, seed: int = 0):
    w = np.random.default_rng(seed).normal(size=(dim, dim)).astype(np.float32) / np.sqrt(dim)
    return {"w": jnp.asarray(w), "n": jnp.zeros((), jnp.int32)}


def heavy_data(dim: int = 256, batch: int = 256, seed: int = 0):
    def data(step: int):
        return {"x": np.random.default_rng((seed, step)).normal(size=(batch, dim)).astype(np.float32)}

    return data


LR_RANGE = "lr = { low = 1e-3, high = 3e-2, log = true }"


def digits_study(*, memory: str, steps: int, eval_every: int, trials: int, concurrency: int,
                 search: str = LR_RANGE, tune: str = "") -> str:
    """An ``xshare tune`` spec: xshare.models.digits (batch 32, width 16) searched with a seeded
    random sampler for the highest eval/accuracy; ``tune``: more lines of its [tune] table."""
    return f'''
[runtime]
memory = "{memory}"

[[job]]
entry = "xshare.models.digits:make_job"
steps = {steps}
params = {{ batch = 32, eval_every = {eval_every}, width = 16 }}

[search]
{search}

[tune]
trials = {trials}
metric = "eval/accuracy"
direction = "maximize"
sampler = "random"
seed = 0
concurrency = {concurrency}
{tune}
'''


def sigint_as_in_a_terminal() -> None:
    """``preexec_fn`` for a child that a test interrupts with SIGINT: Ctrl-C's default, as in a
    terminal. A shell starts a background job (``pytest ... &``) with SIGINT ignored, its
    children inherit that, and Python then installs no KeyboardInterrupt handler at all."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_until_k_steps(k, make, **kw):
    """Run ``make()`` in a fresh Runtime(**kw) until a run had calls of ``k`` steps (the first
    compiles the K-step program in the background; a later one checks and adopts it). At most
    three runs; returns the last run's handle."""
    root = kw.pop("log_root", None)
    for i in range(3):
        if root is not None:  # each run its own run directory (a job's rows append to its file)
            kw["log_dir"] = root / f"run{i}"
        with xshare.Runtime(**kw) as rt:
            handle = rt.submit(make())
            rt.wait()
            rt._tier_pool.shutdown(wait=True)  # (close does not wait for background compiles)
        if handle._rec.tier is not None and handle._rec.tier.steps_at.get(k):
            break
    return handle


def loss_recorders(n: int) -> tuple[dict[int, list], Callable[[int], Callable]]:
    """``(seen, observer)`` for ``n`` jobs: ``observer(i)`` is job ``i``'s observer, which
    appends ``(step, loss)`` to ``seen[i]`` for every step it is told of."""
    seen: dict[int, list] = {i: [] for i in range(n)}

    def observer(i: int):
        def record(step, metrics, t_done):
            seen[i].append((step, np.asarray(metrics["loss"])))
        return record

    return seen, observer
