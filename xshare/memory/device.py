"""Where the arena's capacity comes from: the user, the GPU's preallocated pool, or RAM.

Device effects live here, apart from the pure arena bookkeeping in ``arena.py``.
"""

from __future__ import annotations

import logging
import os
import sys

from .._units import format_bytes, parse_bytes

log = logging.getLogger("xshare.memory")

# On CPU there is no preallocated pool; the default budget is this fraction of physical RAM,
# leaving the rest to the host process (Python, prefetched batches, results).
CPU_RAM_FRACTION = 0.5
DEFAULT_GPU_FRACTION = "0.9"


def configure_preallocation() -> None:
    """Ask XLA to preallocate the GPU pool the arena lives in. Must run before jax's backend starts.

    XLA reads these variables when the backend initializes (the first ``jax.devices()``), so
    setting them at ``import xshare`` works unless the program already used jax. A user's own
    setting always wins; ``XSHARE_MEM_FRACTION`` sets the fraction.
    """
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    fraction = os.environ.get("XSHARE_MEM_FRACTION", DEFAULT_GPU_FRACTION)
    os.environ.setdefault("XLA_CLIENT_MEM_FRACTION", fraction)
    jax = sys.modules.get("jax")
    if jax is not None and _backend_started(jax):
        log.info("jax's backend started before xshare was imported: GPU preallocation settings "
                 "(XLA_PYTHON_CLIENT_PREALLOCATE, XLA_CLIENT_MEM_FRACTION) may not apply")


def _backend_started(jax) -> bool:
    """Whether jax's backends have started (XLA then ignores the preallocation variables).

    jax has no public way to ask this without starting them (``jax.devices()`` and
    ``jax.extend.backend.backends()`` both start them; checked on jax 0.10 to 0.12), so it is
    feature-detected: ``xla_bridge.backends_are_initialized()`` (a function, present from
    jax 0.4 to 0.12), else the ``_backends`` dict it reads. If neither exists (jax moved
    them), assume started: the cost is one needless log line, never a wrong setting.
    """
    try:
        from jax._src import xla_bridge
    except Exception:  # noqa: BLE001 - a private module that may move: assume started (see above)
        return True
    probe = getattr(xla_bridge, "backends_are_initialized", None)
    if callable(probe):
        try:
            return bool(probe())
        except Exception:  # noqa: BLE001 - same: assume started, the safe answer
            return True
    backends = getattr(xla_bridge, "_backends", None)
    return True if backends is None else bool(backends)


def physical_ram() -> int:
    try:
        import psutil
        return int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001 - psutil missing or failing: the OS's own page count
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def arena_capacity(memory, device) -> tuple[int, str]:
    """(capacity in bytes, where it came from) for ``Runtime(memory=...)`` on ``device``."""
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        stats = None
    limit = int(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None
    if memory is not None:
        capacity = parse_bytes(memory)
        if limit is not None and capacity > limit:
            raise ValueError(
                f"memory={memory!r} ({format_bytes(capacity)}) is more than the device's pool of "
                f"{format_bytes(limit)} on {device.device_kind}; ask for at most that, or raise "
                "XSHARE_MEM_FRACTION / XLA_CLIENT_MEM_FRACTION before importing jax")
        return capacity, "memory argument"
    if limit is not None:
        return limit, f"{device.platform} preallocated pool (bytes_limit)"
    ram = physical_ram()
    return int(ram * CPU_RAM_FRACTION), f"{CPU_RAM_FRACTION:.0%} of physical RAM"
