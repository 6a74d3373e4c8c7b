"""The client side of one HTTP/2 connection, and the calls' streams on it.

A :class:`ClientConnection` is opened by the channel (``_channel``) on a connected
socket (:func:`connect`); its task (:meth:`ClientConnection.run`) reads frames into the
streams, and its writer sends what the socket did not take at once. A
:class:`ClientStream` is one call's half of a stream: the caller queues its headers and
messages and waits for the answer; the reader delivers response headers, messages and
trailers into it.

Lifetime guarantees:

* A stream ends exactly once, with a status: the server's trailers; the server's
  RST_STREAM (REFUSED_STREAM: UNAVAILABLE, and the server never saw the call); GOAWAY
  with a last stream id below it (UNAVAILABLE, never processed); the connection lost
  (UNAVAILABLE, possibly processed); a message that cannot be received
  (RESOURCE_EXHAUSTED, INTERNAL...: the stream is reset); or the caller (its deadline:
  DEADLINE_EXCEEDED, a cancellation: CANCELLED; both reset the stream with CANCEL).
* ``reached_server`` is False only when the server certainly did not process the call
  (refused, or above GOAWAY's last stream id); a connection that breaks under a stream
  counts as reached, since the request may have been read.
* When the connection ends, every stream on it ends (UNAVAILABLE) and the socket is
  closed. After GOAWAY no stream is opened on it; it closes once its streams end.
"""

from __future__ import annotations

import errno
import math
import ssl
import urllib.parse
from collections.abc import Callable

import trio
from purerpc.grpclib.status import StatusCode

from rsrv.transport import _frames as F
from rsrv.transport._client_stream import ClientStream
from rsrv.transport._endpoint import Http2Endpoint, set_keepalive
from rsrv.transport._messages import InflateBudget

ASSUMED_MAX_STREAMS = 100  # the server's stream limit until its SETTINGS say otherwise
LAST_STREAM_ID = 2**31 - 1
_RESERVED = frozenset(
    {b"content-type", b"grpc-status", b"grpc-message", b"grpc-encoding", b"grpc-accept-encoding"}
)


async def connect(
    host: str,
    port: int,
    tls: ssl.SSLContext | None,
    server_hostname: str | None,
) -> trio.abc.Stream:
    """A connected stream to ``host:port`` (TLS with ALPN ``h2`` when ``tls`` is given,
    verifying ``server_hostname`` or ``host``). Raises OSError, ``ssl.SSLError`` or
    ``trio.BrokenResourceError`` when the server cannot be reached."""
    sock = await trio.open_tcp_stream(host, port)
    if sock.socket.getsockname() == sock.socket.getpeername():
        # TCP's simultaneous open: a connection to a local port nothing listens on can
        # be given that very port and connect to itself, holding the port the server
        # restarting there needs ("Address already in use"): refused, as it really is.
        await sock.aclose()
        raise ConnectionRefusedError(errno.ECONNREFUSED, "connected to itself: nothing listens")
    set_keepalive(sock.socket)  # (a server gone without a FIN: noticed, not waited on)
    if tls is None:
        return sock
    tls.set_alpn_protocols(["h2"])
    stream = trio.SSLStream(sock, tls, server_hostname=server_hostname or host)
    try:
        await stream.do_handshake()
    except BaseException:
        await trio.aclose_forcefully(sock)
        raise
    return stream


def _parse_headers(headers: list[tuple[bytes, bytes]]) -> tuple:
    """(http status, grpc-status or None, grpc-message, grpc-encoding, metadata)."""
    http = grpc = encoding = None
    message = ""
    metadata = []
    for name, value in headers:
        if name == b":status":
            http = value
        elif name == b"grpc-status":
            grpc = int(value) if value.isdigit() and len(value) <= 3 else -1
        elif name == b"grpc-message":
            message = urllib.parse.unquote(value.decode("latin-1"))
        elif name == b"grpc-encoding":
            encoding = value.decode("latin-1")
        elif name[:1] != b":" and name not in _RESERVED:
            metadata.append((name.decode("latin-1"), value.decode("latin-1")))
    return http, grpc, message, encoding, tuple(metadata)


class ClientConnection(Http2Endpoint):
    """One HTTP/2 connection to the server. ``available`` says whether a stream may be
    opened on it now; ``on_change()`` is called whenever that may have changed (a stream
    ended, SETTINGS, GOAWAY, the connection ended)."""

    peer_may_push = 0  # (a server announcing push would push to a client that refused it)

    def __init__(
        self,
        stream: trio.abc.Stream,
        *,
        stream_window: int,
        max_send: int,
        max_receive: int,
        on_change: Callable[[ClientConnection], None],
        accept_compressed: bool = False,
        send_setting: str = "ClientLimits.max_send_message_bytes",
        receive_setting: str = "ClientLimits.max_receive_message_bytes",
    ):
        super().__init__(stream, stream_window, _parse_headers)
        self.max_send = max_send
        self.max_receive = max_receive
        self.accept_compressed = accept_compressed
        self.send_setting = send_setting  # what sets max_send, named when a message exceeds it
        self.receive_setting = receive_setting
        self.budget = InflateBudget(max(4 * max_receive, 1 << 30))
        self.peer_max_streams = ASSUMED_MAX_STREAMS
        self.draining = False  # GOAWAY received (or sent): no new streams
        self.closed_here = False  # the channel was closed: calls left end by our hand
        self.closed = False
        self._on_change = on_change
        self._read_scope = trio.CancelScope()
        self._error: str | None = None
        self.ready = trio.Event()  # the server's SETTINGS arrived (or the connection ended)
        self.finished = trio.Event()  # set once run() has returned
        self.queue(F.PREFACE + self.local_settings())

    @property
    def available(self) -> bool:
        return not self.draining and len(self.streams) < self.peer_max_streams

    @property
    def load(self) -> int:
        return len(self.streams)

    async def run(self) -> None:
        """Read and write until the connection ends; every stream on it ends with it."""
        reason = "the connection to the server was lost"
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._writer)
                self.flush()
                with self._read_scope:
                    await self._read_loop()
                self.draining = True  # (the server is gone: no new stream while it drains)
                self._on_change(self)
                if self._error is not None:
                    reason = f"the server broke the HTTP/2 protocol: {self._error}"
                await self._drain_writer()
                nursery.cancel_scope.cancel()
        finally:
            self.closed = self.draining = True
            if self.closed_here:
                reason = "the client closed the channel while the call was in flight"
            for stream in list(self.streams.values()):
                stream._lost(True, reason)
            self._on_change(self)
            self.ready.set()
            self.finished.set()
            await self._close_socket()

    def close(self) -> None:
        """Stop opening streams and end the connection once its streams have ended
        (GOAWAY to the server then)."""
        self.draining = True
        if not self.streams and not self.closed:
            self._send_goaway(F.NO_ERROR)
            self._read_scope.cancel()

    def _send_goaway(self, code: int, why: str = "") -> None:
        self._goaway_sent = True
        self.queue(F.goaway(0, code, why.encode()[:256]))  # the server opens none
        self.flush()

    def open_stream(
        self,
        block: bytes,
        *,
        end_stream: bool = False,
        deadline: float = math.inf,
        unary: bool = False,
    ) -> ClientStream:
        """Open a stream whose request headers are ``block`` (queued, not flushed);
        ``deadline`` (trio time) is the call's, for the status of a send it cuts short;
        ``unary``: its call takes one response message (a second ends it INTERNAL)."""
        sid = self._last_stream + 2 if self._last_stream else 1
        self._last_stream = sid
        if sid >= LAST_STREAM_ID - 2:
            self.draining = True  # stream ids run out: the pool opens another connection
        stream = ClientStream(self, sid, deadline, unary)
        self.streams[sid] = stream
        self.write_headers(sid, block, end_stream=end_stream)
        return stream

    def forget(self, stream: ClientStream) -> None:
        if self.streams.pop(stream.id, None) is not None:
            if self.draining and not self.streams and not self.closed:
                self.close()
            self._on_change(self)

    # -- from the reader ----------------------------------------------------------------

    def _protocol_error(self, error: F.ConnectionError_) -> None:
        self._error = str(error)

    def _on_settled(self) -> None:
        self.ready.set()

    def _headers_complete(self, sid: int, flags: int, block: bytes) -> None:
        try:
            parsed = self._decoder.decode(block)  # its state must follow every block
        except F.HeaderListTooLarge as e:
            parsed = e
        stream = self.streams.get(sid)
        if stream is not None:
            if isinstance(parsed, F.HeaderListTooLarge):
                stream._abort(StatusCode.RESOURCE_EXHAUSTED, f"the server sent {parsed}")
            else:
                stream._on_headers(parsed, bool(flags & F.END_STREAM))
        elif sid > self._last_stream:
            raise F.ConnectionError_(F.PROTOCOL_ERROR, f"HEADERS on idle stream {sid}")

    def _on_peer_max_streams(self, value: int) -> None:
        self.peer_max_streams = value
        self._on_change(self)

    def _on_goaway(self, last_stream_id: int, code: int) -> None:
        self.draining = True
        for sid, stream in list(self.streams.items()):
            if sid > last_stream_id:
                stream._lost(
                    False,
                    f"the server is closing the connection (GOAWAY, error code {code}) and "
                    "did not process the call",
                )
        if not self.streams:
            self._read_scope.cancel()
        self._on_change(self)
