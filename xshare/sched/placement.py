"""Placement across devices: which runtime actor gets each job (or fusion group).

The only decision xshare makes across devices (Ray starts, places and restarts the actors;
DESIGN "Beyond one machine"). Pure like the policies: frozen views in, a typed answer out, no
jax, no ray, no clocks, so it is table-tested without either.

Rule: jobs go in priority order (larger first, then arrival, then name), each to the actor
with the most free arena bytes among those whose arena could ever hold it; placing a job takes
its bytes from that actor's tally, so one batch spreads over the actors. An actor with too
little free room *now* still takes a job its arena can hold (its runtime queues it until memory
frees up), but the roomiest actor is always preferred, and higher priorities choose first. A
job that no actor's arena can ever hold is refused with the numbers.

A job whose footprint is not known yet (it has not been compiled anywhere) counts as
``unknown_bytes`` (the caller passes its best estimate, e.g. the footprint of a compiled job
of the same entry; 0 when it has none): the actor's own admission refuses it later, with the
numbers, if the guess was wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._units import format_bytes


@dataclass(frozen=True)
class ActorView:
    """One runtime actor as its last snapshot showed it."""

    id: str
    capacity_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class Want:
    """A job or fusion group to place. ``bytes``: its arena footprint (P + S + E), or None."""

    name: str
    bytes: int | None = None
    priority: int = 0
    arrival: int = 0


@dataclass(frozen=True)
class Placed:
    name: str
    actor: str


@dataclass(frozen=True)
class Unplaceable:
    """No actor's arena can ever hold the job; ``reason`` says by how much."""

    name: str
    needs_bytes: int
    largest_bytes: int
    reason: str


@dataclass(frozen=True)
class Placement:
    placed: tuple[Placed, ...]
    refused: tuple[Unplaceable, ...]

    def by_actor(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for p in self.placed:
            out.setdefault(p.actor, []).append(p.name)
        return out


def place(wants: list[Want] | tuple[Want, ...], actors: list[ActorView] | tuple[ActorView, ...], *,
          unknown_bytes: int = 0) -> Placement:
    """Place every job of ``wants`` on one of ``actors`` (see the module docstring)."""
    if len({a.id for a in actors}) != len(actors):
        raise ValueError(f"actor ids must be unique; got {[a.id for a in actors]}")
    free = {a.id: int(a.free_bytes) for a in actors}
    count = {a.id: 0 for a in actors}
    placed: list[Placed] = []
    refused: list[Unplaceable] = []
    largest = max(actors, key=lambda a: (a.capacity_bytes, a.id), default=None)
    for want in sorted(wants, key=lambda w: (-w.priority, w.arrival, w.name)):
        need = unknown_bytes if want.bytes is None else int(want.bytes)
        able = [a for a in actors if a.capacity_bytes >= need]
        if not able:
            if largest is None:
                reason = f"job {want.name!r}: no runtime actor is alive to take it; start actors (or a Ray cluster)"
                refused.append(Unplaceable(want.name, need, 0, reason))
            else:
                reason = (f"job {want.name!r} needs {format_bytes(need)} of arena but the largest actor "
                          f"({largest.id}) has {format_bytes(largest.capacity_bytes)} in all: no actor can "
                          "ever admit it; give the actors more memory (--memory) or shrink the job")
                refused.append(Unplaceable(want.name, need, int(largest.capacity_bytes), reason))
            continue
        # Most free bytes first; then the fewest jobs placed in this batch (spreads jobs of
        # unknown size); then the id, so the answer never depends on the input order.
        best = min(able, key=lambda a: (-free[a.id], count[a.id], a.id))
        free[best.id] -= need
        count[best.id] += 1
        placed.append(Placed(want.name, best.id))
    return Placement(tuple(placed), tuple(refused))


__all__ = ["ActorView", "Want", "Placed", "Unplaceable", "Placement", "place"]
