"""The GPU allocator settings a Runtime starts XLA with, and where each comes from."""

from __future__ import annotations

import pytest

from xshare.memory import device
from xshare.memory.device import configure_preallocation, preallocation_settings


def row(env: dict, name: str) -> dict:
    return {s["name"]: s for s in preallocation_settings(env)}[name]


@pytest.mark.parametrize("env, name, value, source, fatal, problem", [
    # nothing set: xshare's defaults (set when a Runtime starts)
    ({}, "XLA_PYTHON_CLIENT_PREALLOCATE", "true", "xshare default", False, None),
    ({}, "XLA_CLIENT_MEM_FRACTION", "0.9", "xshare default", False, None),
    ({}, "XLA_PYTHON_CLIENT_ALLOCATOR", "default", "XLA default", False, None),
    # xshare's own knob, then the deprecated XLA name, then the current one win in that order
    ({"XSHARE_MEM_FRACTION": "0.5"}, "XLA_CLIENT_MEM_FRACTION", "0.5", "env XSHARE_MEM_FRACTION", False, None),
    ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.4", "XSHARE_MEM_FRACTION": "0.5"}, "XLA_CLIENT_MEM_FRACTION",
     "0.4", "env XLA_PYTHON_CLIENT_MEM_FRACTION (deprecated name)", False, None),
    # both XLA names: jaxlib raises at backend start, so it is fatal and says which to unset
    ({"XLA_CLIENT_MEM_FRACTION": "0.5", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.4"}, "XLA_CLIENT_MEM_FRACTION",
     "0.5", "env XLA_CLIENT_MEM_FRACTION", True, "unset XLA_PYTHON_CLIENT_MEM_FRACTION"),
    ({"XLA_CLIENT_MEM_FRACTION": "1.5"}, "XLA_CLIENT_MEM_FRACTION", "1.5", "env XLA_CLIENT_MEM_FRACTION",
     True, "must be a number in (0, 1]"),
    # preallocation off: a warning (another process can take the arena's memory), not fatal
    ({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, "XLA_PYTHON_CLIENT_PREALLOCATE", "false",
     "env XLA_PYTHON_CLIENT_PREALLOCATE", False, "preallocation is off"),
    ({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}, "XLA_PYTHON_CLIENT_ALLOCATOR", "platform",
     "env XLA_PYTHON_CLIENT_ALLOCATOR", False, "reports no bytes_limit"),
    ({"XLA_PYTHON_CLIENT_ALLOCATOR": "tlsf"}, "XLA_PYTHON_CLIENT_ALLOCATOR", "tlsf",
     "env XLA_PYTHON_CLIENT_ALLOCATOR", True, "is not one of default, platform, bfc"),
])
def test_settings_and_their_sources(env, name, value, source, fatal, problem):
    got = row(env, name)
    assert (got["value"], got["source"], got["fatal"]) == (value, source, fatal)
    assert (got["problem"] is None) if problem is None else (problem in got["problem"])


def test_a_deprecated_fraction_is_not_joined_by_the_new_name(monkeypatch):
    # jaxlib refuses a GPU backend when both are set: configure_preallocation must not add one.
    monkeypatch.setattr(device, "_backend_started", lambda jax: False)
    for name in ("XLA_CLIENT_MEM_FRACTION", "XSHARE_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.3")
    configure_preallocation()
    import os

    assert "XLA_CLIENT_MEM_FRACTION" not in os.environ
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
    assert not row(dict(os.environ), "XLA_CLIENT_MEM_FRACTION")["fatal"]
