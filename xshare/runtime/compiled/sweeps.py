"""Which program a job of a fused runtime runs, and why a job runs alone: one answer for the
runtime (``Runtime(fuse=True)``) and the dry run (``Runtime.explain``, ``launch --fuse --dry-run``).

Jobs whose steps lower to one program share it (the program key, ``compiler.program_key``).
Jobs whose steps differ only in the values of constants (``optax.adam(lr_i)``) form a *family*
(equal jaxpr skeletons, ``lifting``): the family's first job is its reference, and as soon as
a member differs from it, the family gets a *lifted* program taking the differing constants as
operands; every member then runs that program with its own values, and they fuse as one group.
A later member that differs somewhere new widens the set of lifted constants (a new program,
hence a new group); those already running keep theirs.

Pure bookkeeping over programs: nothing here touches a device or a job's state.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...sched.capacity import parallel_groups, split_capacity
from .compiler import PROGRAMS, CompiledStep
from .lifting import NotLiftable
from .payoff import FUSION, unmeasured


@dataclass
class Choice:
    """What a job runs: ``program`` with ``lifted`` appended to its state's arrays."""

    program: CompiledStep
    lifted: tuple = ()
    traced: Any = None           # its own literal program read as data (None: not liftable)
    peers: int = 1               # jobs of its family so far, itself included
    # Whether other jobs of its family run (or ran) this very program: its family's lifted
    # program, or a literal program equal to the family's first (no constant differs yet). A
    # job of a family that could not lift what differs runs a program of its own (False).
    shared: bool = False


@dataclass(eq=False)
class _Family:
    ref: CompiledStep            # the first member's literal program
    traced: Any                  # ... read as data
    positions: tuple = ()        # sites lifted by ``program``
    program: CompiledStep | None = None
    refused: str | None = None   # why constants cannot be lifted here
    members: list = field(default_factory=list)


class Sweeps:
    """A runtime's families; thread-safe (the compile pool assigns, the dispatcher adopts)."""

    def __init__(self, device: Any):
        self.device = device
        self._families: dict[str, _Family] = {}
        self._lock = threading.Lock()

    def assign(self, programs: list[CompiledStep]) -> list[Choice]:
        """The program each of ``programs`` (jobs' literal programs, in submission order) runs.
        Jobs submitted together are assigned together: the lifted set covers them all."""
        with self._lock:
            traced = [self._read(p) for p in programs]
            touched: dict[int, _Family] = {}
            for p, t in zip(programs, traced):
                if t is None:
                    continue
                fam = self._families.get(t.skeleton)
                if fam is None:
                    fam = self._families[t.skeleton] = _Family(ref=p, traced=t)
                fam.members.append(t)
                touched[id(fam)] = fam
            for fam in touched.values():
                self._widen(fam)
            out = []
            for p, t in zip(programs, traced):
                fam = self._families.get(t.skeleton) if t is not None else None
                peers = len(fam.members) if fam is not None else 1
                if fam is None or fam.program is None or not set(fam.traced.differing(t)) <= set(fam.positions):
                    same = fam is not None and peers >= 2 and not fam.traced.differing(t)
                    out.append(Choice(p, (), t, peers, shared=same))
                else:
                    out.append(Choice(fam.program, values_at(t, fam.positions), t, peers, shared=peers >= 2))
            return out

    def lifting(self) -> bool:
        """Whether any family has a lifted program yet (else ``covering`` cannot answer)."""
        with self._lock:
            return any(fam.program is not None for fam in self._families.values())

    def covering(self, traced: Any, metric_names: tuple) -> Choice | None:
        """What ``assign`` would answer for a job whose step reads as ``traced`` when its family
        already has a lifted program that covers it (its constants differ from the family's only
        where that program takes them as operands): that program and its values, the job counted
        a member. None: its literal program is needed (``assign``). A study's later trials are
        answered here from their jaxpr alone, never lowered on their own."""
        with self._lock:
            fam = self._families.get(traced.skeleton)
            if fam is None or fam.program is None or fam.refused or fam.program.metric_names != metric_names:
                return None
            if not set(fam.traced.differing(traced)) <= set(fam.positions):
                return None
            fam.members.append(traced)
            return Choice(fam.program, values_at(traced, fam.positions), traced, len(fam.members), shared=True)

    def adoptable(self, traced: Any, program: CompiledStep) -> tuple | None:
        """The lifted values with which a job whose literal program reads as ``traced`` can run
        ``program`` (a family's lifted program), or None if it cannot."""
        if traced is None:
            return None
        with self._lock:
            fam = self._families.get(traced.skeleton)
            if fam is None or fam.program is not program:
                return None
            if not set(fam.traced.differing(traced)) <= set(fam.positions):
                return None
            return values_at(traced, fam.positions)

    def why_alone(self, traced: Any, program: CompiledStep) -> str | None:
        """Why a job whose literal program is ``program`` cannot share a family's program."""
        if program.host_callback:
            return "its step calls back into Python (a host callback): it shares a program only with jobs of the same step function"
        fam = self._families.get(traced.skeleton) if traced is not None else None
        if fam is not None and fam.refused:
            return fam.refused
        return None

    def _read(self, program: CompiledStep) -> Any:
        if program.host_callback or program.jaxpr is None:
            return None
        return program.traced()

    def _widen(self, fam: _Family) -> None:
        if fam.refused:
            return
        positions = set(fam.positions)
        for t in fam.members:
            positions |= set(fam.traced.differing(t))
        if not positions or positions == set(fam.positions):
            return
        chosen = tuple(sorted(positions))
        try:
            program = PROGRAMS.lifted(fam.ref, fam.traced, list(chosen), device=self.device)
        except NotLiftable as err:
            fam.refused = f"a constant that differs between these jobs cannot be lifted: {err}"
            return
        fam.positions, fam.program = chosen, program


def values_at(traced: Any, positions: tuple) -> tuple:
    return tuple(np.asarray(traced.values[p]) for p in positions)


@dataclass(frozen=True)
class FusionPlan:
    groups: list[list[str]]    # job names that would fuse, one list per program
    alone: dict[str, str]      # job name -> why it would run alone, in words a user can act on
    # per list of ``groups``: (the groups its jobs open, the slots of each): one per execution
    # stream that runs beside the others (sched/capacity.py: parallel_groups)
    split: list[tuple[int, int]] = field(default_factory=list)


def explain(specs: list, device: Any = None, *, fenced: bool = False, streams: int | None = None,
            staging: dict[str, int] | None = None) -> FusionPlan:
    """Which of ``specs`` a fused runtime would run fused (one list of names per program) and,
    for every job that would run alone, why. The same steps the runtime takes (the program
    cache's lowering and key, this module's families), minus compiling: nothing is compiled or
    placed. ``fenced``: key the programs as a runtime with fences does (its measured fusion
    verdicts are under those keys). ``streams``: the execution streams its groups are split
    over (``engine.streams.parallel_streams``; None: the device's, lanes in parallel).
    ``staging``: the runtime's ``RuntimeConfig.staging`` (a group program kept beside the
    compilation cache under it costs a load, not a compile; None: a default Runtime's)."""
    import jax

    from ..engine.streams import parallel_streams

    from ..config import RuntimeConfig
    from ..engine.source import END, BatchSource
    from .fusion import group_compile_s
    from .leaves import layout_of

    device = device if device is not None else jax.devices()[0]
    staging = staging if staging is not None else RuntimeConfig.of(None).staging  # (a default Runtime's)
    streams = parallel_streams(device, True) if streams is None else streams
    alone: dict[str, str] = {}
    named: list[tuple[str, CompiledStep, Any]] = []
    for spec in specs:
        first = BatchSource(spec.data, start=spec.start_step, stop=spec.steps).peek()
        if first is END:
            alone[spec.name] = "it has no batches to run"
            continue
        try:
            program = PROGRAMS.get(spec.job, spec.state, first, device=device, fenced=fenced, compile=False)
        except Exception as err:  # noqa: BLE001 - the job would fail alone; say so
            alone[spec.name] = f"its step does not compile: {type(err).__name__}: {err}"
            continue
        named.append((spec.name, program, layout_of(spec.state)[1]))
    sweeps = Sweeps(device)
    choices = sweeps.assign([p for _, p, _ in named])
    by_key: dict[str, list[str]] = {}
    for (name, _, _), choice in zip(named, choices):
        by_key.setdefault(choice.program.key, []).append(name)
    steps = {spec.name: (None if spec.steps is None else spec.steps - spec.start_step) for spec in specs}
    programs = {choice.program.key: choice.program for choice in choices}
    for key, names in list(by_key.items()):
        # Fusion only where it pays (payoff.py): a program measured to lose fused, or whose
        # group compile these jobs' steps would not repay, or that nothing measured and that is
        # known to lose on this platform, runs them alone, as the runtime would.
        lefts = [steps[n] for n in names]
        known = [x for x in lefts if x is not None]
        capacity = split_capacity(len(names), streams)  # (each group's, as Groups.join opens them)
        reason = None if len(names) < 2 else FUSION.weigh(
            key, capacity, min(len(names), capacity), sum(known) if len(known) == len(lefts) else None,
            group_compile_s(programs[key], capacity, device, fenced=fenced, staging=staging),  # (as submit)
            prior=unmeasured(device.platform, programs[key].convolves))
        if reason is not None:
            alone.update({n: reason for n in names})
            del by_key[key]
    groups = [names for names in by_key.values() if len(names) > 1]
    biggest = max(groups, key=len)[0] if groups else None
    info = {name: (program, layout, choice) for (name, program, layout), choice in zip(named, choices)}
    for names in by_key.values():
        if len(names) > 1:
            continue
        name = names[0]
        program, layout, choice = info[name]
        alone[name] = (sweeps.why_alone(choice.traced, program)
                       or _against_others(name, program, layout, choice, info, biggest))
    split = [(parallel_groups(len(names), streams), split_capacity(len(names), streams)) for names in groups]
    return FusionPlan(groups, alone, split)


def _against_others(name: str, program: CompiledStep, layout: Any, choice: Choice, info: dict,
                    biggest: str | None) -> str:
    """Explain a lone job against the closest other job: one of the same shapes, else the
    first of the largest group."""
    others = [n for n in info if n != name]
    if not others:
        return "no other job to fuse with"
    avals = _avals_of(program)
    same_shapes = next((n for n in others if _avals_of(info[n][0]) == avals), None)
    if same_shapes is not None:
        return (f"its step computes something else than {same_shapes}'s: a constant that decides a "
                "shape or Python control flow, or different code (only constants used as values "
                "can differ within a group)")
    other = biggest if biggest is not None and biggest != name else others[0]
    return (f"its state or batch shapes differ from {other}'s "
            f"({_first_difference(program, layout, info[other][0], info[other][1])}): "
            "only same-shape jobs fuse")


def _avals_of(program: CompiledStep) -> tuple:
    return (tuple((tuple(s.shape), str(s.dtype)) for s in program.state_struct),
            tuple((tuple(s.shape), str(s.dtype)) for s in program.batch_struct))


def _first_difference(a: CompiledStep, a_layout: Any, b: CompiledStep, b_layout: Any) -> str:
    for what, xs, ys, paths in (("state", a.state_struct, b.state_struct, a_layout.array_paths()),
                                ("batch", a.batch_struct, b.batch_struct, a.batch_layout.array_paths())):
        for i, (x, y) in enumerate(zip(xs, ys)):
            if tuple(x.shape) != tuple(y.shape) or x.dtype != y.dtype:
                where = paths[i] if i < len(paths) else str(i)
                return (f"{what} leaf {where}: {np.dtype(x.dtype).name}{list(x.shape)} vs "
                        f"{np.dtype(y.dtype).name}{list(y.shape)}")
        if len(xs) != len(ys):
            return f"{what} has {len(xs)} arrays vs {len(ys)}"
    return "their structures differ"
