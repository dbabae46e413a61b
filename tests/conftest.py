"""Test configuration: CPU only. (Strict dtype promotion is not set: optax's Adam relies on
standard promotion.)"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
