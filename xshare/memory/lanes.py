"""Layout arithmetic of the arena: free gaps, best fit, room after a lane, compaction plans.

Pure functions over ``Block``s (a lane's id, offset and size), sorted by offset and never
overlapping. They decide nothing about jobs; ``arena.Arena`` owns the lanes and calls them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import AbstractSet, NamedTuple


class Block(NamedTuple):
    """A lane as the layout sees it: ``[offset, offset + size)`` of the arena."""

    id: int
    offset: int
    size: int

    @property
    def end(self) -> int:
        return self.offset + self.size


def gaps(blocks: Sequence[Block], capacity: int) -> list[tuple[int, int]]:
    """Free intervals ``(start, length)`` between the blocks, lowest first; empty ones left out."""
    out = []
    cursor = 0
    for block in blocks:
        if block.offset > cursor:
            out.append((cursor, block.offset - cursor))
        cursor = max(cursor, block.end)
    if capacity > cursor:
        out.append((cursor, capacity - cursor))
    return out


def best_gap(free: Iterable[tuple[int, int]], need: int) -> int | None:
    """Start of the smallest gap that holds ``need`` bytes (the lowest one on a tie), or None."""
    fitting = [(length, start) for start, length in free if length >= need]
    return min(fitting)[1] if fitting else None


def room_after(blocks: Sequence[Block], capacity: int, block_id: int) -> int:
    """Free bytes directly after a block: up to the next block's start, or the arena's end."""
    for i, block in enumerate(blocks):
        if block.id == block_id:
            limit = blocks[i + 1].offset if i + 1 < len(blocks) else capacity
            return limit - block.end
    raise KeyError(f"no block with id {block_id!r} in the layout")


def compact(
    blocks: Sequence[Block], capacity: int, pinned: AbstractSet[int], toward: int | None = None
) -> dict[int, int]:
    """A compaction plan: the new offset of every block, in the same order (none passes another).

    Pinned blocks (a step of theirs is in flight) stay put and split the arena into segments;
    within a segment the movable blocks slide down to its start, so each segment's free space
    ends up in one piece at its end. With ``toward`` (a block id) that free piece is put right
    after that block instead: blocks after it in its segment slide *up* to the segment's end
    (for a pinned ``toward``, the segment that begins where it ends). That is what lets a lane
    other than the last one grow.
    """
    plan: dict[int, int] = {}
    segment: list[Block] = []
    start = 0
    grow_here = False  # the segment starts right after the pinned ``toward`` block

    def place(end: int) -> None:
        ids = [b.id for b in segment]
        if grow_here:
            split = 0
        elif toward in ids:
            split = ids.index(toward) + 1
        else:
            split = len(segment)
        cursor = start
        for block in segment[:split]:
            plan[block.id] = cursor
            cursor += block.size
        cursor = end
        for block in reversed(segment[split:]):
            cursor -= block.size
            plan[block.id] = cursor

    for block in blocks:
        if block.id in pinned:
            place(block.offset)
            plan[block.id] = block.offset
            segment, start, grow_here = [], block.end, block.id == toward
        else:
            segment.append(block)
    place(capacity)
    return plan


def moved(blocks: Sequence[Block], plan: dict[int, int]) -> list[Block]:
    """The blocks at their planned offsets (still sorted: plans never reorder)."""
    return [Block(b.id, plan[b.id], b.size) for b in blocks]
