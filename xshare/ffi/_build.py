"""Compile xshare's XLA FFI fence libraries.

Standalone on purpose (imports nothing from xshare): ``setup.py`` loads this file by path
at install time, and ``xshare.ffi`` calls it on first use when no library was installed.

Each library records what it was built from: the hash of the C++ sources and the version of
the jaxlib whose XLA FFI headers it was compiled against (the FFI C API is versioned by
jaxlib: 0.3 in jaxlib 0.10, 0.4 in 0.11.2, 0.5 in 0.12, and an older jaxlib rejects a handler
built against newer headers). ``is_fresh(lib, jaxlib)`` checks both, so a library is rebuilt
when either changed.

Outputs, always side by side in one directory:

* ``libxshare_fences.so``: CPU handlers, the rings, the lane table and the C ABI (ctypes).
* ``libxshare_fences_cuda.so``: CUDA handlers. Host-only code (no kernels), so g++ against
  the CUDA headers is enough; linked against cudart and against ``libxshare_fences.so``
  (``$ORIGIN`` rpath) so that both share one set of rings.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    from .._errors import XShareError
except ImportError:  # setup.py runs this file by path, outside the package: no parent to import
    class XShareError(Exception):  # type: ignore[no-redef]  # the build's stand-in for xshare's base
        pass

__all__ = [
    "BuildError",
    "CPU_LIB",
    "CUDA_LIB",
    "SOURCES",
    "build_library",
    "find_compiler",
    "find_cuda",
    "built_for",
    "ffi_include_dir",
    "is_fresh",
    "jaxlib_version",
    "source_hash",
]

_log = logging.getLogger("xshare.ffi")

HERE = Path(__file__).resolve().parent
CPU_SRC = HERE / "fences.cc"
CUDA_SRC = HERE / "fences_cuda.cc"
SOURCES = (CPU_SRC, CUDA_SRC)
CPU_LIB = "libxshare_fences.so"
CUDA_LIB = "libxshare_fences_cuda.so"

# Plain flags (docs/explanation/ffi-fences.md): no -fvisibility=hidden (it hides the handler symbols).
CXXFLAGS = ["-std=c++17", "-O2", "-fPIC", "-shared", "-pthread"]

NO_COMPILER = (
    "xshare needs a C++17 compiler (g++ or clang++) to build its XLA FFI fences; "
    "install one, e.g. apt-get install g++"
)

# Markers compiled into both libraries as NUL-terminated strings; is_fresh() looks for them
# in the file's bytes (without loading it: a dlopen'ed path cannot be reloaded after a
# rebuild).
_HASH_MARKER = b"xshare-src-hash:"
_JAXLIB_MARKER = b"xshare-jaxlib:"


class BuildError(XShareError, RuntimeError):
    """The FFI fence libraries could not be built (the message says why and what to do)."""


def source_hash() -> str:
    """Hash of the C++ sources; a library built from other sources is stale."""
    h = hashlib.sha256()
    for src in SOURCES:
        h.update(src.name.encode())
        h.update(src.read_bytes())
    return h.hexdigest()[:16]


def jaxlib_version() -> str:
    """The version of the importable jaxlib (the one whose headers a build here uses)."""
    try:
        import jaxlib.version

        return str(jaxlib.version.__version__)
    except Exception as e:  # pragma: no cover - jaxlib is a hard dependency
        raise BuildError(f"cannot read the jaxlib version (is jaxlib installed?): {e}") from e


def is_fresh(lib: Path, jaxlib: str | None = None) -> bool:
    """True if ``lib`` exists, was built from the sources next to this file and, when
    ``jaxlib`` is given, against the FFI headers of that jaxlib version."""
    try:
        data = Path(lib).read_bytes()
    except OSError:
        return False
    if _HASH_MARKER + source_hash().encode() + b"\0" not in data:
        return False
    return jaxlib is None or _JAXLIB_MARKER + jaxlib.encode() + b"\0" in data


def built_for(lib: Path) -> str | None:
    """The jaxlib version ``lib`` was compiled against (None: unreadable or not recorded)."""
    try:
        data = Path(lib).read_bytes()
    except OSError:
        return None
    at = data.find(_JAXLIB_MARKER)
    if at < 0:
        return None
    end = data.find(b"\0", at)
    return data[at + len(_JAXLIB_MARKER):end].decode(errors="replace") if end > 0 else None


def find_compiler() -> list[str]:
    """The C++ compiler command: $CXX (may carry arguments, e.g. "ccache g++"), else the
    first of g++, clang++, c++ on PATH."""
    cxx = os.environ.get("CXX", "").strip()
    if cxx:
        parts = shlex.split(cxx)
        path = shutil.which(parts[0])
        if path:
            return [path, *parts[1:]]
        _log.warning("xshare.ffi: $CXX=%r not found; trying g++, clang++, c++", cxx)
    for cand in ("g++", "clang++", "c++"):
        path = shutil.which(cand)
        if path:
            return [path]
    raise BuildError(NO_COMPILER)


def ffi_include_dir() -> Path:
    """``jax.ffi.include_dir()``: the header-only ``xla/ffi/api/ffi.h``."""
    try:
        import jax.ffi

        inc = Path(jax.ffi.include_dir())
    except Exception as e:  # pragma: no cover - jax is a hard dependency
        raise BuildError(f"cannot locate the XLA FFI headers via jax.ffi.include_dir(): {e}") from e
    if not (inc / "xla" / "ffi" / "api" / "ffi.h").is_file():
        raise BuildError(f"XLA FFI header xla/ffi/api/ffi.h not found under {inc}")
    return inc


def _cuda_roots() -> list[Path]:
    roots: list[Path] = []
    for var in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"):
        if os.environ.get(var):
            roots.append(Path(os.environ[var]))
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(Path(nvcc).resolve().parent.parent)
    roots.append(Path("/usr/local/cuda"))
    # The CUDA runtime wheel that jax[cuda] installs (headers + libcudart.so.N).
    for entry in sys.path:
        roots.append(Path(entry or ".") / "nvidia" / "cuda_runtime")
    seen: set[Path] = set()
    out = []
    for r in roots:
        try:
            key = r.resolve()
        except OSError:
            continue
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def find_cuda() -> list[tuple[Path, Path, str]]:
    """CUDA installs usable for the CUDA fences: (include dir, lib dir, cudart file name)."""
    found = []
    for root in _cuda_roots():
        inc = root / "include"
        if not (inc / "cuda_runtime_api.h").is_file():
            continue
        for libdir in (root / "lib64", root / "lib", root / "targets" / "x86_64-linux" / "lib"):
            if (libdir / "libcudart.so").exists():
                found.append((inc, libdir, "libcudart.so"))
                break
            versioned = sorted(libdir.glob("libcudart.so.*"))
            if versioned:
                found.append((inc, libdir, versioned[0].name))
                break
    return found


def _run(cmd: list[str], what: str) -> None:
    _log.debug("xshare.ffi: %s", " ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise BuildError(f"{NO_COMPILER} (running {cmd[0]} failed: {e})") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-25:])
        raise BuildError(
            f"compiling {what} failed (exit {proc.returncode}):\n  {' '.join(cmd)}\n{tail}"
        )


def _compile(cmd_head: list[str], out: Path, what: str) -> None:
    # Build to a temporary name and rename: atomic for processes that load `out`
    # concurrently (or already have the old file mapped).
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        _run(cmd_head + ["-o", tmp], what)
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_library(out_dir, *, cuda: bool | None = None, include_dir=None,
                  jaxlib: str | None = None) -> list[Path]:
    """Compile the fence libraries into ``out_dir``; return the paths built.

    ``cuda``: None builds the CUDA variant when CUDA headers and cudart are found (a failure
    is logged and skipped); True requires it (BuildError otherwise); False skips it.
    ``include_dir`` / ``jaxlib``: the FFI headers to compile against and the jaxlib version
    they belong to, recorded in the libraries (default: the importable jaxlib's). Give both
    or neither: the recorded version is what decides, at load, whether to rebuild.
    """
    if (include_dir is None) != (jaxlib is None):
        raise ValueError("build_library: give both include_dir and jaxlib, or neither "
                         f"(got include_dir={include_dir!r}, jaxlib={jaxlib!r})")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cxx = find_compiler()
    if include_dir is None:
        inc, jaxlib = ffi_include_dir(), jaxlib_version()
    else:
        inc = Path(include_dir)
    if jaxlib is None:  # (a bug mypy found: re.fullmatch(None) was a TypeError)
        raise ValueError("build_library: include_dir= needs jaxlib=, the jaxlib version whose headers it holds")
    if not re.fullmatch(r"[\w.+-]+", jaxlib):
        raise ValueError(f"build_library: jaxlib version {jaxlib!r} is not a version string")
    marker = (_HASH_MARKER + source_hash().encode()).decode()
    defines = [f"-DXSHARE_SRC_HASH=\"{marker}\"",
               f"-DXSHARE_JAXLIB=\"{_JAXLIB_MARKER.decode()}{jaxlib}\""]

    installs = find_cuda() if cuda is not False else []
    if cuda and not installs:
        raise BuildError(
            "no CUDA headers/runtime found for the CUDA fences (looked for "
            "include/cuda_runtime_api.h and libcudart under $CUDA_HOME, $CUDA_PATH, "
            "nvcc's install, /usr/local/cuda and the nvidia-cuda-runtime wheel)"
        )

    cpu_out = out_dir / CPU_LIB
    _compile(
        [*cxx, *CXXFLAGS, f"-I{inc}", str(CPU_SRC), *defines, f"-Wl,-soname,{CPU_LIB}"],
        cpu_out,
        "the XLA FFI fences (fences.cc)",
    )
    built = [cpu_out]
    if cuda is False:
        return built

    if not installs:
        _log.debug("xshare.ffi: no CUDA headers/runtime found; CPU fences only")
        return built

    errors = []
    for cuda_inc, cuda_lib, cudart in installs:
        cudart_flag = "-lcudart" if cudart == "libcudart.so" else f"-l:{cudart}"
        try:
            _compile(
                [*cxx, *CXXFLAGS, f"-I{inc}", f"-I{cuda_inc}", str(CUDA_SRC), *defines,
                 f"-Wl,-soname,{CUDA_LIB}",
                 f"-L{out_dir}", f"-l:{CPU_LIB}", "-Wl,-rpath,$ORIGIN",
                 f"-L{cuda_lib}", cudart_flag, f"-Wl,-rpath,{cuda_lib}"],
                out_dir / CUDA_LIB,
                f"the CUDA XLA FFI fences (fences_cuda.cc, CUDA from {cuda_inc.parent})",
            )
        except BuildError as e:
            errors.append(str(e))
            continue
        built.append(out_dir / CUDA_LIB)
        return built
    if cuda:
        raise BuildError("\n".join(errors))
    _log.warning("xshare.ffi: CUDA fences not built; CPU fences only:\n%s", "\n".join(errors))
    return built


if __name__ == "__main__":  # python xshare/ffi/_build.py [OUT_DIR]
    logging.basicConfig(level=logging.INFO)
    for p in build_library(sys.argv[1] if len(sys.argv) > 1 else HERE):
        print(p)
