"""Prometheus metrics of a worker, collected from live state at scrape time.

Nothing on the request path touches a metrics object: counters already kept by the
scheduler, the pipeline statistics and the weight cache are read when /metrics is
scraped. Names and labels are documented in specs/metrics.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from rsrv.worker._statistics import LATENCY_BUCKETS

if TYPE_CHECKING:
    from rsrv.worker._worker import Worker


class WorkerCollector:
    def __init__(self, worker: Worker):
        self.worker = worker

    def collect(self):
        w = self.worker
        info = GaugeMetricFamily(
            "rsrv_worker_info",
            "Worker identity and policy (always 1)",
            labels=["worker", "platform", "device", "discipline", "control_mode"],
        )
        info.add_metric(
            [
                w.config.name,
                w.platform,
                w.device.describe(),
                w.config.scheduler.discipline,
                w.config.model_control_mode,
            ],
            1,
        )
        yield info
        yield GaugeMetricFamily(
            "rsrv_device_fallback",
            "1 when backend cuda found no usable GPU and runs on the CPU (allow_cpu_fallback)",
            value=int(w.device.fallback),
        )

        requests = CounterMetricFamily(
            "rsrv_requests", "Inference requests answered, by status", labels=["model", "status"]
        )
        latency = HistogramMetricFamily(
            "rsrv_request_latency_seconds",
            "Request latency from decode to encode",
            labels=["model"],
        )
        depth = GaugeMetricFamily("rsrv_queue_depth", "Requests queued", labels=["model"])
        wait = GaugeMetricFamily(
            "rsrv_queue_wait_seconds", "Recent queue wait percentiles", labels=["model", "quantile"]
        )
        compute = CounterMetricFamily(
            "rsrv_compute_seconds", "Device execution seconds", labels=["model"]
        )
        executions = CounterMetricFamily("rsrv_executions", "Batches executed", labels=["model"])
        rows = CounterMetricFamily(
            "rsrv_inferences", "Rows inferred (each batch row counts)", labels=["model"]
        )
        batch = CounterMetricFamily(
            "rsrv_batch_executions",
            "Executions per compiled batch size",
            labels=["model", "batch_size"],
        )
        weight_bytes = GaugeMetricFamily(
            "rsrv_model_weight_bytes", "Weight bytes of the model", labels=["model"]
        )
        on_device = GaugeMetricFamily(
            "rsrv_model_device_resident",
            "1 while the model's weights are on the device",
            labels=["model"],
        )
        on_host = GaugeMetricFamily(
            "rsrv_model_host_resident",
            "1 while the model's weights are staged in host RAM",
            labels=["model"],
        )
        for name, entry in sorted(w.models.entries.items()):
            stats = w.pipeline.statistics.get(name)
            if stats is not None:
                requests.add_metric([name, "OK"], stats.success.count)
                for status, n in sorted(stats.failures_by_status.items()):
                    requests.add_metric([name, status], n)
                buckets, acc = [], 0
                for bound, n in zip(LATENCY_BUCKETS, stats.latency_counts, strict=False):
                    acc += n
                    buckets.append((repr(bound), acc))
                buckets.append(("+Inf", stats.success.count + stats.fail.count))
                latency.add_metric([name], buckets, stats.latency_sum)
            served = entry.model
            if served is None:
                continue
            meta = w.pipeline.meta.stats.get(name)
            if served.bundle.kind == "meta":  # compute = the device time of its sub-calls
                compute.add_metric([name], meta.compute_seconds if meta else 0.0)
                continue
            sched = w.scheduler.stats(name)
            depth.add_metric([name], sched.queue_depth)
            for key, quantile in (("p50", "0.5"), ("p99", "0.99")):
                if key in sched.wait_percentiles:
                    wait.add_metric([name, quantile], sched.wait_percentiles[key])
            compute.add_metric([name], sched.compute_seconds)
            executions.add_metric([name], sched.dispatches)
            rows.add_metric([name], sched.rows)
            for size, n in sorted(sched.batch_sizes.items()):
                batch.add_metric([name, str(size)], n)
            weight_bytes.add_metric([name], served.bundle.weight_bytes)
            on_device.add_metric([name], int(w.weights.cache.is_resident(served.key)))
            on_host.add_metric([name], int(w.weights.host_resident(served.key)))
        yield from (
            requests,
            latency,
            depth,
            wait,
            compute,
            executions,
            rows,
            batch,
            weight_bytes,
            on_device,
            on_host,
        )

        cache = w.weights.cache
        c = cache.counters
        yield GaugeMetricFamily(
            "rsrv_weight_cache_budget_bytes",
            "Device bytes for evictable weights (0: cache off)",
            value=cache.budget or 0,
        )
        yield GaugeMetricFamily(
            "rsrv_weight_cache_resident_bytes",
            "Evictable weight bytes on the device",
            value=cache.resident_bytes,
        )
        yield GaugeMetricFamily(
            "rsrv_weight_cache_pinned_bytes",
            "Weight bytes pinned on the device",
            value=cache.pinned_bytes,
        )
        yield CounterMetricFamily(
            "rsrv_weight_cache_loads", "Host-to-device weight loads", value=c.loads
        )
        yield CounterMetricFamily(
            "rsrv_weight_cache_evictions", "Weight evictions", value=c.evictions
        )
        yield CounterMetricFamily(
            "rsrv_weight_cache_load_seconds", "Seconds spent loading weights", value=c.load_seconds
        )
        yield CounterMetricFamily(
            "rsrv_weight_cache_transferred_bytes",
            "Weight bytes copied to the device",
            value=c.bytes_transferred,
        )
        admission = w.admission
        yield GaugeMetricFamily(
            "rsrv_inflight_requests", "RPCs in flight", value=admission.inflight
        )
        yield CounterMetricFamily(
            "rsrv_requests_shed", "RPCs refused at the in-flight cap", value=admission.shed
        )


def exposition(worker: Worker) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerCollector(worker))
    return generate_latest(registry)
