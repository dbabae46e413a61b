"""NVML, optional: GPU utilization and memory for ``/status``, N/A wherever NVML is not there.

Follows nvitop's ``nvmlQuery(..., default=NA)`` (``nvitop/api/libnvml.py``): every call
degrades to a default instead of raising. Two differences, on purpose:

* the first failure of any kind (no ``pynvml``, no driver, a lost GPU, an unsupported query)
  turns NVML off for the rest of the process: it is logged once, at INFO (no GPU is normal),
  and never tried again, so a status endpoint polled every second costs nothing on a CPU host
  and does not fill the log;
* results are cached for ``min_interval_s``: NVML calls take milliseconds and a busy
  Prometheus scrape plus a few ``xshare top`` clients should not multiply them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger("xshare.nvml")


@dataclass(frozen=True)
class DeviceStats:
    """One GPU's figures; ``None`` where unknown (no NVML, or not a GPU)."""

    name: str | None = None
    utilization_percent: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None


NA = DeviceStats()


class Library:
    """A lazily initialised NVML that switches itself off at its first failure. Thread-safe."""

    def __init__(self, *, min_interval_s: float = 0.5,
                 loader: Callable[[], Any] | None = None):
        self._lock = threading.Lock()
        self._nvml: Any = None          # the pynvml module once nvmlInit succeeded
        self._disabled: str | None = None  # why NVML is off (None: not tried yet, or working)
        self._cache: dict[Any, tuple[float, DeviceStats]] = {}
        self._min_interval_s = min_interval_s
        self._loader = loader or _import_pynvml

    @property
    def disabled_reason(self) -> str | None:
        return self._disabled

    @property
    def available(self) -> bool:
        """True once NVML initialised and has not failed since."""
        return self._nvml is not None and self._disabled is None

    def query(self, index: int | str) -> DeviceStats:
        """Figures for GPU ``index`` (an NVML index or a ``GPU-...`` UUID); all-None if unknown."""
        with self._lock:
            if self._disabled is not None:
                return NA
            hit = self._cache.get(index)
            if hit is not None and time.monotonic() - hit[0] < self._min_interval_s:
                return hit[1]
            try:
                nvml = self._init()
                if isinstance(index, str):
                    handle = nvml.nvmlDeviceGetHandleByUUID(index)
                else:
                    handle = nvml.nvmlDeviceGetHandleByIndex(index)
                name = nvml.nvmlDeviceGetName(handle)
                util = nvml.nvmlDeviceGetUtilizationRates(handle)
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
                stats = DeviceStats(
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    utilization_percent=float(util.gpu),
                    memory_used_bytes=int(mem.used), memory_total_bytes=int(mem.total))
            except Exception as err:  # noqa: BLE001 - NVML degrades, it never crashes the runtime
                self._disable(f"{type(err).__name__}: {err}")
                return NA
            self._cache[index] = (time.monotonic(), stats)
            return stats

    def _init(self) -> Any:
        if self._nvml is None:
            nvml = self._loader()
            nvml.nvmlInit()
            self._nvml = nvml
        return self._nvml

    def _disable(self, reason: str) -> None:
        self._disabled = reason
        self._cache.clear()
        log.info("NVML unavailable, GPU utilization and memory show as N/A (not retried): %s", reason)
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
            self._nvml = None


def _import_pynvml() -> Any:
    import pynvml  # nvidia-ml-py; an ImportError here just means N/A

    return pynvml


LIBRARY = Library()


def nvml_index(device: Any) -> int | str | None:
    """The NVML index (or UUID) of a jax GPU device, or None when it is not an NVIDIA GPU.

    jax numbers the *visible* GPUs; NVML numbers all of them, so ``CUDA_VISIBLE_DEVICES``
    (indices or ``GPU-`` UUIDs) maps one onto the other.
    """
    if getattr(device, "platform", None) not in ("gpu", "cuda"):
        return None
    hw = getattr(device, "local_hardware_id", None)
    local = int(getattr(device, "id", 0) if hw is None else hw)
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible and 0 <= local < len(visible):
        v = visible[local]
        if v.isdigit():
            return int(v)
        if v.startswith("GPU-"):
            return v
        return None  # MIG-... or something else NVML's index calls do not take
    return int(local)


def device_stats(device: Any, library: Library | None = None) -> DeviceStats:
    """NVML figures for a jax device; all-None for CPUs, TPUs, or when NVML is unavailable."""
    index = nvml_index(device)
    if index is None:
        return NA
    return (library or LIBRARY).query(index)
