"""Test configuration: CPU only. (Strict dtype promotion is not set: optax's Adam relies on
standard promotion.)"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The dispatcher's one-writer rule, checked: its parts assert they run on its thread
# (xshare/runtime/engine/dispatcher.py, RuntimeConfig.debug_ownership in xshare/runtime/config.py).
os.environ.setdefault("XSHARE_DEBUG_OWNERSHIP", "1")
# Every Runtime keeps XLA's persistent compilation cache (and the K-step verdicts beside it):
# one per test session, shared by its processes, never the user's ~/.cache (a run must not
# depend on what an earlier one left there).
if "XSHARE_COMPILATION_CACHE" not in os.environ:
    import tempfile

    os.environ["XSHARE_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="xshare-test-xla-")



@pytest.fixture(scope="module")
def local_ray():
    """A local Ray for one test module (2 CPUs, this machine's), shut down after it."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, namespace="xshare", logging_level="WARNING",
             log_to_driver=False)
    yield ray
    ray.shutdown()
