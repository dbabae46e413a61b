"""``xshare doctor``: the table and the JSON (every field present, N/A where the CPU lacks
it), exit codes with the fix named, and a read of the canary's cached verdict."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

from xshare.cli.main import main
from xshare.ffi import _build, canary

from ..test_imports import REPO, heavy, imported

SECTIONS = {
    "python": {"version", "implementation", "executable", "platform", "machine", "cpu_count"},
    "packages": {"xshare", "jax", "jaxlib", "flax", "optax", "numpy", "jax-cuda12-plugin",
                 "jax-cuda13-plugin", "nvidia-ml-py"},
    "allocator": {"settings"},
    "devices": {"default_backend", "count", "devices", "arena_bytes", "arena_source"},
    "ffi": {"available", "enabled", "library", "built_for_jaxlib", "running_jaxlib", "ffi_api",
            "cuda_library", "platforms", "handlers", "error"},
    "canary": {"mode", "key", "ok", "reason", "cached", "path", "seconds", "checked_at"},
    "nvml": {"available", "driver", "cuda_driver", "gpus", "reason"},
    "cache": {"launch_dir", "exists", "entries", "bytes", "executables", "this_process_dir"},
    "memory_analysis": {"temp_bytes", "argument_bytes", "output_bytes", "alias_bytes",
                        "bound_bytes", "plausible", "note"},
}


def doctor(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["doctor", *args])
    return code, capsys.readouterr().out


def by_name(report: dict) -> dict:
    return {c["name"]: c for c in report["checks"]}


def test_json_as_a_user_runs_it_has_every_field_and_n_a_for_what_a_cpu_lacks():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "xshare", "doctor", "--json"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["schema"] == "xshare.doctor/v1" and report["ok"] is True
    for section, fields in SECTIONS.items():
        assert set(report[section]) == fields, section
    assert set(report["extras"]) >= {"bench", "tune"}  # from xshare's own metadata
    [cpu] = report["devices"]["devices"]
    assert cpu == {"id": 0, "platform": "cpu", "kind": "cpu", "bytes_limit": None,
                   "bytes_in_use": None, "peak_bytes_in_use": None}
    assert report["nvml"]["available"] is False and report["nvml"]["driver"] is None
    assert report["ffi"]["handlers"] == ["xshare_fence_begin (cpu)", "xshare_fence_end (cpu)"]
    assert report["ffi"]["built_for_jaxlib"] == report["ffi"]["running_jaxlib"] == _build.jaxlib_version()
    assert report["canary"]["ok"] is True and report["canary"]["key"]["driver"] == "N/A"
    checks = by_name(report)
    assert checks["memory cpu:0"]["status"] == "n/a" and checks["nvml"]["status"] == "n/a"
    assert checks["fence canary"]["status"] == "ok"
    assert checks["memory_analysis"]["status"] == "ok" and report["memory_analysis"]["plausible"]
    assert {c["status"] for c in report["checks"]} <= {"ok", "warn", "n/a", "info"}


def test_the_table_names_every_check(capsys):
    code, out = doctor(capsys)
    assert code == 0
    for row in ("XLA_CLIENT_MEM_FRACTION", "memory cpu:0", "fence canary", "compilation cache",
                "memory_analysis", "all checks passed"):
        assert row in out, out


def test_a_failed_check_exits_1_and_names_the_fix(capsys, monkeypatch):
    # jaxlib refuses to start a GPU with both names set: the doctor says which to unset.
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.5")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.3")
    code, out = doctor(capsys, "--json")
    assert code == 1
    report = json.loads(out)
    assert report["ok"] is False
    check = by_name(report)["XLA_CLIENT_MEM_FRACTION"]
    assert check["status"] == "fail" and check["fix"].endswith("unset XLA_PYTHON_CLIENT_MEM_FRACTION")
    code, out = doctor(capsys)
    assert code == 1 and "1 check(s) failed" in out and "unset" in out


def test_a_cached_canary_failure_is_a_failed_check(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(canary, "_memo", {})
    key = canary.key_of(jax.devices()[0])
    canary.write_cached(canary.Verdict(ok=False, reason="the canary child was killed by SIGSEGV",
                                       key=key, seconds=1.0, checked_at="2026-01-01T00:00:00Z"))
    code, out = doctor(capsys, "--json")
    assert code == 1
    check = by_name(json.loads(out))["fence canary"]
    assert check["status"] == "fail" and "killed by SIGSEGV" in check["summary"]
    assert "xshare doctor --recheck" in check["fix"]


@pytest.mark.parametrize("args, env, message", [
    (["--quick"], {}, "--quick and --report go with --selftest"),
    ([], {canary.ENV: "maybe"}, "XSHARE_CANARY='maybe' is not one of auto, recheck, skip"),
])
def test_usage_errors_exit_2(capsys, monkeypatch, args, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    capsys.readouterr()
    assert main(["doctor", *args]) == 2
    assert message in capsys.readouterr().err


def test_help_imports_no_jax():
    proc, modules = imported(["-m", "xshare", "doctor", "--help"])
    assert proc.returncode == 0 and "--selftest" in proc.stdout
    assert heavy(modules) == []


def test_a_backend_that_cannot_start_is_one_failed_row_and_the_report_keeps_its_shape():
    # No CUDA plugin on this machine: asking for it is what a broken GPU install looks like.
    env = {**os.environ, "JAX_PLATFORMS": "cuda", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "xshare", "doctor", "--json"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    failed = [c for c in report["checks"] if c["status"] == "fail"]
    assert [c["name"] for c in failed] == ["backend"]
    assert "jax could not start a backend" in failed[0]["summary"] and "JAX_PLATFORMS=cuda" in failed[0]["summary"]
    assert "JAX_PLATFORMS" in failed[0]["fix"]
    for section in ("devices", "ffi", "canary", "memory_analysis"):
        assert set(report[section]) == SECTIONS[section] | {"error"}, section
        assert report[section]["error"].startswith("not checked: jax could not start a backend")
    assert set(report["nvml"]) == SECTIONS["nvml"] and set(report["cache"]) == SECTIONS["cache"]


def test_recheck_runs_the_child_again_over_a_cached_failure(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(canary, "_memo", {})
    key = canary.key_of(jax.devices()[0])
    canary.write_cached(canary.Verdict(ok=False, reason="stale failure", key=key))
    code, out = doctor(capsys, "--json", "--recheck")
    report = json.loads(out)
    assert code == 0 and report["canary"]["ok"] is True and report["canary"]["cached"] is False
    assert canary.read_cached(key).ok  # the new verdict replaced the stale one
