"""What xshare reads from jax that jax does not promise: each use is feature-detected, with a
fallback, and tested on whichever jax runs the suite (CI runs it at both ends of the
supported range: noxfile.py)."""

from __future__ import annotations

import os
import subprocess
import sys

def test_backend_started_is_detected_on_this_jax():
    # A fresh process: before jax.devices() the backends have not started, after it they have.
    # If jax renamed what _backend_started probes, it falls back to True and this fails.
    code = ("import jax; from xshare.memory.device import _backend_started as s; "
            "print(s(jax)); jax.devices(); print(s(jax))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True"]


def test_backend_started_falls_back_when_jax_moves_things(monkeypatch):
    import jax
    from jax._src import xla_bridge

    from xshare.memory.device import _backend_started

    jax.devices()
    # Without the function: the dict it reads.
    monkeypatch.delattr(xla_bridge, "backends_are_initialized", raising=False)
    monkeypatch.setattr(xla_bridge, "_backends", {}, raising=False)
    assert _backend_started(jax) is False
    monkeypatch.setattr(xla_bridge, "_backends", {"cpu": object()})
    assert _backend_started(jax) is True
    # Without either: assume started (costs a log line, never a wrong setting).
    monkeypatch.delattr(xla_bridge, "_backends")
    assert _backend_started(jax) is True
