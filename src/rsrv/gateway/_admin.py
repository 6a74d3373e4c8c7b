"""The gateway's admin HTTP endpoint (``listen.metrics``): /healthz, /readyz, /metrics.

* ``/healthz``: 200 while the gateway runs, with JSON: each worker's name, address,
  readiness, calls in flight and the models it serves;
* ``/readyz``: 200 while at least one worker is ready and the gateway is not stopping;
* ``/metrics``: Prometheus metrics (specs/metrics.md, Gateway).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rsrv.asgi import admin_app, json_response, serve_http

if TYPE_CHECKING:
    from rsrv.gateway._gateway import Gateway

__all__ = ["serve_gateway_admin"]


def _health(gateway: Gateway) -> dict:
    return {
        "ready": gateway.ready,
        "stopping": gateway.stopping,
        "mode": gateway.config.scheduling.mode,
        "workers": [
            {
                "name": w.name,
                "address": w.address,
                "ready": w.ready,
                "inflight": w.inflight,
                "models": sorted(w.serving),
            }
            for w in gateway.fleet.workers
        ],
    }


class _GatewayCollector:
    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    def collect(self):
        g = self.gateway
        up = GaugeMetricFamily(
            "rsrv_gateway_worker_up",
            "1 while the worker's last probe found it ready",
            labels=["worker"],
        )
        inflight = GaugeMetricFamily(
            "rsrv_gateway_worker_inflight", "Calls open on the worker", labels=["worker"]
        )
        for w in g.fleet.workers:
            up.add_metric([w.name], int(w.ready))
            inflight.add_metric([w.name], w.inflight)
        yield up
        yield inflight
        yield GaugeMetricFamily(
            "rsrv_gateway_inflight_requests", "Client calls in flight", g.admission.inflight
        )
        yield CounterMetricFamily(
            "rsrv_gateway_shed_requests",
            "Client calls refused RESOURCE_EXHAUSTED at the in-flight cap",
            g.admission.shed,
        )
        counters = g.forwarder.counters
        for name, table, text in (
            (
                "rsrv_gateway_routed_requests",
                counters.routed,
                "Calls sent to a worker, by its status",
            ),
            (
                "rsrv_gateway_failovers",
                counters.failovers,
                "Calls moved on from a worker, by its status",
            ),
        ):
            family = CounterMetricFamily(name, text, labels=["worker", "status"])
            for (worker, status), count in sorted(table.items()):
                family.add_metric([worker, status], count)
            yield family
        yield CounterMetricFamily(
            "rsrv_gateway_discovery_rounds", "Discovery rounds completed", g.discovery.rounds
        )
        yield from g.scheduler_metrics()


async def serve_gateway_admin(
    gateway: Gateway, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED
) -> None:
    """Serve until cancelled; ``task_status.started()`` once listening."""
    registry = CollectorRegistry()
    registry.register(_GatewayCollector(gateway))

    async def metrics() -> bytes:  # (per worker: small, so rendered on the loop)
        return generate_latest(registry)

    app = admin_app(
        ready=lambda: gateway.ready,
        metrics=metrics,
        health=lambda: json_response(_health(gateway)),
    )
    await serve_http(app, host, port, "rsrv.gateway.admin", task_status=task_status)
