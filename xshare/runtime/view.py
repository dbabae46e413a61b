"""What a reader of the runtime's state gets (``Runtime.inspect``): one frozen view, taken on the
dispatcher thread between two steps, so every part of it is of the same instant.

The status document (``observe/snapshot.py``) is built from it and from nothing else of the
runtime's. The figures are plain values; the jobs, groups and models are the engine's own
records, which only the dispatcher thread changes: read them inside ``inspect``'s call, and hand
plain data out of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..memory import Arena
from .engine.records import JobRecord


@dataclass(frozen=True)
class RuntimeView:
    """The runtime at one point between two steps."""

    t0: float                     # the runtime's clock origin (``now_s()`` at construction)
    policy: str                   # the scheduling policy's name
    fences: bool                  # whether steps carry FFI fences
    quantum: int                  # steps a job keeps its lane per turn
    closed: bool                  # whether close() has begun
    compiles: int                 # XLA compiles of this process's program cache
    capacity_source: str          # where the arena's size came from
    peak_in_flight_bytes: int     # the most arena bytes reserved by steps in flight at once
    fused_member_steps: int       # member steps run in fused groups, ever
    arena: Arena                  # the reservation ledger (lanes, queue, free bytes)
    jobs: tuple[JobRecord, ...]   # every submitted job, in submission (id) order
    groups: tuple[Any, ...]       # the fused groups now open
    models: tuple[Any, ...]       # the deployed models (every version)
