"""The zoo's factories evaluate on held-out batches of their own data (``eval_every``), and the
digits model (scikit-learn's load_digits) reports eval/accuracy and eval/loss on a fixed split."""

from __future__ import annotations

import json

import numpy as np
import pytest

import xshare
from xshare.models import cnn, common, mlp, transformer


@pytest.mark.slow  # compiles a CNN and a Transformer (~25 s on 2 cores)
def test_zoo_factories_take_eval_every(tmp_path):
    specs = [mlp.make_job(steps=6, eval_every=3, width=16, name="m"),
             cnn.make_job(steps=4, eval_every=2, batch=4, channels=4, blocks=1, name="c"),
             transformer.make_job(steps=4, eval_every=2, batch=2, seq=16, d_model=16, heads=2, layers=1, name="t")]
    with xshare.Runtime(memory="1GiB", log_dir=tmp_path) as rt:
        handles = rt.submit_many(specs)
        rt.wait()
    for h, names, every, steps in zip(handles, (("eval/accuracy", "eval/loss"),) * 2 + (("eval/bits_per_char", "eval/loss"),),
                                      (3, 2, 2), (6, 4, 4)):
        assert h.status() == "done", h.error
        assert set(names) <= set(h.progress().metrics)
        rows = [json.loads(line) for line in open(tmp_path / h.name / "metrics.jsonl")]
        assert [r["step"] for r in rows if names[1] in r] == list(range(every - 1, steps, every))
    # Held out: eval batches come from steps no job trains on.
    data = mlp.TeacherData(8, 0)
    held = common.eval_kwargs(common.classification_loss, data, 5, name="mlp")["eval_data"]
    np.testing.assert_array_equal(held[0]["x"], data(common.HELD_OUT_STEP)["x"])
    assert mlp.make_job(steps=2).eval_step is None  # off unless asked


def test_digits_reports_eval_accuracy_on_a_fixed_split_and_lr_0_does_not_learn():
    digits = pytest.importorskip("xshare.models.digits")
    x_train, y_train, x_val, y_val = digits.split()
    assert len(x_val) == digits.VAL_SIZE and len(x_train) + len(x_val) == 1797
    assert x_train.dtype == np.float32 and 0 <= x_train.min() and x_train.max() <= 1
    (_, good), (_, zero) = xshare.run([digits.make_job(lr=1e-2, steps=60, eval_every=20, name="good"),
                                       digits.make_job(lr=0.0, steps=60, eval_every=20, name="zero")])
    assert good["eval/accuracy"] > 0.8 and zero["eval/accuracy"] < 0.3
    with pytest.raises(ValueError, match=r"digits: dropout=1\.0 must be a number in \[0, 1\)"):
        digits.make_job(dropout=1.0)
