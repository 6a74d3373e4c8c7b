"""The node's admin HTTP endpoint (``metrics_port``): /healthz, /readyz, /metrics.

* ``/healthz``: 200 while the supervisor runs, with a JSON view of every child
  (what ``rsrv node status`` prints);
* ``/readyz``: 200 when the front door serves (the gateway, or the workers of a node
  without one), else 503; 503 from the moment the node starts stopping;
* ``/metrics``: the supervisor's own Prometheus metrics (children up, ready, restarts).
  Each worker serves its own on its metrics port.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rsrv.asgi import admin_app, json_response, serve_http
from rsrv.config import NodePlan

if TYPE_CHECKING:
    from rsrv.node._supervisor import Supervisor

__all__ = ["health", "serve_node_admin"]


def public_port(plan: NodePlan) -> int | None:
    """The port clients of the node connect to: the gateway's, or a one-worker node's
    worker's; None when there is no single front door (workers without a gateway)."""
    if plan.gateway:
        return plan.port
    if len(plan.workers) == 1:
        return plan.workers[0].endpoints.port
    return None


def health(supervisor: Supervisor) -> dict:
    """The node and each child, as ``/healthz`` reports them."""
    now = trio.current_time()
    return {
        "pid": os.getpid(),
        "ready": supervisor.ready,
        "stopping": supervisor.stopping,
        "uptime_seconds": round(now - supervisor.started_at, 3),
        "port": public_port(supervisor.plan),
        "devices": supervisor.plan.devices,
        "children": [
            {
                "name": c.name,
                "kind": c.spec.kind,
                "state": c.state.value,
                "ready": c.ready,
                "pid": c.pid if c.alive else None,
                "port": c.spec.port,
                "device": c.spec.device,
                "restarts": c.restarts_total,
                "last_exit": c.last_exit,
            }
            for c in supervisor.children
        ],
    }


class _NodeCollector:
    def __init__(self, supervisor: Supervisor):
        self.supervisor = supervisor

    def collect(self):
        s = self.supervisor
        yield GaugeMetricFamily("rsrv_node_ready", "1 when the front door serves", int(s.ready))
        up = GaugeMetricFamily(
            "rsrv_node_child_up", "1 while the child process runs", labels=["child", "kind"]
        )
        ready = GaugeMetricFamily(
            "rsrv_node_child_ready", "1 while the child serves", labels=["child", "kind"]
        )
        restarts = CounterMetricFamily(
            "rsrv_node_child_restarts", "Times the child was restarted", labels=["child", "kind"]
        )
        for c in s.children:
            labels = [c.name, c.spec.kind]
            up.add_metric(labels, int(c.alive))
            ready.add_metric(labels, int(c.ready))
            restarts.add_metric(labels, c.restarts_total)
        yield from (up, ready, restarts)


async def serve_node_admin(
    supervisor: Supervisor, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED
) -> None:
    """Serve until cancelled; ``task_status.started()`` once listening."""
    registry = CollectorRegistry()
    registry.register(_NodeCollector(supervisor))

    async def metrics() -> bytes:  # (per worker: small, so rendered on the loop)
        return generate_latest(registry)

    app = admin_app(
        ready=lambda: supervisor.ready,
        metrics=metrics,
        health=lambda: json_response(health(supervisor)),
    )
    await serve_http(app, host, port, "rsrv.node.admin", task_status=task_status)
