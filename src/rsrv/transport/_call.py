"""One gRPC call on a server connection: its stream's inbound messages, flow control,
receive timeout, and what it sends back (see ``_connection`` for the lifetimes)."""

from __future__ import annotations

import collections
import math
import urllib.parse
from typing import TYPE_CHECKING

import h2.exceptions
import trio
from h2.errors import ErrorCodes
from purerpc.grpclib.status import StatusCode

from rsrv.transport._messages import MessageError, MessageReader, frame

if TYPE_CHECKING:
    from rsrv.transport._connection import ServerConnection

INBOX_LIMIT = 4  # complete messages a stream may hold unread before flow control stops
RESPONSE_HEADERS = [
    (b":status", b"200"),
    (b"content-type", b"application/grpc"),
    (b"grpc-accept-encoding", b"identity,gzip,deflate"),
]


class ServerCall:
    """One gRPC call: what a handler may read about it, and its stream's state.

    Handlers see ``path`` ("/package.Service/Method"), ``metadata`` (custom headers,
    lower-case names, values as text; ``-bin`` values still base64), ``deadline`` (the
    grpc-timeout as an absolute trio time, inf if none) and ``peer`` ("host:port").
    """

    __slots__ = (
        "conn",
        "id",
        "path",
        "metadata",
        "deadline",
        "peer",
        "scope",
        "unary_request",
        "_reader",
        "_inbox",
        "_ended",
        "_closed",
        "_started",
        "_deferred",
        "_waiter",
        "_window",
        "_since",
        "_received",
        "_stalled",
    )

    def __init__(self, conn: ServerConnection, stream_id: int, path: str, metadata, deadline):
        self.conn = conn
        self.id = stream_id
        self.path = path
        self.metadata: dict[str, str] = metadata
        self.deadline: float = deadline
        self.peer: str = conn.peer
        self.scope = trio.CancelScope()  # cancelled by RST_STREAM
        self.unary_request = True  # set by the server from the method
        self._reader: MessageReader | None = None
        self._inbox: collections.deque = collections.deque()
        self._ended = False  # the client half-closed the stream
        self._closed = False  # we sent the trailers (or the stream was reset)
        self._started = False  # response headers sent
        self._deferred = 0  # flow-controlled bytes not yet acknowledged
        self._waiter: trio.Event | None = None
        self._window: trio.Event | None = None
        self._since = trio.current_time()  # headers, or the first byte of a partial message
        self._received = False
        self._stalled = False  # the request did not arrive in time

    # -- inbound, called by the connection's reader -----------------------------------

    def _on_data(self, data: bytes, flow: int) -> None:
        if self._closed:
            self.conn.acknowledge(self.id, flow)
            return
        reader = self._reader
        was_partial = reader.partial
        messages = reader.feed(data)
        if messages:
            self._inbox.extend(messages)
            self._wake()
        if reader.partial and (messages or not was_partial):
            self._since = trio.current_time()
        if len(self._inbox) <= INBOX_LIMIT:
            self.conn.acknowledge(self.id, flow)
        else:
            self._deferred += flow

    def _on_end(self) -> None:
        self._ended = True
        self._wake()

    def _on_reset(self) -> None:
        self._closed = True
        self.scope.cancel()
        self._wake()
        self._window_opened()

    def _wake(self) -> None:
        if self._waiter is not None:
            self._waiter.set()
            self._waiter = None

    def _window_opened(self) -> None:
        if self._window is not None:
            self._window.set()
            self._window = None

    # -- for the handler -------------------------------------------------------------

    async def receive(self) -> bytes | None:
        """The next request message, or None once the client has finished sending.

        Raises MessageError for a message that cannot be delivered, or when the message
        does not arrive in time (see the module docstring).
        """
        while not self._inbox:
            if self._ended or self._closed:
                return None
            deadline = math.inf
            if self._reader.partial or (self.unary_request and not self._received):
                deadline = self._since + self.conn.server.limits.receive_timeout
            waiter = self._waiter = trio.Event()
            with trio.move_on_at(deadline) as timer:
                await waiter.wait()
            if timer.cancelled_caught and not self._inbox:
                self._stalled = True
                raise MessageError(
                    StatusCode.DEADLINE_EXCEEDED,
                    f"the request message did not arrive in full within "
                    f"{self.conn.server.limits.receive_timeout:g} s "
                    "(endpoints.receive_timeout_seconds)",
                )
        message = self._inbox.popleft()
        self._received = True
        if self._deferred and len(self._inbox) < INBOX_LIMIT:
            self.conn.acknowledge(self.id, self._deferred)
            self._deferred = 0
            self.conn.wake_writer()
        if isinstance(message, MessageError):
            raise message
        return message

    async def send(self, payload: bytes) -> None:
        """Send one response message (already serialized)."""
        if self._closed:
            return
        conn = self.conn
        h2conn = conn.h2
        sid = self.id
        try:
            if not self._started:
                h2conn.send_headers(sid, RESPONSE_HEADERS)
                self._started = True
            data = memoryview(frame(payload))
            pos, end = 0, len(data)
            while pos < end:
                window = h2conn.local_flow_control_window(sid)
                if window <= 0:
                    conn.wake_writer()
                    waiter = self._window = trio.Event()
                    await waiter.wait()
                    if self._closed:
                        return
                    continue
                size = min(window, h2conn.max_outbound_frame_size, end - pos)
                h2conn.send_data(sid, data[pos : pos + size])
                pos += size
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self._closed = True  # reset or closed under us: nothing more to send
            return
        conn.wake_writer()

    def finish(self, code: StatusCode, message: str = "") -> None:
        """End the call with its status (trailers); a no-op once closed."""
        if self._closed:
            return
        self._closed = True
        trailers = [] if self._started else [(b":status", b"200"), *RESPONSE_HEADERS[1:]]
        trailers.append((b"grpc-status", b"%d" % code.value))
        if message:
            trailers.append((b"grpc-message", urllib.parse.quote(message, safe="").encode()))
        h2conn = self.conn.h2
        try:
            # A client still sending may finish: what it sends is acknowledged and
            # dropped (some clients fail on the RST_STREAM that would stop it); one
            # that stalled mid-message is reset.
            h2conn.send_headers(self.id, trailers, end_stream=True)
            if self._stalled and not self._ended:
                h2conn.reset_stream(self.id, ErrorCodes.CANCEL)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            pass
        self.conn.wake_writer()

    def release(self) -> None:
        """Forget the call (its task ended): free its buffers and inflate budget."""
        self._closed = True
        self._inbox.clear()
        if self._deferred:
            self.conn.acknowledge(self.id, self._deferred)
            self._deferred = 0
        if self._reader is not None:
            self._reader.release()
        self.conn.forget(self)
