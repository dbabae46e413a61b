"""Building the fence libraries (what setup.py and the first-use fallback run)."""

from __future__ import annotations

import ctypes
import re
import subprocess

import pytest

from xshare.ffi import _build


def test_cpu_build(tmp_path):
    (lib,) = _build.build_library(tmp_path, cuda=False)
    assert lib == tmp_path / _build.CPU_LIB
    assert _build.is_fresh(lib)
    # The handler symbols must stay visible (no -fvisibility=hidden).
    dll = ctypes.CDLL(str(lib))
    for sym in ("XshareFenceBegin", "XshareFenceEnd", "xshare_ring_open", "xshare_ring_drain"):
        assert hasattr(dll, sym), sym
    assert not list(tmp_path.glob("*.tmp")), "no temporary files left behind"


def test_stale_library_is_detected(tmp_path):
    lib = tmp_path / _build.CPU_LIB
    lib.write_bytes(b"\x7fELF not built from these sources")
    assert not _build.is_fresh(lib)
    assert not _build.is_fresh(tmp_path / "missing.so")


def test_no_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(_build.shutil, "which", lambda name: None)
    with pytest.raises(_build.BuildError, match=re.escape(
        "xshare needs a C++17 compiler (g++ or clang++) to build its XLA FFI fences; "
        "install one, e.g. apt-get install g++"
    )):
        _build.build_library(tmp_path)


@pytest.mark.skipif(not _build.find_cuda(), reason="no CUDA headers and cudart found "
                    "($CUDA_HOME, nvcc, /usr/local/cuda, nvidia-cuda-runtime wheel)")
def test_cuda_build(tmp_path):
    libs = _build.build_library(tmp_path, cuda=True)
    cuda_lib = tmp_path / _build.CUDA_LIB
    assert libs == [tmp_path / _build.CPU_LIB, cuda_lib]
    assert _build.is_fresh(cuda_lib)
    syms = subprocess.run(["nm", "-D", "--defined-only", str(cuda_lib)],
                          capture_output=True, text=True).stdout
    for sym in ("XshareFenceBeginCuda", "XshareFenceEndCuda"):
        assert sym in syms
    # Shares the rings of the CPU library (found next to it through $ORIGIN) and links cudart.
    needed = subprocess.run(["readelf", "-d", str(cuda_lib)], capture_output=True, text=True).stdout
    assert f"[{_build.CPU_LIB}]" in needed and "libcudart" in needed


def test_cuda_required_but_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(_build, "find_cuda", lambda: [])
    with pytest.raises(_build.BuildError, match="no CUDA headers/runtime found"):
        _build.build_library(tmp_path, cuda=True)
    # auto mode: CPU library only, no error
    assert _build.build_library(tmp_path, cuda=None) == [tmp_path / _build.CPU_LIB]


def test_first_use_build_from_a_source_checkout(tmp_path):
    # A checkout that was never installed: no library next to the sources. Importing
    # xshare.ffi compiles it into the package dir, says so, and registers the fences.
    import os
    import shutil
    import sys
    from pathlib import Path

    import xshare

    src = Path(xshare.__file__).resolve().parent
    shutil.copytree(src, tmp_path / "xshare", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "JAX_PLATFORMS": "cpu",
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    code = ("import jax, jax.numpy as jnp; from xshare import ffi; r = ffi.open_ring(4); "
            "jax.block_until_ready(jax.jit(lambda x: ffi.begin(x, ring_id=r, job_id=1))(jnp.ones(2))); "
            "print(ffi.available(), ffi._state.lib_dir, len(ffi.drain(r)))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", str(tmp_path / "xshare" / "ffi"), "1"]
    assert "compiled the XLA FFI fences on first use" in proc.stderr
    assert _build.is_fresh(tmp_path / "xshare" / "ffi" / _build.CPU_LIB)


def test_first_use_build_goes_to_the_cache_when_the_package_is_read_only(
        tmp_path, monkeypatch, caplog):
    import logging
    from pathlib import Path

    from xshare import ffi

    here = Path(ffi.__file__).resolve().parent
    real_is_fresh = _build.is_fresh
    monkeypatch.setattr(_build, "is_fresh", lambda p: Path(p).parent != here and real_is_fresh(p))
    monkeypatch.setattr(ffi, "_cache_dir", lambda: tmp_path / "cache")
    monkeypatch.setattr(ffi.os, "access", lambda path, mode: Path(path) != here)
    with caplog.at_level(logging.WARNING, logger="xshare.ffi"):
        d = ffi._locate(want_cuda=False)
    assert d == tmp_path / "cache"
    assert real_is_fresh(d / _build.CPU_LIB)
    assert f"compiled the XLA FFI fences on first use into {d}" in caplog.text
    assert ffi._locate(want_cuda=False) == d  # found, not rebuilt


def test_the_fence_library_is_available_after_install():
    # The other FFI tests skip when the library is missing (so a machine without a compiler
    # still runs the rest); this one makes sure a broken build cannot hide behind those skips.
    from xshare import ffi

    assert ffi.available(), ffi.unavailable_reason()
