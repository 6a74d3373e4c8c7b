"""What a channel's calls give their callers: :class:`UnaryResult` (a unary call's
outcome) and :class:`StreamingCall` (a bidirectional-streaming call in progress)."""

from __future__ import annotations

from dataclasses import dataclass

import trio
from purerpc.grpclib.status import StatusCode

from rsrv.transport._client_stream import DEADLINE_MESSAGE, CallEnded, ClientStream

__all__ = ["StreamingCall", "UnaryResult", "unary_result"]


@dataclass(slots=True)
class UnaryResult:
    """The outcome of a unary call. ``response`` is the message's bytes when ``status``
    is OK (None otherwise); ``message`` is grpc-message, percent-decoded;
    ``initial_metadata`` and ``trailers`` are the server's custom headers (name, value).
    ``reached_server`` is False only when the server certainly did not process the
    call (connection refused, GOAWAY below the call's stream, REFUSED_STREAM)."""

    status: StatusCode
    message: str = ""
    response: bytes | None = None
    initial_metadata: tuple[tuple[str, str], ...] = ()
    trailers: tuple[tuple[str, str], ...] = ()
    reached_server: bool = True

    @property
    def ok(self) -> bool:
        return self.status is StatusCode.OK


class StreamingCall:
    """One bidirectional-streaming call (from :meth:`Channel.stream`).

    ``await send(message)``, ``await end()`` (half-close), ``async for message in call``
    (raw bytes, until the call ends); then ``status`` (a purerpc ``StatusCode``),
    ``message``, ``initial_metadata``, ``trailers`` and ``reached_server`` are final.
    ``send`` raises :class:`CallEnded` once the call has ended or was half-closed. The
    call's deadline ends it with DEADLINE_EXCEEDED (stream reset) in whichever of
    ``send`` or the iteration is waiting. One task sends at a time (a message held up
    by flow control would interleave with another's); one task iterates.
    """

    def __init__(self, deadline: float):
        self._stream: ClientStream | None = None
        self._deadline = deadline
        self._status: tuple[StatusCode, str, bool] | None = None  # failed before a stream

    def _failed(self, code: StatusCode, message: str, *, reached_server: bool = False) -> None:
        self._status = (code, message, reached_server)

    async def send(self, message: bytes) -> None:
        stream = self._stream
        if stream is None:
            raise CallEnded(self.message)
        with trio.move_on_at(self._deadline) as timer:
            await stream.send(message)
        if timer.cancelled_caught:
            stream.cancel(StatusCode.DEADLINE_EXCEEDED, DEADLINE_MESSAGE)
            raise CallEnded(self.message)

    async def end(self) -> None:
        if self._stream is not None:
            self._stream.end()

    def __aiter__(self) -> StreamingCall:
        return self

    async def __anext__(self) -> bytes:
        stream = self._stream
        if stream is None:
            raise StopAsyncIteration
        message = None
        with trio.move_on_at(self._deadline):
            message = await stream.receive()
        if message is None:
            if not stream.done:  # the deadline
                stream.cancel(StatusCode.DEADLINE_EXCEEDED, DEADLINE_MESSAGE)
            raise StopAsyncIteration
        return message

    def cancel(self, code: StatusCode = StatusCode.CANCELLED, message: str = "") -> None:
        """End the call now (RST_STREAM CANCEL, status ``code``) unless it has ended."""
        if self._stream is not None:
            self._stream.cancel(code, message)

    @property
    def done(self) -> bool:
        return self._stream is None or self._stream.done

    @property
    def status(self) -> StatusCode | None:
        """None while the call is running."""
        if self._stream is None:
            return self._status[0]
        return self._stream.status

    @property
    def message(self) -> str:
        return self._status[1] if self._stream is None else self._stream.message

    @property
    def reached_server(self) -> bool:
        return self._status[2] if self._stream is None else self._stream.reached_server

    @property
    def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        return () if self._stream is None else self._stream.metadata

    @property
    def trailers(self) -> tuple[tuple[str, str], ...]:
        return () if self._stream is None else self._stream.trailers


def unary_result(stream: ClientStream) -> UnaryResult:
    code, message = stream.status, stream.message
    response = None
    if code is StatusCode.OK:
        messages = stream.take_messages()
        if len(messages) == 1:
            response = messages[0]
        else:
            code = StatusCode.INTERNAL
            message = f"a unary call received {len(messages)} response messages, not 1"
    return UnaryResult(
        code, message, response, stream.metadata, stream.trailers, stream.reached_server
    )
