"""Find (or build), load and register the fence libraries: once, lazily, never fatally.

Nothing happens at import. ``ensure_loaded()`` (called by the first ``Runtime`` and by every
function that needs the library) starts jax's backends, finds a library built from these
sources against the running jaxlib's FFI headers, builds one if there is none, loads it with
ctypes and registers the handlers. Any failure on the way (no compiler, a library built for
another FFI API, the running jaxlib rejecting a handler, a CUDA error) logs one warning and
leaves the fences off: ``available()`` is False and ``unavailable_reason()`` says why.

Where a library is looked for, in order:

1. next to this file (built at install by ``setup.py``), if its recorded jaxlib version is the
   running one;
2. ``$XDG_CACHE_HOME/xshare/ffi-<source hash>-jaxlib<version>/`` (default ``~/.cache``);
3. otherwise it is compiled into (2). The installed copy is never overwritten: another
   environment with another jaxlib may share it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from pathlib import Path

from . import _build

_log = logging.getLogger("xshare.ffi")

ABI_VERSION = 2  # XSHARE_FFI_ABI_VERSION in fences.cc / xshare_cuda_abi_version
BEGIN, END = 0, 1
TARGETS = {BEGIN: "xshare_fence_begin", END: "xshare_fence_end"}
_SYMBOLS = {"cpu": {BEGIN: "XshareFenceBegin", END: "XshareFenceEnd"},
            "CUDA": {BEGIN: "XshareFenceBeginCuda", END: "XshareFenceEndCuda"}}


class _State:
    def __init__(self) -> None:
        self.loaded = False  # ensure_loaded() ran (whatever its outcome)
        self.lib: ctypes.CDLL | None = None
        self.cuda_lib: ctypes.CDLL | None = None
        self.lib_dir: Path | None = None
        self.registered: set[str] = set()  # platforms with fences: "cpu", "cuda"
        self.error: str | None = None  # why the fences are unavailable, if they are


state = _State()
_lock = threading.Lock()


def cache_dir(jaxlib: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "xshare" / f"ffi-{_build.source_hash()}-jaxlib{jaxlib}"


def _cuda_backend() -> bool:
    import jax

    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def _complete(d: Path, jaxlib: str, want_cuda: bool) -> bool:
    if not _build.is_fresh(d / _build.CPU_LIB, jaxlib):
        return False
    return (not want_cuda or _build.is_fresh(d / _build.CUDA_LIB, jaxlib)
            or not _build.find_cuda())


def locate(want_cuda: bool, jaxlib: str) -> Path:
    """A directory holding libraries built for ``jaxlib``, building them if needed."""
    here = Path(__file__).resolve().parent
    cache = cache_dir(jaxlib)
    for d in (here, cache):
        if _complete(d, jaxlib, want_cuda):
            return d
    installed = _build.built_for(here / _build.CPU_LIB)
    why = (f"the installed library was built against jaxlib {installed}'s FFI headers, "
           f"this is jaxlib {jaxlib}" if installed and installed != jaxlib
           else "no library built from these sources was installed")
    start = time.perf_counter()
    try:
        built = _build.build_library(cache, cuda=None if want_cuda else False)
    except _build.BuildError as e:
        raise _build.BuildError(f"{why}, and rebuilding failed: {e}") from e
    _log.warning(
        "xshare.ffi: compiled the XLA FFI fences on first use into %s (%s; %s; %.1f s). "
        "`pip install` builds them ahead of time.",
        cache, why, ", ".join(p.name for p in built), time.perf_counter() - start,
    )
    return cache


def _declare(lib: ctypes.CDLL) -> None:
    i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    sigs = {
        "xshare_abi_version": (i32, []),
        "xshare_ffi_api_version": (i32, []),
        "xshare_built_for_jaxlib": (ctypes.c_char_p, []),
        "xshare_now_ns": (i64, []),
        "xshare_ring_open": (i32, [i64]),
        "xshare_ring_close": (i32, [i32]),
        "xshare_ring_size": (i64, [i32]),
        "xshare_ring_drain": (i64, [i32, ptr, i64]),
        "xshare_ring_dropped": (i64, [i32]),
        "xshare_ring_exists": (i32, [i32]),
        "xshare_set_lane": (None, [i32, i32]),
        "xshare_get_lane": (i32, [i32]),
        "xshare_record": (i32, [i32, i32, i32, i32]),
        "xshare_record_rows": (i32, [ptr, i64, i32, i64]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args


def _declare_cuda(lib: ctypes.CDLL) -> None:
    for name, res in (("xshare_cuda_abi_version", ctypes.c_int32),
                      ("xshare_cuda_poll", ctypes.c_int64),
                      ("xshare_cuda_pending", ctypes.c_int64),
                      ("xshare_cuda_lost", ctypes.c_int64)):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, []


def _register(lib: ctypes.CDLL, platform: str) -> None:
    import jax

    for kind, target in TARGETS.items():
        sym = getattr(lib, _SYMBOLS[platform][kind])
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(sym), platform=platform)


def _fail(what: str, e: BaseException) -> None:
    state.error = f"{what}: {type(e).__name__}: {e}"
    _log.warning("xshare.ffi: XLA FFI fences unavailable, running without them (%s)",
                 state.error)


def _load() -> None:
    import jax

    # Create the backends before registering anything: a CPU client created lazily later
    # flushes handlers before types and fails with FAILED_PRECONDITION (docs/explanation/ffi-fences.md).
    jax.devices()
    want_cuda = _cuda_backend()
    try:
        jaxlib = _build.jaxlib_version()
        d = locate(want_cuda, jaxlib)
        lib = ctypes.CDLL(str(d / _build.CPU_LIB))
        _declare(lib)
        if lib.xshare_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{d / _build.CPU_LIB} has C ABI version "
                               f"{lib.xshare_abi_version()}, expected {ABI_VERSION}")
    except Exception as e:  # noqa: BLE001 - no compiler, bad headers...: fences off, runtime goes on
        _fail("loading the fence library", e)
        return
    api = lib.xshare_ffi_api_version()
    built = f"built against jaxlib {lib.xshare_built_for_jaxlib().decode().split(':')[-1]} " \
            f"(XLA FFI API {api // 1000}.{api % 1000}), running jaxlib {jaxlib}"
    try:
        _register(lib, "cpu")
    except Exception as e:  # noqa: BLE001 - e.g. the running jaxlib rejects this FFI API version
        _fail(f"registering {d / _build.CPU_LIB} ({built})", e)
        return
    state.lib, state.lib_dir = lib, d
    state.registered.add("cpu")

    if want_cuda and _build.is_fresh(d / _build.CUDA_LIB, jaxlib):
        try:
            cuda_lib = ctypes.CDLL(str(d / _build.CUDA_LIB))
            _declare_cuda(cuda_lib)
            if cuda_lib.xshare_cuda_abi_version() != ABI_VERSION:
                raise RuntimeError(f"C ABI version {cuda_lib.xshare_cuda_abi_version()}, "
                                   f"expected {ABI_VERSION}")
            _register(cuda_lib, "CUDA")
        except Exception as e:  # noqa: BLE001 - whatever failed, the CPU fences still work
            _log.warning("xshare.ffi: CUDA fences unavailable (%s: %s: %s); CPU fences only",
                         d / _build.CUDA_LIB, type(e).__name__, e)
        else:
            state.cuda_lib = cuda_lib
            state.registered.add("cuda")


def ensure_loaded() -> bool:
    """Locate or build the fence library, load it and register the handlers, once per
    process (thread-safe; later calls return at once). Returns ``available()``.
    Never raises: a failure logs one warning and leaves the fences off."""
    if not state.loaded:
        with _lock:
            if not state.loaded:
                try:
                    _load()
                except Exception as e:  # noqa: BLE001 - jax itself failed to start: still not fatal here
                    _fail("starting jax", e)
                finally:
                    state.loaded = True
    return _available()


def _current_platform() -> str:
    import jax

    backend = jax.default_backend()
    if backend == "gpu":
        return "cuda" if "cuda" in state.registered and _cuda_backend() else "gpu"
    return backend


def _available() -> bool:
    return state.lib is not None and _current_platform() in state.registered


def available() -> bool:
    """The library is loaded and the fences are registered for the current backend."""
    return ensure_loaded()


def enabled() -> bool:
    """``available()`` and not switched off with ``XSHARE_FFI=0``."""
    return os.environ.get("XSHARE_FFI", "1") != "0" and ensure_loaded()


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (None when it is True)."""
    if ensure_loaded():
        return None
    if state.error:
        return state.error
    import jax

    return (f"no xshare fences for backend {jax.default_backend()!r} "
            f"(registered: {sorted(state.registered) or 'none'})")


def lib() -> ctypes.CDLL:
    """The loaded CPU library (rings, lanes, clock); RuntimeError naming why if none."""
    ensure_loaded()
    if state.lib is None:
        raise RuntimeError(f"xshare FFI fences are unavailable: {state.error}")
    return state.lib
