"""Lazy, guarded loading: nothing at import; a library the running jaxlib cannot take is
rebuilt, or the fences are off with one warning; never a crash.

The jaxlib mismatch is reproduced without downloading another jaxlib: the FFI headers of
the running jaxlib are copied and their API minor version raised (what a newer jaxlib's
headers carry: 0.3 in jaxlib 0.10, 0.5 in 0.12). The running jaxlib really rejects such a
handler at registration, as it rejects one built against a newer jaxlib's headers.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import xshare
from xshare.ffi import _build, _loader

RUNNING = _build.jaxlib_version()
NEWER = "0.99.0"  # recorded in the doctored library: "built against a newer jaxlib"


def newer_headers(tmp_path: Path) -> Path:
    """A copy of the running jaxlib's FFI headers with a higher FFI API minor version."""
    inc = tmp_path / "newer-include"
    shutil.copytree(_build.ffi_include_dir(), inc)
    c_api = inc / "xla" / "ffi" / "api" / "c_api.h"
    text = c_api.read_text()
    minor = int(re.search(r"#define XLA_FFI_API_MINOR (\d+)", text).group(1))
    c_api.write_text(text.replace(f"#define XLA_FFI_API_MINOR {minor}",
                                  f"#define XLA_FFI_API_MINOR {minor + 2}"))
    return inc


def checkout(tmp_path: Path, installed_for: str | None) -> Path:
    """A copy of the xshare package whose "installed" library (next to the sources) was
    built against newer FFI headers and records jaxlib ``installed_for``."""
    root = tmp_path / "site"
    shutil.copytree(Path(xshare.__file__).resolve().parent, root / "xshare",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    if installed_for is not None:
        _build.build_library(root / "xshare" / "ffi", cuda=False,
                             include_dir=newer_headers(tmp_path), jaxlib=installed_for)
    return root


CODE = """
import jax, jax.numpy as jnp
from xshare import ffi
ok = ffi.ensure_loaded()
assert ffi.ensure_loaded() == ok  # idempotent, and silent the second time
print("available", ffi.available())
print("reason", ffi.unavailable_reason())
print("dir", ffi._state.lib_dir)
print("jax", float(jax.jit(lambda x: x.sum())(jnp.ones(3))))  # jax is fine either way
"""


def run(root: Path, tmp_path: Path, path: str | None = None) -> tuple[dict, list[str]]:
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu",
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop("CXX", None)
    if path is not None:
        env["PATH"] = path
    proc = subprocess.run([sys.executable, "-c", CODE], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("xshare.ffi:")]
    return out, warnings


def test_import_loads_and_starts_nothing(tmp_path):
    code = ("import sys; import xshare.ffi as ffi; from jax._src import xla_bridge; "
            "maps = open('/proc/self/maps').read(); "
            "print(ffi._state.loaded, xla_bridge.backends_are_initialized(), "
            "'libxshare_fences' in maps)")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XDG_CACHE_HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False", "False"]
    assert not (tmp_path / "xshare").exists(), "nothing built at import"


def test_library_for_another_jaxlib_is_rebuilt_for_the_running_one(tmp_path):
    root = checkout(tmp_path, installed_for=NEWER)
    out, warnings = run(root, tmp_path)
    cache = tmp_path / "cache" / "xshare" / f"ffi-{_build.source_hash()}-jaxlib{RUNNING}"
    assert out == {"available": "True", "reason": "None", "dir": str(cache), "jax": "3.0"}
    assert len(warnings) == 1, warnings
    assert (f"the installed library was built against jaxlib {NEWER}'s FFI headers, "
            f"this is jaxlib {RUNNING}") in warnings[0]
    # The installed copy is left alone (another environment may use it).
    assert _build.built_for(root / "xshare" / "ffi" / _build.CPU_LIB) == NEWER


def test_no_compiler_to_rebuild_means_fences_off_with_one_warning(tmp_path):
    root = checkout(tmp_path, installed_for=NEWER)
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    out, warnings = run(root, tmp_path, path=str(empty))
    assert out["available"] == "False" and out["jax"] == "3.0" and out["dir"] == "None"
    assert len(warnings) == 1, warnings
    for part in (f"built against jaxlib {NEWER}'s FFI headers, this is jaxlib {RUNNING}",
                 "rebuilding failed", "xshare needs a C++17 compiler"):
        assert part in out["reason"] and part in warnings[0]


def test_a_handler_the_running_jaxlib_rejects_is_not_fatal(tmp_path):
    # Recorded as built for the running jaxlib, but with a newer FFI API: nothing triggers a
    # rebuild, and registration itself fails. The guard turns that into fences off.
    root = checkout(tmp_path, installed_for=RUNNING)
    out, warnings = run(root, tmp_path)
    assert out["available"] == "False" and out["jax"] == "3.0"
    assert len(warnings) == 1, warnings
    assert "registering" in out["reason"] and "incompatible" in out["reason"]
    assert f"running jaxlib {RUNNING}" in out["reason"]


def test_ensure_loaded_runs_the_load_once_across_threads(monkeypatch):
    calls = []
    gate = threading.Event()

    def slow_load():
        calls.append(threading.get_ident())
        gate.wait(5)

    monkeypatch.setattr(_loader, "state", _loader._State())
    monkeypatch.setattr(_loader, "_load", slow_load)
    threads = [threading.Thread(target=_loader.ensure_loaded) for _ in range(8)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join(10)
    assert len(calls) == 1 and _loader.state.loaded


def test_a_failing_load_is_recorded_not_raised(monkeypatch, caplog):
    def broken():
        raise OSError("no such device")

    monkeypatch.setattr(_loader, "state", _loader._State())
    monkeypatch.setattr(_loader, "_load", broken)
    with caplog.at_level("WARNING", logger="xshare.ffi"):
        assert _loader.ensure_loaded() is False
        assert _loader.ensure_loaded() is False
    assert caplog.text.count("fences unavailable") == 1
    assert _loader.state.error == "starting jax: OSError: no such device"
    with pytest.raises(RuntimeError, match=re.escape(
            "xshare FFI fences are unavailable: starting jax: OSError: no such device")):
        _loader.lib()
