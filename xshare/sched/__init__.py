"""Pure scheduling policies: which job each lane steps next, from a frozen snapshot.

Nothing here imports jax, reads a clock, or touches a device; the runtime passes everything in a
``View`` (``now`` included) and applies the returned ``Decision``.
"""

from __future__ import annotations

from .base import Policy as Policy
from .fair import Fair as Fair
from .fifo import Fifo as Fifo
from .pack import Pack as Pack
from .priority import Priority as Priority
from .srtf import Srtf as Srtf
from .view import Decision as Decision
from .view import JobView as JobView
from .view import View as View

__all__ = [
    # view
    "JobView", "View", "Decision",
    # base
    "Policy",
    # policies
    "Fifo", "Pack", "Srtf", "Fair", "Priority",
    # registry
    "POLICIES", "get_policy",
]

_BY_NAME: dict[str, type] = {
    "fifo": Fifo, "pack": Pack, "srtf": Srtf, "fair": Fair, "priority": Priority,
}
POLICIES: tuple[str, ...] = tuple(_BY_NAME)
"""The policy names ``Runtime(policy=...)``, ``xshare.run`` and ``xshare launch --policy`` accept:
``fifo``, ``pack``, ``srtf``, ``fair``, ``priority``."""


def get_policy(name: str | Policy) -> Policy:
    """A policy by name (case-insensitive), or a ``Policy`` instance passed through unchanged."""
    if isinstance(name, str):
        cls = _BY_NAME.get(name.strip().lower())
        if cls is None:
            raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(POLICIES)}")
        return cls()
    if isinstance(name, Policy):
        return name
    raise TypeError(
        f"policy must be a name ({', '.join(POLICIES)}) or a Policy object with "
        f"name, exclusive, init() and pick(); got {name!r}"
    )
