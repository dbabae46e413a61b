"""A pytest plugin (``-p tests.runtime.engine.block_jax``) that makes jax unimportable, so the
engine's pure parts are shown to run without it (test_without_jax.py)."""

from __future__ import annotations

import sys

for name in ("jax", "jaxlib", "flax", "optax"):
    if name in sys.modules:
        raise RuntimeError(f"{name} was imported before the blocker")
    sys.modules[name] = None  # type: ignore[assignment]  # `import jax` now raises ImportError
