"""xshare.sched stays pure: no jax, no clocks, no randomness.

The runtime calls ``pick`` under its dispatch lock; a jax import there would tie the policies to a
device (and import jax where the CLI must not), and a clock read would make decisions
unreproducible in tests and simulators.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import xshare.sched

SCHED_DIR = Path(xshare.sched.__file__).resolve().parent
XSHARE_DIR = SCHED_DIR.parent

# Runs in a fresh interpreter. A stub `xshare` package (same __path__, empty body) stands in for
# the real one, whose __init__ imports jax; a meta-path finder records and refuses every attempt
# to import jax, so even `try: import jax / except ImportError` inside sched is caught.
_PROBE = r"""
import importlib, pkgutil, sys, types

attempts = []

class NoJax:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("jax", "jaxlib"):
            attempts.append(name)
            raise ImportError(f"xshare.sched must not import {name}")
        return None

assert not any(m.split(".")[0] in ("jax", "jaxlib") for m in sys.modules)
sys.meta_path.insert(0, NoJax())
stub = types.ModuleType("xshare")
stub.__path__ = [XSHARE_DIR]
sys.modules["xshare"] = stub

import xshare.sched
names = [m.name for m in pkgutil.iter_modules(xshare.sched.__path__)]
for name in names:
    importlib.import_module("xshare.sched." + name)
for name in xshare.sched.POLICIES:
    xshare.sched.get_policy(name).init()
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib"))
if attempts or loaded:
    sys.exit(f"jax imported: attempts={attempts} loaded={loaded}")
print("ok", ",".join(sorted(names)))
"""


def test_sched_imports_without_jax():
    code = _PROBE.replace("XSHARE_DIR", repr(str(XSHARE_DIR)))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    modules = proc.stdout.split()[1].split(",")
    assert {"view", "base", "fifo", "pack", "srtf", "fair", "priority"} <= set(modules)


FORBIDDEN = {"jax", "jaxlib", "time", "datetime", "random", "threading"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_sched_sources_import_no_clock_or_device():
    """Static check over every module, including imports hidden inside functions."""
    sources = sorted(SCHED_DIR.glob("*.py"))
    assert len(sources) >= 8
    offenders = {p.name: sorted(_imports(p) & FORBIDDEN) for p in sources if _imports(p) & FORBIDDEN}
    assert offenders == {}
