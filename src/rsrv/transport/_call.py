"""One gRPC call on a server connection: its stream's inbound messages, flow control,
receive timeout, and what it sends back (see ``_connection`` for the lifetimes)."""

from __future__ import annotations

import collections
import math
import urllib.parse
from typing import TYPE_CHECKING

import trio
from purerpc.grpclib.status import StatusCode

from rsrv.transport._endpoint import INBOX_LIMIT
from rsrv.transport._frames import CANCEL, STREAM_CLOSED, header_block
from rsrv.transport._messages import Compressed, MessageError, MessageReader, frame

if TYPE_CHECKING:
    from rsrv.transport._connection import ServerConnection

_RESPONSE = [
    (b":status", b"200"),
    (b"content-type", b"application/grpc"),
    (b"grpc-accept-encoding", b"identity,gzip,deflate"),
]
_RESPONSE_BLOCK = header_block(_RESPONSE)  # the same bytes for every response
_OK_BLOCK = header_block([(b"grpc-status", b"0")])


#: The longest grpc-message sent (percent-encoded): a client's header list limit (16 KiB
#: here, 8 KiB by default in gRPC's C core) must not fail the call, nor its connection.
MAX_STATUS_MESSAGE = 4096


def trailers_only(code: StatusCode, message: str, extra=(), *, with_response=True) -> bytes:
    """The header block that ends a call with ``code``: the response headers first when
    none were sent (a trailers-only response), ``message`` percent-encoded and cut to
    MAX_STATUS_MESSAGE bytes (between two characters, ending in " ..."), then ``extra``
    custom trailers (name, value as text)."""
    trailers = list(_RESPONSE) if with_response else []
    trailers.append((b"grpc-status", b"%d" % code.value))
    if message:
        quoted = urllib.parse.quote(message, safe="")
        if len(quoted) > MAX_STATUS_MESSAGE:
            end = MAX_STATUS_MESSAGE - 6  # room for "%20..."
            percent = quoted.rfind("%", end - 2, end)  # an escape (%XX) is never split
            head = urllib.parse.unquote_to_bytes(quoted[: end if percent == -1 else percent])
            # nor a character: grpc-message is UTF-8
            quoted = urllib.parse.quote(head.decode("utf-8", "ignore"), safe="") + "%20..."
        trailers.append((b"grpc-message", quoted.encode()))
    trailers.extend((k.encode("latin-1"), v.encode("latin-1")) for k, v in extra)
    return header_block(trailers)


class ServerCall:
    """One gRPC call: what a handler may read about it, and its stream's state.

    Handlers see ``path`` ("/package.Service/Method"), ``metadata`` (custom headers,
    lower-case names, values as text; ``-bin`` values still base64), ``deadline`` (the
    grpc-timeout as an absolute trio time, inf if none), ``peer`` ("host:port") and
    ``received_bytes`` (the size of the last request message received, inflated).
    """

    __slots__ = (
        "conn",
        "id",
        "path",
        "metadata",
        "deadline",
        "peer",
        "scope",
        "ended_by",
        "unary_request",
        "received_bytes",
        "_reader",
        "_inbox",
        "_ended",
        "_closed",
        "_started",
        "_deferred",
        "_waiter",
        "_window",
        "_since",
        "_stalled",
        "_messages_in",
        "_messages_out",
        "_blocked",
        "_owes",
        "recv_window",
        "recv_unacked",
        "send_window",
    )

    def __init__(self, conn: ServerConnection, stream_id: int, path: str, metadata, deadline):
        self.conn = conn
        self.id = stream_id
        self.path = path
        self.metadata: dict[str, str] = metadata
        self.deadline: float = deadline
        self.peer: str = conn.peer
        self.scope = trio.CancelScope()  # cancelled by RST_STREAM
        self.ended_by: BaseException | None = None  # the server's own reason (end_with)
        self.unary_request = True  # set by the server (streams_requests)
        self.received_bytes = 0
        self._reader: MessageReader | None = None
        self._inbox: collections.deque = collections.deque()
        self._ended = False  # the client half-closed the stream
        self._closed = False  # we sent the trailers (or the stream was reset)
        self._started = False  # response headers sent
        self._deferred = 0  # flow-controlled bytes not yet acknowledged
        self._waiter: trio.Event | None = None
        self._window: trio.Event | None = None
        self._since = trio.current_time()  # headers, or the first byte of a partial message
        self._stalled = False  # the request did not arrive in time
        conn.last_active = self._since
        self._messages_in = self._messages_out = 0
        self._blocked = False  # waiting on the client: for window, or for it to read
        self._owes = False  # counted in the connection's ``owed`` (see _reowe)
        self.recv_window = 0  # HTTP/2 flow control, kept by the connection
        self.recv_unacked = 0
        self.send_window = 0

    @property
    def idle(self) -> bool:
        """A stream whose client's requests have all been answered, so that ending it
        now cuts nothing short: an open ModelStreamInfer between requests, a Health
        Watch once it has sent a status (a unary call's one answer is followed by its
        trailers at once)."""
        if self._closed:
            return False
        if self.unary_request:
            return self._messages_out >= 1
        return self._messages_in <= self._messages_out

    @property
    def closed(self) -> bool:
        """Its trailers were sent, or the stream was reset."""
        return self._closed

    def end_with(self, reason: BaseException) -> None:
        """End the call from the server's side (its shutdown): its handler is cancelled,
        and the client receives ``reason``'s status and trailers (``status_of``)."""
        if not self._closed:
            self.ended_by = reason
            self.scope.cancel()

    # -- inbound, called by the connection's reader -----------------------------------

    def _on_data(self, data: bytes, flow: int) -> None:
        if self._closed:
            self.conn.acknowledge(None, flow)
            return
        if self._ended:  # DATA after the client's END_STREAM: RFC 9113 §5.1
            self.conn.acknowledge(None, flow)
            self.conn._reset(self, STREAM_CLOSED)
            return
        now = self.conn.last_active = trio.current_time()
        reader = self._reader
        was_partial = reader.partial
        messages = self._split(data)
        if reader.partial and (messages or not was_partial):
            self._since = now
        self.conn.received(self, flow)

    def _split(self, data: bytes = b"") -> int:
        """Add the messages ``data`` completes to the inbox, up to one more than
        INBOX_LIMIT (flow control then stops); the reader keeps the rest as bytes for
        :meth:`_refill`. Returns how many were added."""
        messages = self._reader.feed(data, max(INBOX_LIMIT + 1 - len(self._inbox), 0))
        if messages:
            self._messages_in += len(messages)
            self._reowe()
            self._inbox.extend(messages)
            self._wake()
        return len(messages)

    def _refill(self) -> None:
        """Split out what the reader held back while the inbox was full (called as a
        message is taken, see Http2Endpoint.take_message)."""
        if self._reader.partial:
            self._split()

    def _on_end(self) -> None:
        self._ended = True
        self._reowe()
        self._wake()

    def _on_reset(self, code: int = CANCEL) -> None:
        self._closed = True
        self._reowe()
        self.scope.cancel()
        self._wake()
        self._window_opened()

    def _reowe(self) -> None:
        """Keep the connection's count of calls that owe their client an answer (what
        makes it busy, never closed to make room at the connection cap): those not
        closed that the client half-closed (a unary call once its request is whole, a
        Health Watch), or whose client sent more messages than they answered (a
        stream), unless they wait on the client itself."""
        owes = not (self._closed or self._blocked) and (
            self._ended or (not self.unary_request and self._messages_in > self._messages_out)
        )
        if owes != self._owes:
            self._owes = owes
            self.conn.owed += 1 if owes else -1

    def streams_requests(self, streaming: bool) -> None:
        """Set by the server from the method: whether the client streams its requests
        (the call then owes an answer to each message), or sends one (``unary_request``:
        the call owes its answer once the client half-closed)."""
        self.unary_request = not streaming
        self._reowe()

    async def _on_client(self, wait) -> None:
        """Await ``wait``, a wait of the call's send on its client (for its flow-control
        window, or for it to read what is queued): meanwhile the call owes nothing."""
        self._blocked = True
        self.conn.last_active = trio.current_time()
        self._reowe()
        try:
            await wait
        finally:
            self._blocked = False
            self._reowe()

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

        Raises MessageError for a message that cannot be delivered, that does not arrive
        in time (see the module docstring), or that the client's end cut short
        (INTERNAL).
        """
        await self._wait_for_input()
        if not self._inbox:
            if self._ended and self._reader.partial:
                raise MessageError(StatusCode.INTERNAL, "the request ended mid-message")
            return None
        message = self.conn.take_message(self)
        if isinstance(message, Compressed):  # (inflated off the event loop)
            async with self.conn.inflating:  # (then in turn with other connections')
                message = await self._reader.inflate(message, self.conn.server.inflating)
        if isinstance(message, MessageError):
            raise message
        self.received_bytes = len(message)
        return message

    async def receive_single(self) -> bytes:
        """The request message of a unary method, once the client has half-closed
        (most clients send the end with the message; this waits for those that do
        not, within ``receive_timeout`` like the message itself).

        Raises MessageError: INTERNAL when the request ends without a message, or
        holds more than one (a second one, whole or cut short, is neither read nor
        inflated: as gRPC's own servers answer it); as :meth:`receive` does.
        """
        message = await self.receive()
        if message is None:
            raise MessageError(StatusCode.INTERNAL, "the request ended before its message")
        await self._wait_for_input()  # the end, or more
        if self._inbox or self._reader.partial:
            raise MessageError(
                StatusCode.INTERNAL, "more than one request message for a unary method"
            )
        return message

    async def _wait_for_input(self) -> None:
        """Until a message waits in the inbox or the client has finished sending; a
        message under way, and a unary call's message and end, within
        ``receive_timeout`` of ``_since`` (else DEADLINE_EXCEEDED)."""
        while not self._inbox and not (self._ended or self._closed):
            deadline = math.inf
            if self._reader.partial or self.unary_request:
                deadline = self._since + self.conn.server.limits.receive_timeout
            waiter = self._waiter = trio.Event()
            with trio.move_on_at(deadline) as timer:
                await waiter.wait()
            if timer.cancelled_caught and not self._inbox:
                self._stalled = True
                timeout = self.conn.server.limits.receive_timeout
                what = (
                    "the request message did not arrive in full"
                    if self._reader.partial or not self._messages_in
                    else "the request did not end (no half-close after its message)"
                )
                raise MessageError(
                    StatusCode.DEADLINE_EXCEEDED,
                    f"{what} within {timeout:g} s (endpoints.receive_timeout_seconds)",
                )

    async def send(self, payload: bytes, *, flush: bool = True) -> None:
        """Send one response message (already serialized). ``flush`` False leaves it
        queued for the next flush (a unary call's answer leaves with its trailers).
        Waits for the client's flow-control window, and, before queuing it and after
        flushing it, while more than ``max_unsent_bytes`` wait unsent on the connection
        (until half is left)."""
        if self._closed:
            return
        conn = self.conn
        if conn._pending is not None or conn._writing:  # the socket is full
            # Queue no more while over the limit: a client that does not read holds
            # the answers of its calls here, unary ones too (queued unflushed).
            await self._on_client(conn._unsent_below(conn.max_unsent))
            if self._closed:
                return
        if not self._started:
            conn.write_headers(self.id, _RESPONSE_BLOCK)
            self._started = True
        data = memoryview(frame(payload))
        while data:
            sent = conn.write_data(self, data)
            if not sent:  # out of window: wait for the peer's WINDOW_UPDATE
                conn.flush()
                waiter = self._window = trio.Event()
                await self._on_client(waiter.wait())
                if self._closed:
                    return  # reset meanwhile
                continue
            data = data[sent:]
        self._messages_out += 1
        conn.last_active = trio.current_time()
        self._reowe()
        if flush:
            conn.flush()
            if conn._pending is not None or conn._writing:  # the socket is full
                # A client that sends and does not read: its stream's answers wait here
                # (and its handler with them), not in the connection's output.
                await self._on_client(conn._unsent_below(conn.max_unsent))

    def finish(self, code: StatusCode, message: str = "", extra=()) -> None:
        """End the call with its status (trailers), and ``extra`` custom trailers (name,
        value as text); a no-op once closed."""
        if self._closed:
            return
        self._closed = True
        self._reowe()
        if code is StatusCode.OK and not message and self._started and not extra:
            block = _OK_BLOCK
        else:
            block = trailers_only(code, message, extra, with_response=not self._started)
        conn = self.conn
        conn.write_headers(self.id, block, end_stream=True)
        # A client still sending may finish: what it sends is acknowledged and dropped
        # (some clients fail on the RST_STREAM that would stop it); one that stalled
        # mid-message is reset.
        if self._stalled and not self._ended:
            conn.reset_stream(self.id, CANCEL)
        conn.flush()

    def release(self) -> None:
        """Forget the call (its task ended): free its buffers and inflate budget."""
        self._closed = True
        self._reowe()
        self._inbox.clear()
        if self._deferred:
            self.conn.acknowledge(None, self._deferred)
            self._deferred = 0
        if self._reader is not None:
            self._reader.release()
        self.conn.forget(self)
