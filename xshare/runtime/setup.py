"""What a ``Runtime`` sets up in the process before it runs anything: the FFI fences (only once
they passed their canary on this machine) and XLA's persistent compilation cache."""

from __future__ import annotations

import os
from typing import Any

import jax

from .. import ffi
from .._errors import XShareError


def fences_wanted(fences: bool | None, device: Any) -> bool:
    if fences is False:
        return False
    loaded = getattr(ffi, "ensure_loaded", None)
    if loaded is not None:
        loaded()
    if fences is None and not ffi.enabled():
        return False
    if fences is not None and not ffi.available():
        raise XShareError("fences=True but the xshare FFI library is not available: "
                          f"{ffi.unavailable_reason()}")
    # The fences' device code runs here only once it has passed in a child process on this
    # machine (cached per machine); a failed canary turns them off, with one warning.
    from ..ffi import canary

    ok, verdict = canary.gate(device)
    if not ok and fences:
        assert verdict is not None  # gate() gives no verdict only under XSHARE_CANARY=skip, which passes
        raise XShareError(f"fences=True but the fence canary failed on this machine: {verdict.reason}. "
                          f"Run `xshare doctor`; {canary.ENV}=skip runs them unchecked")
    return ok


def compilation_cache_dir(value: bool | str | os.PathLike) -> str | None:
    """``Runtime(compilation_cache=...)``: turn on JAX's persistent compilation cache (see the
    argument's docs); the directory in use, or None."""
    from .compiled.compiler import enable_persistent_cache

    if value is False:
        return None
    if value is True:
        current = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # jax sets its options on Config at import (setattr)
        if current:
            return str(current)  # the user's own choice stands
        return enable_persistent_cache()
    if isinstance(value, (str, os.PathLike)):
        return enable_persistent_cache(os.fspath(value))
    raise ValueError(f"compilation_cache={value!r} must be True, False or a directory path")
