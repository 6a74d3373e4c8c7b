"""One HTTP/2 connection of the gRPC server (each call on it: ``_call.ServerCall``).

rsrv speaks HTTP/2 itself (``_frames``; HPACK decoding by the ``hpack`` package): the
server side of RFC 9113 that gRPC needs, with the request path kept to a few byte
operations — a general-purpose HTTP/2 library cost more per request than the model
it serves. A :class:`ServerConnection` (on :class:`~._endpoint.Http2Endpoint`, which the
client's connection shares) runs a reader task that parses frames and turns them into
calls, and, for what the socket does not take at once, a writer task; each call runs in
its own task, started by the server (:meth:`GrpcServer._run_call`), under the
connection's nursery.

Protocol errors end the connection with GOAWAY and the RFC's error code (a malformed
request header block ends only its stream, with RST_STREAM); every limit below is
enforced on what the peer sends: frame size, header block size, concurrent streams
(beyond: RST_STREAM REFUSED_STREAM), flow-control windows (a peer that overruns one:
FLOW_CONTROL_ERROR).

Lifetime guarantees:

* When the connection ends (the peer closes it, resets it, or breaks the protocol), every
  call on it is cancelled and everything it held is released.
* RST_STREAM from the peer cancels that call at once (its scheduler slot, its in-flight
  slot, its buffers).
* A request message must arrive whole within ``receive_timeout`` of its first byte, and
  the message of a unary-request call, and its end (the handler runs once the client
  half-closed), within ``receive_timeout`` of its headers (or of the message's first
  byte, once that has come); a call that misses this fails with DEADLINE_EXCEEDED and
  is reset.
* A connection must complete the HTTP/2 preface within ``handshake_timeout``; one with
  no call open for ``idle_timeout`` is closed with GOAWAY.
* A stream's complete, unconsumed messages are not acknowledged beyond a few (flow
  control pushes back on a client that sends faster than its handler reads).
* While more than ``max_unsent_bytes`` waits unsent to the client, the connection reads
  nothing more and a streaming call's next answer waits (until half is left): a client
  that sends and does not read makes its own sends wait, not the server's output grow.
"""

from __future__ import annotations

import logging
import math
import re
from typing import TYPE_CHECKING

import trio
from purerpc.grpclib.status import StatusCode

from rsrv.transport import _frames as F
from rsrv.transport._call import ServerCall, trailers_only
from rsrv.transport._endpoint import (
    CONNECTION_WINDOW,
    MAX_FRAME,
    MAX_HEADER_BLOCK,
    MAX_HEADER_LIST,
    Http2Endpoint,
)
from rsrv.transport._messages import MessageReader

if TYPE_CHECKING:
    from rsrv.transport._server import GrpcServer

__all__ = [
    "CONNECTION_WINDOW",
    "MAX_FRAME",
    "MAX_HEADER_BLOCK",
    "MAX_HEADER_LIST",
    "ServerConnection",
]

log = logging.getLogger("rsrv.transport")
#: Seconds a connection reads on after the server's GOAWAY (see ServerConnection._linger).
GOAWAY_LINGER = 1.0

_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
#: Request headers the transport keeps to itself: never a call's metadata.
NOT_METADATA = frozenset(
    {b"te", b"content-type", b"grpc-timeout", b"grpc-encoding", b"grpc-accept-encoding"}
)
_PSEUDO = frozenset({b":method", b":scheme", b":path", b":authority"})
_FORBIDDEN_IN_VALUES = re.compile(rb"[\0\r\n]")
#: Request headers HTTP/2 forbids (RFC 9113 §8.2.2): a request carrying one is reset.
CONNECTION_SPECIFIC = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"}
)


#: What :func:`_checked` makes of a header list that no request (or trailers) may carry.
_MALFORMED = object()


def _checked(headers: list) -> list | object:
    """``headers`` (decoded, cached with their block: so checked once per block), or
    _MALFORMED when RFC 9113 forbids them: a pseudo-header that is unknown, given twice
    or after a regular header (§8.3), an upper-case or connection-specific name (§8.2),
    NUL, CR or LF in a value (§8.2.1). Its stream is then reset."""
    regular = False
    pseudo: set[bytes] = set()
    for name, value in headers:
        if _FORBIDDEN_IN_VALUES.search(value):
            return _MALFORMED
        if name[:1] == b":":
            if regular or name not in _PSEUDO or name in pseudo:
                return _MALFORMED
            pseudo.add(name)
        elif name != name.lower() or name in CONNECTION_SPECIFIC:
            return _MALFORMED
        else:
            regular = True
    return headers


_METADATA_KEY = re.compile(r"[0-9a-z_.-]+")
_NOT_SENDABLE = NOT_METADATA | CONNECTION_SPECIFIC | {b"user-agent"}


def metadata_problem(name: str, value: str) -> str | None:
    """Why a call cannot carry the header ``name: value`` as its metadata; None if it
    can (a gRPC metadata key, not one the transport or HTTP/2 keeps to itself, with a
    printable ASCII value)."""
    if not isinstance(name, str) or not isinstance(value, str):
        wrong = value if isinstance(name, str) else name
        return f"a header is a str and its value a str, not {type(wrong).__name__}"
    if not _METADATA_KEY.fullmatch(name) or name.encode() in _NOT_SENDABLE or name[:5] == "grpc-":
        return (
            "not a metadata key a call may carry (lower case letters, digits, '_', '.', '-'; "
            f"not grpc-*, nor one of {', '.join(sorted(n.decode() for n in _NOT_SENDABLE))})"
        )
    if not (value.isascii() and value.isprintable()):
        return "the value must be printable ASCII"
    return None


class ServerConnection(Http2Endpoint):
    """One client connection: protocol state, a reader task and a writer task.
    ``streams`` holds its calls (:class:`ServerCall`) by stream id."""

    def __init__(self, stream: trio.abc.Stream, server: GrpcServer, peer: str):
        limits = server.limits
        super().__init__(stream, 2 * limits.max_message_bytes, _checked)  # (it caps the window)
        self.server = server
        self.peer = peer
        self.max_streams = limits.max_streams_per_connection
        self._preface = b""  # the client preface received so far (24 bytes in all)
        self._opened = trio.current_time()
        self._read_scope = trio.CancelScope()  # the reader's; its deadline: see _reader
        self._lingers = True  # read on after the server's GOAWAY (see goaway)
        self.max_unsent = limits.max_unsent_bytes
        # one of its compressed requests at a time queues for the server's inflaters:
        # a connection's many do not make other clients' wait behind them all
        self.inflating = trio.CapacityLimiter(1)
        self._idle_since: float | None = self._opened  # None while a call is open
        self.owed = 0  # calls that owe the client an answer (ServerCall._reowe)
        self.last_active = self._opened  # the calls' last activity (see quiet_since)

    @property
    def calls(self) -> dict[int, ServerCall]:
        """The calls open on this connection, by stream id (``streams``)."""
        return self.streams

    async def run(self) -> None:
        """Serve the connection until it ends; every call on it ends with it."""
        self.queue(self.local_settings(self.max_streams))
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._writer)
                self.flush()
                self._read_scope.deadline = self._opened + self.server.limits.handshake_timeout
                while True:
                    with self._read_scope:
                        await self._reader()
                    if not self._read_scope.cancelled_caught or self._goaway_sent:
                        break
                    again = self._idle_deadline()
                    if again is None:
                        break
                    self._read_scope = trio.CancelScope(deadline=again)
                if self._read_scope.cancelled_caught:
                    if not self._goaway_sent:
                        why = "an idle" if self._settled else "a silent (no HTTP/2 preface)"
                        log.debug("closing %s connection from %s", why, self.peer)
                        self._send_goaway(F.NO_ERROR)
                    if self._settled and self._lingers:
                        await self._linger()
                # Let the writer flush what is queued (a GOAWAY, the last trailers).
                await self._drain_writer()
                nursery.cancel_scope.cancel()
        finally:
            for call in list(self.streams.values()):
                call.release()
            await self._close_socket()

    def quiet_since(self) -> float | None:
        """Since when the connection has been waiting on its client (see
        ``ConnectionCap``): idle (no call open) since ``_idle_since``; else, when no
        call owes the client an answer, since the last message or part of one either
        way, or the last call that began waiting on the client; None while one owes."""
        if self._idle_since is not None:
            return self._idle_since
        return None if self.owed else self.last_active

    def goaway(self, *, linger: bool = True) -> None:
        """Close the connection cleanly: GOAWAY, flushed, then close (after
        :meth:`_linger`, unless not ``linger``). At shutdown it is called once the calls
        on it have been answered; to make room at the connection cap (without lingering:
        a connection no longer counted must not hold its descriptor on), on one whose
        calls all wait on their client. Calls still running are cancelled when the
        connection closes.
        """
        if not self._goaway_sent:
            self._send_goaway(F.NO_ERROR)
        self._lingers = self._lingers and linger  # (once told not to, it never does)
        self._read_scope.cancel()

    async def _linger(self) -> None:
        """After the server's GOAWAY, read on until the client closes, for at most
        GOAWAY_LINGER seconds: a request that crossed the GOAWAY is refused
        (REFUSED_STREAM: never started, its client sends it again), where closing with
        its frames unread would reset the connection (a TCP RST, which can reach the
        client before the GOAWAY does and fail the request as if it may have run)."""
        self._read_scope = trio.CancelScope(deadline=trio.current_time() + GOAWAY_LINGER)
        with self._read_scope:
            await self._reader()

    # -- reading ------------------------------------------------------------------------

    async def _reader(self) -> None:
        """Read until the peer closes, breaks the protocol, or ``_read_scope`` ends:
        its deadline is the handshake's, then an idle check's (``_on_settled``,
        :meth:`_idle_deadline`), and :meth:`goaway` cancels it."""
        await self._read_loop()

    def _idle_deadline(self) -> float | None:
        """The read scope's deadline passed: None to close the connection (no preface
        yet, or no call open for ``idle_timeout``), else the next moment to check.

        Calls only record when the connection became idle (``_idle_since``), so no
        request moves a deadline; the check runs at most once per ``idle_timeout``
        while the connection is busy."""
        idle = self.server.limits.idle_timeout
        if not self._settled or not idle:
            return None
        now = trio.current_time()
        if self._idle_since is None:
            return now + idle
        if now - self._idle_since >= idle:
            return None
        return self._idle_since + idle

    def _protocol_error(self, error: F.ConnectionError_) -> None:
        log.debug("HTTP/2 protocol error from %s: %s", self.peer, error)

    def _receive(self, data: bytes) -> None:
        if len(self._preface) < len(F.PREFACE):
            need = len(F.PREFACE) - len(self._preface)
            self._preface += data[:need]
            data = data[need:]
            if not F.PREFACE.startswith(self._preface):
                raise F.ConnectionError_(F.PROTOCOL_ERROR, "not the HTTP/2 client preface")
            if not data:
                return
        self._dispatch(self._frames.feed(data))

    def _on_settled(self) -> None:
        idle = self.server.limits.idle_timeout
        self._read_scope.deadline = trio.current_time() + idle if idle else math.inf

    def _headers_complete(self, sid: int, flags: int, block: bytes) -> None:
        try:
            headers = self._decoder.decode(block)  # its state must follow every block
        except F.HeaderListTooLarge as e:
            headers = e
        if sid <= self._last_stream:  # trailers (or a late block) of a known stream
            call = self.streams.get(sid)
            if call is None:
                self._answer(F.rst_stream(sid, F.STREAM_CLOSED))
                return
            if call._closed:  # (answered or reset already: dropped, as its DATA is)
                return
            if isinstance(headers, F.HeaderListTooLarge):
                self._reset(call, F.ENHANCE_YOUR_CALM)
                return
            if not flags & F.END_STREAM:
                raise F.ConnectionError_(F.PROTOCOL_ERROR, "trailers without END_STREAM")
            if headers is _MALFORMED or any(name[:1] == b":" for name, _ in headers):  # (§8.1)
                self._reset(call, F.PROTOCOL_ERROR)
                return
            call._on_end()
            return
        self._last_stream = sid
        if len(self.streams) >= self.max_streams or self._goaway_sent:
            # (past the GOAWAY's last stream: never started, so the client may retry it)
            self._answer(F.rst_stream(sid, F.REFUSED_STREAM))
            return
        if isinstance(headers, F.HeaderListTooLarge):
            message = f"the request's headers are too large: {headers}"
            block = trailers_only(StatusCode.RESOURCE_EXHAUSTED, message)
            self._end_request(sid, block, bool(flags & F.END_STREAM))
            return
        self._on_request(sid, flags, headers)

    def _on_request(self, sid: int, flags: int, headers) -> None:
        method = path = content_type = encoding = timeout = None
        metadata: dict[str, str] = {}
        if headers is _MALFORMED:
            self._answer(F.rst_stream(sid, F.PROTOCOL_ERROR))
            return
        for name, value in headers:
            if name[:1] == b":":
                if name == b":path":
                    path = value
                elif name == b":method":
                    method = value
                continue
            if name == b"content-type":
                content_type = value
            elif name == b"grpc-timeout":
                timeout = value
            elif name == b"grpc-encoding":
                encoding = value
            elif name not in NOT_METADATA:
                metadata[name.decode("latin-1")] = value.decode("latin-1")
        end = bool(flags & F.END_STREAM)
        if method != b"POST" or not path:
            self._end_request(sid, F.header_block([(b":status", b"405")]), end)
            return
        if not (content_type or b"").startswith(b"application/grpc"):
            self._end_request(sid, F.header_block([(b":status", b"415")]), end)
            return
        seconds = math.inf
        if timeout is not None:
            seconds = _parse_timeout(timeout)
            if seconds is None:
                message = f"malformed grpc-timeout {timeout!r}"
                self._end_request(sid, trailers_only(StatusCode.INVALID_ARGUMENT, message), end)
                return
        limits = self.server.limits
        call = ServerCall(self, sid, path.decode("latin-1"), metadata, math.inf)
        call.recv_window = self.stream_window
        call.send_window = self.peer_initial_window
        call._reader = MessageReader(
            encoding.decode("latin-1") if encoding else None,
            limits.max_message_bytes,
            None,  # (each call inflates its compressed messages itself)
            setting=limits.message_setting,
        )
        self.streams[sid] = call
        self._idle_since = None
        if seconds != math.inf:
            call.deadline = call.scope.deadline = trio.current_time() + seconds
        if end:
            call._on_end()
        self._nursery.start_soon(self.server._run_call, call)

    def _end_request(self, sid: int, block: bytes, ended: bool) -> None:
        """Answer a request refused before it became a call with ``block`` (an HTTP
        status, or a gRPC trailers-only status): the stream is done (RST_STREAM NO_ERROR
        stops a client still sending)."""
        self._answered()
        self.write_headers(sid, block, end_stream=True)
        if not ended:
            self._answer(F.rst_stream(sid, F.NO_ERROR))

    def forget(self, call: ServerCall) -> None:
        if self.streams.get(call.id) is call:
            del self.streams[call.id]
            if not self.streams:
                self._idle_since = trio.current_time()


def _parse_timeout(value: bytes) -> float | None:
    """Seconds of a grpc-timeout header ("100m", "5S"...), or None if malformed."""
    unit = _TIMEOUT_UNITS.get(value[-1:])
    digits = value[:-1]
    if unit is None or not digits.isdigit() or len(digits) > 8:
        return None
    return int(digits) * unit
