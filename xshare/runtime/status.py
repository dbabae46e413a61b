"""The runtime's status as data: ``snapshot(rt)``, the document ``GET /status``, ``GET
/metrics`` and ``xshare top`` render (schema ``xshare.status/v1``: :mod:`.schema`; Prometheus
rendering: :mod:`.metrics`). Renderers take the document from the public ``Runtime.snapshot()``.

``snapshot`` copies what it needs under the runtime's lock (a few dict reads per job: cheap)
and asks NVML outside it.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

from .schema import SCHEMA_ID as SCHEMA_ID
from .schema import STATUS_SCHEMA as STATUS_SCHEMA
from .schema import validate as validate

# -------------------------------------------------------------------------------------- snapshot

def snapshot(rt: Any) -> dict[str, Any]:
    """The runtime's state as one JSON-ready dict following ``STATUS_SCHEMA``."""
    from .. import __version__
    from . import nvml
    from .records import now_s

    with rt._cv:  # everything below is dict reads; no device calls under the runtime's lock
        now = now_s()
        rel = now - rt.t0
        records = sorted(rt._jobs.values(), key=lambda j: j.id)
        names = {j.id: j.name for j in records}
        in_flight = dict(rt._lane_in_flight)
        lane_infos = rt.arena.lanes()
        arena = {
            "capacity_bytes": int(rt.arena.capacity),
            "capacity_source": str(rt.capacity_source),
            "committed_bytes": int(rt.arena.committed),
            "free_bytes": int(rt.arena.free),
            "largest_gap_bytes": int(rt.arena.largest_gap),
            "peak_in_flight_bytes": int(rt.peak_in_flight_bytes),
            "queued_jobs": len(rt.arena.queue),
            "queue": [names.get(i, str(i)) for i in rt.arena.queue],
        }
        # A lane's peak ephemeral region is the largest E of any job that was ever its member
        # (lane ids are never reused, and a job's record keeps its lane after it ends).
        e_peak: dict[int, int] = {}
        for j in records:
            if j.lane is not None and j.compiled is not None:
                e_peak[j.lane] = max(e_peak.get(j.lane, 0), int(j.compiled.footprint.ephemeral))
        lanes = []
        for info in lane_infos:
            steps = int(in_flight.get(info.id, 0))
            lanes.append({
                "id": int(info.id),
                "offset_bytes": int(info.offset),
                "size_bytes": int(info.size),
                "persistent_bytes": int(info.persistent),
                "ephemeral_bytes": int(info.ephemeral),
                "ephemeral_peak_bytes": max(e_peak.get(info.id, 0), int(info.ephemeral)),
                "in_use_bytes": int(info.persistent) + (int(info.ephemeral) if steps > 0 else 0),
                "steps_in_flight": steps,
                "jobs": [names.get(i, str(i)) for i in info.jobs],
                "swapped_jobs": [names.get(i, str(i)) for i in getattr(info, "swapped", ())],
            })
        jobs = [_job(j, rel) for j in records]
        runtime = {
            "pid": os.getpid(),
            "version": __version__,
            "policy": str(getattr(rt.policy, "name", rt.policy)),
            "started_unix_s": time.time() - rel,
            "uptime_s": max(rel, 0.0),
            "fences": bool(rt.fences),
            "quantum": int(rt.quantum),
            "closed": bool(rt._closed),
        }
    total_device = sum(j["device_time_s"] for j in jobs)
    for j in jobs:
        j["device_time_share"] = j["device_time_s"] / total_device if total_device > 0 else None
    dev = rt.device
    stats = nvml.device_stats(dev)  # outside the lock: NVML calls take milliseconds
    device = {
        "platform": str(dev.platform),
        "kind": str(getattr(dev, "device_kind", dev.platform)),
        "id": int(getattr(dev, "id", 0)),
        "name": stats.name,
        "utilization_percent": stats.utilization_percent,
        "memory_used_bytes": stats.memory_used_bytes,
        "memory_total_bytes": stats.memory_total_bytes,
    }
    return {"schema": SCHEMA_ID, "time_unix_s": time.time(), "runtime": runtime, "device": device,
            "arena": arena, "lanes": lanes, "jobs": jobs}


def _job(j: Any, now: float) -> dict[str, Any]:
    """One job's row (runtime lock held)."""
    fp = j.compiled.footprint if j.compiled is not None else None
    times = sorted(j.step_times)
    return {
        "name": j.name,
        "id": int(j.id),
        "status": j.status,
        "paused": bool(j.paused),
        "lane": j.lane,
        "priority": int(j.priority),
        "steps_done": int(j.spec.start_step + j.steps_done),
        "steps_total": j.steps_total,
        "steps_per_s": _finite(j.steps_per_s(now)),
        "step_time_p50_s": _quantile(times, 0.5),
        "step_time_p95_s": _quantile(times, 0.95),
        "arrival_s": max(float(j.arrival_s), 0.0),
        "started_s": j.started_s,
        "ended_s": j.ended_s,
        "queue_wait_s": j.queue_wait_s,
        "device_time_s": float(j.device_time_s),
        "device_time_share": None,  # filled in once every job's device time is known
        "persistent_bytes": None if fp is None else int(fp.persistent),
        "staging_bytes": None if fp is None else int(fp.staging),
        "ephemeral_bytes": None if fp is None else int(fp.ephemeral),
        "metrics": None if j.last_metrics is None else {str(k): _finite(v) for k, v in j.last_metrics.items()},
        "error": j.error,
    }


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
