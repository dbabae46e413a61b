"""Tests of the model zoo (models/): each job learns under the runtime, matches a plain loop bit
for bit, and (inference) reports latency. Shared helpers below."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from flax import nnx

import xshare
from tests.helpers import assert_trees_equal, plain_loop


def losses(log_dir: Path, job: str) -> np.ndarray:
    """The ``loss`` column of a job's ``metrics.jsonl``, in step order."""
    rows = [json.loads(line) for line in (Path(log_dir) / job / "metrics.jsonl").read_text().splitlines()]
    rows.sort(key=lambda r: r["step"])
    assert [r["step"] for r in rows] == list(range(len(rows))), "a step is missing or repeated"
    return np.array([r["loss"] for r in rows])


def relative_drop(values: np.ndarray, k: int = 10) -> float:
    """1 - mean(last k) / mean(first k): 0.2 means the loss fell by a fifth."""
    return 1.0 - float(np.mean(values[-k:])) / float(np.mean(values[:k]))


def learner_and_control(make_job, steps: int, log_dir: Path):
    """One runtime, two jobs of ``make_job`` sharing it: ``learns`` (lr=3e-3) must learn and
    ``frozen`` (lr=0, the control that shows the loss check can fail) must not.
    Returns ``(log_dir, specs, handles)``."""
    specs = [make_job(lr=3e-3, steps=steps, name="learns"), make_job(lr=0.0, steps=steps, name="frozen")]
    with xshare.Runtime(policy="pack", memory="1GiB", log_dir=log_dir) as rt:
        handles = rt.submit_many(specs)
        rt.wait()
    return log_dir, specs, handles


def finished_losses(shared_run, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """The losses of ``learner_and_control``'s two jobs, ``(learns, frozen)``, after checking
    that both are done and logged every one of their ``steps``."""
    log_dir, _, handles = shared_run
    assert [h.status() for h in handles] == ["done", "done"], [h.error for h in handles]
    learns, frozen = losses(log_dir, "learns"), losses(log_dir, "frozen")
    assert len(learns) == len(frozen) == steps
    return learns, frozen


def learner_as_plain_loop(shared_run):
    """Check that the learner's final state (an nnx ``(model, optimizer)``) and last loss are
    bit-identical to a plain loop's; returns ``(state, metrics, reference_metrics)``."""
    _, specs, handles = shared_run
    state, metrics = handles[0].result()
    ref_state, ref_metrics = plain_loop(specs[0])
    assert_trees_equal(nnx.state(state), ref_state)
    assert metrics["loss"] == float(ref_metrics["loss"])
    return state, metrics, ref_metrics
