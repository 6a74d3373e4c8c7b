"""Prometheus metrics of a worker, read from live state at scrape time.

Nothing on the request path touches a metrics object: counters already kept by the
scheduler, the pipeline statistics and the weight cache are read when /metrics is
scraped. The read copies plain values, on the event loop; building the families and
their text, most of a scrape's cost, runs in a thread, so a scrape of many models holds
the loop only for the copy. Names and labels are documented in specs/metrics.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from rsrv.threads import run_sync
from rsrv.worker._statistics import LATENCY_BUCKETS

if TYPE_CHECKING:
    from rsrv.scheduler import SchedulingStats
    from rsrv.worker._worker import Worker


@dataclass(frozen=True, slots=True)
class _ModelReading:
    """One model's values at the scrape: copies, as the thread that renders them must
    not read live objects. ``requests``: (status, count), OK first, None before any;
    ``latency``: the histogram's cumulative bucket counts, then its sum; ``sched``: a
    served model's scheduling statistics (a snapshot), ``meta_compute`` a meta's."""

    name: str
    requests: tuple[tuple[str, int], ...] | None
    latency: tuple[list[tuple[str, int]], float] | None
    served: bool
    meta_compute: float | None
    sched: SchedulingStats | None
    weight_bytes: int
    on_device: int
    on_host: int


@dataclass(frozen=True, slots=True)
class _WorkerReading:
    """Everything /metrics shows, read at once; :meth:`collect` builds the families."""

    info: list[str]
    fallback: int
    models: list[_ModelReading]
    cache_budget: int
    cache_resident: int
    cache_pinned: int
    cache_loads: int
    cache_evictions: int
    cache_load_seconds: float
    cache_transferred: int
    inflight: int
    shed: int

    def collect(self):
        info = GaugeMetricFamily(
            "rsrv_worker_info",
            "Worker identity and policy (always 1)",
            labels=["worker", "platform", "device", "discipline", "control_mode"],
        )
        info.add_metric(self.info, 1)
        yield info
        yield GaugeMetricFamily(
            "rsrv_device_fallback",
            "1 when backend cuda found no usable GPU and runs on the CPU (allow_cpu_fallback)",
            value=self.fallback,
        )
        yield from self._model_families()
        yield GaugeMetricFamily(
            "rsrv_weight_cache_budget_bytes",
            "Device bytes for evictable weights (0: cache off)",
            value=self.cache_budget,
        )
        yield GaugeMetricFamily(
            "rsrv_weight_cache_resident_bytes",
            "Evictable weight bytes on the device",
            value=self.cache_resident,
        )
        yield GaugeMetricFamily(
            "rsrv_weight_cache_pinned_bytes",
            "Weight bytes pinned on the device",
            value=self.cache_pinned,
        )
        yield CounterMetricFamily(
            "rsrv_weight_cache_loads", "Host-to-device weight loads", value=self.cache_loads
        )
        yield CounterMetricFamily(
            "rsrv_weight_cache_evictions", "Weight evictions", value=self.cache_evictions
        )
        yield CounterMetricFamily(
            "rsrv_weight_cache_load_seconds",
            "Seconds spent loading weights",
            value=self.cache_load_seconds,
        )
        yield CounterMetricFamily(
            "rsrv_weight_cache_transferred_bytes",
            "Weight bytes copied to the device",
            value=self.cache_transferred,
        )
        yield GaugeMetricFamily("rsrv_inflight_requests", "RPCs in flight", value=self.inflight)
        yield CounterMetricFamily(
            "rsrv_requests_shed", "RPCs refused at the in-flight cap", value=self.shed
        )

    def _model_families(self):
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
        for m in self.models:
            name = m.name
            for status, n in m.requests or ():
                requests.add_metric([name, status], n)
            if m.latency is not None:
                latency.add_metric([name], *m.latency)
            if not m.served:
                continue
            if m.meta_compute is not None:  # a meta: the device time of its sub-calls
                compute.add_metric([name], m.meta_compute)
                continue
            sched = m.sched
            depth.add_metric([name], sched.queue_depth)
            for key, quantile in (("p50", "0.5"), ("p99", "0.99")):
                if key in sched.wait_percentiles:
                    wait.add_metric([name, quantile], sched.wait_percentiles[key])
            compute.add_metric([name], sched.compute_seconds)
            executions.add_metric([name], sched.dispatches)
            rows.add_metric([name], sched.rows)
            for size, n in sched.batch_sizes.items():
                batch.add_metric([name, str(size)], n)
            weight_bytes.add_metric([name], m.weight_bytes)
            on_device.add_metric([name], m.on_device)
            on_host.add_metric([name], m.on_host)
        return (
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


def _read_model(w: Worker, name: str, entry) -> _ModelReading:
    stats = w.pipeline.statistics.get(name)
    requests = latency = None
    if stats is not None:
        requests = (("OK", stats.success.count), *sorted(stats.failures_by_status.items()))
        buckets, acc = [], 0
        for bound, n in zip(LATENCY_BUCKETS, stats.latency_counts, strict=False):
            acc += n
            buckets.append((repr(bound), acc))
        buckets.append(("+Inf", stats.success.count + stats.fail.count))
        latency = (buckets, stats.latency_sum)
    served = entry.model
    meta_compute = sched = None
    weight_bytes = on_device = on_host = 0
    if served is not None and served.bundle.kind == "meta":
        meta = w.pipeline.meta.stats.get(name)
        meta_compute = meta.compute_seconds if meta else 0.0
    elif served is not None:
        sched = w.scheduler.stats(name)
        weight_bytes = served.bundle.weight_bytes
        on_device = int(w.weights.cache.is_resident(served.key))
        on_host = int(w.weights.host_resident(served.key))
    return _ModelReading(
        name,
        requests,
        latency,
        served is not None,
        meta_compute,
        sched,
        weight_bytes,
        on_device,
        on_host,
    )


def read(w: Worker) -> _WorkerReading:
    """The worker's metrics now (on the event loop: it reads live state)."""
    cache = w.weights.cache
    c = cache.counters
    return _WorkerReading(
        info=[
            w.config.name,
            w.platform,
            w.device.describe(),
            w.config.scheduler.discipline,
            w.config.model_control_mode,
        ],
        fallback=int(w.device.fallback),
        models=[_read_model(w, name, e) for name, e in sorted(w.models.entries.items())],
        cache_budget=cache.budget or 0,
        cache_resident=cache.resident_bytes,
        cache_pinned=cache.pinned_bytes,
        cache_loads=c.loads,
        cache_evictions=c.evictions,
        cache_load_seconds=c.load_seconds,
        cache_transferred=c.bytes_transferred,
        inflight=w.admission.inflight,
        shed=w.admission.shed,
    )


async def exposition(worker: Worker) -> bytes:
    """The worker's metrics in Prometheus's text format: read on the loop, rendered in
    a thread."""
    return await run_sync(generate_latest, read(worker))
