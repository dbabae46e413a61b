"""Triton's model configuration and statistics extensions, as plain JSON documents: HTTP answers
them as they are (``GET /v2/models/{m}/config``, ``/stats``), gRPC parses the same documents into
``ModelConfigResponse`` / ``ModelStatisticsResponse`` (protobuf's JSON mapping), so the two
protocols cannot drift apart.

The configuration is Triton's ``ModelConfig`` (``model_config.proto``) for what an xshare model
is: ``max_batch_size`` = ``max_batch``, ``input``/``output`` with per-row ``dims``, and
``dynamic_batching`` with ``max_queue_delay_microseconds`` = ``max_delay_ms``,
``preferred_batch_size``, ``priority_levels`` and ``default_priority_level``. What Triton's
schema has no field for (the padded batch sizes compiled ahead, the queue bound in rows, the
priority among models) is in ``parameters`` under ``xshare.*`` names.

The statistics follow Triton's statistics extension: per model ``inference_count`` (rows),
``execution_count`` (batches run), ``last_inference`` (ms since the epoch) and per request
``success``, ``fail``, ``queue`` (arrival to its batch's start), ``compute_input`` (stacking and
padding the batch), ``compute_infer`` (from the batch's launch to its outputs on the host) and
``compute_output`` (cutting out each request's rows), each ``{"count", "ns"}``; ``batch_stats``
per executed batch size (rows, before padding). ``fail`` counts requests a model took into its
queue and could not answer (its predict raised, it waited past its ``timeout``, the runtime
closed); refusals before the queue (a bad input, a full queue) are not inferences.
"""

from __future__ import annotations

from typing import Any

from .tensors import datatype_of


def config_type(datatype: str) -> str:
    """Triton's ``DataType`` enum name of an OIP datatype (``FP32`` -> ``TYPE_FP32``)."""
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def model_config(handle: Any) -> dict[str, Any]:
    """Triton's model configuration of a deployed model (JSON form of ``ModelConfig``)."""
    meta, spec = handle.metadata(), handle.spec

    def tensor(t: dict[str, Any]) -> dict[str, Any]:
        return {"name": t["name"], "data_type": config_type(t["datatype"]), "dims": [int(d) for d in t["shape"][1:]]}

    batching: dict[str, Any] = {"max_queue_delay_microseconds": int(round(spec.max_delay_ms * 1000))}
    if spec.preferred_batch_sizes:
        batching["preferred_batch_size"] = list(spec.preferred_batch_sizes)
    if spec.priority_levels:
        batching["priority_levels"] = spec.priority_levels
        batching["default_priority_level"] = spec.default_priority_level
    params = {"xshare.buckets": ",".join(map(str, spec.buckets)), "xshare.max_queue_rows": str(spec.max_queue),
              "xshare.priority": str(spec.priority)}
    return {
        "name": meta["name"], "platform": meta["platform"], "backend": "xshare",
        # the versions deployed (a name's every one; a version's config, that one): what is served
        "version_policy": {"specific": {"versions": [int(v) for v in meta["versions"]]}},
        "max_batch_size": spec.max_batch,
        "input": [tensor(t) for t in meta["inputs"]],
        "output": [tensor(t) for t in meta["outputs"]],
        "dynamic_batching": batching,
        "parameters": {k: {"string_value": v} for k, v in params.items()},
    }


def _duration(count: int, ns: int) -> dict[str, int]:
    return {"count": int(count), "ns": int(ns)}


def model_statistics(handles: list[Any]) -> dict[str, Any]:
    """Triton's statistics document for these models (``{"model_stats": [...]}``)."""
    out = []
    for h in handles:
        s = h.triton_stats()
        out.append({
            "name": h.name, "version": str(h.version), "last_inference": s["last_inference_ms"],
            "inference_count": s["inference_count"], "execution_count": s["execution_count"],
            "inference_stats": {k: _duration(*s[k]) for k in ("success", "fail", "queue", "compute_input",
                                                                 "compute_infer", "compute_output")},
            "batch_stats": [{"batch_size": size, "compute_input": _duration(n, i), "compute_infer": _duration(n, c),
                             "compute_output": _duration(n, o)}
                            for size, (n, i, c, o) in sorted(s["batches"].items())],
        })
    return {"model_stats": out}


__all__ = ["model_config", "model_statistics", "config_type", "datatype_of"]
