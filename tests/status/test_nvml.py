"""NVML is optional: without a driver every figure is N/A, the failure is logged once and NVML
is never polled again; with one, figures come back (a fake pynvml stands in for the GPU)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import jax

from xshare.runtime.observe import nvml
from xshare.runtime.observe.schema import validate

from tests.status import runtime_dir, serving  # noqa: F401


class FakeNvml:
    """A pynvml stand-in: one GPU; ``fail_after`` queries, it reports the GPU lost."""

    class NVMLError(Exception):
        pass

    def __init__(self, fail_after: int | None = None):
        self.calls = {"init": 0, "query": 0, "shutdown": 0}
        self.fail_after = fail_after

    def nvmlInit(self):
        self.calls["init"] += 1

    def nvmlShutdown(self):
        self.calls["shutdown"] += 1

    def nvmlDeviceGetHandleByIndex(self, i):
        self.calls["query"] += 1
        if self.fail_after is not None and self.calls["query"] > self.fail_after:
            raise self.NVMLError("GPU is lost")
        return ("handle", i)

    nvmlDeviceGetHandleByUUID = nvmlDeviceGetHandleByIndex

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA Fake 80GB"

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=37, memory=5)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=3 << 30, total=80 << 30, free=77 << 30)


def test_without_a_driver_it_is_na_logged_once_and_never_retried(caplog, monkeypatch):
    import pynvml  # installed (nvidia-ml-py)

    inits = []

    def no_driver(*a, **k):
        # What nvmlInit raises on a machine without the NVIDIA driver (this project's CPU
        # machines), raised here too so that the test holds on a GPU machine as well.
        inits.append(1)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    lib = nvml.Library(min_interval_s=0)
    caplog.set_level(logging.INFO, logger="xshare.nvml")
    for _ in range(5):
        assert lib.query(0) == nvml.NA
    assert len(inits) == 1  # no polling after the first failure
    assert not lib.available and "NVMLError" in lib.disabled_reason
    assert [r.getMessage().startswith("NVML unavailable") for r in caplog.records] == [True]


def test_a_missing_pynvml_is_na_too():
    def no_pynvml():
        raise ImportError("No module named 'pynvml'")

    lib = nvml.Library(loader=no_pynvml)
    assert lib.query(0) == nvml.NA and "ImportError" in lib.disabled_reason


def test_with_a_gpu_it_reports_caches_and_stops_at_the_first_failure():
    fake = FakeNvml(fail_after=2)
    lib = nvml.Library(min_interval_s=60, loader=lambda: fake)
    stats = lib.query(0)
    assert stats == nvml.DeviceStats("NVIDIA Fake 80GB", 37.0, 3 << 30, 80 << 30)
    assert lib.query(0) is stats and fake.calls["query"] == 1  # cached
    assert lib.query(1).utilization_percent == 37.0  # another GPU: asked
    assert lib.query(2) == nvml.NA  # the GPU is lost: N/A from now on
    assert lib.query(0) == nvml.NA and fake.calls == {"init": 1, "query": 3, "shutdown": 1}


def test_device_mapping(monkeypatch):
    gpu = SimpleNamespace(platform="gpu", id=1, local_hardware_id=1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert nvml.nvml_index(gpu) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert nvml.nvml_index(gpu) == 5  # jax counts visible GPUs, NVML all of them
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaa,GPU-bbb")
    assert nvml.nvml_index(gpu) == "GPU-bbb"
    assert nvml.nvml_index(jax.devices("cpu")[0]) is None

    def untouchable():
        raise AssertionError("NVML must not be asked about a CPU")

    assert nvml.device_stats(jax.devices("cpu")[0], nvml.Library(loader=untouchable)) == nvml.NA


def test_status_carries_nvml_figures_when_there_are_some(runtime_dir, monkeypatch):
    lib = nvml.Library(loader=FakeNvml)
    monkeypatch.setattr(nvml, "LIBRARY", lib)
    monkeypatch.setattr(nvml, "nvml_index", lambda device: 0)  # pretend the CPU is GPU 0
    with serving(("alpha",)) as rt:
        s = rt.snapshot()
    assert validate(s) == []
    assert s["device"]["name"] == "NVIDIA Fake 80GB" and s["device"]["utilization_percent"] == 37.0
    assert s["device"]["memory_used_bytes"] == 3 << 30 and s["device"]["memory_total_bytes"] == 80 << 30
