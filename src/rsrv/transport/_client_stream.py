"""One call's stream on a client connection (:class:`ClientStream`): the caller's side
(send, half-close, receive, wait, cancel) and what the connection's reader delivers
into it (response headers, messages, trailers, resets, loss). The lifetime guarantees
are in ``_client``'s docstring."""

from __future__ import annotations

import collections
import math
from typing import TYPE_CHECKING

import trio
from purerpc.grpclib.status import StatusCode

from rsrv.transport import _frames as F
from rsrv.transport._messages import MessageError, MessageReader, frame

DEADLINE_MESSAGE = "deadline exceeded (client timeout)"  # a call's own deadline passed

if TYPE_CHECKING:
    from rsrv.transport._client import ClientConnection

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


class MessageTooLarge(ValueError):
    """A message above ``ClientLimits.max_send_message_bytes``: not sent; the call goes
    on."""


def _status_of(code: int) -> StatusCode:
    try:
        return StatusCode(code)
    except ValueError:
        return StatusCode.UNKNOWN


class ClientStream:
    """One call's stream. The reader feeds it (``_on_*``); the caller sends with
    :meth:`send` / :meth:`end`, reads with :meth:`receive`, and waits with
    :meth:`wait_done`. Once ``done``, ``status``, ``message``, ``trailers`` and
    ``reached_server`` are final; ``metadata`` holds the response headers' metadata
    (of a trailers-only response, the same as ``trailers``)."""

    __slots__ = (
        "conn",
        "id",
        "deadline",
        "send_window",
        "recv_window",
        "recv_unacked",
        "done",
        "status",
        "message",
        "metadata",
        "trailers",
        "reached_server",
        "unary",
        "half_closed",
        "_sending",
        "_end_asked",
        "_closed",
        "_reader",
        "_inbox",
        "_deferred",
        "_waiter",
        "_window",
    )

    def __init__(
        self, conn: ClientConnection, sid: int, deadline: float = math.inf, unary: bool = False
    ):
        self.conn = conn
        self.id = sid
        self.deadline = deadline  # the call's (trio time)
        self.unary = unary  # one response message: a second ends the call
        self.send_window = conn.peer_initial_window
        self.recv_window = conn.stream_window
        self.recv_unacked = 0
        self.done = False
        self.status: StatusCode | None = None
        self.message = ""
        self.metadata: tuple[tuple[str, str], ...] = ()
        self.trailers: tuple[tuple[str, str], ...] = ()
        self.reached_server = True
        self.half_closed = False  # we sent END_STREAM (or will, after the send under way)
        self._sending = False  # a send is under way
        self._end_asked = False  # end() was called during it
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
                self.conn.receive_setting,
                compressed=self.conn.accept_compressed,
            )
            if not end_stream:
                if http != b"200":
                    self._abort(*_http_status(http))
                return
            self.trailers = metadata  # trailers-only: its metadata is the trailers too
        elif not end_stream:
            self._abort(StatusCode.INTERNAL, "the server sent headers twice without ending")
            return
        else:
            self.trailers = metadata
        self._end_sending()
        if grpc is not None:
            code = _status_of(grpc)
            if code == StatusCode.OK and self._reader.partial:
                code, message = StatusCode.INTERNAL, "the server ended the call mid-message"
            self._finish(code, message)
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
        # (a unary call's: at most the one too many; a server sending a window of tiny
        # messages would otherwise take several times its window in objects)
        room = 2 - len(self._inbox) if self.unary else None
        for message in self._reader.feed(data, room):
            if isinstance(message, MessageError):
                self.conn.acknowledge(None, flow)
                status = message.status
                self._abort(status.status_code, status.status_message)
                return
            self._inbox.append(message)
        if self.unary and len(self._inbox) > 1:
            self.conn.acknowledge(None, flow)
            self._abort(
                StatusCode.INTERNAL, "the server sent more than one message for a unary call"
            )
            return
        self.conn.received(self, flow)
        self._wake()

    def _on_end(self) -> None:
        if not self.done:
            self._end_sending()
            self._finish(StatusCode.INTERNAL, "the server ended the stream without trailers")

    def _end_sending(self) -> None:
        """The server ended the stream while ours is open (a call answered before its
        request was all sent, a stream refused at once): RST_STREAM NO_ERROR, as
        grpc-go sends, so the stream closes on both sides (RFC 9113 §8.1); left open,
        it counted against the server's MAX_CONCURRENT_STREAMS while forgotten here."""
        if not self.half_closed or self._sending:
            self.conn.reset_stream(self.id, F.NO_ERROR)
            self.conn.flush()

    def _refill(self) -> None:
        """(Nothing held back: answers are split out as they arrive.)"""

    def _on_reset(self, code: int) -> None:
        if self.done:
            return
        if code == F.REFUSED_STREAM and self._reader is None:  # (no answer began)
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
        the call has ended or was half-closed, :class:`MessageTooLarge` (nothing sent,
        the call goes on) for a message above the channel's limit; waits for flow
        control. Cancelled while waiting, it ends the call (RST_STREAM; CANCELLED, or
        DEADLINE_EXCEEDED past the call's deadline) if part of the message has gone
        out, since the rest can never follow; if none has, the call goes on as if this
        send had not been made. One task sends at a time."""
        if self.done or self.half_closed:
            raise CallEnded(f"the call has ended ({self.status})" if self.done else "half-closed")
        if len(payload) > self.conn.max_send:
            raise MessageTooLarge(
                f"message of {len(payload)} bytes is larger than the channel's maximum "
                f"{self.conn.max_send} ({self.conn.send_setting})"
            )
        conn = self.conn
        data = whole = memoryview(frame(payload))
        self.half_closed = end
        self._sending, ended = True, False
        try:
            while True:
                data = data[conn.write_data(self, data, end) :]
                if not data:
                    break
                conn.flush()
                waiter = self._window = trio.Event()
                try:
                    await waiter.wait()
                except BaseException:
                    if len(data) == len(whole):
                        self.half_closed = self._end_asked  # nothing went out
                    elif trio.current_time() >= self.deadline:
                        self.cancel(StatusCode.DEADLINE_EXCEEDED, DEADLINE_MESSAGE)
                    else:
                        self.cancel(message="the call was cancelled in the middle of a message")
                    raise
                if self.done:
                    raise CallEnded(f"the call has ended ({self.status})")
            ended = end
        finally:
            self._sending = False
            if self._end_asked:  # by end() meanwhile
                self._end_asked = False
                if not ended:
                    self._write_end()  # (a no-op once the call has ended)
        if len(conn.streams) > 1:
            # Other calls are in flight on this connection: what they send in this pass
            # of the event loop goes out with this in one write, by the writer task.
            conn.wake_writer()
        else:
            conn.flush()

    def end(self) -> None:
        """Half-close: tell the server no more messages follow (idempotent). During
        another task's :meth:`send`, the end follows that message (or goes at once if
        that send is cancelled before any of it went out)."""
        if self.done:
            return
        if self._sending:
            self._end_asked = self.half_closed = True
        elif not self.half_closed:
            self.half_closed = True
            self._write_end()

    def _write_end(self) -> None:
        if not self.done:
            self.conn.queue(F.frame(F.DATA, F.END_STREAM, self.id))
            self.conn.flush()

    async def receive(self) -> bytes | None:
        """The next response message, or None once the call has ended (see ``status``)."""
        while not self._inbox:
            if self.done:
                return None
            await self._wait()
        message = self.conn.take_message(self)
        return message

    async def wait_done(self) -> None:
        while not self.done:
            await self._wait()

    def take_messages(self) -> list[bytes]:
        messages = list(self._inbox)  # (once the call is done: its reader released)
        self._inbox.clear()
        return messages

    def cancel(self, code: StatusCode = StatusCode.CANCELLED, message: str = "") -> None:
        """End the call now (RST_STREAM CANCEL) unless it has ended; never raises."""
        if not self.done:
            self._abort(code, message or "the call was cancelled by the client")


def _http_status(http: bytes | None) -> tuple[StatusCode, str]:
    code = _HTTP_STATUS.get(http or b"", StatusCode.UNKNOWN)
    return code, f"the server answered HTTP {(http or b'?').decode('latin-1')}, not gRPC"
