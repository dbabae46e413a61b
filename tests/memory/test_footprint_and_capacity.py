"""Footprints from XLA's analysis (unknown is refused, never zero) and where capacity comes from."""

from __future__ import annotations

import re
import subprocess
import sys
from types import SimpleNamespace

import jax
import pytest

from xshare import FootprintUnknown
from xshare.memory import device as memdev
from xshare.memory.footprint import footprint_from_analysis
from xshare.runtime.compiled.compiler import compile_step
from tests.helpers import heavy_data, heavy_state, heavy_step


def _stats(arg, out, alias, temp):
    return SimpleNamespace(argument_size_in_bytes=arg, output_size_in_bytes=out, alias_size_in_bytes=alias,
                           temp_size_in_bytes=temp, generated_code_size_in_bytes=0)


def test_footprint_splits_state_from_batch_temp_and_metrics():
    fp = footprint_from_analysis(_stats(arg=1000 + 200, out=1000 + 8, alias=1000, temp=300),
                                 state_bytes=1000, batch_bytes=200, prefetch=2, job="j")
    assert (fp.persistent, fp.ephemeral, fp.staging, fp.temp) == (1000, 300 + 200 + 8, 400, 300)
    assert fp.resident == 1400 and fp.total == 1400 + 508


@pytest.mark.parametrize("stats", [None, _stats(0, 0, 0, 0), _stats(1200, 1008, 1000, -1)],
                         ids=["no analysis", "all zeros (jax #18954)", "temp -1"])
def test_an_unusable_analysis_is_refused_never_taken_as_zero(stats):
    with pytest.raises(FootprintUnknown, match=re.escape("job 'j'")):
        footprint_from_analysis(stats, state_bytes=1000, batch_bytes=200, prefetch=2, job="j")


def test_the_donated_compile_reports_temporaries():
    # Donation matters: without it XLA packs temporaries into the outputs (docs/explanation/memory.md).
    spec = heavy_step.bind(heavy_state(dim=128), heavy_data(dim=128, batch=64), steps=1, name="h")
    fp = compile_step(spec.fn, spec.state, spec.data(0), device=jax.devices()[0], prefetch=2).footprint
    assert fp.persistent == 128 * 128 * 4 + 4
    assert fp.temp > 0 and fp.ephemeral >= fp.temp + 64 * 128 * 4


def test_the_ledger_charges_staged_and_in_flight_batches():
    # A job's reservation holds its state, prefetched batches and the batches of the steps in
    # flight behind its own (dispatch_ahead): all can be resident at once.
    import xshare

    spec = heavy_step.bind(heavy_state(dim=32), heavy_data(dim=32, batch=16), steps=3, name="staged")
    batch_bytes = 16 * 32 * 4
    with xshare.Runtime(prefetch=2, dispatch_ahead=5) as rt:
        h = rt.submit(spec)
        rt.wait()
        job = h._rec
    assert job.footprint.staging == (2 + 5) * batch_bytes
    from xshare.runtime.compiled import fusion
    assert fusion.pipeline_depth(8, 32, 64 << 20) == 8          # a huge stacked batch: a job's depth
    assert fusion.pipeline_depth(8, 32, 1 << 20) == 32          # small ones: the group's depth


class _Device:
    platform, device_kind = "gpu", "Fake GPU"

    def __init__(self, stats):
        self._stats = stats

    def memory_stats(self):
        return self._stats


def test_physical_ram_is_psutils_figure_without_importing_it():
    # The OS's page count (what a Runtime without memory= sizes its CPU arena by) is the same
    # figure as psutil's MemTotal, and reading it no longer imports psutil (a child process:
    # this one may have imported psutil already).
    psutil = pytest.importorskip("psutil")
    out = subprocess.run([sys.executable, "-c", "import sys; from xshare.memory import device; "
                          "print(device.physical_ram(), 'psutil' in sys.modules)"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) == psutil.virtual_memory().total and out[1] == "False"


def test_physical_ram_without_sysconf_or_psutil_names_the_fix(monkeypatch):
    # (a platform without the page count, e.g. Windows, and psutil not installed)
    monkeypatch.delattr(memdev.os, "sysconf")
    monkeypatch.setitem(sys.modules, "psutil", None)  # (import psutil raises ImportError)
    with pytest.raises(RuntimeError, match=re.escape("pass Runtime(memory=...)")):
        memdev.physical_ram()


def test_capacity_from_the_argument_the_gpu_pool_or_ram():
    assert memdev.arena_capacity("1GiB", _Device(None)) == (1 << 30, "memory argument")
    assert memdev.arena_capacity(None, _Device({"bytes_limit": 5 << 30})) == (
        5 << 30, "gpu preallocated pool (bytes_limit)")
    cap, source = memdev.arena_capacity(None, _Device(None))
    assert cap == int(memdev.physical_ram() * memdev.CPU_RAM_FRACTION) and source == "50% of physical RAM"
    with pytest.raises(ValueError, match=re.escape("is more than the device's pool of 4.0 GiB on Fake GPU")):
        memdev.arena_capacity("8GiB", _Device({"bytes_limit": 4 << 30}))


def test_preallocation_settings_never_override_the_user(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.5")
    monkeypatch.setenv("XSHARE_MEM_FRACTION", "0.8")
    memdev.configure_preallocation()
    import os
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
    assert os.environ["XLA_CLIENT_MEM_FRACTION"] == "0.5"
