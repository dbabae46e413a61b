"""The canary child's work: a few fenced steps on the device, and the check of what the
fences recorded. Runs in the child process that ``xshare.ffi.canary`` starts (and in
``xshare doctor --selftest``, once a child has survived it), never first in a runtime's own.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Sequence

FAULT_ENV = "XSHARE_CANARY_FAULT"
STEPS = 4

# CUDA fence times are host times through an anchor event (fences_cuda.cc), known to within
# a few microseconds; CPU fences read the host's clock itself.
CLOCK_SLACK_NS = {"cpu": 0, "gpu": 100_000, "cuda": 100_000}


def check_records(records: Any, walls: Sequence[tuple[int, int]], job: int,
                  slack_ns: int = 0) -> list[str]:
    """What is wrong with the fence records of one job's ``len(walls)`` steps (empty: nothing).

    ``records``: RECORD_DTYPE rows drained from the ring; ``walls``: each step's host interval
    ``(t0, t1)`` on the fences' clock, ``t0`` before the call and ``t1`` after its results
    were ready. Expected: exactly one begin then one end per step, in sequence order, with
    timestamps that never go back and lie within the step's interval (widened by
    ``slack_ns`` each side, for a device clock mapped onto the host's).
    """
    from ._loader import BEGIN, END

    rows = sorted((int(r["seq"]), int(r["t_ns"]), int(r["job"]), int(r["kind"])) for r in records)
    rows = [r for r in rows if r[2] == job]
    problems = []
    want = [k for _ in walls for k in (BEGIN, END)]
    got = [r[3] for r in rows]
    if got != want:
        names = {BEGIN: "begin", END: "end"}
        problems.append(f"expected {len(walls)} x (begin, end) records, got "
                        f"[{', '.join(names.get(k, str(k)) for k in got)}]")
        return problems
    times = [r[1] for r in rows]
    back = [i for i in range(1, len(times)) if times[i] < times[i - 1] - slack_ns]
    if back:
        problems.append(f"timestamps go back at record {back[0]} "
                        f"({times[back[0] - 1]} ns then {times[back[0]]} ns)")
    for k, (t0, t1) in enumerate(walls):
        b, e = times[2 * k], times[2 * k + 1]
        if not (t0 - slack_ns <= b <= e <= t1 + slack_ns):
            problems.append(f"step {k}: begin {b - t0} ns / end {e - t0} ns after the call, "
                            f"outside its wall time of {t1 - t0} ns")
    return problems


def _step(state, batch):
    import jax
    import jax.numpy as jnp

    def loss(w):
        return jnp.mean((jnp.tanh(batch["x"] @ w["a"]) @ w["b"] - batch["y"]) ** 2)

    value, g = jax.value_and_grad(loss)(state)
    return jax.tree.map(lambda p, d: p - 0.1 * d, state, g), {"loss": value}


def _inputs(k: int):
    import numpy as np

    rng = np.random.default_rng(k)
    state = {"a": rng.normal(size=(16, 32)).astype(np.float32) / 4,
             "b": rng.normal(size=(32, 4)).astype(np.float32) / 6}
    batch = {"x": rng.normal(size=(8, 16)).astype(np.float32),
             "y": rng.normal(size=(8, 4)).astype(np.float32)}
    return state, batch


def run_canary(platform: str, steps: int = STEPS) -> tuple[bool, str]:
    """The child's work: ``steps`` fenced steps on the first ``platform`` device, checked.
    Returns (ok, reason). Run it in a child process (``main``), never in a runtime's own."""
    import jax
    import numpy as np

    from . import _loader, _rings
    from ._fences import fenced

    fault = os.environ.get(FAULT_ENV, "")
    device = jax.devices(platform)[0]
    if not _loader.ensure_loaded():
        return False, f"fence library unavailable: {_loader.unavailable_reason()}"
    if fault == "abort":  # a crash inside device code, as a bad handler would cause
        os.abort()
    if fault == "exit":
        sys.exit(3)
    if fault == "hang":
        time.sleep(10**6)
    ring = _rings.open_ring(256)
    job = 7
    try:
        ident = jax.device_put(_rings.ident(ring, job, 0), device)
        run = jax.jit(fenced(_step, donated=True), donate_argnums=(0,))
        plain = jax.jit(_step)
        state0, _ = _inputs(0)
        state = jax.device_put(state0, device)
        ref = jax.device_put(state0, device)
        walls = []
        for k in range(steps):
            _, batch = _inputs(k + 1)
            t0 = _rings.now_ns()
            state, metrics = run(state, jax.device_put(batch, device), ident)
            jax.block_until_ready((state, metrics))
            walls.append((t0, _rings.now_ns()))
            ref, _ = plain(ref, jax.device_put(batch, device))
        same = all(np.array_equal(np.asarray(a), np.asarray(b))
                   for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref)))
        records = _rings.drain(ring)
        deadline = time.monotonic() + 10
        while len(records) < 2 * steps and time.monotonic() < deadline:
            time.sleep(0.01)  # CUDA: events are read back after the device passed them
            more = _rings.drain(ring)
            records = np.concatenate([records, more]) if len(more) else records
        if fault == "records":
            records = records[1:]
        problems = check_records(records, walls, job, CLOCK_SLACK_NS.get(platform, 100_000))
        if not same:
            problems.append("the fenced step's results differ from the unfenced step's")
    finally:
        _rings.close_ring(ring)
    if problems:
        return False, f"{device.device_kind}: " + "; ".join(problems)
    return True, (f"passed on {device.device_kind}: {steps} fenced steps, one begin and one "
                  "end each, monotone, within each step's wall time, results equal to the "
                  "unfenced step's")


