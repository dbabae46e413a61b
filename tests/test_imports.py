"""Import is free: ``import xshare`` and the read-only commands import no jax (checked with
``python -X importtime`` in a fresh interpreter, as a user would see it) and change no
environment variable; the public names still resolve on first use."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("jax", "jaxlib", "flax", "optax", "numpy", "xshare.ffi", "optuna", "sklearn", "grpc", "tritonclient")


def imported(args: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``python -X importtime ARGS`` from the repository root; the modules it imported."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=120, **kwargs)
    modules = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines()
               if line.startswith("import time:") and line.count("|") == 2}
    assert "xshare" in modules or "xshare.cli" in modules, proc.stderr[-2000:]  # importtime did report
    return proc, modules


def heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY))


def test_import_xshare_imports_no_jax_and_changes_no_environment():
    code = ("import os; before = dict(os.environ); import xshare; "
            "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items()); "
            "assert sorted(xshare.__all__) == sorted(n for n in dir(xshare) if n in xshare.__all__); "
            "xshare.SpecError, xshare.XShareError, xshare.POLICIES")
    proc, modules = imported(["-c", code])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert heavy(modules) == []


def test_public_names_resolve_lazily_to_their_modules():
    import xshare
    from xshare._job import job
    from xshare.runtime.runtime import Runtime

    assert xshare.Runtime is Runtime and xshare.job is job
    assert set(xshare.__all__) <= set(dir(xshare))
    with pytest.raises(AttributeError, match="has no attribute 'Runtim'"):
        xshare.Runtim  # noqa: B018


@pytest.mark.parametrize("args", [
    ["--help"],
    ["top", "--help"],
    ["launch", "examples/sweep.toml", "--dry-run"],
    ["launch", "examples/zoo.toml", "--dry-run"],
    ["launch", "xshare.models.mlp:make_job", "--set", "lr=1e-3,3e-3", "--dry-run"],
], ids=lambda a: " ".join(a))
def test_read_only_commands_import_no_jax(args):
    proc, modules = imported(["-m", "xshare", *args])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert heavy(modules) == []


def test_top_without_a_runtime_says_so_and_imports_no_jax():
    proc, modules = imported(["-m", "xshare", "top", "--once", "--address", "127.0.0.1:9"])
    assert proc.returncode == 1
    assert "no runtime at 127.0.0.1:9" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert heavy(modules) == []


def test_light_modules_stay_light():
    # What the CLI's top and spec parsing import: pure Python, whatever the runtime does.
    code = ("import xshare.runtime.web.discovery, xshare.runtime.observe.schema, xshare.runtime.web.server, "
            "xshare.jobs, xshare.cli.spec, xshare.cli.top, xshare.sched, xshare._units, xshare._errors")
    proc, modules = imported(["-c", code])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert heavy(modules) == []


def test_pyproject_lists_every_package_of_the_source_tree():
    # pyproject.toml lists packages by hand (models/ installs as xshare.models): a package
    # missing from the list would import from a checkout and be absent from the wheel.
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "xshare").rglob("__init__.py")}
    found |= {"xshare.models"} if (REPO / "models" / "__init__.py").exists() else set()
    assert listed == found
