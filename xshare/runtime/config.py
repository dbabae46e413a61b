"""The runtime's settings, checked once and frozen: what ``Runtime(...)``'s arguments mean.

``Runtime`` builds one ``RuntimeConfig`` from its arguments (``RuntimeConfig.of``) and hands it
to every part that needs a setting (the dispatcher, the compile pool's staging of fused
programs, the recorder), so each setting has one home and one check. Pure: no jax, no device
(the arena's size and where it came from are the device's answer, kept beside it in
``Runtime``), so every refusal is tested without a runtime (``tests/runtime/test_config.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..sched.steps import MAX_STEPS_PER_CALL, QUANTUM_S, pow2_floor

# Steps kept in flight behind a fused group's step under throughput policies (while their
# stacked batches stay small: compiled.fusion.pipeline_depth). A group step makes N members'
# batches, so its host hiccups are N times larger than a job's.
GROUP_AHEAD = 32

# The least a program's compile is assumed to cost when weighing a K-step promotion
# (engine/tiers.py) or a fused group (prepare.py): a small MLP's step compiles in 0.4-1.0 s on
# this project's CPU machine, its scan about as long.
COLD_COMPILE_S = 0.5


@dataclass(frozen=True)
class RuntimeConfig:
    """Every ``Runtime`` setting the engine reads (see ``Runtime``'s arguments for each)."""

    quantum: int = 1                      # steps a unit keeps its lane per turn
    slots: int = 1                        # units srtf runs at once
    prefetch: int = 2                     # batches staged per job (charged to its footprint)
    dispatch_ahead: int = 8               # steps in flight behind a job's
    group_ahead: int = GROUP_AHEAD        # ... behind a fused group's
    compile_workers: int = 1
    log_dir: Path | None = None
    checkpoint_dir: Path | None = None    # None: no checkpoints
    checkpoint_every: int | None = None
    checkpoint_keep: int = 3
    resume: bool = False
    keep_results: bool = True             # False: a done job's final state lives in its final checkpoint only
    fuse: bool = False
    # fuse=True: groups open where fusing pays and dissolve where it was measured not to
    # (compiled/payoff.py); fuse="always": every group opens and stays (no measuring).
    fuse_measured: bool = True
    group_capacity: int | None = None     # fused groups' floor (sched/capacity.py); None: none
    steps_per_call: int = MAX_STEPS_PER_CALL  # the most steps one call may run
    steps_forced: bool = False            # the user named K: no payback weighing (engine/tiers.py)
    steps_rtol: float | None = None       # K-step forms kept within this relative difference (None: exact)
    preemptive: bool = False              # the policy preempts at step boundaries (caps K)
    call_quantum_s: float = QUANTUM_S     # ... to about this much device time in flight (Policy.quantum_s)
    debug_ownership: bool = False         # parts assert they run on the dispatcher thread
    parallel_lanes: bool = True           # on CPU, lanes' calls side by side (engine/streams.py); off under exclusive policies

    @property
    def staging(self) -> dict[str, int]:
        """What a fused program's footprint charges beyond its states, part of its cache key:
        staged and in-flight batches (``compiled.fusion.fused_program``'s keywords)."""
        return {"prefetch": self.prefetch, "ahead": self.dispatch_ahead, "group_ahead": self.group_ahead}

    @classmethod
    def of(cls, policy: Any, *, quantum: int = 1, slots: int = 1, prefetch: int = 2,
           dispatch_ahead: int | None = None, compile_workers: int = 1,
           log_dir: str | os.PathLike | None = None, checkpoint_dir: str | os.PathLike | None = None,
           checkpoint_every: int | None = None, checkpoint_keep: int = 3, resume: bool = False,
           keep_results: bool = True, fuse: bool | str = False, group_capacity: int | None = None, steps_per_call: int | str = "auto",
           steps_per_call_rtol: float | None = None, writers: Sequence[Any] = (),
           debug_ownership: bool = False, parallel_lanes: bool = True) -> "RuntimeConfig":
        """Check ``Runtime``'s arguments and derive what they imply (``policy``: the resolved
        policy; ``writers``: the metrics writers asked for). Raises ValueError naming
        the value and what it must be."""
        preemptive = bool(getattr(policy, "preemptive", False))
        group_ahead = dispatch_ahead
        if dispatch_ahead is None:
            # Preemptive policies keep one step in flight, so an urgent job starts within a step;
            # throughput policies keep more, and a fused group's pipeline deeper still.
            dispatch_ahead = 1 if preemptive else 8
            group_ahead = dispatch_ahead if preemptive else GROUP_AHEAD
        for name, value, low in (("quantum", quantum, 1), ("prefetch", prefetch, 1),
                                 ("dispatch_ahead", dispatch_ahead, 0), ("slots", slots, 1),
                                 ("compile_workers", compile_workers, 1)):
            if not _int(value) or value < low:
                raise ValueError(f"{name}={value!r} must be an int >= {low}")
        if not isinstance(parallel_lanes, bool):
            raise ValueError(f"parallel_lanes={parallel_lanes!r} must be True (on CPU, lanes' calls run side by "
                             "side) or False (every call on one execution stream)")
        if fuse not in (True, False, "always"):
            raise ValueError(f"fuse={fuse!r} must be True (fuse where it pays, measured), \"always\" or False")
        if group_capacity is not None and (not _int(group_capacity) or group_capacity < 1):
            raise ValueError(f"group_capacity={group_capacity!r} must be an int >= 1 (slots per fused group), or None")
        if not _int(checkpoint_keep) or checkpoint_keep < 1:
            raise ValueError(f"checkpoint_keep={checkpoint_keep!r} must be an int >= 1 (checkpoints kept per job)")
        if checkpoint_every is not None and (not _int(checkpoint_every) or checkpoint_every < 1):
            raise ValueError(f"checkpoint_every={checkpoint_every!r} must be an int >= 1 (steps), or None")
        if steps_per_call_rtol is not None and not (
                isinstance(steps_per_call_rtol, (int, float)) and not isinstance(steps_per_call_rtol, bool)
                and 0 <= steps_per_call_rtol < 1):
            raise ValueError(f"steps_per_call_rtol={steps_per_call_rtol!r} must be a float in [0, 1) (the largest "
                             "relative difference from K single steps a K-step program may show), or None "
                             "(bit-identical only)")
        if writers and log_dir is None:
            raise ValueError(f"writers={list(writers)!r} need a log_dir (each job's writer writes under "
                             "log_dir/<job>/)")
        ckpt = checkpoint_dir if checkpoint_dir is not None else log_dir
        if (checkpoint_every is not None or resume) and ckpt is None:
            raise ValueError("checkpoint_every/resume need a checkpoint_dir (or log_dir) to keep checkpoints in")
        # An explicit checkpoint_dir means checkpoints at each job's end and on stop() even
        # without checkpoint_every (launch --checkpoint-every 0: "only on exit").
        keeps = ckpt is not None and (checkpoint_every or resume or checkpoint_dir is not None)
        if not isinstance(keep_results, bool):
            raise ValueError(f"keep_results={keep_results!r} must be True (each done job's final state "
                             "stays in memory for result()) or False (it stays in its final checkpoint only)")
        if not keep_results and not keeps:
            raise ValueError("keep_results=False needs a checkpoint_dir: a done job's final state is then "
                             "kept only in its final checkpoint there, and result() reads it back; pass "
                             "checkpoint_dir=..., or keep_results=True")
        return cls(quantum=quantum, slots=slots, prefetch=prefetch, dispatch_ahead=dispatch_ahead,
                   group_ahead=dispatch_ahead if group_ahead is None else group_ahead,
                   compile_workers=compile_workers,
                   log_dir=Path(log_dir) if log_dir is not None else None,
                   checkpoint_dir=Path(ckpt) if keeps and ckpt is not None else None,
                   checkpoint_every=checkpoint_every, checkpoint_keep=checkpoint_keep, resume=resume,
                   keep_results=keep_results, fuse=bool(fuse), fuse_measured=fuse is True, group_capacity=group_capacity if fuse else None,
                   steps_per_call=_steps_per_call(steps_per_call), steps_forced=steps_per_call != "auto",
                   steps_rtol=None if steps_per_call_rtol is None else float(steps_per_call_rtol),
                   preemptive=preemptive, call_quantum_s=float(getattr(policy, "quantum_s", QUANTUM_S)),
                   debug_ownership=debug_ownership,
                   # A policy that gives one job the device (fifo, priority, srtf) keeps every call
                   # on one stream: run side by side, the next job's first call shares the cores
                   # with the running one's last (the urgent job's, under priority).
                   parallel_lanes=parallel_lanes and not getattr(policy, "exclusive", False))


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _steps_per_call(value: int | str) -> int:
    """``Runtime(steps_per_call=...)``: "auto" (the runtime promotes jobs to K-step programs
    where they pay, K up to ``sched.steps.MAX_STEPS_PER_CALL``), or an int cap (1: one step per
    call, as a plain loop)."""
    if value == "auto":
        return MAX_STEPS_PER_CALL
    if not _int(value) or int(value) < 1:
        raise ValueError(f"steps_per_call={value!r} must be 'auto' or an int >= 1 (1: one step per "
                         "executable call)")
    return pow2_floor(int(value))
