"""The CPU's matrix-multiply kernels made as a runtime starts (xshare/runtime/compiled/warmup.py):
once per process, its program kept with the runtime's executables and loaded by a later process,
accelerators left alone, and a failure never failing anything. (What it saves, a job's first
step ~20 ms sooner on a CPU, is measured in benchmarks/RESULTS.md, not asserted here.)"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import jax
import pytest

import xshare
from xshare.runtime import workers
from xshare.runtime.compiled import warmup
from xshare.runtime.compiled.executables import Executables


@pytest.fixture
def store(monkeypatch, tmp_path):
    """A fresh executables store and a process that has not warmed yet."""
    store = Executables()
    store.persist(tmp_path)
    monkeypatch.setattr(warmup, "EXECUTABLES", store)
    monkeypatch.setattr(warmup, "_started", False)
    return store


def test_the_kernels_are_made_once_per_process_and_a_later_process_loads_their_program(store, tmp_path):
    cpu = jax.devices("cpu")[0]
    assert warmup.warm_kernels(cpu) is True
    assert warmup.warm_kernels(cpu) is False  # (once per process)
    deadline = time.monotonic() + 30  # kept by a thread of its own (executables.py)
    while not list((tmp_path / "executables").glob("*.xla")):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    warmup._started = False  # a later process: the program loads, nothing is lowered
    assert warmup.warm_kernels(cpu) is True
    assert store.loaded == 1


def test_an_accelerator_is_left_alone(store):
    assert warmup.warm_kernels(SimpleNamespace(platform="gpu")) is False
    assert warmup._started is False and store.saved == 0


def test_a_failure_to_warm_is_logged_and_fails_nothing(store, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(store, "compile", broken)
    with caplog.at_level(logging.DEBUG, logger="xshare.runtime"):
        assert warmup.warm_kernels(jax.devices("cpu")[0]) is True
    assert "could not warm the CPU's matrix-multiply kernels: no compiler today" in caplog.text


def test_a_runtime_warms_its_device_as_it_starts(monkeypatch):
    asked = []
    monkeypatch.setattr(workers, "warm_kernels", asked.append)
    with xshare.Runtime(memory="64MiB") as rt:
        rt._tier_pool.shutdown(wait=True)  # (it runs on the tiers' thread)
    assert asked == [rt.device]
