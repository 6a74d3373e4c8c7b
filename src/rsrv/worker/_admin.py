"""The admin HTTP endpoint: /healthz, /readyz and /metrics, served by hypercorn on trio."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from rsrv.worker._metrics import CONTENT_TYPE, exposition

if TYPE_CHECKING:
    from rsrv.worker._worker import Worker

log = logging.getLogger(__name__)


class AdminApp:
    """A minimal ASGI app; every answer is computed from the worker's live state."""

    def __init__(self, worker: Worker):
        self.worker = worker

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if scope["method"] not in ("GET", "HEAD"):
            status, body, ctype = 405, b"method not allowed\n", "text/plain"
        elif path == "/healthz":
            status, body, ctype = 200, b"ok\n", "text/plain"
        elif path == "/readyz":
            ready = self.worker.ready
            status, body, ctype = (
                (200, b"ready\n", "text/plain") if ready else (503, b"not ready\n", "text/plain")
            )
        elif path == "/metrics":
            status, body, ctype = 200, exposition(self.worker), CONTENT_TYPE
        else:
            status, body, ctype = 404, b"not found\n", "text/plain"
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", ctype.encode()),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


async def serve_admin(
    worker: Worker, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED
) -> None:
    """Serve until cancelled; ``task_status.started()`` once listening."""
    config = Config()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("rsrv.admin")
    config.graceful_timeout = 1.0
    await serve(AdminApp(worker), config, mode="asgi", task_status=task_status)
