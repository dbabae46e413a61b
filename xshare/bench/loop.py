"""The plain loop: one job's step in an ordinary jitted Python loop, as a user writes it alone.

This is what a job gets under exclusive allocation (and in each of the ``processes``), so it is
the yardstick. It is written to be the *fast* version of a plain loop, so the comparison does
not flatter xshare:

* the step is ``jax.jit(step, donate_argnums=0)`` compiled ahead of time (the compile and the
  first ``device_put`` of the state are outside the timed run, as they are for xshare);
* batch ``k`` is made on the host while step ``k - 1`` runs (JAX dispatches asynchronously);
* the metrics of step ``k - 1`` are read after step ``k`` is dispatched: one step in flight
  behind the executing one, the same pipelining the runtime uses (``dispatch_ahead=1``), and
  every step's metrics reach the host as they do under xshare;
* a job with an ``observer`` (an inference server) answers each batch before taking the next:
  its metrics are read right after its step, and the observer gets that time, as under xshare;
* the job ends when its final state is on the host (``device_get``), as an xshare job does.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import jax


@dataclass
class PlainJob:
    name: str
    run_steps: Callable[..., "PlainRun"]
    flops_per_step: float | None
    compile_s: float


@dataclass
class PlainRun:
    steps: int
    t_start: float        # time.monotonic(): comparable across the processes of one machine
    t_end: float
    metrics: dict[str, float] | None
    cpu: "CpuDelta | None" = None

    @property
    def seconds(self) -> float:
        return self.t_end - self.t_start


@dataclass(frozen=True)
class CpuSnapshot:
    """CPU seconds so far: this process (all its threads, XLA's included) and the whole machine."""

    t: float
    process_s: float
    machine_busy_s: float     # every CPU's non-idle time, every process's (ours included)
    machine_steal_s: float    # time the hypervisor gave our virtual CPUs to someone else

    def since(self, before: "CpuSnapshot") -> "CpuDelta":
        return CpuDelta(self.t - before.t, self.process_s - before.process_s,
                        self.machine_busy_s - before.machine_busy_s, self.machine_steal_s - before.machine_steal_s,
                        before, self)


@dataclass(frozen=True)
class CpuDelta:
    wall_s: float
    process_s: float
    machine_busy_s: float
    machine_steal_s: float

    before: CpuSnapshot | None = None   # the absolute counters at the start and end (the
    after: CpuSnapshot | None = None    # machine's are comparable across processes)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"wall_s": self.wall_s, "process_cpu_s": self.process_s,
                               "machine_busy_s": self.machine_busy_s, "machine_steal_s": self.machine_steal_s}
        if self.before is not None and self.after is not None:
            out["machine_busy_at"] = [self.before.machine_busy_s, self.after.machine_busy_s]
            out["machine_steal_at"] = [self.before.machine_steal_s, self.after.machine_steal_s]
        return out


def cpu_snapshot() -> CpuSnapshot:
    import os

    import psutil

    t = os.times()
    m = psutil.cpu_times()
    busy = sum(m) - m.idle - getattr(m, "iowait", 0.0) - getattr(m, "steal", 0.0) - getattr(m, "guest", 0.0) \
        - getattr(m, "guest_nice", 0.0)  # guest time is already counted in user/nice
    return CpuSnapshot(time.monotonic(), t.user + t.system, busy, getattr(m, "steal", 0.0))


def flops_of(compiled: Any) -> float | None:
    """FLOPs of one execution from XLA's ``cost_analysis()`` (None when the backend has none)."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    flops = (cost or {}).get("flops")
    return float(flops) if flops and flops > 0 else None


def _batches(spec: Any) -> Callable[[int], Any]:
    if callable(spec.data) and not hasattr(spec.data, "__iter__"):
        return spec.data
    it = iter(spec.data)
    return lambda _step: next(it)


def _floats(metrics: Any) -> dict[str, float]:
    out = {}
    for path, value in jax.tree_util.tree_flatten_with_path(metrics)[0]:
        key = "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path) or "value"
        out[key] = float(value.mean()) if getattr(value, "size", 1) != 1 else float(value)
    return out


def prepare(spec: Any, device: Any = None) -> PlainJob:
    """Compile ``spec``'s step and place its state (untimed), ready to run its steps."""
    device = device if device is not None else jax.devices()[0]
    t0 = time.monotonic()
    batch_of = _batches(spec)
    first = batch_of(spec.start_step)
    state = jax.device_put(spec.state, device, may_alias=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        compiled = jax.jit(spec.fn, donate_argnums=(0,)).lower(state, first).compile()
    compile_s = time.monotonic() - t0
    steps = spec.steps

    def run_steps(data_from: Any = None) -> PlainRun:
        """Run the steps. ``data_from``: another copy of the job whose data (and observer) to
        use, fresh, instead of the compiled one's: its request clock starts now, not at compile."""
        nonlocal state
        st = state
        state = None  # donated from here on
        source = data_from if data_from is not None else spec
        take = batch_of if data_from is None else _batches(data_from)
        observer = source.observer
        cpu0 = cpu_snapshot()
        t_start = time.monotonic()
        pending = None  # (step, metrics future) of the step behind the executing one
        last = None
        for k in range(steps):
            step = spec.start_step + k
            batch = first if k == 0 and data_from is None else take(step)
            st, metrics = compiled(st, batch)
            if observer is not None:
                last = _floats(jax.device_get(metrics))
                last.update({n: float(v) for n, v in (observer(step, last, time.monotonic()) or {}).items()})
                continue
            if pending is not None:
                last = _floats(jax.device_get(pending))  # a sync point: step k is already queued
            pending = metrics
        if pending is not None:
            last = _floats(jax.device_get(pending))
        jax.device_get(st)
        t_end = time.monotonic()
        return PlainRun(steps, t_start, t_end, last, cpu_snapshot().since(cpu0))

    return PlainJob(spec.name, run_steps, flops_of(compiled), compile_s)
