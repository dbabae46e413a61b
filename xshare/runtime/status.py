"""The runtime's status as data: the document ``GET /status``, ``GET /metrics`` and ``xshare top``
render (schema ``xshare.status/v1``: :mod:`.schema`; Prometheus rendering: :mod:`.metrics`).

The document is built by ``Runtime.snapshot()`` (:mod:`.snapshot`); renderers take it from there.
"""

from __future__ import annotations

from typing import Any

from .schema import SCHEMA_ID as SCHEMA_ID
from .schema import STATUS_SCHEMA as STATUS_SCHEMA
from .schema import validate as validate


def snapshot(rt: Any) -> dict[str, Any]:
    """``rt.snapshot()`` (kept for callers of the 0.1 function)."""
    return rt.snapshot()
