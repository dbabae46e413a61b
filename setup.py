"""Build hook: compile xshare's XLA FFI fences (xshare/ffi/*.cc) at install time.

Metadata lives in pyproject.toml; this file only adds the compile step, so that both
``pip install .`` and ``pip install -e .`` produce the shared libraries with no manual step:

* regular install / wheel: into ``build/lib/xshare/ffi/``, packaged with the wheel;
* editable install: into the source tree's ``xshare/ffi/``, where the import finds them.

The libraries are compiled against the XLA FFI headers of the jaxlib in the *build*
environment and record its version. Under pip's build isolation that is the newest jaxlib for
this Python, not necessarily the one that will run; xshare then rebuilds them once, on first
use, for the running jaxlib (into ``~/.cache/xshare/ffi-<hash>-jaxlib<version>/``).
``pip install --no-build-isolation`` compiles against the installed jaxlib from the start.

``XSHARE_BUILD_FFI=0`` skips the step (xshare then compiles the fences on first use, or runs
without them: ``xshare.ffi.available()`` is False, with one warning). ``CXX`` picks the
compiler; ``CUDA_HOME`` the CUDA install for the CUDA variant (built when CUDA headers are
found).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _ffi_build():
    # Load xshare/ffi/_build.py by path: importing the xshare package here would start
    # jax's backends and need the package's dependencies.
    spec = importlib.util.spec_from_file_location(
        "_xshare_ffi_build", ROOT / "xshare" / "ffi" / "_build.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class build_py_with_fences(build_py):
    """build_py, then compile the FFI fence libraries next to the package's modules."""

    def run(self):
        super().run()  # in editable mode this copies nothing; we still build below
        self._fence_libs = []
        if os.environ.get("XSHARE_BUILD_FFI", "1") == "0":
            print("xshare: XSHARE_BUILD_FFI=0, not compiling the XLA FFI fences", file=sys.stderr)
            return
        if self.editable_mode:
            out = ROOT / "xshare" / "ffi"
        else:
            out = Path(self.build_lib) / "xshare" / "ffi"
        build = _ffi_build()
        try:
            self._fence_libs = build.build_library(out, cuda=None)
        except build.BuildError as e:
            raise SystemExit(f"error: {e}\n(set XSHARE_BUILD_FFI=0 to install without them)")
        for lib in self._fence_libs:
            print(f"xshare: built {lib}", file=sys.stderr)

    def get_outputs(self, include_bytecode=True):
        outputs = list(super().get_outputs(include_bytecode))
        if not self.editable_mode:
            outputs += [str(p) for p in getattr(self, "_fence_libs", [])
                        if str(p) not in outputs]
        return outputs


class BinaryDistribution(Distribution):
    """Platform wheel (cp3xx-linux_x86_64), not py3-none-any: it carries a native library."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": build_py_with_fences}, distclass=BinaryDistribution)
