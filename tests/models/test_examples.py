"""examples/zoo.toml and examples/train_infer.toml: they plan, build, and (slow) run."""

from __future__ import annotations

from pathlib import Path

import pytest

from xshare.cli import spec as specs
from xshare.cli.main import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_zoo_plans_two_mlps_a_cnn_and_a_transformer():
    plan = specs.plan_file(EXAMPLES / "zoo.toml")
    assert [j.entry for j in plan.jobs] == ["models.mlp:make_job"] * 2 + ["models.cnn:make_job",
                                                                         "models.transformer:make_job"]
    built = specs.build_all(plan)
    assert [s.meta["model"] for s in built] == ["mlp", "mlp", "cnn", "transformer"]


def test_train_infer_plans_two_training_jobs_then_the_inference_job():
    plan = specs.plan_file(EXAMPLES / "train_infer.toml")
    assert [j.entry.split(":")[0] for j in plan.jobs] == ["models.cnn", "models.transformer", "models.inference"]
    built = specs.build_all(plan)
    assert built[-1].observer is not None


@pytest.mark.slow
@pytest.mark.parametrize("example", ["zoo.toml", "train_infer.toml"])
def test_example_launches_end_to_end(example, tmp_path):
    assert main(["launch", str(EXAMPLES / example), "--steps", "10", "--out", str(tmp_path / "run")]) == 0


def test_every_zoo_entry_resolves_to_a_factory():
    import models

    assert set(models.ZOO) == {"mlp", "cnn", "transformer", "inference"}
    for entry in models.ZOO.values():
        assert callable(specs.resolve_entry(entry, entry))
