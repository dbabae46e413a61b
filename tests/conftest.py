"""Test configuration: CPU only. (Strict dtype promotion is not set: optax's Adam relies on
standard promotion.)"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The dispatcher's one-writer rule, checked: its parts assert they run on its thread
# (xshare/runtime/dispatcher.py, DispatchConfig.debug_ownership).
os.environ.setdefault("XSHARE_DEBUG_OWNERSHIP", "1")
