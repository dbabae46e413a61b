"""What ``xshare doctor`` looks at: one function per section, each returning its data (every
field present, ``None`` where this machine has no such thing) and its checks.

The sections before ``devices`` import no jax (the versions are read from package metadata,
the extras found with ``find_spec``, never imported). A section that raises becomes a failed
check with the exception's text: the doctor always finishes and always reports.
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
    data = {}
    for extra in extras:
        dists = []
        for req in requires:
            if re.search(rf"extra\s*==\s*['\"]{re.escape(extra)}['\"]", req):
                name = re.match(r"[A-Za-z0-9_.\-]+", req).group(0)
                if name != "xshare":
                    dists.append(name)
        found = {}
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


def devices_section() -> tuple[dict, list[Check]]:
    import jax

    from ..memory.device import arena_capacity

    devices = []
    for d in jax.devices():
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 - some backends raise instead of returning None
            stats = None
        stats = stats or {}
        devices.append({"id": d.id, "platform": d.platform, "kind": str(d.device_kind),
                        "bytes_limit": stats.get("bytes_limit"),
                        "bytes_in_use": stats.get("bytes_in_use"),
                        "peak_bytes_in_use": stats.get("peak_bytes_in_use")})
    first = jax.devices()[0]
    capacity, source = arena_capacity(None, first)
    data = {"default_backend": jax.default_backend(), "count": len(devices), "devices": devices,
            "arena_bytes": capacity, "arena_source": source}
    checks = [Check("devices", "backend", OK, f"{data['default_backend']}: {len(devices)} device(s), "
                    f"{', '.join(sorted({d['kind'] for d in devices}))}")]
    for d in devices:
        if d["bytes_limit"] is None:
            checks.append(Check("devices", f"memory {d['platform']}:{d['id']}", NA,
                                f"{d['kind']}: no memory_stats() on this backend"))
        else:
            checks.append(Check("devices", f"memory {d['platform']}:{d['id']}", OK,
                                f"{d['kind']}: limit {format_bytes(d['bytes_limit'])}, in use "
                                f"{format_bytes(d['bytes_in_use'])}, peak {format_bytes(d['peak_bytes_in_use'])}"))
    checks.append(Check("devices", "arena", OK, f"{format_bytes(capacity)} ({source})"))
    return data, checks


def ffi_section() -> tuple[dict, list[Check]]:
    from .. import ffi
    from ..ffi import _build, _loader

    ok = ffi.ensure_loaded()
    st = _loader.state
    lib_path = str(st.lib_dir / _build.CPU_LIB) if st.lib_dir else None
    api = None
    if st.lib is not None:
        n = st.lib.xshare_ffi_api_version()
        api = f"{n // 1000}.{n % 1000}"
    data = {"available": ok, "enabled": os.environ.get("XSHARE_FFI", "1") != "0",
            "library": lib_path, "built_for_jaxlib": _build.built_for(Path(lib_path)) if lib_path else None,
            "running_jaxlib": _build.jaxlib_version(), "ffi_api": api,
            "cuda_library": str(st.lib_dir / _build.CUDA_LIB) if st.cuda_lib is not None else None,
            "platforms": sorted(st.registered),
            "handlers": [f"{t} ({p})" for p in sorted(st.registered) for t in _loader.TARGETS.values()],
            "error": None if ok else ffi.unavailable_reason()}
    if not data["enabled"]:
        check = Check("ffi", "fences", WARN, "switched off with XSHARE_FFI=0 (steps are timed on the host)",
                      "unset XSHARE_FFI for device timestamps")
    elif ok:
        check = Check("ffi", "fences", OK, f"{lib_path} (built for jaxlib {data['built_for_jaxlib']}, "
                      f"FFI API {api}); registered for {', '.join(data['platforms'])}")
    else:
        check = Check("ffi", "fences", WARN, f"unavailable: {data['error']}",
                      "install a C++17 compiler (apt-get install g++) and rerun; the runtime works "
                      "without fences, timing steps on the host")
    return data, [check]


def canary_section(recheck: bool = False) -> tuple[dict, list[Check]]:
    import jax

    from .. import ffi
    from ..ffi import canary

    mode = canary.mode()
    device = jax.devices()[0]
    data: dict[str, Any] = {"mode": mode, "key": canary.key_of(device), "ok": None, "reason": None,
                            "cached": None, "path": None, "seconds": None, "checked_at": None}
    if not ffi.available():
        return data, [Check("canary", "fence canary", NA, "no fences to check on this backend")]
    if mode == "skip" and not recheck:
        return data, [Check("canary", "fence canary", WARN, f"skipped ({canary.ENV}=skip): fences run unchecked",
                            f"unset {canary.ENV} to check them once per machine")]
    v = canary.check(device, force=recheck)
    data.update({k: getattr(v, k) for k in ("ok", "reason", "cached", "path", "seconds", "checked_at")})
    when = f"cached {v.checked_at}" if v.cached else f"ran now, {v.seconds:.1f} s"
    if v.ok:
        return data, [Check("canary", "fence canary", OK, f"{v.reason} ({when})")]
    return data, [Check("canary", "fence canary", FAIL, f"{v.reason} ({when})",
                        "runtimes here run without fences; report this with `xshare doctor --json`. "
                        f"`xshare doctor --recheck` (or {canary.ENV}=recheck) checks again")]


def nvml_section() -> tuple[dict, list[Check]]:
    import jax

    data: dict[str, Any] = {"available": False, "driver": None, "cuda_driver": None, "gpus": [], "reason": None}
    try:
        gpu_backend = any(d.platform in ("gpu", "cuda") for d in jax.devices())
    except Exception:  # noqa: BLE001 - no backend: NVML is still worth asking
        gpu_backend = False
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            drv = pynvml.nvmlSystemGetDriverVersion()
            data["driver"] = drv.decode() if isinstance(drv, bytes) else str(drv)
            data["cuda_driver"] = pynvml.nvmlSystemGetCudaDriverVersion()
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                name = pynvml.nvmlDeviceGetName(h)
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                data["gpus"].append({"index": i, "name": name.decode() if isinstance(name, bytes) else str(name),
                                     "memory_total_bytes": int(mem.total), "memory_used_bytes": int(mem.used)})
            data["available"] = True
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # noqa: BLE001 - no NVML is normal on a CPU host
        data["reason"] = f"{type(e).__name__}: {e}"
    if data["available"]:
        gpus = "; ".join(f"{g['index']}: {g['name']}, {format_bytes(g['memory_used_bytes'])} / "
                         f"{format_bytes(g['memory_total_bytes'])} used" for g in data["gpus"])
        return data, [Check("nvml", "nvml", OK, f"driver {data['driver']}; {gpus or 'no GPUs'}")]
    if gpu_backend:
        return data, [Check("nvml", "nvml", WARN, f"unavailable on a GPU backend ({data['reason']})",
                            "pip install nvidia-ml-py; xshare top and /metrics show N/A for GPU figures")]
    return data, [Check("nvml", "nvml", NA, f"no NVIDIA driver ({data['reason']})")]


def cache_section() -> tuple[dict, list[Check]]:
    import jax

    from ..runtime.compiler import persistent_cache_dir

    directory = Path(persistent_cache_dir())
    files = [p for p in directory.rglob("*") if p.is_file()] if directory.is_dir() else []
    data = {"launch_dir": str(directory), "exists": directory.is_dir(), "entries": len(files),
            "bytes": sum(p.stat().st_size for p in files),
            "this_process_dir": jax.config.jax_compilation_cache_dir}
    writable = os.access(directory if directory.is_dir() else _existing_parent(directory), os.W_OK)
    summary = (f"{directory}: {data['entries']} entries, {format_bytes(data['bytes'])}" if data["exists"]
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


def analysis_section() -> tuple[dict, list[Check]]:
    """memory_analysis() of a small donated step on the default device, and whether
    admission can believe it (``xshare.memory.plausible``)."""
    import jax
    import jax.numpy as jnp

    from ..memory.plausible import implausible_temp, temp_bound

    def step(w, x):
        h = jnp.tanh(x @ w)
        return w - 0.01 * x.T @ (h * (1 - h * h)), jnp.mean(h)

    w, x = jnp.ones((128, 128), jnp.float32), jnp.ones((64, 128), jnp.float32)
    compiled = jax.jit(step, donate_argnums=0).lower(w, x).compile()
    ma = compiled.memory_analysis()
    if ma is None:
        data = {"temp_bytes": None, "argument_bytes": None, "output_bytes": None, "alias_bytes": None,
                "bound_bytes": None, "plausible": False, "note": "memory_analysis() returned None"}
        return data, [Check("memory_analysis", "memory_analysis", FAIL, "returned None for a probe step",
                            "jobs cannot be admitted from XLA's figures on this backend; report it")]
    hlo = compiled.as_text()
    fixed = implausible_temp(int(ma.temp_size_in_bytes), hlo)
    data = {"temp_bytes": int(ma.temp_size_in_bytes), "argument_bytes": int(ma.argument_size_in_bytes),
            "output_bytes": int(ma.output_size_in_bytes), "alias_bytes": int(ma.alias_size_in_bytes),
            "bound_bytes": temp_bound(hlo).bytes, "plausible": fixed is None,
            "note": fixed[1] if fixed else None}
    if fixed is None:
        return data, [Check("memory_analysis", "memory_analysis", OK,
                            f"probe step: temp {format_bytes(data['temp_bytes'])} (bound "
                            f"{format_bytes(data['bound_bytes'])}), arguments {format_bytes(data['argument_bytes'])}")]
    return data, [Check("memory_analysis", "memory_analysis", WARN, fixed[1],
                        "admission charges the safe bound (more memory per job than needed); "
                        "run `xshare doctor --selftest` and attach its report to a bug")]


SECTIONS: list[tuple[str, Callable[..., tuple[dict, list[Check]]]]] = [
    ("python", python_section), ("packages", packages_section), ("extras", extras_section),
    ("allocator", allocator_section), ("devices", devices_section), ("ffi", ffi_section),
    ("canary", canary_section), ("nvml", nvml_section), ("cache", cache_section),
    ("memory_analysis", analysis_section),
]


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
    for name, fn in SECTIONS:
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
