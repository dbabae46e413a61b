"""What ``xshare doctor`` looks at: one function per section, each returning its data (every
field present, ``None`` where this machine has no such thing) and its checks.

The sections here import no jax (the versions are read from package metadata, the extras
found with ``find_spec``, never imported); those that start it are in ``doctor_device``. A
section that raises becomes a failed check with the exception's text: the doctor always
finishes and always reports.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import platform
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from .._units import format_bytes

SCHEMA = "xshare.doctor/v1"
OK, WARN, FAIL, NA, INFO = "ok", "warn", "fail", "n/a", "info"
PACKAGES = ("xshare", "jax", "jaxlib", "flax", "optax", "numpy", "jax-cuda12-plugin",
            "jax-cuda13-plugin", "nvidia-ml-py")
# Distribution name -> import name, where they differ (find_spec takes the import name).
_MODULE = {"scikit-learn": "sklearn", "grpcio": "grpc", "grpcio-tools": "grpc_tools",
           "nvidia-ml-py": "pynvml", "protobuf": "google.protobuf", "pyyaml": "yaml",
           "tensorboardx": "tensorboardX", "orbax-checkpoint": "orbax.checkpoint"}


@dataclass(frozen=True)
class Check:
    section: str
    name: str
    status: str          # ok | warn | fail | n/a | info
    summary: str         # one line: what was found
    fix: str | None = None  # for warn/fail: what to do


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def python_section() -> tuple[dict, list[Check]]:
    v = sys.version_info
    data = {"version": platform.python_version(), "implementation": platform.python_implementation(),
            "executable": sys.executable, "platform": platform.platform(),
            "machine": platform.machine(), "cpu_count": os.cpu_count()}
    ok = (v.major, v.minor) >= (3, 11)
    return data, [Check("python", "python", OK if ok else FAIL,
                        f"Python {data['version']} ({data['executable']})",
                        None if ok else "xshare needs Python >= 3.11")]


def packages_section() -> tuple[dict, list[Check]]:
    data = {name: _version(name) for name in PACKAGES}
    checks = []
    for need in ("jax", "jaxlib", "flax", "optax", "numpy"):
        checks.append(Check("packages", need, OK if data[need] else FAIL,
                            f"{need} {data[need] or 'not installed'}",
                            None if data[need] else f"pip install '{need}' (a core dependency of xshare)"))
    jax_v, lib_v = data["jax"], data["jaxlib"]
    if jax_v and lib_v and jax_v.split(".")[:2] != lib_v.split(".")[:2]:
        checks.append(Check("packages", "jax/jaxlib", WARN, f"jax {jax_v} with jaxlib {lib_v}",
                            f"pip install 'jaxlib=={jax_v}' (jax and jaxlib should be one release)"))
    return data, checks


def extras_section() -> tuple[dict, list[Check]]:
    """xshare's optional extras (from its own package metadata) and whether each one's
    packages can be imported: ``find_spec`` on the top-level name, nothing imported."""
    try:
        meta = md.metadata("xshare")
        extras = [e for e in (meta.get_all("Provides-Extra") or []) if e != "test"]
        requires = meta.get_all("Requires-Dist") or []
    except md.PackageNotFoundError:
        extras, requires = [], []
    data: dict[str, dict[str, Any]] = {}
    for extra in extras:
        dists = []
        for req in requires:
            if re.search(rf"extra\s*==\s*['\"]{re.escape(extra)}['\"]", req):
                m = re.match(r"[A-Za-z0-9_.\-]+", req)  # PEP 508: a requirement starts with its name
                if m is not None and m.group(0) != "xshare":
                    dists.append(m.group(0))
        found: dict[str, bool] = {}
        for dist in dists:
            module = _MODULE.get(dist.lower(), dist.lower().replace("-", "_"))
            top = module.split(".")[0]
            found[dist] = importlib.util.find_spec(top) is not None
        data[extra] = {"installed": bool(found) and all(found.values()), "packages": found}
    checks = [Check("extras", extra, OK if d["installed"] else INFO,
                    ("installed" if d["installed"] else "not installed (missing "
                     + ", ".join(k for k, v in d["packages"].items() if not v) + ")"),
                    None if d["installed"] else f"pip install 'xshare[{extra}]' to use it")
              for extra, d in data.items()]
    return data, checks


def allocator_section() -> tuple[dict, list[Check]]:
    from ..memory.device import preallocation_settings

    settings = preallocation_settings()
    checks = [Check("allocator", s["name"], FAIL if s["fatal"] else WARN if s["problem"] else OK,
                    f"{s['value']} ({s['source']})", s["problem"]) for s in settings]
    return {"settings": settings}, checks


def cache_section() -> tuple[dict, list[Check]]:
    import jax

    from ..runtime.compiled.compiler import persistent_cache_dir

    directory = Path(persistent_cache_dir())
    files = [p for p in directory.rglob("*") if p.is_file()] if directory.is_dir() else []
    data = {"launch_dir": str(directory), "exists": directory.is_dir(), "entries": len(files),
            "bytes": sum(p.stat().st_size for p in files),
            # programs kept whole (runtime/compiled/executables.py)
            "executables": sum(1 for p in files if p.parent.name == "executables" and p.suffix == ".xla"),
            "this_process_dir": jax.config.jax_compilation_cache_dir}  # type: ignore[attr-defined]  # jax sets its options on Config at import (setattr)
    writable = os.access(directory if directory.is_dir() else _existing_parent(directory), os.W_OK)
    summary = (f"{directory}: {data['entries']} entries, {format_bytes(data['bytes'])} "
               f"({data['executables']} programs kept whole)" if data["exists"]
               else f"{directory} (not created yet: the first `xshare launch` creates it)")
    return data, [Check("cache", "compilation cache", OK if writable else WARN, summary,
                        None if writable else "make it writable or set XSHARE_COMPILATION_CACHE")]


def _jax_started() -> bool:
    jax = sys.modules.get("jax")
    if jax is None:
        return False
    from ..memory.device import _backend_started

    return _backend_started(jax)


def _existing_parent(p: Path) -> Path:
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def sections() -> list[tuple[str, Callable[..., tuple[dict, list[Check]]]]]:
    """Every section, in the order of the report: those without jax first."""
    from . import doctor_device as d

    return [("python", python_section), ("packages", packages_section), ("extras", extras_section),
            ("allocator", allocator_section), ("devices", d.devices_section), ("ffi", d.ffi_section),
            ("canary", d.canary_section), ("nvml", d.nvml_section), ("cache", cache_section),
            ("memory_analysis", d.analysis_section)]


def collect(*, recheck: bool = False, preallocate: bool = False) -> dict:
    """The whole report: ``{"schema", "ok", <section>: data..., "checks": [...]}``.

    The settings a Runtime would use are reported first, as they are. Then jax starts:
    ``preallocate=False``, without preallocating (the doctor must not take most of a GPU that
    a running runtime may be using); ``True`` (the self-test), set up as a Runtime does.
    """
    report: dict[str, Any] = {"schema": SCHEMA}
    checks: list[Check] = []
    saved = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")
    try:
        _collect(report, checks, recheck, preallocate)
    finally:  # the backend read it when it started; the caller's environment is left as it was
        if not preallocate:
            if saved is None:
                os.environ.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
            else:
                os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = saved
    report["checks"] = [asdict(c) for c in checks]
    report["ok"] = not any(c.status == FAIL for c in checks)
    return report


# The sections that need a started backend, with their fields: without a backend each is
# reported with every field null (and why), so a report always has the same shape.
NEEDS_BACKEND = {
    "devices": ("default_backend", "count", "devices", "arena_bytes", "arena_source"),
    "ffi": ("available", "enabled", "library", "built_for_jaxlib", "running_jaxlib", "ffi_api",
            "cuda_library", "platforms", "handlers", "error"),
    "canary": ("mode", "key", "ok", "reason", "cached", "path", "seconds", "checked_at"),
    "memory_analysis": ("temp_bytes", "argument_bytes", "output_bytes", "alias_bytes",
                        "bound_bytes", "plausible", "note"),
}


def _collect(report: dict, checks: list[Check], recheck: bool, preallocate: bool) -> None:
    no_backend = None  # why jax could not start a backend, once it has been tried
    for name, fn in sections():
        if name == "devices":
            if preallocate:
                from ..memory.device import configure_preallocation

                configure_preallocation()  # as a Runtime does, before jax starts
            elif not _jax_started():
                os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
            no_backend = _start_backend()
            if no_backend is not None:
                checks.append(Check("devices", "backend", FAIL, f"jax could not start a backend: {no_backend}",
                                    "check JAX_PLATFORMS and that jax's plugin for this accelerator is "
                                    "installed (e.g. pip install 'jax[cuda12]'); `python -c 'import jax; "
                                    "jax.devices()'` shows the full error"))
        if no_backend is not None and name in NEEDS_BACKEND:
            report[name] = {**dict.fromkeys(NEEDS_BACKEND[name]),
                            "error": f"not checked: jax could not start a backend ({no_backend})"}
            checks.append(Check(name, name, NA, "not checked: jax could not start a backend"))
            continue
        try:
            data, found = fn(recheck=recheck) if name == "canary" else fn()
        except Exception as e:  # noqa: BLE001 - one broken section must not hide the others
            data, found = {"error": _describe(e)}, [
                Check(name, name, FAIL, f"could not check: {_describe(e)}",
                      "report this with `xshare doctor --json`")]
        report[name] = data
        checks.extend(found)


def _start_backend() -> str | None:
    try:
        import jax

        jax.devices()
    except Exception as e:  # noqa: BLE001 - reported as the devices row
        return _describe(e) + (f" (JAX_PLATFORMS={os.environ['JAX_PLATFORMS']})"
                               if os.environ.get("JAX_PLATFORMS") else "")
    return None


def _describe(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else f"{type(e).__name__} (no message)"
