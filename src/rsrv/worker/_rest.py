"""The worker's KServe V2 REST endpoint (``endpoints.http_port``): the protocol's
:class:`~rsrv.protocol.RestService` over the worker, served by hypercorn on trio in the
worker's own nursery, beside the gRPC port (specs/http.md)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import trio

from rsrv.asgi import serve_http
from rsrv.protocol import InferenceService, RestService

if TYPE_CHECKING:
    from rsrv.worker._worker import Worker


async def serve_rest(
    worker: Worker, service: InferenceService, *, task_status=trio.TASK_STATUS_IGNORED
) -> None:
    """Serve until cancelled; ``task_status.started(port)`` with the port bound once
    listening (``endpoints.http_port``; 0: a free one). The endpoint shares the gRPC
    port's address, restrictions, in-flight cap, message limit, receive timeout and TLS
    files. A connection without a whole request for ``endpoints.idle_connection_seconds``
    (0: never) is closed: one idle between requests, and one whose request headers do not
    complete. No timeout applies while a request is being answered, but a connection
    whose answer makes no progress for ``endpoints.receive_timeout_seconds`` (its client
    reads nothing) is closed. ``worker.rest_stop`` closes the port gracefully."""
    ep = worker.config.endpoints
    app = RestService(
        service,
        worker.restrictions,
        max_body_bytes=ep.max_message_bytes,
        receive_timeout=ep.receive_timeout_seconds,
    )
    idle = ep.idle_connection_seconds or math.inf
    tls = (ep.tls_cert_file, ep.tls_key_file, ep.tls_client_ca_file) if ep.tls_cert_file else None
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            lambda task_status: _serve_until_stopped(
                worker,
                app,
                ep.host,
                ep.http_port,
                "rsrv.rest",
                # hypercorn's idle timer runs until a request's headers are complete and
                # again after each answer. Its read_timeout is not used: it would apply to
                # every read, also while a long inference runs, and drop its answer.
                keep_alive_timeout=idle,
                handshake_timeout=ep.receive_timeout_seconds,  # (as the gRPC port's)
                send_timeout=ep.receive_timeout_seconds,  # (an answer nobody reads)
                tls=tls,
                max_connections=ep.max_connections,
                connections_setting="endpoints.max_connections",
                what="REST",
                shutdown_trigger=worker.rest_stop.wait,
                task_status=task_status,
            )
        )
        task_status.started(int(binds[0].rsplit(":", 1)[1]))


async def _serve_until_stopped(worker: Worker, *args, **kwargs) -> None:
    """serve_http, then ``worker.rest_stopped`` set: once ``worker.rest_stop`` is, the
    port stops listening and the answers under way are finished (hypercorn's graceful
    close), rather than cut by the worker's cancel."""
    try:
        await serve_http(*args, **kwargs)
    finally:
        worker.rest_stopped.set()
