"""models/transformer.py: a char-level Transformer LM on the shipped corpus."""

from __future__ import annotations

import re

import numpy as np
import pytest

from xshare.models import transformer
from tests.models import finished_losses, learner_and_control, learner_as_plain_loop, relative_drop

STEPS = 30


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    """One runtime, two LMs sharing it: lr=3e-3 must learn, lr=0 (the control) must not."""
    return learner_and_control(transformer.make_job, STEPS, tmp_path_factory.mktemp("transformer"))


def test_loss_falls_under_the_runtime_and_the_check_can_fail(shared_run):
    learns, frozen = finished_losses(shared_run, STEPS)
    # Deterministic data: 3.15 -> 2.56 nats/char here (a 19% drop); the control moves by <1%.
    assert relative_drop(learns) > 0.10, learns
    assert abs(relative_drop(frozen)) < 0.03, frozen


def test_final_state_is_bit_identical_to_a_plain_loop(shared_run):
    _, metrics, ref_metrics = learner_as_plain_loop(shared_run)
    assert metrics["bits_per_char"] == float(ref_metrics["bits_per_char"])


def test_corpus_ships_with_the_package():
    vocab, ids = transformer.corpus()
    assert len(ids) > 20_000                    # a few tens of KB of text
    assert vocab == "".join(sorted(set(vocab))) and "\n" in vocab and "e" in vocab
    assert ids.dtype == np.int32 and ids.min() == 0 and ids.max() == len(vocab) - 1
    assert "THE KEEPER" in "".join(vocab[i] for i in ids[:40])


def test_windows_are_deterministic_and_targets_are_the_next_character():
    data = transformer.WindowData(batch=4, seq=16, seed=1)
    a, b = data(7), transformer.WindowData(batch=4, seq=16, seed=1)(7)
    assert a["x"].shape == a["y"].shape == (4, 16) and a["x"].dtype == np.int32
    np.testing.assert_array_equal(a["x"], b["x"])
    np.testing.assert_array_equal(a["x"][:, 1:], a["y"][:, :-1])
    assert not np.array_equal(a["x"], data(8)["x"])


def test_make_job_validates_its_shape_parameters():
    spec = transformer.make_job(steps=5, seed=1)     # default sizes: reuses the compiled inits
    assert spec.name == "transformer-d64-s1" and spec.steps == 5
    assert spec.meta == {"model": "transformer", "lr": 3e-3, "d_model": 64, "layers": 2, "heads": 4, "seq": 64,
                         "batch": 16, "seed": 1, "vocab": len(transformer.corpus()[0])}
    with pytest.raises(ValueError, match=re.escape("transformer: d_model=30 must be a multiple of heads=4")):
        transformer.make_job(d_model=30)
    with pytest.raises(ValueError, match=re.escape("transformer: seq=100000 is longer than the corpus")):
        transformer.make_job(seq=100_000)
