"""The JSON schema of the runtime's status document (``GET /status``, ``xshare top``,
``Runtime.snapshot()``), and :func:`validate`, which checks a document with ``jsonschema``.

Conventions (schema ``xshare.status/v1``): units are in the field names (``*_bytes``, ``*_s``,
``*_percent``), times ``*_s`` without ``unix`` are seconds since the runtime started (its
monotonic clock), and ``null`` means unknown (no NVML, no step measured yet, a non-finite
metric: strict JSON has no NaN). Consumers must ignore fields they do not know: v1 only grows.
Pure data: importing this module imports nothing else.
"""

from __future__ import annotations

from typing import Any, Mapping

SCHEMA_ID = "xshare.status/v1"

_INT = {"type": "integer"}
_NN_INT = {"type": "integer", "minimum": 0}
_NN_NUM = {"type": "number", "minimum": 0}
_OPT_NN_NUM = {"type": ["number", "null"], "minimum": 0}
_OPT_NN_INT = {"type": ["integer", "null"], "minimum": 0}
_OPT_STR = {"type": ["string", "null"]}
# "compiling": submitted, its program being traced/compiled off the submitting thread.
_STATUS = {"enum": ["compiling", "queued", "running", "paused", "done", "failed", "cancelled"]}


def _obj(props: Mapping[str, Any], optional: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """An object with exactly these fields, ``props`` required (the server always writes every
    one), ``optional`` allowed (fields added within v1 that a runtime may not fill yet)."""
    return {"type": "object", "properties": {**props, **(optional or {})}, "required": list(props),
            "additionalProperties": False}


# Every step time the job measured, bucketed: ``counts[i]`` steps took at most ``bounds_s[i]``
# seconds (and more than the bound before it); ``counts[-1]`` (one more than the bounds) took
# longer than the last bound. ``sum_s`` and ``count`` cover the same steps. Optional in v1.
_HISTOGRAM = {"type": "object", "required": ["bounds_s", "counts", "sum_s", "count"],
              "additionalProperties": False,
              "properties": {"bounds_s": {"type": "array", "items": {"type": "number", "exclusiveMinimum": 0}},
                             "counts": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                             "sum_s": {"type": "number", "minimum": 0},
                             "count": {"type": "integer", "minimum": 0}}}


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
        }, optional={"xla_compiles": _NN_INT, "fused_member_steps": _NN_INT}),
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
            "peak_in_flight_bytes": _NN_INT,
            "queued_jobs": _NN_INT,
            "queue": {"type": "array", "items": {"type": "string"}},
        }),
        "lanes": {"type": "array", "items": _obj({
            "id": _NN_INT,
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
        }, optional={"step_time_histogram": {"anyOf": [_HISTOGRAM, {"type": "null"}]},
                     "group": _OPT_STR,                                 # its fused group's name
                     "state": {"type": "string"},                       # the runtime's finer job state
                     "step_times_s": {"type": "array", "items": _NN_NUM},  # the most recent step times
                     "program": _OPT_STR,                               # the shared program's key
                     # steps run per K steps per call, and why (docs/explanation/multi-step.md)
                     "steps_per_call": {"type": "object", "additionalProperties": _NN_INT},
                     "programs": {"type": "string"}})},
    }, optional={"groups": {"type": "array", "items": _obj({   # fused groups (Runtime(fuse=True))
        "name": {"type": "string"},
        "id": _NN_INT,
        "capacity": {"type": "integer", "minimum": 1},
        "lane": _NN_INT,
        "members": {"type": "array", "items": {"type": "string"}},
        "steps": _NN_INT,
        "fused_member_steps": _NN_INT,
        "persistent_bytes": _NN_INT,
        "ephemeral_bytes": _NN_INT,
        "program": {"type": "string"},
    }, optional={  # group steps run per K steps per call, and why (docs/explanation/multi-step.md)
        "steps_per_call": {"type": "object", "additionalProperties": _NN_INT},
        "programs": {"type": "string"}})},
        "models": {"type": "array", "items": _obj({   # deployed models (Runtime.deploy)
            "name": {"type": "string"},
            "version": {"type": "integer", "minimum": 1},
            "status": {"enum": ["loading", "ready", "leaving", "gone"]},
            "priority": {"type": "integer"},
            "max_batch": {"type": "integer", "minimum": 1},
            "max_delay_ms": _NN_NUM,
            "buckets": {"type": "array", "items": {"type": "integer", "minimum": 1}},
            "lane": {"type": ["integer", "null"], "minimum": 0},
            "persistent_bytes": _NN_INT,
            "ephemeral_bytes": _NN_INT,
            "queue_rows": _NN_INT,
            "queue_requests": _NN_INT,
            "requests_total": _NN_INT,
            "errors_total": _NN_INT,
            "rejected_total": _NN_INT,
            "batches_total": _NN_INT,
            "rows_total": _NN_INT,
            "batch_fill": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
            "requests_per_s": _NN_NUM,
            "latency_p50_s": _OPT_NN_NUM,
            "latency_p99_s": _OPT_NN_NUM,
            "latency_histogram": _HISTOGRAM,
        })}}),
}


def validate(doc: Any) -> list[str]:
    """Why ``doc`` breaks :data:`STATUS_SCHEMA` (``"$.jobs[0].lane: -1 is less than the minimum
    of 0"``), in document order; empty when it follows it."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(STATUS_SCHEMA, format_checker=None)
    errors = sorted(validator.iter_errors(doc), key=lambda e: [str(p) for p in e.absolute_path])
    return [f"{e.json_path}: {e.message}" for e in errors]
