"""The worker's admin HTTP endpoint: /healthz, /readyz and /metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from rsrv.asgi import admin_app, serve_http
from rsrv.worker._metrics import exposition

if TYPE_CHECKING:
    from rsrv.worker._worker import Worker


async def serve_admin(
    worker: Worker, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED
) -> None:
    """Serve until cancelled; ``task_status.started()`` once listening. Every answer is
    computed from the worker's live state."""
    app = admin_app(
        ready=lambda: worker.ready and not worker.admission.closed,  # (draining: not)
        metrics=lambda: exposition(worker),
    )
    await serve_http(app, host, port, "rsrv.admin", task_status=task_status)
