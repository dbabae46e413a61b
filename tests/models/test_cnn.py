"""models/cnn.py: a ResNet-style CNN on synthetic CIFAR-shaped images."""

from __future__ import annotations

import re

import numpy as np
import pytest

from xshare.models import cnn
from tests.models import finished_losses, learner_and_control, learner_as_plain_loop, relative_drop

STEPS = 40


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    """One runtime, two CNNs sharing it: lr=3e-3 must learn, lr=0 (the control) must not."""
    return learner_and_control(cnn.make_job, STEPS, tmp_path_factory.mktemp("cnn"))


def test_loss_falls_under_the_runtime_and_the_check_can_fail(shared_run):
    learns, frozen = finished_losses(shared_run, STEPS)
    # Deterministic data: 2.30 -> 1.73 here (a 25% drop); the frozen control moves by ~1%.
    assert relative_drop(learns) > 0.15, learns
    assert relative_drop(frozen) < 0.05, frozen


def test_final_state_is_bit_identical_to_a_plain_loop(shared_run):
    (_, optimizer), _, _ = learner_as_plain_loop(shared_run)
    assert int(optimizer.step[...]) == STEPS


def test_data_is_deterministic_per_seed_and_step_and_cifar_shaped():
    a, b = cnn.PatternData(8, seed=3), cnn.PatternData(8, seed=3)
    x, y = a(5)["x"], a(5)["y"]
    assert x.shape == (8, 32, 32, 3) and x.dtype == np.float32
    assert y.shape == (8,) and y.dtype == np.int32 and y.min() >= 0 and y.max() < 10
    np.testing.assert_array_equal(x, b(5)["x"])
    assert not np.array_equal(x, a(6)["x"])
    assert not np.array_equal(x, cnn.PatternData(8, seed=4)(5)["x"])


def test_make_job_records_its_parameters_and_rejects_bad_sizes():
    spec = cnn.make_job(lr=1e-3, steps=3, seed=2)    # default sizes: reuses the compiled inits
    assert spec.steps == 3 and spec.name == "cnn-c16-s2"
    assert spec.meta == {"model": "cnn", "lr": 1e-3, "channels": 16, "blocks": 2, "batch": 32, "seed": 2}
    with pytest.raises(ValueError, match=re.escape("cnn: channels=0 must be a positive int")):
        cnn.make_job(channels=0)
