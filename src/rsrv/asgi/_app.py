"""A GET-only ASGI app answering from a route function, the admin endpoints built on it,
and hypercorn serving it (or any other ASGI app, e.g. the worker's KServe V2 REST
endpoint)."""

from __future__ import annotations

import json
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import hypercorn.protocol
import hypercorn.trio.run
import trio
from hypercorn.config import Config
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol.events import Body, Data, EndBody, EndData
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.trio import serve
from hypercorn.trio.tcp_server import TCPServer

from rsrv.errors import alone
from rsrv.transport import ConnectionCap, is_listen_error, listen_error

__all__ = [
    "NOT_FOUND",
    "PROMETHEUS",
    "PlainApp",
    "Response",
    "admin_app",
    "answer_lifespan",
    "json_response",
    "request_path",
    "serve_http",
]


class _ClosingTCPServer(TCPServer):
    """hypercorn's connection (0.17), closed as soon as the client closes it, and
    refused (closed at once) beyond its server's connection cap.

    hypercorn's own holds the socket (CLOSE_WAIT, one descriptor) until its keep-alive
    timer ends when the client closes an idle HTTP/1.1 connection: the read loop meets
    the end of the stream, but the timer's task, still running in the connection's task
    group, keeps the group, and the close after it, waiting. Stopping the timer there
    lets the connection close once its requests are answered. (A hypercorn without
    that timer, ``idle_task``, is left to itself.)

    hypercorn has no connection cap: a client opening connections that never finish
    their headers would hold one descriptor each until the process has none left. Here
    a server holds at most its :class:`~rsrv.transport.ConnectionCap`, a connection
    waiting for a request being one whose headers are not complete, or idle between
    requests."""

    # Since when no request is under way (hypercorn's Updated(idle) events), None while
    # one is: headers not complete, or idle between requests, count as waiting.
    _rsrv_waiting_since: float | None = None
    # Cancelled to close the connection at the cap: its own task then closes its stream
    # (closed from another task, a TLS handshake under way raised past hypercorn, which
    # catches only BrokenResourceError there, and took the whole server down).
    _rsrv_scope: trio.CancelScope | None = None

    async def run(self) -> None:
        cap: ConnectionCap = self.config.rsrv_connection_cap  # (serve_http sets it)
        self._rsrv_waiting_since = trio.current_time()
        admitted, oldest = cap.make_room()
        if not admitted:
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(self.stream)
            return
        cap.open[self] = None  # (before any checkpoint: a burst sees it counted)
        scope = self._rsrv_scope = trio.CancelScope()
        try:
            if oldest is not None:
                oldest._rsrv_scope.cancel()
            with scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._close_after_stop)
                    await super().run()
                    nursery.cancel_scope.cancel()
        except Exception as e:  # (one connection's failure ends it, never the server)
            # hypercorn lets some escape: an HTTP/2 :path or :method that is not ASCII
            # (UnicodeDecodeError) took the whole process down, gRPC port and all.
            self.config.errorlog.warning(
                "closed a connection that broke the HTTP server: %s", _described(e)
            )
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(self.stream)
        finally:
            cap.open.pop(self, None)
            if scope.cancelled_caught:  # (hypercorn's own close was cancelled too)
                with trio.CancelScope(shield=True):
                    await trio.aclose_forcefully(self.stream)

    async def protocol_send(self, event) -> None:
        if isinstance(event, RawData):
            await self._send_data(event.data)
            return
        if isinstance(event, Updated):
            self._rsrv_waiting_since = trio.current_time() if event.idle else None
        await super().protocol_send(event)

    async def _close_after_stop(self) -> None:
        """Once the server stops, give the connection hypercorn's graceful time, then
        close its socket: a shielded write to a client still reading slowly ends there
        too (ClosedResourceError), so a stop never waits on one."""
        await self.context.terminated.wait()
        try:
            await trio.sleep(self.config.graceful_timeout)
        finally:  # (also when cancelled: the connection ended, or the stop's deadline)
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(self.stream)

    async def _send_data(self, data: bytes) -> None:
        """hypercorn's write, shielded as its own (an answer is never cut by a cancel),
        but closing the connection when a piece of it makes no progress for
        ``rsrv_send_timeout`` seconds: a client that does not read its answer would
        hold the connection (and a graceful stop) for ever."""
        timeout = self.config.rsrv_send_timeout
        view = memoryview(data)
        async with self.send_lock:
            try:
                with trio.CancelScope(shield=True) as scope:
                    for start in range(0, len(view), _SEND_PIECE):
                        scope.deadline = trio.current_time() + timeout
                        await self.stream.send_all(view[start : start + _SEND_PIECE])
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await self.protocol.handle(Closed())
                return
            if scope.cancelled_caught:
                self.config.errorlog.info(
                    "closed a connection whose client read none of its answer for %g s", timeout
                )
                with trio.CancelScope(shield=True):
                    await trio.aclose_forcefully(self.stream)
                await self.protocol.handle(Closed())

    async def _read_data(self) -> None:
        await super()._read_data()
        idle = getattr(self, "idle_task", None)
        if idle is not None:
            await idle.stop()


def _described(error: BaseException) -> str:
    """``error`` in one line: type and message; a group's first member (a nursery's)."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return f"{type(error).__name__}: {error}"[:300]


#: An answer is written in pieces of this, each within the send timeout: a client
#: reading at least this much per timeout is never cut off.
_SEND_PIECE = 64 * 1024


class _BoundedH2Protocol(H2Protocol):
    """hypercorn's HTTP/2 connection (0.17), closed when an answer waiting for the
    client's flow-control window makes no progress for ``rsrv_send_timeout`` seconds
    (not one frame of it sent), and whose answers stop waiting once it is closed.

    hypercorn's own waits without a bound, in the answering task (the bytes it hands
    over never reach :meth:`_ClosingTCPServer._send_data` meanwhile): a client that
    opened no window held its connection, answering and so beyond the cap's reach, for
    as long as it stayed; and for good once it closed, the wait then never ending. (64
    of them took an admin port for good: every probe refused.)"""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # stream id -> the deadline of its answer's wait, pushed back at each frame sent
        self._rsrv_waits: dict[int, trio.CancelScope] = {}

    async def stream_send(self, event) -> None:
        if not isinstance(event, (Body, Data, EndBody, EndData)):
            await super().stream_send(event)
            return
        timeout = self.config.rsrv_send_timeout
        scope = self._rsrv_waits[event.stream_id] = trio.CancelScope()
        scope.deadline = trio.current_time() + timeout
        try:
            with scope:
                await super().stream_send(event)
        finally:
            if self._rsrv_waits.get(event.stream_id) is scope:
                del self._rsrv_waits[event.stream_id]
        if scope.cancelled_caught:
            self.config.errorlog.info(
                "closed an HTTP/2 connection whose client took none of its answer for %g s",
                timeout,
            )
            await self.send(Closed())

    async def _send_data(self, stream_id: int) -> None:
        buffer = self.stream_buffers.get(stream_id)
        held = len(buffer.buffer) if buffer is not None else 0
        await super()._send_data(stream_id)
        scope = self._rsrv_waits.get(stream_id)
        if scope is not None and (buffer is None or len(buffer.buffer) < held):  # (progress)
            scope.deadline = trio.current_time() + self.config.rsrv_send_timeout

    async def handle(self, event) -> None:
        await super().handle(event)
        if isinstance(event, Closed):  # (an answer waiting for window space: stop it)
            for buffer in list(self.stream_buffers.values()):
                await buffer.close()


def _waiting_since(conn: _ClosingTCPServer) -> float | None:
    return conn._rsrv_waiting_since


# What serve() starts per connection. (On a hypercorn whose connection has no
# ``_read_data``, the override above is never called; the cap still applies.)
hypercorn.trio.run.TCPServer = _ClosingTCPServer
hypercorn.protocol.H2Protocol = _BoundedH2Protocol  # (what a connection switches to)


class Response(NamedTuple):
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"


NOT_FOUND = Response(404, b"not found\n")
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"  # the text exposition format
_OK = Response(200, b"ok\n")
_READY = Response(200, b"ready\n")
_NOT_READY = Response(503, b"not ready\n")


def json_response(value: Any, status: int = 200) -> Response:
    """``value`` as indented JSON."""
    return Response(status, json.dumps(value, indent=1).encode() + b"\n", "application/json")


async def answer_lifespan(receive, send) -> None:
    """Complete an ASGI lifespan exchange: startup, then (returning) shutdown."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


_NOT_ALLOWED = Response(405, b"method not allowed\n")


def request_path(scope) -> str:
    """The path of an ASGI ``http`` scope, also for a request target in absolute form
    (``GET http://host/healthz``, which RFC 9112 §3.2.2 says a server must accept, and
    hypercorn passes on whole)."""
    path = scope["path"]
    if path.startswith("/") or "://" not in path:
        return path
    rest = path.partition("://")[2]
    slash = rest.find("/")
    return rest[slash:] if slash >= 0 else "/"


class PlainApp:
    """Answers GET and HEAD with ``await route(path)``, computed when asked; other
    methods get 405. ``route`` returns a :class:`Response` (``NOT_FOUND`` for unknown
    paths)."""

    def __init__(self, route: Callable[[str], Awaitable[Response]]):
        self.route = route

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
        if scope["type"] == "websocket":  # (a GET with Upgrade: websocket got a 500)
            await _answer_websocket(self.route, scope, receive, send)
        if scope["type"] != "http":
            return
        headers = []
        if scope["method"] in ("GET", "HEAD"):
            response = await self.route(request_path(scope))
        else:
            response = _NOT_ALLOWED
            headers.append((b"allow", b"GET, HEAD"))  # (RFC 9110: a 405 says which)
        headers += [
            (b"content-type", response.content_type.encode()),
            (b"content-length", str(len(response.body)).encode()),
        ]
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        body = b"" if scope["method"] == "HEAD" else response.body
        await send({"type": "http.response.body", "body": body})


async def _answer_websocket(route, scope, receive, send) -> None:
    """A GET asking to upgrade to a WebSocket: answered as plain HTTP where the server
    lets an app refuse the upgrade with a response (ASGI's websocket.http.response);
    else refused (403)."""
    await receive()  # websocket.connect
    if "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close"})
        return
    response = await route(request_path(scope))
    headers = [
        (b"content-type", response.content_type.encode()),
        (b"content-length", str(len(response.body)).encode()),
    ]
    await send(
        {"type": "websocket.http.response.start", "status": response.status, "headers": headers}
    )
    await send({"type": "websocket.http.response.body", "body": response.body})


def admin_app(
    *,
    ready: Callable[[], bool],
    metrics: Callable[[], Awaitable[bytes]],
    health: Callable[[], Response] = lambda: _OK,
) -> PlainApp:
    """The admin endpoints of an rsrv process, each answer computed when asked:
    ``/healthz`` (``health()``; 200 "ok" by default), ``/readyz`` (200 while ``ready()``,
    else 503) and ``/metrics`` (``await metrics()``: Prometheus's text format); any
    other path 404."""

    async def route(path: str) -> Response:
        if path == "/healthz":
            return health()
        if path == "/readyz":
            return _READY if ready() else _NOT_READY
        if path == "/metrics":
            return Response(200, await metrics(), PROMETHEUS)
        return NOT_FOUND

    return PlainApp(route)


async def serve_http(
    app,
    host: str,
    port: int,
    logger: str,
    *,
    keep_alive_timeout: float | None = None,
    read_timeout: float | None = None,
    handshake_timeout: float | None = None,
    send_timeout: float = 60.0,
    tls: tuple[str, str, str | None] | None = None,
    backlog: int | None = None,
    max_connections: int = 64,
    connections_setting: str = "64 per admin port",
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    what: str = "admin HTTP",
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the ASGI app ``app`` (a :class:`PlainApp` or any other) on host:port until
    cancelled; ``task_status.started(binds)`` once listening, ``binds`` the bound
    addresses (``["http://127.0.0.1:8000"]``: port 0 becomes the port bound). Errors are
    logged to ``logger``; no access log. ``keep_alive_timeout``: an idle connection is
    closed after it (hypercorn's default, 5 s, when None); ``read_timeout``: a read of
    the socket that takes longer closes the connection; ``tls``: (certificate chain,
    key, client CA or None) in PEM files, to serve HTTPS (with the CA: clients must
    present a certificate it signed), each TLS handshake within ``handshake_timeout``
    (hypercorn's default, 60 s, when None); a write of an answer that makes no progress
    for ``send_timeout`` (its client reads nothing) closes the connection. At most
    ``max_connections`` connections are open
    at once: one more closes the one waiting longest for a request, or is refused when
    every one is answering one (``connections_setting`` names the limit in the log).
    Once ``shutdown_trigger()`` returns, the port stops listening, the answers under way
    get a second to finish, idle connections close, and this returns. A bind that fails
    raises its OSError naming the port as ``what`` (``rsrv.transport.listen_error``)."""
    config = Config()
    config.rsrv_connection_cap = ConnectionCap(
        max_connections, _waiting_since, logging.getLogger(logger), connections_setting
    )
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger(logger)
    config.graceful_timeout = 1.0
    config.rsrv_send_timeout = send_timeout
    if keep_alive_timeout is not None:
        config.keep_alive_timeout = keep_alive_timeout
    if read_timeout is not None:
        config.read_timeout = read_timeout
    if backlog is not None:
        config.backlog = backlog
    if handshake_timeout is not None:
        config.ssl_handshake_timeout = handshake_timeout
    if tls is not None:
        config.certfile, config.keyfile, config.ca_certs = tls
        if tls[2] is not None:
            config.verify_mode = ssl.CERT_REQUIRED
    try:
        await serve(
            app, config, mode="asgi", shutdown_trigger=shutdown_trigger, task_status=task_status
        )
    except* OSError as group:  # (hypercorn binds before it serves: a bind that failed)
        error = alone(group)
        if not is_listen_error(error):
            raise
        raise listen_error(error, what, host, port) from error
