"""examples/zoo.toml and examples/train_infer.toml: they plan, build, and (slow) run."""

from __future__ import annotations

from pathlib import Path

import pytest

from xshare import jobs as specs
from xshare.cli.main import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_zoo_plans_two_mlps_a_cnn_and_a_transformer():
    plan = specs.plan_file(EXAMPLES / "zoo.toml")
    assert [j.entry for j in plan.jobs] == ["xshare.models.mlp:make_job"] * 2 + [
        "xshare.models.cnn:make_job", "xshare.models.transformer:make_job"]
    built = specs.build_all(plan)
    assert [s.meta["model"] for s in built] == ["mlp", "mlp", "cnn", "transformer"]


def test_train_infer_plans_two_training_jobs_then_the_inference_job():
    plan = specs.plan_file(EXAMPLES / "train_infer.toml")
    assert [j.entry.split(":")[0] for j in plan.jobs] == [
        "xshare.models.cnn", "xshare.models.transformer", "xshare.models.inference"]
    built = specs.build_all(plan)
    assert built[-1].observer is not None


@pytest.mark.slow
@pytest.mark.parametrize("example", ["zoo.toml", "train_infer.toml"])
def test_example_launches_end_to_end(example, tmp_path):
    assert main(["launch", str(EXAMPLES / example), "--steps", "10", "--out", str(tmp_path / "run")]) == 0


def test_every_zoo_entry_resolves_to_a_factory():
    import xshare.models as models

    assert set(models.ZOO) == {"mlp", "cnn", "transformer", "inference"}
    for entry in models.ZOO.values():
        assert callable(specs.resolve_entry(entry, entry))


def test_the_old_models_spelling_works_from_a_checkout_without_a_warning(monkeypatch, recwarn):
    monkeypatch.chdir(EXAMPLES.parent)  # the repository root: its models/ folder is importable
    monkeypatch.syspath_prepend(str(EXAMPLES.parent))
    plan = specs.plan_entry("models.mlp:make_job", specs.Overrides(sets={"lr": [1e-3, 3e-3]}))
    assert len(plan.jobs) == 2
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


def test_the_old_models_spelling_resolves_to_the_installed_copy_with_a_warning(tmp_path):
    # Outside the checkout no top-level `models` exists: the entry maps to xshare.models.
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-m", "xshare", "launch", "models.mlp:make_job", "--dry-run"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "resolves to the installed 'xshare.models.mlp': write 'xshare.models.mlp'" in proc.stderr
    assert "models.mlp:make_job" in proc.stdout


def test_lr_sweep_plans_eight_fusable_jobs_and_runs_fused(tmp_path, monkeypatch):
    from xshare.runtime.compiled import fusion
    from xshare.runtime.compiled.compiler import PROGRAMS
    from xshare.runtime.compiled.executables import EXECUTABLES, Executables
    # As on a machine that kept none of its programs: with the jobs' own program kept and not
    # their group's, 20-step jobs would finish alone before their group compiled (prepare.py).
    monkeypatch.setattr(EXECUTABLES, "directory", EXECUTABLES.directory)  # (restored after)
    monkeypatch.setattr(EXECUTABLES, "persist", lambda directory: Executables.persist(EXECUTABLES, tmp_path))
    PROGRAMS.clear()
    fusion._cache.clear()
    plan = specs.plan_file(EXAMPLES / "lr_sweep.toml")
    assert len(plan.jobs) == 8 and plan.runtime.fuse
    assert main(["launch", str(EXAMPLES / "lr_sweep.toml"), "--steps", "20", "--out", str(tmp_path / "run")]) == 0
    rows = (tmp_path / "run" / plan.jobs[0].name / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 20
    log = (tmp_path / "run" / plan.jobs[0].name / "log.txt").read_text()
    assert "joined group-0" in log  # it ran fused
