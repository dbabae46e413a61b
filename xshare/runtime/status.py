"""The runtime's status as data: ``snapshot(rt)`` for ``GET /status`` and ``xshare top``,
``prometheus(snapshot)`` for ``GET /metrics``, and the JSON schema both follow.

``snapshot`` copies what it needs under the runtime's lock (a few dict reads per job: cheap)
and asks NVML outside it; everything else here is a pure function of that dict, so the
Prometheus text and the JSON can never disagree.

Conventions (schema ``xshare.status/v1``): units are in the field names (``*_bytes``, ``*_s``,
``*_percent``), times ``*_s`` without ``unix`` are seconds since the runtime started (its
monotonic clock), and ``null`` means unknown (no NVML, no step measured yet, a non-finite
metric: strict JSON has no NaN). Consumers must ignore fields they do not know: v1 only grows.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Iterable, Mapping

SCHEMA_ID = "xshare.status/v1"

# ---------------------------------------------------------------------------------------- schema

_INT = {"type": "integer"}
_NN_INT = {"type": "integer", "minimum": 0}
_NN_NUM = {"type": "number", "minimum": 0}
_OPT_NN_NUM = {"type": ["number", "null"], "minimum": 0}
_OPT_NN_INT = {"type": ["integer", "null"], "minimum": 0}
_OPT_STR = {"type": ["string", "null"]}
_STATUS = {"enum": ["queued", "running", "paused", "done", "failed", "cancelled"]}


def _obj(props: Mapping[str, Any]) -> dict[str, Any]:
    """An object with exactly these fields, all required (the server always writes every one)."""
    return {"type": "object", "properties": dict(props), "required": list(props),
            "additionalProperties": False}


STATUS_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": SCHEMA_ID,
    "title": "xshare runtime status (GET /status)",
    **_obj({
        "schema": {"const": SCHEMA_ID},
        "time_unix_s": _NN_NUM,
        "runtime": _obj({
            "pid": _NN_INT,
            "version": {"type": "string"},
            "policy": {"type": "string"},
            "started_unix_s": _NN_NUM,
            "uptime_s": _NN_NUM,
            "fences": {"type": "boolean"},
            "quantum": {"type": "integer", "minimum": 1},
            "closed": {"type": "boolean"},
        }),
        "device": _obj({
            "platform": {"type": "string"},
            "kind": {"type": "string"},
            "id": _INT,
            "name": _OPT_STR,                      # NVML's name of the GPU
            "utilization_percent": {"type": ["number", "null"], "minimum": 0, "maximum": 100},
            "memory_used_bytes": _OPT_NN_INT,
            "memory_total_bytes": _OPT_NN_INT,
        }),
        "arena": _obj({
            "capacity_bytes": _NN_INT,
            "capacity_source": {"type": "string"},
            "committed_bytes": _NN_INT,
            "free_bytes": _NN_INT,
            "largest_gap_bytes": _NN_INT,
            "peak_in_flight_bytes": _NN_INT,
            "queued_jobs": _NN_INT,
            "queue": {"type": "array", "items": {"type": "string"}},
        }),
        "lanes": {"type": "array", "items": _obj({
            "id": _NN_INT,
            "offset_bytes": _NN_INT,
            "size_bytes": _NN_INT,
            "persistent_bytes": _NN_INT,
            "ephemeral_bytes": _NN_INT,
            "ephemeral_peak_bytes": _NN_INT,
            "in_use_bytes": _NN_INT,
            "steps_in_flight": _NN_INT,
            "jobs": {"type": "array", "items": {"type": "string"}},
            "swapped_jobs": {"type": "array", "items": {"type": "string"}},
        })},
        "jobs": {"type": "array", "items": _obj({
            "name": {"type": "string"},
            "id": _NN_INT,
            "status": _STATUS,
            "paused": {"type": "boolean"},
            "lane": _OPT_NN_INT,
            "priority": _INT,
            "steps_done": _NN_INT,
            "steps_total": _OPT_NN_INT,
            "steps_per_s": _OPT_NN_NUM,
            "step_time_p50_s": _OPT_NN_NUM,
            "step_time_p95_s": _OPT_NN_NUM,
            "arrival_s": _NN_NUM,
            "started_s": _OPT_NN_NUM,
            "ended_s": _OPT_NN_NUM,
            "queue_wait_s": _OPT_NN_NUM,
            "device_time_s": _NN_NUM,
            "device_time_share": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
            "persistent_bytes": _OPT_NN_INT,
            "staging_bytes": _OPT_NN_INT,
            "ephemeral_bytes": _OPT_NN_INT,
            "metrics": {"type": ["object", "null"],
                        "additionalProperties": {"type": ["number", "null"]}},
            "error": _OPT_STR,
        })},
    }),
}


def validate(instance: Any, schema: Mapping[str, Any] = STATUS_SCHEMA, path: str = "$") -> list[str]:
    """Errors of ``instance`` against the JSON-schema subset used above (empty list: valid).

    A tiny validator so that clients and tests need no ``jsonschema``; it supports ``type``,
    ``enum``, ``const``, ``minimum``, ``maximum``, ``properties``, ``required``,
    ``additionalProperties`` and ``items``, and refuses any other keyword rather than ignore it.
    """
    known = {"$schema", "$id", "title", "description", "type", "enum", "const", "minimum",
             "maximum", "properties", "required", "additionalProperties", "items"}
    unknown = set(schema) - known
    if unknown:
        raise ValueError(f"validate() does not support schema keyword(s) {sorted(unknown)} at {path}")
    errors: list[str] = []
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is_type(instance, t) for t in types):
            return [f"{path}: {instance!r:.80} is not of type {' | '.join(types)}"]
    if "const" in schema and instance != schema["const"]:
        errors.append(f"{path}: {instance!r:.80} != {schema['const']!r}")
    if "enum" in schema and instance not in schema["enum"]:
        errors.append(f"{path}: {instance!r:.80} is not one of {schema['enum']}")
    if _is_type(instance, "number"):
        if "minimum" in schema and instance < schema["minimum"]:
            errors.append(f"{path}: {instance} < minimum {schema['minimum']}")
        if "maximum" in schema and instance > schema["maximum"]:
            errors.append(f"{path}: {instance} > maximum {schema['maximum']}")
    if isinstance(instance, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", ()):
            if key not in instance:
                errors.append(f"{path}: missing required field {key!r}")
        extra = schema.get("additionalProperties", True)
        for key, value in instance.items():
            if key in props:
                errors += validate(value, props[key], f"{path}.{key}")
            elif extra is False:
                errors.append(f"{path}: unexpected field {key!r}")
            elif isinstance(extra, dict):
                errors += validate(value, extra, f"{path}.{key}")
    if isinstance(instance, list) and "items" in schema:
        for i, item in enumerate(instance):
            errors += validate(item, schema["items"], f"{path}[{i}]")
    return errors


def _is_type(x: Any, t: str) -> bool:
    if t == "null":
        return x is None
    if t == "boolean":
        return isinstance(x, bool)
    if t == "integer":
        return isinstance(x, int) and not isinstance(x, bool)
    if t == "number":
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    if t == "string":
        return isinstance(x, str)
    if t == "array":
        return isinstance(x, list)
    if t == "object":
        return isinstance(x, dict)
    raise ValueError(f"unknown JSON-schema type {t!r}")


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


# ------------------------------------------------------------------------------------ prometheus

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def prometheus(snap: Mapping[str, Any]) -> str:
    """The snapshot in Prometheus' text exposition format (0.0.4): ``xshare_`` prefix, base
    units (bytes, seconds, ratios in [0, 1]), ``_total`` counters. Unknown values (JSON
    ``null``) are left out: in Prometheus a missing sample is the way to say "unknown"."""
    out: list[str] = []

    def family(name: str, kind: str, help_: str, samples: Iterable[tuple[Mapping[str, Any], Any]]) -> None:
        out.append(f"# HELP {name} {_escape_help(help_)}")
        out.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            if value is None:
                continue
            text = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items())
            out.append(f"{name}{{{text}}} {_number(value)}" if text else f"{name} {_number(value)}")

    rt, dev, arena = snap["runtime"], snap["device"], snap["arena"]
    lanes, jobs = snap["lanes"], snap["jobs"]

    family("xshare_runtime_info", "gauge", "The runtime: its pid, version and scheduling policy (always 1).",
           [({"pid": rt["pid"], "version": rt["version"], "policy": rt["policy"]}, 1)])
    family("xshare_runtime_uptime_seconds", "gauge", "Seconds since the runtime started.",
           [({}, rt["uptime_s"])])
    family("xshare_device_info", "gauge", "The device the runtime owns (always 1).",
           [({"platform": dev["platform"], "kind": dev["kind"], "id": dev["id"],
              "name": dev["name"] or ""}, 1)])
    util = dev["utilization_percent"]
    family("xshare_device_utilization_ratio", "gauge", "GPU utilization from NVML, 0 to 1 (absent without NVML).",
           [({}, None if util is None else util / 100.0)])
    family("xshare_device_memory_used_bytes", "gauge", "GPU memory in use from NVML (absent without NVML).",
           [({}, dev["memory_used_bytes"])])
    family("xshare_device_memory_total_bytes", "gauge", "GPU memory in total from NVML (absent without NVML).",
           [({}, dev["memory_total_bytes"])])

    for key, help_ in (("capacity", "Bytes the arena may hand out to lanes."),
                       ("committed", "Bytes held by lanes: the most the admitted jobs can use at once."),
                       ("free", "Bytes of the arena held by no lane."),
                       ("largest_gap", "The largest free interval of the arena, in bytes."),
                       ("peak_in_flight", "Peak of the bytes that could be in use at once "
                                          "(persistent + ephemeral of busy lanes).")):
        family(f"xshare_arena_{key}_bytes", "gauge", help_, [({}, arena[f"{key}_bytes"])])
    family("xshare_arena_queued_jobs", "gauge", "Jobs waiting for memory in the arena's queue.",
           [({}, arena["queued_jobs"])])

    def per_lane(field: str) -> list:
        return [({"lane": lane["id"]}, lane[field]) for lane in lanes]

    for field, help_ in (("offset_bytes", "Where the lane starts in the arena."),
                         ("size_bytes", "Bytes the lane holds: its jobs' persistent bytes plus one ephemeral region."),
                         ("persistent_bytes", "Persistent (state + staged batch) bytes of the lane's resident jobs."),
                         ("ephemeral_bytes", "The lane's ephemeral region: the largest ephemeral need of its jobs."),
                         ("ephemeral_peak_bytes", "The largest ephemeral region the lane has had."),
                         ("in_use_bytes", "Persistent bytes, plus the ephemeral region while a step is in flight.")):
        family(f"xshare_lane_{field}", "gauge", help_, per_lane(field))
    family("xshare_lane_steps_in_flight", "gauge", "Steps dispatched on the lane and not yet retired.",
           per_lane("steps_in_flight"))
    family("xshare_lane_jobs", "gauge", "Jobs that are members of the lane.",
           [({"lane": lane["id"]}, len(lane["jobs"])) for lane in lanes])

    def per_job(field: str) -> list:
        return [({"job": j["name"]}, j[field]) for j in jobs]

    family("xshare_job_status", "gauge", "The job's current status (1 on the label of its status).",
           [({"job": j["name"], "status": j["status"]}, 1) for j in jobs])
    family("xshare_job_priority", "gauge", "The job's priority (higher runs first under the priority policy).",
           per_job("priority"))
    family("xshare_job_steps_total", "counter", "Steps the job has completed (counting from its start step).",
           per_job("steps_done"))
    family("xshare_job_device_seconds_total", "counter", "Device seconds the job's steps have used.",
           per_job("device_time_s"))
    family("xshare_job_device_time_ratio", "gauge", "The job's share of all jobs' device seconds, 0 to 1.",
           per_job("device_time_share"))
    family("xshare_job_steps_per_second", "gauge", "Completed steps per second since the job started.",
           per_job("steps_per_s"))
    family("xshare_job_step_seconds", "gauge", "Device seconds per step over the job's recent steps, by quantile.",
           [({"job": j["name"], "quantile": q}, j[f"step_time_p{p}_s"]) for j in jobs
            for q, p in (("0.5", "50"), ("0.95", "95"))])
    family("xshare_job_queue_wait_seconds", "gauge", "Seconds the job waited for memory before it started.",
           per_job("queue_wait_s"))
    for field, help_ in (("persistent_bytes", "The job's persistent bytes (state) while it is admitted."),
                         ("staging_bytes", "The job's prefetched batches, resident while it runs."),
                         ("ephemeral_bytes", "Bytes one of the job's steps needs while it executes.")):
        family(f"xshare_job_{field}", "gauge", help_, per_job(field))
    family("xshare_job_metric", "gauge", "The last value of each metric the job's step returns.",
           [({"job": j["name"], "metric": k}, v) for j in jobs for k, v in (j["metrics"] or {}).items()])
    return "\n".join(out) + "\n"


def _escape_label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    x = float(value)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(x)
