"""The device effects of fusion groups: their vmapped programs and stacked states.

``groups.Groups`` decides (which group a job joins, when one opens, grows, shrinks or closes,
against the ledger) without jax; this compiles and moves arrays. Runs on the dispatcher thread.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ... import ffi
from ..compiled import fusion
from .group import Group


class GroupDevice:
    """Group programs at a capacity, and slot moves in a group's stacked state, on ``device``."""

    def __init__(self, device: Any, ring: int | None, staging: dict[str, int]):
        self.device, self.ring, self.staging = device, ring, staging
        self.platform: str = device.platform

    def program(self, program: Any, capacity: int) -> Any:
        """The vmapped program of ``program`` at ``capacity`` slots (compiled once per process)."""
        return fusion.fused_program(program, capacity, self.device, fenced=self.ring is not None,
                                    **self.staging)

    def cached(self, program: Any, capacity: int) -> bool:
        """Whether that program costs no compile (compiled already, or kept whole: a resize to
        it is free)."""
        return fusion.loads(program, capacity, self.device, fenced=self.ring is not None, **self.staging)

    def open(self, gid: int, program: Any, fused: Any, lane: int, name: str) -> Group:
        """A new, empty group on ``lane``: zeroed stacked state on the host, its fence id."""
        arrays = fusion.host_stack(program, fused.capacity)
        ident = (jax.device_put(ffi.ident(self.ring, gid, lane), self.device)
                 if self.ring is not None else None)
        zeros = [np.zeros(s.shape, s.dtype) for s in jax.tree.leaves(program.batch_struct)]
        return Group(gid, program, fused, lane, arrays, ident, zeros, name=name)

    def put(self, group: Group, leaves: list, slot: int) -> None:
        """A member's state leaves into ``slot`` of the group's stack."""
        group.arrays = fusion.put(group.fused, group.arrays, leaves, slot)

    def regroup(self, group: Group, slots: list[int], fused: Any) -> None:
        """Restack the states of ``slots`` (in that order) into ``fused``'s capacity."""
        group.arrays = fusion.regroup(group.arrays, slots, fused.capacity)

