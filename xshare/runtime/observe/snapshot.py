"""``Runtime.snapshot()``: the runtime's state as one JSON-ready document (schema
``xshare.status/v1``).

Readers never walk the dispatcher's live tables: the document's runtime part (jobs, groups,
lanes, the arena's books) is built *on the dispatcher thread*, between two steps (``Runtime.inspect``),
so it is one consistent view, and handed over as a new immutable-by-convention dict. NVML is
asked afterwards, on the reader's thread (its calls take milliseconds).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

from ..engine.records import now_s
from ..engine.tiers import explain as explain_tier
from ..engine.tiers import steps_per_call
from ..view import RuntimeView
from .schema import SCHEMA_ID



def snapshot(rt: Any) -> dict[str, Any]:
    """``rt.snapshot()``: the document from ``rt.inspect`` (public figures only), then NVML's."""
    from . import nvml

    doc = rt.inspect(_document, timeout=30.0)
    dev = rt.device
    stats = nvml.device_stats(dev)
    doc["device"] = {
        "platform": str(dev.platform),
        "kind": str(getattr(dev, "device_kind", dev.platform)),
        "id": int(getattr(dev, "id", 0)),
        "name": stats.name,
        "utilization_percent": stats.utilization_percent,
        "memory_used_bytes": stats.memory_used_bytes,
        "memory_total_bytes": stats.memory_total_bytes,
    }
    return doc


def _document(view: RuntimeView) -> dict[str, Any]:
    """Everything but the device's NVML figures; runs on the dispatcher thread."""
    from ... import __version__

    rel = now_s() - view.t0
    records = view.jobs
    names: dict[Any, str] = {j.id: j.name for j in records}
    arena = view.arena
    lane_infos = arena.lanes()
    queue = arena.queue
    arena_doc = {
        "capacity_bytes": int(arena.capacity),
        "capacity_source": view.capacity_source,
        "committed_bytes": int(arena.committed),
        "free_bytes": int(arena.free),
        "peak_in_flight_bytes": int(view.peak_in_flight_bytes),
        "queued_jobs": len(queue),
        "queue": [names.get(i, str(i)) for i in queue],
    }
    in_flight: dict[int, int] = {}
    e_peak: dict[int, int] = {}
    for j in records:
        if j.lane is not None and j.footprint is not None:
            e_peak[j.lane] = max(e_peak.get(j.lane, 0), int(j.footprint.ephemeral))
        if j.in_flight and j.lane is not None:
            in_flight[j.lane] = in_flight.get(j.lane, 0) + j.in_flight
    lanes = []
    for info in lane_infos:
        steps = int(in_flight.get(info.id, 0))
        lanes.append({
            "id": int(info.id),
            "size_bytes": int(info.size),
            "persistent_bytes": int(info.persistent),
            "ephemeral_bytes": int(info.ephemeral),
            "ephemeral_peak_bytes": max(e_peak.get(info.id, 0), int(info.ephemeral)),
            "in_use_bytes": int(info.persistent) + (int(info.ephemeral) if steps > 0 else 0),
            "steps_in_flight": steps,
            "jobs": [names.get(i, str(i)) for i in info.jobs],
            "swapped_jobs": [names.get(i, str(i)) for i in info.swapped],
        })
    jobs = [_job(j, rel) for j in records]
    groups = [{
        "name": g.name,
        "id": int(g.id),
        "capacity": int(g.capacity),
        "lane": int(g.lane),
        "members": [m.name for m in g.members],
        "steps": int(g.steps_run),
        "fused_member_steps": int(g.fused_member_steps),
        "persistent_bytes": int(g.fused.footprint.persistent),
        "ephemeral_bytes": int(g.fused.footprint.ephemeral),
        "program": g.program.key[:12],
        # Group steps by how many ran per call, and why the group runs where it runs (tiers.py).
        "steps_per_call": steps_per_call(g),
        "programs": explain_tier(g.tier),
    } for g in view.groups]
    total_device = sum(row["device_time_s"] for row in jobs)
    for row in jobs:
        row["device_time_share"] = row["device_time_s"] / total_device if total_device > 0 else None
    runtime = {
        "pid": os.getpid(),
        "version": __version__,
        "policy": view.policy,
        "started_unix_s": time.time() - rel,
        "uptime_s": max(rel, 0.0),
        "fences": bool(view.fences),
        "quantum": int(view.quantum),
        "closed": bool(view.closed),
        "xla_compiles": int(view.compiles),
        "fused_member_steps": int(view.fused_member_steps),
    }
    return {"schema": SCHEMA_ID, "time_unix_s": time.time(), "runtime": runtime, "device": None,
            "arena": arena_doc, "lanes": lanes, "jobs": jobs, "groups": groups,
            "models": [m.stats() for m in view.models]}


def _job(j: Any, now: float) -> dict[str, Any]:
    fp = j.footprint
    times = sorted(j.step_times)
    metrics = j.last_metrics
    return {
        "name": j.name,
        "id": int(j.id),
        "status": j.status,
        "state": j.state.value,
        "paused": j.status == "paused",
        "lane": j.lane,
        "priority": int(j.priority),
        "steps_done": int(j.spec.start_step + j.steps_done),
        "steps_total": j.steps_total,
        "steps_per_s": _finite(j.steps_per_s(now)),
        "step_time_p50_s": _quantile(times, 0.5),
        "step_time_p95_s": _quantile(times, 0.95),
        "step_times_s": [float(t) for t in times[-64:]],
        "arrival_s": max(float(j.arrival_s), 0.0),
        "started_s": j.started_s,
        "ended_s": j.ended_s,
        "queue_wait_s": j.queue_wait_s,
        "device_time_s": float(j.device_time_s),
        "device_time_share": None,  # filled in once every job's device time is known
        "persistent_bytes": None if fp is None else int(fp.persistent),
        "staging_bytes": None if fp is None else int(fp.staging),
        "ephemeral_bytes": None if fp is None else int(fp.ephemeral),
        "program": None if j.program is None else j.program.key[:12],
        "group": None if j.group is None else j.group.name,
        # Steps run at each K steps per call, and why the job runs where it runs (tiers.py).
        "steps_per_call": steps_per_call(j),
        "programs": explain_tier(j.tier),
        "step_time_histogram": _histogram(times),
        "metrics": None if metrics is None else {str(k): _finite(v) for k, v in metrics.items()},
        "error": j.error,
    }


# Step-time histogram buckets (seconds): Prometheus-style upper bounds, 50 us to 10 s.
BOUNDS_S = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


def _histogram(times: list[float]) -> dict[str, Any] | None:
    """The job's recent step times (a bounded window) in ``BOUNDS_S`` buckets."""
    if not times:
        return None
    counts = [0] * (len(BOUNDS_S) + 1)
    for t in times:
        counts[next((i for i, b in enumerate(BOUNDS_S) if t <= b), len(BOUNDS_S))] += 1
    return {"bounds_s": list(BOUNDS_S), "counts": counts, "sum_s": float(sum(times)), "count": len(times)}


def _finite(x: Any) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _quantile(sorted_values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not sorted_values:
        return None
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return float(sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo))
