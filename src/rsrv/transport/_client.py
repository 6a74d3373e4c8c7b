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

import collections
import ssl
import urllib.parse
from collections.abc import Callable

import trio
from purerpc.grpclib.status import StatusCode

from rsrv.transport import _frames as F
from rsrv.transport._endpoint import Http2Endpoint
from rsrv.transport._messages import InflateBudget, MessageError, MessageReader, frame

INBOX_LIMIT = 4  # complete messages a stream may hold unread before flow control stops
ASSUMED_MAX_STREAMS = 100  # the server's stream limit until its SETTINGS say otherwise
LAST_STREAM_ID = 2**31 - 1
_RESERVED = frozenset(
    {b"content-type", b"grpc-status", b"grpc-message", b"grpc-encoding", b"grpc-accept-encoding"}
)
#: RST_STREAM error codes as gRPC statuses (gRPC's HTTP/2 mapping).
_RESET_STATUS = {
    F.REFUSED_STREAM: StatusCode.UNAVAILABLE,
    F.CANCEL: StatusCode.CANCELLED,
    F.ENHANCE_YOUR_CALM: StatusCode.RESOURCE_EXHAUSTED,
    0xC: StatusCode.PERMISSION_DENIED,  # INADEQUATE_SECURITY
}
#: HTTP statuses of a response without grpc-status, as gRPC statuses.
_HTTP_STATUS = {
    b"400": StatusCode.INTERNAL,
    b"401": StatusCode.UNAUTHENTICATED,
    b"403": StatusCode.PERMISSION_DENIED,
    b"404": StatusCode.UNIMPLEMENTED,
    b"429": StatusCode.UNAVAILABLE,
    b"502": StatusCode.UNAVAILABLE,
    b"503": StatusCode.UNAVAILABLE,
    b"504": StatusCode.UNAVAILABLE,
}


class CallEnded(Exception):
    """Sending on a call that has ended (its status says why) or was half-closed."""


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
            grpc = int(value) if value.isdigit() else -1
        elif name == b"grpc-message":
            message = urllib.parse.unquote(value.decode("latin-1"))
        elif name == b"grpc-encoding":
            encoding = value.decode("latin-1")
        elif name[:1] != b":" and name not in _RESERVED:
            metadata.append((name.decode("latin-1"), value.decode("latin-1")))
    return http, grpc, message, encoding, tuple(metadata)


def _status_of(code: int) -> StatusCode:
    try:
        return StatusCode(code)
    except ValueError:
        return StatusCode.UNKNOWN


class ClientStream:
    """One call's stream. The reader feeds it (``_on_*``); the caller sends with
    :meth:`send` / :meth:`end`, reads with :meth:`receive`, and waits with
    :meth:`wait_done`. Once ``done``, ``status``, ``message``, ``trailers`` and
    ``reached_server`` are final; ``metadata`` holds the response headers' metadata."""

    __slots__ = (
        "conn",
        "id",
        "send_window",
        "recv_window",
        "recv_unacked",
        "done",
        "status",
        "message",
        "metadata",
        "trailers",
        "reached_server",
        "half_closed",
        "_closed",
        "_reader",
        "_inbox",
        "_deferred",
        "_waiter",
        "_window",
    )

    def __init__(self, conn: ClientConnection, sid: int):
        self.conn = conn
        self.id = sid
        self.send_window = conn.peer_initial_window
        self.recv_window = conn.stream_window
        self.recv_unacked = 0
        self.done = False
        self.status: StatusCode | None = None
        self.message = ""
        self.metadata: tuple[tuple[str, str], ...] = ()
        self.trailers: tuple[tuple[str, str], ...] = ()
        self.reached_server = True
        self.half_closed = False  # we sent END_STREAM
        self._closed = False  # no more acknowledgements owed (ended)
        self._reader: MessageReader | None = None
        self._inbox: collections.deque = collections.deque()
        self._deferred = 0  # flow-controlled bytes not yet acknowledged
        self._waiter: trio.lowlevel.Task | None = None  # the caller, parked in _wait
        self._window: trio.Event | None = None

    # -- from the reader ----------------------------------------------------------------

    def _on_headers(self, parsed: tuple, end_stream: bool) -> None:
        if self.done:
            return
        http, grpc, message, encoding, metadata = parsed
        if self._reader is None:  # the response headers (or trailers-only)
            self.metadata = metadata
            self._reader = MessageReader(
                encoding,
                self.conn.max_receive,
                self.conn.budget,
                "ClientLimits.max_receive_message_bytes",
            )
            if not end_stream:
                if http != b"200":
                    self._abort(*_http_status(http))
                return
        elif not end_stream:
            self._abort(StatusCode.INTERNAL, "the server sent headers twice without ending")
            return
        else:
            self.trailers = metadata
        if grpc is not None:
            self._finish(_status_of(grpc), message)
        elif http not in (None, b"200"):
            self._finish(*_http_status(http))
        else:
            self._finish(StatusCode.INTERNAL, "the server ended the call without a grpc-status")

    def _on_data(self, data: bytes, flow: int) -> None:
        if self.done:
            self.conn.acknowledge(None, flow)
            return
        if self._reader is None:
            self.conn.acknowledge(None, flow)
            self._abort(StatusCode.INTERNAL, "the server sent DATA before its headers")
            return
        for message in self._reader.feed(data):
            if isinstance(message, MessageError):
                self.conn.acknowledge(None, flow)
                status = message.status
                self._abort(status.status_code, status.status_message)
                return
            self._inbox.append(message)
        if len(self._inbox) <= INBOX_LIMIT:
            self.conn.acknowledge(self, flow)
        else:
            self._deferred += flow
        self._wake()

    def _on_end(self) -> None:
        if not self.done:
            self._finish(StatusCode.INTERNAL, "the server ended the stream without trailers")

    def _on_reset(self, code: int) -> None:
        if self.done:
            return
        if code == F.REFUSED_STREAM:
            self.reached_server = False
        status = _RESET_STATUS.get(code, StatusCode.INTERNAL)
        self._finish(status, f"the server reset the stream (HTTP/2 error code {code})")

    def _lost(self, reached_server: bool, message: str) -> None:
        if not self.done:
            self.reached_server = reached_server
            self._finish(StatusCode.UNAVAILABLE, message)

    def _window_opened(self) -> None:
        if self._window is not None:
            self._window.set()
            self._window = None

    def _wake(self) -> None:
        task = self._waiter
        if task is not None:
            self._waiter = None
            trio.lowlevel.reschedule(task)

    async def _wait(self) -> None:
        """Until the reader wakes this stream (no Event: the caller's task is parked)."""
        self._waiter = trio.lowlevel.current_task()

        def abort(_) -> trio.lowlevel.Abort:
            self._waiter = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    def _abort(self, code: StatusCode, message: str) -> None:
        """End the stream on our side: RST_STREAM CANCEL, status ``code``."""
        self.conn.reset_stream(self.id, F.CANCEL)
        self._finish(code, message)
        self.conn.flush()

    def _finish(self, code: StatusCode, message: str) -> None:
        self.done = self._closed = True
        self.status, self.message = code, message
        if self._deferred:
            self.conn.acknowledge(None, self._deferred)
            self._deferred = 0
        if self._reader is not None:
            self._reader.release()
        self.conn.forget(self)
        self._wake()
        self._window_opened()

    # -- for the caller ---------------------------------------------------------------

    async def send(self, payload: bytes, *, end: bool = False) -> None:
        """Send one message (``end``: and half-close). Raises :class:`CallEnded` once
        the call has ended or was half-closed; waits for flow control."""
        if self.done or self.half_closed:
            raise CallEnded(f"the call has ended ({self.status})" if self.done else "half-closed")
        if len(payload) > self.conn.max_send:
            self._abort(
                StatusCode.RESOURCE_EXHAUSTED,
                f"message of {len(payload)} bytes is larger than the channel's maximum "
                f"{self.conn.max_send} (ClientLimits.max_send_message_bytes)",
            )
            raise CallEnded(self.message)
        conn = self.conn
        data = memoryview(frame(payload))
        self.half_closed = end
        while True:
            data = data[conn.write_data(self, data, end) :]
            if not data:
                break
            conn.flush()
            waiter = self._window = trio.Event()
            await waiter.wait()
            if self.done:
                raise CallEnded(f"the call has ended ({self.status})")
        conn.flush()

    def end(self) -> None:
        """Half-close: tell the server no more messages follow (idempotent)."""
        if not self.half_closed and not self.done:
            self.half_closed = True
            self.conn._out.append(F.frame(F.DATA, F.END_STREAM, self.id))
            self.conn.flush()

    async def receive(self) -> bytes | None:
        """The next response message, or None once the call has ended (see ``status``)."""
        while not self._inbox:
            if self.done:
                return None
            await self._wait()
        message = self._inbox.popleft()
        if self._deferred and len(self._inbox) < INBOX_LIMIT:
            self.conn.acknowledge(self, self._deferred)
            self._deferred = 0
            self.conn.flush()
        return message

    async def wait_done(self) -> None:
        while not self.done:
            await self._wait()

    def take_messages(self) -> list[bytes]:
        messages = list(self._inbox)
        self._inbox.clear()
        return messages

    def cancel(self, code: StatusCode = StatusCode.CANCELLED, message: str = "") -> None:
        """End the call now (RST_STREAM CANCEL) unless it has ended; never raises."""
        if not self.done:
            self._abort(code, message or "the call was cancelled by the client")


def _http_status(http: bytes | None) -> tuple[StatusCode, str]:
    code = _HTTP_STATUS.get(http or b"", StatusCode.UNKNOWN)
    return code, f"the server answered HTTP {(http or b'?').decode('latin-1')}, not gRPC"


class ClientConnection(Http2Endpoint):
    """One HTTP/2 connection to the server. ``available`` says whether a stream may be
    opened on it now; ``on_change()`` is called whenever that may have changed (a stream
    ended, SETTINGS, GOAWAY, the connection ended)."""

    def __init__(
        self,
        stream: trio.abc.Stream,
        *,
        stream_window: int,
        max_send: int,
        max_receive: int,
        on_change: Callable[[ClientConnection], None],
    ):
        super().__init__(stream, stream_window, _parse_headers)
        self.max_send = max_send
        self.max_receive = max_receive
        self.budget = InflateBudget(max(4 * max_receive, 1 << 30))
        self.peer_max_streams = ASSUMED_MAX_STREAMS
        self.draining = False  # GOAWAY received (or sent): no new streams
        self.closed = False
        self._on_change = on_change
        self._read_scope = trio.CancelScope()
        self._error: str | None = None
        self.ready = trio.Event()  # the server's SETTINGS arrived (or the connection ended)
        self.finished = trio.Event()  # set once run() has returned
        self._out.append(F.PREFACE + self.local_settings())

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
                if self._error is not None:
                    reason = f"the server broke the HTTP/2 protocol: {self._error}"
                await self._drain_writer()
                nursery.cancel_scope.cancel()
        finally:
            self.closed = self.draining = True
            for stream in list(self.streams.values()):
                stream._lost(True, reason)
            self._on_change(self)
            self.ready.set()
            self.finished.set()
            await trio.aclose_forcefully(self.stream)

    def close(self) -> None:
        """Stop opening streams and end the connection once its streams have ended
        (GOAWAY to the server then)."""
        self.draining = True
        if not self.streams:
            self._send_goaway(F.NO_ERROR)
            self._read_scope.cancel()

    def _send_goaway(self, code: int, why: str = "") -> None:
        self._goaway_sent = True
        self._out.append(F.goaway(0, code, why.encode()[:256]))  # the server opens none
        self.flush()

    def open_stream(self, block: bytes, *, end_stream: bool = False) -> ClientStream:
        """Open a stream whose request headers are ``block`` (queued, not flushed)."""
        sid = self._last_stream + 2 if self._last_stream else 1
        self._last_stream = sid
        if sid >= LAST_STREAM_ID - 2:
            self.draining = True  # stream ids run out: the pool opens another connection
        stream = ClientStream(self, sid)
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
        parsed = self._decoder.decode(block)  # its state must follow every block
        stream = self.streams.get(sid)
        if stream is not None:
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
