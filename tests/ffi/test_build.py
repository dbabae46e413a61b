"""Building the fence libraries (what setup.py and the first-use fallback run)."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from xshare.ffi import _build


def test_cpu_build(tmp_path):
    (lib,) = _build.build_library(tmp_path, cuda=False)
    assert lib == tmp_path / _build.CPU_LIB
    assert _build.is_fresh(lib)
    # The library records the jaxlib whose FFI headers it was compiled against.
    running = _build.jaxlib_version()
    assert _build.built_for(lib) == running
    assert _build.is_fresh(lib, running)
    assert not _build.is_fresh(lib, running + "1")  # 0.10.2 is not 0.10.21
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
    assert _build.built_for(lib) is None and _build.built_for(tmp_path / "missing.so") is None


def test_build_against_given_headers_records_their_version(tmp_path):
    (lib,) = _build.build_library(tmp_path, cuda=False, include_dir=_build.ffi_include_dir(),
                                  jaxlib="9.9.9")
    assert _build.built_for(lib) == "9.9.9"
    assert _build.is_fresh(lib, "9.9.9") and not _build.is_fresh(lib, _build.jaxlib_version())
    with pytest.raises(ValueError, match=re.escape("give both include_dir and jaxlib")):
        _build.build_library(tmp_path, jaxlib="9.9.9")
    with pytest.raises(ValueError, match=re.escape("jaxlib version '1\"; rm' is not a version")):
        _build.build_library(tmp_path, include_dir=tmp_path, jaxlib='1"; rm')


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
    # Device timestamps from events on XLA's stream; never a host callback (it stalls the stream).
    undefined = subprocess.run(["nm", "-D", "--undefined-only", str(cuda_lib)],
                               capture_output=True, text=True).stdout
    assert "cudaEventRecord" in undefined and "cudaEventElapsedTime" in undefined
    assert "cudaLaunchHostFunc" not in undefined


@pytest.mark.slow  # (the default run builds the CUDA variant with the host compiler: test_cuda_build)
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_cuda_fences_compile_with_nvcc(tmp_path):
    # nvcc's own front end (-x cu), not only the host compiler: the CUDA variant must keep
    # compiling with the CUDA toolkit's compiler (nvcc 13 here). Compile only: no GPU needed.
    (cpu_lib,) = _build.build_library(tmp_path, cuda=False)
    found = _build.find_cuda()
    cuda_inc = found[0][0] if found else Path(shutil.which("nvcc")).parent.parent / "include"
    out = tmp_path / "nvcc_fences_cuda.so"
    proc = subprocess.run(
        ["nvcc", "-x", "cu", "-std=c++17", "-O2", "-Xcompiler", "-fPIC", "-shared",
         f"-I{_build.ffi_include_dir()}", f"-I{cuda_inc}", str(_build.CUDA_SRC),
         f"-L{tmp_path}", f"-l:{cpu_lib.name}", "-lcudart", "-o", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    syms = subprocess.run(["nm", "-D", "--defined-only", str(out)], capture_output=True,
                          text=True).stdout
    assert "XshareFenceBeginCuda" in syms and "xshare_cuda_poll" in syms


def test_cuda_required_but_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(_build, "find_cuda", lambda: [])
    with pytest.raises(_build.BuildError, match="no CUDA headers/runtime found"):
        _build.build_library(tmp_path, cuda=True)
    # auto mode: CPU library only, no error
    assert _build.build_library(tmp_path, cuda=None) == [tmp_path / _build.CPU_LIB]


def test_first_use_build_from_a_source_checkout(tmp_path):
    # A checkout that was never installed: no library next to the sources. The first use
    # compiles it into the per-jaxlib cache dir (never into the package), says so once, and
    # registers the fences. Importing xshare.ffi alone builds and loads nothing.
    import os
    import shutil
    import sys
    from pathlib import Path

    import xshare

    src = Path(xshare.__file__).resolve().parent
    shutil.copytree(src, tmp_path / "xshare", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "JAX_PLATFORMS": "cpu",
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    code = ("import jax, jax.numpy as jnp; from xshare import ffi; "
            "print(ffi._state.loaded, ffi._state.lib); r = ffi.open_ring(4); "
            "jax.block_until_ready(jax.jit(lambda x: ffi.begin(x, ring_id=r, job_id=1))(jnp.ones(2))); "
            "print(ffi.available(), ffi._state.lib_dir, len(ffi.drain(r)))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    cache = (tmp_path / "cache" / "xshare" /
             f"ffi-{_build.source_hash()}-jaxlib{_build.jaxlib_version()}")
    assert proc.stdout.split() == ["False", "None", "True", str(cache), "1"]
    assert proc.stderr.count("compiled the XLA FFI fences on first use") == 1, proc.stderr
    assert "no library built from these sources was installed" in proc.stderr
    assert _build.is_fresh(cache / _build.CPU_LIB, _build.jaxlib_version())
    assert not list((tmp_path / "xshare" / "ffi").glob("*.so"))


def test_first_use_build_is_found_again(tmp_path, monkeypatch, caplog):
    import logging

    from xshare.ffi import _loader

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    running = _build.jaxlib_version()
    monkeypatch.setattr(_loader, "_complete", lambda d, j, c, real=_loader._complete:
                        d != Path(_loader.__file__).resolve().parent and real(d, j, c))
    with caplog.at_level(logging.WARNING, logger="xshare.ffi"):
        d = _loader.locate(want_cuda=False, jaxlib=running)
    assert d == tmp_path / "xshare" / f"ffi-{_build.source_hash()}-jaxlib{running}"
    assert _build.is_fresh(d / _build.CPU_LIB, running)
    assert f"compiled the XLA FFI fences on first use into {d}" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="xshare.ffi"):
        assert _loader.locate(want_cuda=False, jaxlib=running) == d  # found, not rebuilt
    assert caplog.text == ""


def test_the_fence_library_is_available_after_install():
    # The other FFI tests skip when the library is missing (so a machine without a compiler
    # still runs the rest); this one makes sure a broken build cannot hide behind those skips.
    from xshare import ffi

    assert ffi.available(), ffi.unavailable_reason()
