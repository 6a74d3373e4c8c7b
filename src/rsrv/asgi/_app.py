"""A GET-only ASGI app answering from a route function, and hypercorn serving it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

__all__ = ["NOT_FOUND", "PlainApp", "Response", "serve_http"]


class Response(NamedTuple):
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"


NOT_FOUND = Response(404, b"not found\n")
_NOT_ALLOWED = Response(405, b"method not allowed\n")


class PlainApp:
    """Answers GET and HEAD with ``route(path)``, computed when asked; other methods
    get 405. ``route`` returns a :class:`Response` (``NOT_FOUND`` for unknown paths)."""

    def __init__(self, route: Callable[[str], Response]):
        self.route = route

    async def __call__(self, scope, receive, send) -> None:
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
        if scope["method"] in ("GET", "HEAD"):
            response = self.route(scope["path"])
        else:
            response = _NOT_ALLOWED
        await send(
            {
                "type": "http.response.start",
                "status": response.status,
                "headers": [
                    (b"content-type", response.content_type.encode()),
                    (b"content-length", str(len(response.body)).encode()),
                ],
            }
        )
        body = b"" if scope["method"] == "HEAD" else response.body
        await send({"type": "http.response.body", "body": body})


async def serve_http(
    app: PlainApp,
    host: str,
    port: int,
    logger: str,
    *,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on host:port until cancelled; ``task_status.started()`` once
    listening. Errors are logged to ``logger``; no access log."""
    config = Config()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger(logger)
    config.graceful_timeout = 1.0
    await serve(app, config, mode="asgi", task_status=task_status)
