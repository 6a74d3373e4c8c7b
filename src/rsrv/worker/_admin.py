"""The worker's admin HTTP endpoint: /healthz, /readyz and /metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from rsrv.asgi import NOT_FOUND, PlainApp, Response, serve_http
from rsrv.worker._metrics import CONTENT_TYPE, exposition

if TYPE_CHECKING:
    from rsrv.worker._worker import Worker


def _route(worker: Worker, path: str) -> Response:
    """Every answer is computed from the worker's live state."""
    if path == "/healthz":
        return Response(200, b"ok\n")
    if path == "/readyz":
        return Response(200, b"ready\n") if worker.ready else Response(503, b"not ready\n")
    if path == "/metrics":
        return Response(200, exposition(worker), CONTENT_TYPE)
    return NOT_FOUND


async def serve_admin(
    worker: Worker, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED
) -> None:
    """Serve until cancelled; ``task_status.started()`` once listening."""
    app = PlainApp(lambda path: _route(worker, path))
    await serve_http(app, host, port, "rsrv.admin", task_status=task_status)
