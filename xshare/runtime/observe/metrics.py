"""``GET /metrics``: the status document as Prometheus metrics, through ``prometheus_client``.

A custom collector (:class:`StatusCollector`) turns one status document (schema
``xshare.status/v1``, from ``Runtime.snapshot()``) into metric families at scrape time, so
``/metrics`` and ``/status`` can never disagree and nothing is counted twice. Conventions
(Prometheus' naming guide): ``xshare_`` prefix, base units (bytes, seconds, ratios in [0, 1]),
``_total`` counters, and unknown values (JSON ``null``) left out: a missing sample is how
Prometheus says "unknown". Jobs are labelled ``job_name`` (``job`` is the scrape target's label).

A job's step times are a histogram (``xshare_job_step_seconds``, every measured step) when the
document carries ``step_time_histogram``, else a summary of the recent steps' p50 and p95.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                            InfoMetricFamily, Metric)
from prometheus_client.registry import Collector, CollectorRegistry

CONTENT_TYPE = CONTENT_TYPE_LATEST

_ARENA = (("capacity", "Bytes the arena may hand out to lanes."),
          ("committed", "Bytes held by lanes: the most the admitted jobs can use at once."),
          ("free", "Bytes of the arena held by no lane."),
          ("peak_in_flight", "Peak of the bytes that could be in use at once (persistent + ephemeral of busy lanes)."))
_LANE = (("size_bytes", "Bytes the lane holds: its jobs' persistent bytes plus one ephemeral region."),
         ("persistent_bytes", "Persistent (state + staged batch) bytes of the lane's resident jobs."),
         ("ephemeral_bytes", "The lane's ephemeral region: the largest ephemeral need of its jobs."),
         ("ephemeral_peak_bytes", "The largest ephemeral region the lane has had."),
         ("in_use_bytes", "Persistent bytes, plus the ephemeral region while a step is in flight."),
         ("steps_in_flight", "Steps dispatched on the lane and not yet retired."))
_JOB_BYTES = (("persistent_bytes", "The job's persistent bytes (state) while it is admitted."),
              ("staging_bytes", "The job's prefetched batches, resident while it runs."),
              ("ephemeral_bytes", "Bytes one of the job's steps needs while it executes."))


def _family(name: str, doc: str, labels: tuple[str, ...], rows: list[tuple[tuple[Any, ...], Any]],
            kind: type = GaugeMetricFamily) -> Metric:
    """A family of one sample per row ``(label values, value)``; ``None`` values are left out."""
    family = kind(name, doc, labels=list(labels))
    for values, value in rows:
        if value is not None:
            family.add_metric([str(v) for v in values], float(value))
    return family


def families(doc: Mapping[str, Any]) -> Iterator[Metric]:
    """The metric families of one status document."""
    rt, dev, arena, lanes, jobs = doc["runtime"], doc["device"], doc["arena"], doc["lanes"], doc["jobs"]

    yield InfoMetricFamily("xshare_runtime", "The runtime: its pid, version and scheduling policy.",
                           value={"pid": str(rt["pid"]), "version": rt["version"], "policy": rt["policy"]})
    yield GaugeMetricFamily("xshare_runtime_uptime_seconds", "Seconds since the runtime started.", rt["uptime_s"])
    yield InfoMetricFamily("xshare_device", "The device the runtime owns.",
                           value={"platform": dev["platform"], "kind": dev["kind"], "id": str(dev["id"]),
                                  "name": dev["name"] or ""})
    util = dev["utilization_percent"]
    for name, value, help_ in (
            ("xshare_device_utilization_ratio", None if util is None else util / 100.0,
             "GPU utilization from NVML, 0 to 1 (absent without NVML)."),
            ("xshare_device_memory_used_bytes", dev["memory_used_bytes"], "GPU memory in use from NVML (absent without NVML)."),
            ("xshare_device_memory_total_bytes", dev["memory_total_bytes"], "GPU memory in total from NVML (absent without NVML).")):
        if value is not None:
            yield GaugeMetricFamily(name, help_, value)

    for key, help_ in _ARENA:
        if arena.get(f"{key}_bytes") is not None:
            yield GaugeMetricFamily(f"xshare_arena_{key}_bytes", help_, arena[f"{key}_bytes"])
    yield GaugeMetricFamily("xshare_arena_queued_jobs", "Jobs waiting for memory in the arena's queue.",
                            arena["queued_jobs"])

    for field, help_ in _LANE:
        yield _family(f"xshare_lane_{field}", help_, ("lane",), [((ln["id"],), ln.get(field)) for ln in lanes])
    yield _family("xshare_lane_jobs", "Jobs that are members of the lane.", ("lane",),
                  [((ln["id"],), len(ln["jobs"])) for ln in lanes])

    yield from _job_families(jobs)
    yield from _model_families(doc.get("models") or [])


def _model_families(models: list[Mapping[str, Any]]) -> Iterator[Metric]:
    """Deployed models (labelled ``model`` and ``version``): request counters, queue, batch fill, latency."""
    by = ("model", "version")

    def rows(field: str) -> list[tuple[tuple[Any, ...], Any]]:
        return [((m["name"], str(m.get("version", 1))), m[field]) for m in models]

    for field, help_ in (("requests", "Requests the model answered."),
                         ("errors", "Requests answered 500 because their batch's predict failed."),
                         ("rejected", "Requests refused 503 because the model's queue was full."),
                         ("batches", "Batches the model ran."),
                         ("rows", "Rows (requests' batch entries) the model ran, padding excluded.")):
        yield _family(f"xshare_model_{field}", help_, by, rows(f"{field}_total"), kind=CounterMetricFamily)
    yield _family("xshare_model_queue_rows", "Rows waiting in the model's queue.", by, rows("queue_rows"))
    yield _family("xshare_model_batch_fill_ratio", "Rows run over padded rows run, 0 to 1.", by, rows("batch_fill"))
    yield _family("xshare_model_requests_per_second", "Requests answered per second over the last 10 s.",
                  by, rows("requests_per_s"))
    family = HistogramMetricFamily("xshare_model_request_seconds",
                                   "Seconds from a request's arrival to its answer.", labels=list(by))
    for m in models:
        h = m["latency_histogram"]
        cumulative, buckets = 0, []
        for bound, count in zip(list(h["bounds_s"]) + [float("inf")], h["counts"]):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
        family.add_metric([m["name"], str(m.get("version", 1))], buckets, float(h["sum_s"]))
    yield family


def _job_families(jobs: list[Mapping[str, Any]]) -> Iterator[Metric]:
    by_job = ("job_name",)

    def per_job(field: str) -> list[tuple[tuple[Any, ...], Any]]:
        return [((j["name"],), j[field]) for j in jobs]

    yield _family("xshare_job_status", "The job's current status (1 on the label of its status).",
                  ("job_name", "status"), [((j["name"], j["status"]), 1) for j in jobs])
    yield _family("xshare_job_priority", "The job's priority (higher runs first under the priority policy).",
                  by_job, per_job("priority"))
    yield _family("xshare_job_steps", "Steps the job has completed (counting from its start step).",
                  by_job, per_job("steps_done"), kind=CounterMetricFamily)
    yield _family("xshare_job_device_seconds", "Device seconds the job's steps have used.",
                  by_job, per_job("device_time_s"), kind=CounterMetricFamily)
    yield _family("xshare_job_device_time_ratio", "The job's share of all jobs' device seconds, 0 to 1.",
                  by_job, per_job("device_time_share"))
    yield _family("xshare_job_steps_per_second", "Completed steps per second since the job started.",
                  by_job, per_job("steps_per_s"))
    yield _step_seconds(jobs)
    yield _family("xshare_job_queue_wait_seconds", "Seconds the job waited for memory before it started.",
                  by_job, per_job("queue_wait_s"))
    for field, help_ in _JOB_BYTES:
        yield _family(f"xshare_job_{field}", help_, by_job, per_job(field))
    yield _family("xshare_job_metric", "The last value of each metric the job's step returns.",
                  ("job_name", "metric"),
                  [((j["name"], k), v) for j in jobs for k, v in (j["metrics"] or {}).items()])


def _step_seconds(jobs: list[Mapping[str, Any]]) -> Metric:
    """Histogram of every measured step when the document has the buckets, else a summary of
    the recent steps' quantiles (OpenMetrics allows a summary without count and sum)."""
    name = "xshare_job_step_seconds"
    if jobs and all(j.get("step_time_histogram") for j in jobs):  # optional in v1: the runtime fills it
        hist = HistogramMetricFamily(name, "Device seconds per step, every measured step.", labels=["job_name"])
        for j in jobs:
            h = j["step_time_histogram"]
            cumulative, buckets = 0, []
            for bound, count in zip(list(h["bounds_s"]) + [float("inf")], h["counts"]):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
            hist.add_metric([j["name"]], buckets, float(h["sum_s"]))
        return hist
    family = Metric(name, "Device seconds per step over the job's recent steps, by quantile.", "summary")
    for j in jobs:
        for q, key in (("0.5", "step_time_p50_s"), ("0.95", "step_time_p95_s")):
            if j[key] is not None:
                family.add_sample(name, {"job_name": j["name"], "quantile": q}, float(j[key]))
    return family


class StatusCollector(Collector):
    """Collects from ``source()``, a status document, at every scrape."""

    def __init__(self, source: Callable[[], Mapping[str, Any]]):
        self._source = source

    def collect(self) -> Iterator[Metric]:
        return families(self._source())


def exposition(doc: Mapping[str, Any]) -> bytes:
    """The document in Prometheus' text format (content type :data:`CONTENT_TYPE`)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(lambda: doc))
    return generate_latest(registry)


__all__ = ["CONTENT_TYPE", "StatusCollector", "exposition", "families"]
