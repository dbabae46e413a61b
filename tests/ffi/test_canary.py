"""The fence canary: the verdict is cached per machine and honoured; a child that crashes or
fails its check leaves the runtime running without fences, with exactly one warning."""

from __future__ import annotations

import logging
import re

import jax
import numpy as np
import pytest

import xshare
from xshare import ffi
from xshare.ffi import _build, canary
from xshare.ffi._loader import BEGIN, END

from . import needs_ffi
from ..helpers import assert_trees_equal, linreg_data, linreg_state, linreg_step, plain_loop

pytestmark = needs_ffi()


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty verdict cache and no verdict remembered by this process."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(canary.ENV, raising=False)
    monkeypatch.delenv(canary.FAULT_ENV, raising=False)
    monkeypatch.setattr(canary, "_memo", {})
    monkeypatch.setattr(canary, "_warned", set())
    return tmp_path / "cache"


def canary_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "xshare.ffi" and "fence canary failed" in r.getMessage()]


def run_one_job(**kwargs):
    spec = linreg_step.bind(linreg_state(), linreg_data(), steps=5, name="canary-job")
    with xshare.Runtime(memory="64MiB", **kwargs) as rt:
        h = rt.submit(spec)
        rt.wait()
        fences = rt.fences
    state, _ = h.result()
    assert_trees_equal(state, plain_loop(spec)[0])  # the job itself is unharmed either way
    return fences


def never_run(*args, **kwargs):
    raise AssertionError("the canary child ran although a verdict was cached")


# --------------------------------------------------------------- check_records, a table


def rows(*spec):
    """Records from (kind, t_ns) pairs, in sequence order, all of job 7."""
    out = np.zeros(len(spec), ffi.RECORD_DTYPE)
    for i, (kind, t) in enumerate(spec):
        out[i] = (i, t, 7, 0, kind)
    return out


@pytest.mark.parametrize("records, walls, problem", [
    # two good steps: begin then end, monotone, inside each step's wall time
    (rows((BEGIN, 10), (END, 20), (BEGIN, 40), (END, 45)), [(5, 25), (30, 50)], None),
    # an end is missing: the count/order check fires
    (rows((BEGIN, 10), (BEGIN, 40), (END, 45)), [(5, 25), (30, 50)], "expected 2 x (begin, end)"),
    # the clock goes back between steps
    (rows((BEGIN, 10), (END, 20), (BEGIN, 15), (END, 45)), [(5, 25), (5, 50)], "timestamps go back"),
    # the second step's end lies after its wall time ended
    (rows((BEGIN, 10), (END, 20), (BEGIN, 40), (END, 60)), [(5, 25), (30, 50)], "step 1: begin"),
])
def test_check_records(records, walls, problem):
    problems = canary.check_records(records, walls, job=7)
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0], problems


def test_records_of_other_jobs_are_ignored():
    other = rows((BEGIN, 1), (END, 2))
    other["job"] = 3
    good = rows((BEGIN, 10), (END, 20))
    good["seq"] += 2
    assert canary.check_records(np.concatenate([other, good]), [(5, 25)], job=7) == []


# --------------------------------------------------------------- the verdict, cached


def test_a_passing_child_is_cached_and_the_runtime_keeps_its_fences(fresh, caplog):
    assert run_one_job() is True
    key = canary.key_of(jax.devices()[0])
    cached = canary.read_cached(key)
    # "passed on cpu" here; on a GPU the reason names the card ("passed on NVIDIA H100 80GB HBM3")
    assert cached is not None and cached.ok and cached.reason.startswith("passed on ")
    assert cached.path == str(canary.cache_path(key)) and str(fresh) in cached.path
    assert (key["platform"], key["device_kind"], key["driver"]) == ("cpu", "cpu", "N/A")
    assert key["jaxlib"] == _build.jaxlib_version() and key["fences"] == _build.source_hash()
    assert canary_warnings(caplog) == []


def test_a_cached_failure_is_honoured_without_running_the_child(fresh, monkeypatch, caplog):
    key = canary.key_of(jax.devices()[0])
    canary.write_cached(canary.Verdict(ok=False, reason="hand-made failure", key=key))
    monkeypatch.setattr(canary, "run_child", never_run)
    caplog.set_level(logging.WARNING, logger="xshare.ffi")
    assert run_one_job() is False
    assert run_one_job() is False  # a second runtime: no second warning
    [message] = canary_warnings(caplog)
    assert "hand-made failure" in message and "xshare doctor" in message
    assert "XSHARE_CANARY=recheck" in message


def test_fences_true_with_a_failed_canary_is_refused_naming_the_fix(fresh):
    key = canary.key_of(jax.devices()[0])
    canary.write_cached(canary.Verdict(ok=False, reason="hand-made failure", key=key))
    with pytest.raises(xshare.XShareError, match=re.escape(
            "fences=True but the fence canary failed on this machine: hand-made failure. "
            "Run `xshare doctor`; XSHARE_CANARY=skip runs them unchecked")):
        xshare.Runtime(memory="64MiB", fences=True)


def test_skip_trusts_the_fences_and_recheck_runs_the_child_again(fresh, monkeypatch):
    key = canary.key_of(jax.devices()[0])
    canary.write_cached(canary.Verdict(ok=False, reason="hand-made failure", key=key))
    monkeypatch.setenv(canary.ENV, "skip")
    assert run_one_job() is True
    monkeypatch.setenv(canary.ENV, "recheck")
    assert run_one_job() is True  # the child ran for real and passed
    assert canary.read_cached(key).ok


def test_a_bad_mode_names_the_valid_ones(fresh, monkeypatch):
    monkeypatch.setenv(canary.ENV, "sometimes")
    with pytest.raises(ValueError, match=re.escape(
            "XSHARE_CANARY='sometimes' is not one of auto, recheck, skip")):
        canary.mode()


# --------------------------------------------------------------- a child that fails


def test_a_crashing_child_leaves_the_runtime_without_fences_and_one_warning(fresh, monkeypatch, caplog):
    monkeypatch.setenv(canary.FAULT_ENV, "abort")  # the child calls abort() after loading the fences
    caplog.set_level(logging.WARNING, logger="xshare.ffi")
    assert run_one_job() is False
    assert run_one_job() is False
    [message] = canary_warnings(caplog)
    assert "the canary child was killed by SIGABRT" in message and "xshare doctor" in message
    cached = canary.read_cached(canary.key_of(jax.devices()[0]))
    assert cached is not None and not cached.ok and "SIGABRT" in cached.reason


@pytest.mark.parametrize("fault, timeout, reason", [
    ("records", None, "expected 4 x (begin, end) records"),
    ("exit", None, "the canary child exited with code 3 without a verdict"),
    ("hang", "3", "the canary child did not answer within 3 s"),
])
def test_a_failing_child_is_a_failed_verdict(fresh, monkeypatch, fault, timeout, reason):
    monkeypatch.setenv(canary.FAULT_ENV, fault)
    if timeout:
        monkeypatch.setenv(canary.TIMEOUT_ENV, timeout)
    v = canary.check(jax.devices()[0])
    assert not v.ok and reason in v.reason, v.reason
    assert v.seconds is not None and v.checked_at


def test_a_device_clock_gets_its_stated_slack_and_no_more():
    # A CUDA fence time is a host time through an anchor event (a few us off at most).
    records = rows((BEGIN, 10_000), (END, 20_000))
    walls = [(50_000, 60_000)]  # the records lie 40 us before the step's call
    assert canary.check_records(records, walls, job=7) != []
    assert canary.check_records(records, walls, job=7, slack_ns=canary.CLOCK_SLACK_NS["gpu"]) == []
    assert canary.CLOCK_SLACK_NS["cpu"] == 0


@pytest.mark.slow
def test_processes_starting_at_once_run_one_child_per_machine(fresh, tmp_path):
    # Three runtimes in three processes (a Ray actor per GPU does this): the lock beside the
    # cache file lets one child run; the others read its verdict.
    import os
    import subprocess
    import sys

    code = ("import jax, logging; from xshare.ffi import canary; "
            "v = canary.check(jax.devices()[0]); print(v.ok, v.cached)")
    env = {**os.environ, "XDG_CACHE_HOME": str(fresh), "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = sorted(p.communicate(timeout=300)[0].split()[1] for p in procs)
    assert all(p.returncode == 0 for p in procs)
    assert outs == ["False", "True", "True"]  # one ran the child; two found its verdict
