"""Test configuration: CPU only. (Strict dtype promotion is not set: optax's Adam relies on
standard promotion.)"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The dispatcher's one-writer rule, checked: its parts assert they run on its thread
# (xshare/runtime/dispatcher.py, DispatchConfig.debug_ownership).
os.environ.setdefault("XSHARE_DEBUG_OWNERSHIP", "1")



@pytest.fixture(scope="module")
def local_ray():
    """A local Ray for one test module (2 CPUs, this machine's), shut down after it."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, namespace="xshare", logging_level="WARNING",
             log_to_driver=False)
    yield ray
    ray.shutdown()
