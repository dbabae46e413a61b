"""The device sections of ``xshare doctor``: they start jax (``doctor_checks.collect`` first
reports what needs no jax, then starts the backend once, then calls these).

Each returns its data (every field present, ``None`` where this machine has no such thing)
and its checks, like the sections of ``doctor_checks``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .._units import format_bytes
from .doctor_checks import FAIL, NA, OK, WARN, Check

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
    data: dict[str, Any]
    data = {"available": ok, "enabled": os.environ.get("XSHARE_FFI", "1") != "0",
            "library": lib_path, "built_for_jaxlib": _build.built_for(Path(lib_path)) if lib_path else None,
            "running_jaxlib": _build.jaxlib_version(), "ffi_api": api,
            "cuda_library": (str(st.lib_dir / _build.CUDA_LIB)  # (lib_dir is set before cuda_lib)
                             if st.lib_dir is not None and st.cuda_lib is not None else None),
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
    data: dict[str, Any]
    if ma is None:
        data = {"temp_bytes": None, "argument_bytes": None, "output_bytes": None, "alias_bytes": None,
                "bound_bytes": None, "plausible": False, "note": "memory_analysis() returned None"}
        return data, [Check("memory_analysis", "memory_analysis", FAIL, "returned None for a probe step",
                            "jobs cannot be admitted from XLA's figures on this backend; report it")]
    hlo = compiled.as_text()  # None where the backend has no text: then no bound
    bound = temp_bound(hlo).bytes if hlo is not None else None
    figures = [int(getattr(ma, f"{k}_size_in_bytes", -1)) for k in ("temp", "argument", "output", "alias")]
    if min(figures) < 0:
        data = {"temp_bytes": figures[0], "argument_bytes": figures[1], "output_bytes": figures[2],
                "alias_bytes": figures[3], "bound_bytes": bound, "plausible": False,
                "note": "memory_analysis() returned negative (unknown) figures"}
        return data, [Check("memory_analysis", "memory_analysis", FAIL,
                            f"probe step: unknown figures {figures} (temp, arguments, outputs, aliased)",
                            "jobs are refused with FootprintUnknown on this backend (jax #18954); report it")]
    fixed = implausible_temp(int(ma.temp_size_in_bytes), hlo)
    data = {"temp_bytes": int(ma.temp_size_in_bytes), "argument_bytes": int(ma.argument_size_in_bytes),
            "output_bytes": int(ma.output_size_in_bytes), "alias_bytes": int(ma.alias_size_in_bytes),
            "bound_bytes": bound, "plausible": fixed is None,
            "note": fixed[1] if fixed else None}
    if fixed is None:
        return data, [Check("memory_analysis", "memory_analysis", OK,
                            f"probe step: temp {format_bytes(data['temp_bytes'])} (bound "
                            f"{format_bytes(data['bound_bytes'])}), arguments {format_bytes(data['argument_bytes'])}")]
    return data, [Check("memory_analysis", "memory_analysis", WARN, fixed[1],
                        "admission charges the safe bound (more memory per job than needed); "
                        "run `xshare doctor --selftest` and attach its report to a bug")]
