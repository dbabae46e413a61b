"""Fusion-group capacity: how many slots a group opens with, whether a lone job opens one,
and whether a group that lost members is repacked into a smaller program.

Pure like the policies: the dispatcher (``runtime/engine/groups.py``) and the compile pool
(``runtime/prepare.py``) pass counts and measured costs in and apply the answer; nothing here
imports jax, reads a clock or touches a device.

Capacities are powers of two: every capacity is its own compiled program (and its own slot
moves and vmapped evaluation), so few distinct sizes mean few compiles.

``group_capacity`` is the runtime's floor (``Runtime(fuse=True, group_capacity=N)``; a study sets
it to its concurrency): a workload that knows how many jobs of one program run at once opens
each group with room for all of them and never shrinks it below that, so it compiles one group
program per program, not one per size its membership passes through. What that trades: an
empty slot is computed and masked away (a group step costs its capacity, not its members), and
on a small model a compile costs far more. Measured on the digits study (2-core CPU, 64 trials,
concurrency 8): 6 group programs at capacities 2, 4 and 8 cost 4.3-5.7 s of compile, their 12 slot-move and
5-6 vmapped-eval compiles 3.8-5.4 s more, against a member step of well under a millisecond.
"""

from __future__ import annotations

SHRINK_PAYBACK = 2.0   # a smaller program must save this many times its compile to be compiled


def pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def floor_capacity(group_capacity: int | None) -> int:
    """The fewest slots a group has under ``group_capacity`` (0: no floor)."""
    return 0 if group_capacity is None else max(2, pow2(group_capacity))


def open_capacity(joining: int, group_capacity: int | None = None) -> int:
    """Slots for a new group that ``joining`` jobs enter at once (those submitted together on
    its program, plus running jobs that move in): room for all of them, at least two (there is
    no group of one) and at least the floor."""
    return max(2, pow2(joining), floor_capacity(group_capacity))


def parallel_groups(joining: int, streams: int, group_capacity: int | None = None) -> int:
    """How many groups ``joining`` jobs of one program, submitted together, open: one for each
    execution stream that runs beside the others (``streams``: a CPU backend's cores, see
    ``runtime/engine/streams.py``; 1 elsewhere), each with two of them at least.

    A group's step is one executable call, and a call runs on one stream: one group of eight
    left a 2-core CPU's second core to the dispatcher, which at K steps a call is mostly idle.
    Two groups of four, on lanes (and streams) of their own, ran the same 3,000 steps of the
    hook's eight Flax nets at K=16 in 133-136 ms against 224-248 for the one group (a hand-made
    ``/tmp`` measurement, this project's 2-core VM). Under a floor (a study's concurrency) one
    group: its refills join it without a compile."""
    if group_capacity is not None or streams <= 1:
        return 1
    return max(1, min(streams, joining // 2))


def split_capacity(joining: int, streams: int, group_capacity: int | None = None) -> int:
    """The slots of each of the ``parallel_groups`` groups that ``joining`` jobs open."""
    groups = parallel_groups(joining, streams, group_capacity)
    return open_capacity(-(-joining // groups), group_capacity)


def opens_alone(together: int, movers: int, shared: bool, group_capacity: int | None = None) -> bool:
    """Whether a job that finds no group of its program opens one (True) or steps alone.

    ``together``: jobs of its submit call on its program, itself included; ``movers``: running
    jobs that can move into a group of its program at this step boundary; ``shared``: other jobs
    of its family ran or run this very program (sweeps.Choice.shared). Without a floor a group
    opens only for two or more jobs at once. With one, a job of a shared program opens it alone:
    more are coming (a study asks the next trial as one ends), and they join without a compile.
    A job whose program nobody else runs still steps alone: its group would stay a group of one
    paying for empty slots."""
    if together >= 2 or movers > 0:
        return True
    return group_capacity is not None and shared


def shrink_target(members: int, capacity: int, group_capacity: int | None = None) -> int | None:
    """The smaller capacity to repack a group of ``capacity`` slots into after members left
    (``members`` remain), or None to keep it: only when they fit in a quarter of the slots (a
    laxer rule would thrash between two sizes as jobs come and go), never below the floor."""
    target = max(2, pow2(members), floor_capacity(group_capacity))
    return target if target * 4 <= capacity else None


def shrink_pays(target: int, capacity: int, *, steps_left: int | None, step_s: float,
                compile_s: float) -> bool:
    """Whether compiling the ``target``-slot program wins its time back: the members' remaining
    group steps (``steps_left``, the longest member's; None: unbounded), each ``step_s`` long
    at ``capacity``, shortened in proportion to the slots dropped, must save ``SHRINK_PAYBACK``
    times the compile (``compile_s``: the current program's, as the estimate)."""
    left = 10**6 if steps_left is None else steps_left
    return left * step_s * (1 - target / capacity) >= SHRINK_PAYBACK * compile_s
