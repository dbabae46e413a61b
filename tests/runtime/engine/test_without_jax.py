"""The engine's scheduling, admission and lifecycle parts run with jax unimportable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_engines_pure_parts_and_their_tests_run_with_jax_unimportable():
    tests = sorted(str(p.relative_to(ROOT)) for p in Path(__file__).parent.glob("test_*.py")
                   if p.name != Path(__file__).name)
    assert len(tests) >= 3, tests
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest",
         "-p", "tests.runtime.engine.block_jax", *tests],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout, out.stdout[-2000:]


def test_importing_jax_really_fails_under_the_blocker():
    code = "import tests.runtime.engine.block_jax\ntry:\n import jax\nexcept ImportError:\n print('blocked')"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "blocked", out.stdout + out.stderr
