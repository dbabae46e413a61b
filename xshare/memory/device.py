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
DEPRECATED_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"  # still read by jaxlib 0.10


def preallocation_settings(environ=None) -> list[dict]:
    """The GPU allocator settings a ``Runtime`` would start XLA with, and where each comes
    from (``env NAME``, ``xshare default``, ``XLA default``): what ``xshare doctor`` shows.
    Each: ``{"name", "value", "source", "problem", "fatal"}`` (``problem``: None, or what is
    wrong and the fix; ``fatal``: jaxlib would refuse to start with it). Pure: reads
    ``environ`` (default ``os.environ``), changes nothing."""
    env = os.environ if environ is None else environ
    out = []
    pre = env.get("XLA_PYTHON_CLIENT_PREALLOCATE")
    out.append({"name": "XLA_PYTHON_CLIENT_PREALLOCATE", "value": pre or "true",
                "source": "env XLA_PYTHON_CLIENT_PREALLOCATE" if pre else "xshare default",
                "fatal": False,
                "problem": None if not pre or pre.lower() not in ("false", "0") else
                "preallocation is off: the arena's budget is not reserved on the GPU, so another "
                "process can take it; unset XLA_PYTHON_CLIENT_PREALLOCATE"})
    new, old, own = (env.get("XLA_CLIENT_MEM_FRACTION"), env.get(DEPRECATED_FRACTION),
                     env.get("XSHARE_MEM_FRACTION"))
    problem = None
    if new and old:
        problem = (f"both XLA_CLIENT_MEM_FRACTION={new} and {DEPRECATED_FRACTION}={old} are set: "
                   f"jaxlib refuses to start the GPU; unset {DEPRECATED_FRACTION}")
    if new:
        value, source = new, "env XLA_CLIENT_MEM_FRACTION"
    elif old:
        value, source = old, f"env {DEPRECATED_FRACTION} (deprecated name)"
    elif own:
        value, source = own, "env XSHARE_MEM_FRACTION"
    else:
        value, source = DEFAULT_GPU_FRACTION, "xshare default"
    try:
        if not 0 < float(value) <= 1:
            raise ValueError
    except ValueError:
        problem = problem or f"memory fraction {value!r} ({source}) must be a number in (0, 1]"
    out.append({"name": "XLA_CLIENT_MEM_FRACTION", "value": value, "source": source,
                "problem": problem, "fatal": problem is not None})
    alloc = env.get("XLA_PYTHON_CLIENT_ALLOCATOR")
    valid = ("default", "platform", "bfc", "cuda_async", "vmm")
    out.append({"name": "XLA_PYTHON_CLIENT_ALLOCATOR", "value": alloc or "default",
                "source": "env XLA_PYTHON_CLIENT_ALLOCATOR" if alloc else "XLA default",
                "fatal": bool(alloc and alloc.lower() not in valid),
                "problem": (f"XLA_PYTHON_CLIENT_ALLOCATOR={alloc!r} is not one of {', '.join(valid)}"
                            if alloc and alloc.lower() not in valid else
                            "the platform allocator preallocates nothing and reports no bytes_limit: "
                            "pass Runtime(memory=...) or unset XLA_PYTHON_CLIENT_ALLOCATOR"
                            if alloc and alloc.lower() == "platform" else None)})
    return out


def configure_preallocation() -> None:
    """Ask XLA to preallocate the GPU pool the arena lives in. Must run before jax's backend starts.

    XLA reads these variables when the backend initializes (the first ``jax.devices()``), so
    setting them at ``import xshare`` works unless the program already used jax. A user's own
    setting always wins; ``XSHARE_MEM_FRACTION`` sets the fraction.
    """
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    fraction = os.environ.get("XSHARE_MEM_FRACTION", DEFAULT_GPU_FRACTION)
    # jaxlib refuses to start a GPU backend when both names are set: a user's (deprecated)
    # XLA_PYTHON_CLIENT_MEM_FRACTION is their setting, and it wins.
    if not os.environ.get(DEPRECATED_FRACTION):
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
    """The machine's RAM in bytes. The OS's own page count first (Linux, macOS): the same figure
    as psutil's ``virtual_memory().total`` (both read MemTotal on Linux), without importing
    psutil, which took ~8 ms of a ``Runtime()`` without ``memory=`` (of its ~55 ms start).
    psutil only where ``sysconf`` lacks the names (Windows)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        pass
    try:
        import psutil
    except ImportError:
        raise RuntimeError("cannot read this machine's RAM to size the CPU arena (no os.sysconf page "
                           "count, and psutil is not installed): pass Runtime(memory=...), e.g. "
                           "memory='8GiB', or pip install psutil") from None
    return int(psutil.virtual_memory().total)


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
