"""``examples/nnx_tutorial.py`` (the Flax NNX MNIST tutorial's CNN and step on 8x8 digits) runs
as shipped: its jobs train (loss falls, test accuracy above chance), and a job ends
bit-identical to the tutorial's own loop under ``nnx.jit``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from flax import nnx

import xshare

from tests.users import harness

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "nnx_tutorial.py"
STEPS = 30


def load_example():
    spec = importlib.util.spec_from_file_location("nnx_tutorial", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # (~14 s; the default run's example is tests/models/test_examples.py)
def test_the_example_trains_and_matches_the_tutorials_loop(capsys):
    tutorial = load_example()
    rows = tutorial.main(steps=STEPS, lrs=(0.005, 0.002))
    assert [r["steps"] for r in rows] == [STEPS, STEPS]
    # From ~2.3 (ten classes) at the start. Test accuracy is in eval mode, on BatchNorm's running
    # statistics, which after 30 steps (momentum 0.99) are still far from the batches': about
    # 0.64 on scikit-learn's digits, 0.32 on the synthetic ones; chance is 0.1.
    assert all(r["train_loss"] < 1.0 and r["test_accuracy"] > 0.2 for r in rows), rows
    assert "cnn-lr0.005: 30 steps" in capsys.readouterr().out

    # One job again, against the tutorial's loop: nnx.jit of the same step, in place.
    train, _ = tutorial.digits(0)
    batches = tutorial.Batches(train, 32, 0)
    (model, optimizer), _ = xshare.run(
        [tutorial.train_step.bind(tutorial.make_objects(0.005), batches, steps=STEPS)])[0]
    ref_model, ref_optimizer = tutorial.make_objects(0.005)
    step = nnx.jit(tutorial.train_step.fn)
    for k in range(STEPS):
        step(ref_model, ref_optimizer, batches(k))
    harness.assert_states_equal(nnx.state((model, optimizer)), nnx.state((ref_model, ref_optimizer)))
