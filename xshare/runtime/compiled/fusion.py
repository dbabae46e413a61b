"""Fused sweeps: jobs of one program step together as one vmapped executable, each still a job.

A ``Group`` holds up to ``capacity`` (a power of two) jobs whose programs share a program key.
Their states live stacked on the device (every leaf gains a leading slot axis); each group step
stacks the members' own batches, runs ``vmap(step)`` once, and keeps a masked slot's state as
it was (``where(mask, new, old)``): empty slots, paused members and members whose data ran out
pass through unchanged. Members keep everything a job has: their own data source, step count,
metrics rows, checkpoints, controls and failure boundary (a bad batch, a data error or a NaN
fails that member alone; see README for what an exception inside the step does).

Numerics: a member computes exactly what the same vmapped step computes in a plain loop at the
same capacity, whatever the other slots hold (vmap adds no reduction across slots). It is not
bit-identical to the unfused job: vmap changes XLA's reduction order (docs/explanation/fusion.md).

One compiled executable per (program, capacity, fenced), cached process-wide like the programs.
"""

from __future__ import annotations

import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ... import ffi
from ...memory.footprint import Footprint, footprint_from_analysis
from ..config import COLD_COMPILE_S
from .compiler import PROGRAMS, CompiledStep, tree_nbytes
from .executables import EXECUTABLES, zeros_like

GROUP_INFLIGHT_BYTES = 64 << 20    # ... as long as the in-flight stacked batches stay under this


@dataclass(frozen=True)
class FusedProgram:
    executable: Any        # (stacked state leaves, (stacked batch leaves, mask)[, ident]) -> (state, metrics[C, M])
    capacity: int
    footprint: Footprint   # persistent = capacity x one state; ephemeral from memory_analysis
    flops: float | None
    moves: Future | None   # -> (put, take): (stacked, one slot's leaves, slot) -> stacked; (stacked, slot) -> leaves
    #                        (None: slots move through host memory, see ``host_moves``)
    compile_s: float       # what compiling the step cost (to judge whether a shrink pays)
    rent: "HostMoves | None" = None  # where slots move through host memory: when to stop (``HostMoves``)


# On a CPU device a stack up to this size moves its slots through numpy (the device's memory is
# the host's: a copy of the stack costs microseconds) rather than through compiled moves, whose
# compile (~0.26 s of XLA for a Flax TrainState's 16 leaves at 8 slots, ~0.5 s beside a running
# group on 2 cores) cost a cold fused run more than every move it makes.
HOST_MOVES_BYTES = 64 << 20
# What compiled moves are taken to cost (their compile beside a running group on 2 cores): host
# moves of a stack on the device that have cost this much pay for compiling them (``HostMoves``).
MOVES_COMPILE_S = 0.3


class HostMoves:
    """A group whose slots move through host memory (``host_moves``), and when to stop: ski
    rental's rule again. A move of a stack that is still the host copy it was formed in costs
    microseconds; once the group has stepped, its stack is on the device and each move copies
    all of it to the host behind every group call in flight (8-10 ms a move on the digits study's
    groups, 83 of them: ~0.7 s of its dispatcher's time, no group stepping meanwhile). Those
    moves are measured, and once they have cost what compiling the moves would
    (``MOVES_COMPILE_S``), the moves compile on a thread of their own and are used once ready;
    kept whole beside the cache like the group program, so where this machine compiled them
    before they load at once (a few ms) and no move goes through the host."""

    def __init__(self, build: Any, kept: bool):
        self._build = build
        self.spent_s = 0.0
        self.moves: Future | None = None
        self._lock = threading.Lock()
        if kept:
            self.start()

    def start(self) -> None:
        with self._lock:
            if self.moves is not None:
                return
            self.moves = Future()
        # (not a daemon, as for the moves compiled at once: see ``fused_program``)
        threading.Thread(target=_compile_into, name="xshare-compile-moves", daemon=False,
                         args=(self.moves, self._build)).start()

    def paid(self, seconds: float) -> None:
        """A move of a stack on the device went through the host and took ``seconds``."""
        self.spent_s += seconds
        if self.spent_s >= MOVES_COMPILE_S and self.moves is None:
            self.start()

    def ready(self) -> Any:
        """The compiled (put, take), or None while they are not (or could not be) built."""
        moves = self.moves
        if moves is None or not moves.done() or moves.exception() is not None:
            return None
        return moves.result()

_cache: dict[tuple, FusedProgram] = {}
_lock = threading.Lock()


def pipeline_depth(ahead: int, group_ahead: int, stacked_batch_bytes: int) -> int:
    """How many steps may be in flight behind a group's: ``group_ahead``, as long as their
    stacked batches stay under ``GROUP_INFLIGHT_BYTES`` (never fewer than a job's ``ahead``).
    A group step makes N members' batches on the host, so host hiccups (a data source making its
    batches in blocks, the GIL) are N times larger than a solo job's; a deeper pipeline lets the
    device ride them out (measured: 32 jobs fused ran 0.98x a hand-written vmap loop at depth 32,
    0.89x at 8). The group's footprint charges these in-flight batches (``fused_program``)."""
    if group_ahead <= ahead:
        return ahead
    return max(ahead, min(group_ahead, GROUP_INFLIGHT_BYTES // max(stacked_batch_bytes, 1)))


def fused_program(program: CompiledStep, capacity: int, device: Any, *, fenced: bool,
                  prefetch: int, ahead: int = 0, group_ahead: int = 0) -> FusedProgram:
    """The vmapped executable of ``program`` at ``capacity`` slots (compiled once per process).
    Its footprint's staging charges every stacked batch that can be resident: ``prefetch``
    staged plus those in flight behind its steps (``pipeline_depth``)."""
    key = (program.key, capacity, fenced, prefetch, ahead, group_ahead)
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            return hit
        body = group_body(program.flat)
        sharding = jax.sharding.SingleDeviceSharding(device)
        args = _group_args(program, capacity, device, fenced)
        states = args[0]
        fn = ffi.fenced(body, donated=True) if fenced else body

        def lower() -> Any:
            return jax.jit(fn, donate_argnums=(0, 1)).lower(*args)

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            # (seconds: XLA's part only, as for single programs; a kept executable's load)
            compiled, seconds, _ = EXECUTABLES.compile_program(("group", program.key, capacity), lower, args,
                                                               fenced=fenced, device=device)
        # The slot moves at this capacity compile afterwards, on a thread of their own: a group
        # forms on the host (see ``put``) and needs them only when a member joins a group that
        # already stepped, or leaves it, so its first step does not wait for them. Compiled
        # ahead (not when first needed) so joining or leaving never compiles on the dispatcher.
        slot = jax.ShapeDtypeStruct((), np.int32, sharding=sharding)
        one = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)
               for s in jax.tree.leaves(program.state_struct)]
        moves: Future | None = None
        rent: HostMoves | None = None
        build = lambda: _moves(program.key, capacity, states, one, slot, device)  # noqa: E731
        if not host_moves(device, tree_nbytes(states)):
            moves = Future()
            # Not a daemon: a process that ends while XLA compiles on a daemon thread aborts in
            # C++ at exit ("FATAL: exception not rethrown"); exit waits for this instead (< 1 s).
            threading.Thread(target=_compile_into, name="xshare-compile-moves", daemon=False,
                             args=(moves, build)).start()
        else:
            rent = HostMoves(build, kept=_moves_kept(program.key, capacity, device, tree_nbytes(states)))
        from .compiler import PROGRAMS
        # One ledger of compiles per process; like a hit in XLA's persistent cache, a kept
        # executable's load counts as its program's compile (Runtime.compiles: programs built).
        PROGRAMS._count(seconds)
        state_bytes = capacity * tree_nbytes(program.state_struct)
        batch_bytes = capacity * tree_nbytes(program.batch_struct) + capacity
        depth = pipeline_depth(ahead, group_ahead, capacity * tree_nbytes(program.batch_struct))
        fp = footprint_from_analysis(compiled.memory_analysis(), state_bytes=state_bytes,
                                     batch_bytes=batch_bytes, prefetch=prefetch + depth, job="fused group",
                                     hlo=compiled.as_text)
        from .compiler import _flops
        out = FusedProgram(compiled, capacity, fp, _flops(compiled), moves, seconds, rent)
        _cache[key] = out
        return out


def _group_args(program: CompiledStep, capacity: int, device: Any, fenced: bool) -> list:
    """The group program's arguments as ShapeDtypeStructs: stacked states, (stacked batches,
    slot mask)[, the fences' ident]."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    stack = lambda s: jax.ShapeDtypeStruct((capacity, *s.shape), s.dtype, sharding=sharding)  # noqa: E731
    states = [stack(s) for s in jax.tree.leaves(program.state_struct)]
    batches = [stack(s) for s in jax.tree.leaves(program.batch_struct)]
    mask = jax.ShapeDtypeStruct((capacity,), np.bool_, sharding=sharding)
    args: list[Any] = [states, (batches, mask)]
    if fenced:
        args.append(jax.ShapeDtypeStruct((3,), np.int32, sharding=sharding))
    return args


def group_body(flat: Any) -> Any:
    """One group step over stacked states: ``vmap`` of the flat step, masked slots kept."""
    def body(states, batch_and_mask):
        batches, mask = batch_and_mask
        new, metrics = jax.vmap(flat)(states, batches)
        kept = [jnp.where(mask.reshape(mask.shape + (1,) * (n.ndim - 1)), n, o)
                for n, o in zip(new, states)]
        return kept, metrics

    return body


def _moves(program_key: str, capacity: int, states: list, one: list, slot: Any, device: Any) -> tuple:
    """The slot moves (``put``, ``take``) at this capacity, kept whole like the group program:
    tracing and lowering them (~50 ms for a Flax TrainState's leaves) held the GIL against the
    dispatcher during the group's first steps, in every process; a kept pair loads in a few ms."""
    nbytes = tree_nbytes(states)
    put, _, _ = EXECUTABLES.compile(
        EXECUTABLES.key("put", program_key, capacity, device=device), lambda: _put.lower(states, one, slot),
        device=device, nbytes=nbytes, trial=lambda c: c(*zeros_like([states, one, slot])))
    take, _, _ = EXECUTABLES.compile(
        EXECUTABLES.key("take", program_key, capacity, device=device), lambda: _take.lower(states, slot),
        device=device, nbytes=nbytes, trial=lambda c: c(*zeros_like([states, slot])))
    return put, take


def _moves_kept(program_key: str, capacity: int, device: Any, nbytes: int) -> bool:
    """Whether this machine kept the slot moves of ``program_key`` at ``capacity`` (``_moves``)."""
    return all(EXECUTABLES.has(EXECUTABLES.key(name, program_key, capacity, device=device), nbytes)
               for name in ("put", "take"))


def _compile_into(future: Future, compile_fn: Any) -> None:
    try:
        future.set_result(compile_fn())
    except BaseException as err:  # noqa: BLE001 - raised where the result is read
        future.set_exception(err)


# Slot moves: one small jitted call each, not one dispatch per leaf.
@jax.jit
def _take(states, slot):
    return [x[slot] for x in states]


@jax.jit
def _put(states, values, slot):
    return [x.at[slot].set(v) for x, v in zip(states, values)]


@jax.jit
def _gather(states, slots):
    return [x[slots] for x in states]


def on_host(states: list) -> bool:
    """Whether a group's stack is still the host copy it was formed in (it has not stepped)."""
    return not states or type(states[0]) is np.ndarray


def host_stack(program: CompiledStep, capacity: int) -> list:
    """A new group's stack, on the host: members are written into it in place (no compile,
    no dispatch), and it goes to the device with the group's first step."""
    return [np.zeros((capacity, *s.shape), s.dtype) for s in jax.tree.leaves(program.state_struct)]


def host_moves(device: Any, stack_bytes: int) -> bool:
    """Whether a group's slots move through host memory (see ``HOST_MOVES_BYTES``)."""
    return device.platform == "cpu" and stack_bytes <= HOST_MOVES_BYTES


def take(fused: FusedProgram, states: list, slot: int) -> list:
    """One slot's state leaves (new arrays: safe from the group's next donation)."""
    if not on_host(states):
        moves = compiled_moves(fused)
        if moves is not None:
            return moves[1](states, np.int32(slot))
    # (the moves still compiling: one copy of the stack to the host beats waiting for them)
    t0 = time.perf_counter()
    out = [np.array(x[slot]) for x in jax.device_get(states)]
    _paid(fused, states, t0)
    return out


def compiled_moves(fused: FusedProgram) -> Any:
    """The group's compiled slot moves (put, take) if they are ready, else None."""
    if fused.moves is not None:
        return fused.moves.result() if fused.moves.done() else None
    return fused.rent.ready() if fused.rent is not None else None


def _paid(fused: FusedProgram, states: list, t0: float) -> None:
    if fused.rent is not None and not on_host(states):
        fused.rent.paid(time.perf_counter() - t0)


def put(fused: FusedProgram, states: list, values: list, slot: int) -> list:
    """``states`` with ``values`` in ``slot``: written in place while the stack is on the host;
    while the moves still compile (a member joins right after its group's first steps), the
    stack comes back to the host rather than the dispatcher waiting for them (as it always
    does where slots move through host memory: ``host_moves``)."""
    moves = None if on_host(states) else compiled_moves(fused)
    if moves is not None:
        return moves[0](states, jax.device_put(values, states[0].sharding, may_alias=False), np.int32(slot))
    if not on_host(states):
        t0 = time.perf_counter()
        device_states = states
        states = [np.array(x) for x in jax.device_get(states)]
        _paid(fused, device_states, t0)
    for x, v in zip(states, values):
        x[slot] = np.asarray(v)
    return states


def cached(program: CompiledStep, capacity: int, *, fenced: bool, prefetch: int, ahead: int = 0,
           group_ahead: int = 0) -> bool:
    """Whether ``fused_program`` for this capacity is compiled already (free to switch to)."""
    return (program.key, capacity, fenced, prefetch, ahead, group_ahead) in _cache


def loads(program: CompiledStep, capacity: int, device: Any, *, fenced: bool, prefetch: int, ahead: int = 0,
          group_ahead: int = 0) -> bool:
    """Whether ``fused_program`` for this capacity costs no XLA compile: compiled in this
    process, or kept whole beside the compilation cache (a few ms to load)."""
    if cached(program, capacity, fenced=fenced, prefetch=prefetch, ahead=ahead, group_ahead=group_ahead):
        return True
    return EXECUTABLES.has_program(("group", program.key, capacity), _group_args(program, capacity, device, fenced),
                                   fenced=fenced, device=device)


def group_compile_s(program: CompiledStep, capacity: int, device: Any, *, fenced: bool,
                    staging: dict[str, int]) -> float:
    """What opening a group of ``program`` at ``capacity`` costs in compiling, as the fuse
    decision weighs it (``payoff.FusionVerdicts.weigh``; submit and ``explain`` both ask here):
    nothing if its program is compiled or kept beside the cache (``loads``), else the slowest
    compile this process has seen, at least ``COLD_COMPILE_S``. ``staging``:
    ``RuntimeConfig.staging`` (part of the program's key)."""
    if loads(program, capacity, device, fenced=fenced, **staging):
        return 0.0
    return max(PROGRAMS.slowest_compile_s, COLD_COMPILE_S)


def regroup(states: list, slots: list[int], capacity: int) -> list:
    """The states of ``slots`` (in that order) in a stack of ``capacity`` slots, zero-padded."""
    idx = np.zeros((capacity,), np.int32)
    idx[:len(slots)] = slots
    if on_host(states):
        return [x[idx] for x in states]
    return _gather(states, idx)
