"""One HTTP/2 connection of the gRPC server (each call on it: ``_call.ServerCall``).

rsrv speaks HTTP/2 itself (``_frames``; HPACK decoding by the ``hpack`` package): the
server side of RFC 9113 that gRPC needs, with the request path kept to a few byte
operations — a general-purpose HTTP/2 library cost more per request than the model
it serves. A :class:`ServerConnection` runs a reader task that parses frames and turns
them into calls, and, for what the socket does not take at once, a writer task; each
call runs in its own task, started by the server (:meth:`GrpcServer._run_call`), under
the connection's nursery.

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
  the message of a unary-request call within ``receive_timeout`` of its headers; a call
  that misses this fails with DEADLINE_EXCEEDED and is reset.
* A connection must complete the HTTP/2 preface within ``handshake_timeout``; one with
  no call open for ``idle_timeout`` is closed with GOAWAY.
* A stream's complete, unconsumed messages are not acknowledged beyond a few (flow
  control pushes back on a client that sends faster than its handler reads).
"""

from __future__ import annotations

import logging
import math
import os
from typing import TYPE_CHECKING

import hpack
import hpack.exceptions
import trio
from purerpc.grpclib.status import StatusCode

from rsrv.transport import _frames as F
from rsrv.transport._call import ServerCall
from rsrv.transport._messages import InflateBudget, MessageReader

if TYPE_CHECKING:
    from rsrv.transport._server import GrpcServer

log = logging.getLogger("rsrv.transport")

CONNECTION_WINDOW = 2**30  # what the connection-level receive window is raised to
MAX_FRAME = 2**24 - 1  # the largest frame we accept
MAX_HEADER_BLOCK = 64 * 1024  # a request's header block, CONTINUATION frames included
MAX_HEADER_LIST = 16 * 1024  # decoded header list size (SETTINGS_MAX_HEADER_LIST_SIZE)
RECEIVE_SIZE = 256 * 1024
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_RESERVED = frozenset(
    {b"te", b"content-type", b"grpc-timeout", b"grpc-encoding", b"grpc-accept-encoding"}
)
_PSEUDO = frozenset({b":method", b":scheme", b":path", b":authority"})
_CONNECTION_SPECIFIC = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"}
)


class ServerConnection:
    """One client connection: protocol state, a reader task and a writer task."""

    def __init__(self, stream: trio.abc.Stream, server: GrpcServer, peer: str):
        self.stream = stream
        self.server = server
        self.peer = peer
        limits = server.limits
        self.calls: dict[int, ServerCall] = {}
        self.budget = InflateBudget(limits.max_message_bytes)
        # what we told the peer, and what we owe it
        self.max_streams = limits.max_streams_per_connection
        self.stream_window = min(2 * limits.max_message_bytes, F.MAX_WINDOW)
        self._recv_window = CONNECTION_WINDOW  # connection-level, left before WINDOW_UPDATE
        self._recv_unacked = 0
        # what the peer told us
        self.send_window = F.DEFAULT_WINDOW  # connection-level
        self.peer_initial_window = F.DEFAULT_WINDOW
        self.peer_max_frame = F.DEFAULT_FRAME
        self._decoder = hpack.Decoder()
        self._decoder.max_header_list_size = MAX_HEADER_LIST
        self._decoded: dict[bytes, tuple] = {}  # block -> (table state, headers)
        self._frames = F.FrameReader(MAX_FRAME)
        self._preface = b""  # the client preface received so far (24 bytes in all)
        self._settled = False  # the preface and first SETTINGS arrived
        self._continuing: tuple[int, int, list[bytes]] | None = None  # HEADERS cont'd
        self._last_stream = 0  # highest stream id the peer opened
        self._out: list[bytes] = []  # frames queued, not yet written
        self._writable = trio.lowlevel.ParkingLot()
        # plain TCP: flush() writes straight to the socket (see there)
        self._fd = stream.socket.fileno() if isinstance(stream, trio.SocketStream) else None
        self._sending = False  # the writer task is in send_all
        self._pending: memoryview | None = None  # bytes flush() could not write
        self._closing = False
        self._writer_done = trio.Event()
        self._opened = trio.current_time()
        self._nursery: trio.Nursery | None = None
        self._read_scope = trio.CancelScope()  # the reader's; its deadline: see _reader
        self._goaway_sent = False

    async def run(self) -> None:
        """Serve the connection until it ends; every call on it ends with it."""
        self._out.append(
            F.settings(
                {
                    F.MAX_CONCURRENT_STREAMS: self.max_streams,
                    F.INITIAL_WINDOW_SIZE: self.stream_window,
                    F.MAX_FRAME_SIZE: MAX_FRAME,
                    F.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST,
                    F.ENABLE_PUSH: 0,
                }
            )
        )
        self._out.append(F.window_update(0, CONNECTION_WINDOW - F.DEFAULT_WINDOW))
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._writer)
                self.flush()
                self._read_scope.deadline = self._opened + self.server.limits.handshake_timeout
                with self._read_scope:
                    await self._reader()
                if self._read_scope.cancelled_caught and not self._goaway_sent:
                    why = "an idle" if self._settled else "a silent (no HTTP/2 preface)"
                    log.debug("closing %s connection from %s", why, self.peer)
                    self._send_goaway(F.NO_ERROR)
                # Let the writer flush what is queued (a GOAWAY, the last trailers).
                self._closing = True
                self.wake_writer()
                with trio.move_on_after(1):
                    await self._writer_done.wait()
                nursery.cancel_scope.cancel()
        finally:
            for call in list(self.calls.values()):
                call.release()
            await trio.aclose_forcefully(self.stream)

    def goaway(self) -> None:
        """Close the connection cleanly (server shutdown): GOAWAY, flushed, then close.

        Call it once the calls on it have been answered: calls still running are
        cancelled when the connection closes.
        """
        self._send_goaway(F.NO_ERROR)
        self._read_scope.cancel()

    def _send_goaway(self, code: int, why: str = "") -> None:
        self._goaway_sent = True
        self._out.append(F.goaway(self._last_stream, code, why.encode()[:256]))
        self.flush()

    # -- reading ------------------------------------------------------------------------

    async def _reader(self) -> None:
        """Read until the peer closes, breaks the protocol, or ``_read_scope`` ends:
        its deadline is the handshake's, then the idle timeout's while no call is open
        (set by ``_on_request`` and ``forget``), and :meth:`goaway` cancels it."""
        receive = self.stream.receive_some
        while not self._closing:
            try:
                data = await receive(RECEIVE_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return  # reset by the peer, or a TLS stream cut short
            if not data:
                return  # the peer closed the connection
            try:
                self._receive(data)
            except F.ConnectionError_ as e:
                log.debug("HTTP/2 protocol error from %s: %s", self.peer, e)
                self._send_goaway(e.code, str(e))
                return
            self.flush()

    def _receive(self, data: bytes) -> None:
        if len(self._preface) < len(F.PREFACE):
            need = len(F.PREFACE) - len(self._preface)
            self._preface += data[:need]
            data = data[need:]
            if not F.PREFACE.startswith(self._preface):
                raise F.ConnectionError_(F.PROTOCOL_ERROR, "not the HTTP/2 client preface")
            if not data:
                return
        for kind, flags, sid, payload in self._frames.feed(data):
            if not self._settled:
                if kind != F.SETTINGS or flags & F.ACK:
                    raise F.ConnectionError_(F.PROTOCOL_ERROR, "the preface must be SETTINGS")
                self._settled = True
                idle = self.server.limits.idle_timeout
                self._read_scope.deadline = trio.current_time() + idle if idle else math.inf
            if self._continuing is not None and kind != F.CONTINUATION:
                raise F.ConnectionError_(F.PROTOCOL_ERROR, "a header block was interrupted")
            if kind == F.DATA:
                self._on_data(flags, sid, payload)
            elif kind == F.HEADERS:
                self._on_headers(flags, sid, payload)
            elif kind == F.CONTINUATION:
                self._on_continuation(flags, sid, payload)
            elif kind == F.WINDOW_UPDATE:
                self._on_window_update(sid, payload)
            elif kind == F.RST_STREAM:
                if sid == 0 or sid > self._last_stream:
                    raise F.ConnectionError_(F.PROTOCOL_ERROR, f"RST_STREAM on stream {sid}")
                F.parse_u32(payload, "RST_STREAM")
                call = self.calls.get(sid)
                if call is not None:
                    call._on_reset()
            elif kind == F.SETTINGS:
                self._on_settings(flags, sid, payload)
            elif kind == F.PING:
                if sid != 0 or len(payload) != 8:
                    raise F.ConnectionError_(F.PROTOCOL_ERROR, "malformed PING")
                if not flags & F.ACK:
                    self._out.append(F.frame(F.PING, F.ACK, 0, payload))
            elif kind == F.PRIORITY:
                if sid == 0:
                    raise F.ConnectionError_(F.PROTOCOL_ERROR, "PRIORITY on stream 0")
            elif kind == F.GOAWAY:
                if sid != 0:
                    raise F.ConnectionError_(F.PROTOCOL_ERROR, "GOAWAY on a stream")
            elif kind == F.PUSH_PROMISE:
                raise F.ConnectionError_(F.PROTOCOL_ERROR, "a client may not push")
            # unknown frame types are ignored (RFC 9113 §4.1)

    def _on_data(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0 or sid % 2 == 0 or sid > self._last_stream:
            raise F.ConnectionError_(F.PROTOCOL_ERROR, f"DATA on stream {sid}, never opened")
        flow = len(payload)
        self._recv_window -= flow
        if self._recv_window < 0:
            raise F.ConnectionError_(F.FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        call = self.calls.get(sid)
        if call is None:  # a finished or refused stream: count it, drop it
            self.acknowledge(None, flow)
            return
        call.recv_window -= flow
        if call.recv_window < 0:
            self._reset(call, F.FLOW_CONTROL_ERROR)
            self.acknowledge(None, flow)
            return
        call._on_data(F.strip_padding(flags, payload), flow)
        if flags & F.END_STREAM:
            call._on_end()

    def _on_headers(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0 or sid % 2 == 0:
            raise F.ConnectionError_(F.PROTOCOL_ERROR, f"HEADERS on stream {sid}")
        block = F.strip_padding(flags, payload)
        if flags & F.PRIORITY_FLAG:
            if len(block) < 5:
                raise F.ConnectionError_(F.FRAME_SIZE_ERROR, "HEADERS priority cut short")
            block = block[5:]
        if not flags & F.END_HEADERS:
            self._continuing = (sid, flags, [block])
            return
        self._headers_complete(sid, flags, block)

    def _on_continuation(self, flags: int, sid: int, payload: bytes) -> None:
        if self._continuing is None or self._continuing[0] != sid:
            raise F.ConnectionError_(F.PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
        _, first_flags, pieces = self._continuing
        pieces.append(payload)
        if sum(len(p) for p in pieces) > MAX_HEADER_BLOCK:
            raise F.ConnectionError_(F.ENHANCE_YOUR_CALM, "header block too large")
        if flags & F.END_HEADERS:
            self._continuing = None
            self._headers_complete(sid, first_flags, b"".join(pieces))

    def _headers_complete(self, sid: int, flags: int, block: bytes) -> None:
        try:  # the decoder's state must follow every block, whatever becomes of it
            headers = self._decode(block)
        except hpack.exceptions.OversizedHeaderListError:
            # hpack stops mid-block, so its table may no longer match the peer's
            raise F.ConnectionError_(F.ENHANCE_YOUR_CALM, "header list too large") from None
        except hpack.exceptions.HPACKError as e:
            raise F.ConnectionError_(F.COMPRESSION_ERROR, f"bad header block: {e}") from None
        if sid <= self._last_stream:  # trailers (or a late block) of a known stream
            call = self.calls.get(sid)
            if call is None:
                self._out.append(F.rst_stream(sid, F.STREAM_CLOSED))
                return
            if not flags & F.END_STREAM:
                raise F.ConnectionError_(F.PROTOCOL_ERROR, "trailers without END_STREAM")
            call._on_end()
            return
        self._last_stream = sid
        if len(self.calls) >= self.max_streams:
            self._out.append(F.rst_stream(sid, F.REFUSED_STREAM))
            return
        self._on_request(sid, flags, headers)

    def _decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        """The headers of ``block``, decoded once per dynamic-table state.

        Clients send the same block over and over (every field indexed, the table
        unchanged by it); decoding it again would give the same list. The table's state
        is named by its newest entry (each insertion makes a new object, kept alive by
        the table) and its length; a block that changed the table is never reused.
        """
        table = self._decoder.header_table
        state = self._table_state(table)
        hit = self._decoded.get(block)
        if hit is not None and hit[0] == state and hit[0][0] is state[0]:
            return hit[1]
        headers = self._decoder.decode(block, raw=True)
        if self._table_state(table) == state:
            if len(self._decoded) >= 64:
                self._decoded.clear()
            self._decoded[block] = (state, headers)
        return headers

    @staticmethod
    def _table_state(table) -> tuple:
        entries = table.dynamic_entries
        return (entries[0] if entries else None, len(entries), table.maxsize)

    def _on_request(self, sid: int, flags: int, headers) -> None:
        method = path = content_type = encoding = timeout = None
        metadata: dict[str, str] = {}
        regular = False
        for name, value in headers:
            if name[:1] == b":":
                if regular or name not in _PSEUDO:
                    self._out.append(F.rst_stream(sid, F.PROTOCOL_ERROR))
                    return
                if name == b":path":
                    path = value
                elif name == b":method":
                    method = value
                continue
            regular = True
            if name != name.lower() or name in _CONNECTION_SPECIFIC:
                self._out.append(F.rst_stream(sid, F.PROTOCOL_ERROR))
                return
            if name == b"content-type":
                content_type = value
            elif name == b"grpc-timeout":
                timeout = value
            elif name == b"grpc-encoding":
                encoding = value
            elif name not in _RESERVED:
                metadata[name.decode("latin-1")] = value.decode("latin-1")
        end = bool(flags & F.END_STREAM)
        if method != b"POST" or not path:
            self._respond_http(sid, b"405", end)
            return
        if not (content_type or b"").startswith(b"application/grpc"):
            self._respond_http(sid, b"415", end)
            return
        limits = self.server.limits
        call = ServerCall(self, sid, path.decode("latin-1"), metadata, math.inf)
        call.recv_window = self.stream_window
        call.send_window = self.peer_initial_window
        call._reader = MessageReader(
            encoding.decode("latin-1") if encoding else None,
            limits.max_message_bytes,
            self.budget,
        )
        self.calls[sid] = call
        if len(self.calls) == 1:
            self._read_scope.deadline = math.inf  # not idle
        if timeout is not None:
            seconds = _parse_timeout(timeout)
            if seconds is None:
                call.finish(StatusCode.INVALID_ARGUMENT, f"malformed grpc-timeout {timeout!r}")
                call.release()
                return
            call.deadline = call.scope.deadline = trio.current_time() + seconds
        if end:
            call._on_end()
        self._nursery.start_soon(self.server._run_call, call)

    def _respond_http(self, sid: int, status: bytes, ended: bool) -> None:
        """A non-gRPC request: an HTTP status, and the stream is done."""
        self.write_headers(sid, F.header_block([(b":status", status)]), end_stream=True)
        if not ended:
            self._out.append(F.rst_stream(sid, F.NO_ERROR))

    def _on_window_update(self, sid: int, payload: bytes) -> None:
        increment = F.parse_u32(payload, "WINDOW_UPDATE")
        if sid == 0:
            if increment == 0:
                raise F.ConnectionError_(F.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.send_window += increment
            if self.send_window > F.MAX_WINDOW:
                raise F.ConnectionError_(F.FLOW_CONTROL_ERROR, "connection window overflow")
            for call in self.calls.values():
                call._window_opened()
            return
        if sid > self._last_stream:
            raise F.ConnectionError_(F.PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {sid}")
        call = self.calls.get(sid)
        if call is None:
            return
        if increment == 0:
            self._reset(call, F.PROTOCOL_ERROR)
            return
        call.send_window += increment
        if call.send_window > F.MAX_WINDOW:
            self._reset(call, F.FLOW_CONTROL_ERROR)
            return
        call._window_opened()

    def _on_settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid != 0:
            raise F.ConnectionError_(F.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & F.ACK:
            if payload:
                raise F.ConnectionError_(F.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        for key, value in F.parse_settings(payload):
            if key == F.INITIAL_WINDOW_SIZE:
                if value > F.MAX_WINDOW:
                    raise F.ConnectionError_(F.FLOW_CONTROL_ERROR, "initial window too large")
                delta, self.peer_initial_window = value - self.peer_initial_window, value
                for call in self.calls.values():
                    call.send_window += delta
                    call._window_opened()
            elif key == F.MAX_FRAME_SIZE:
                if not F.DEFAULT_FRAME <= value <= MAX_FRAME:
                    raise F.ConnectionError_(F.PROTOCOL_ERROR, f"MAX_FRAME_SIZE {value}")
                self.peer_max_frame = value
            elif key == F.ENABLE_PUSH and value > 1:
                raise F.ConnectionError_(F.PROTOCOL_ERROR, f"ENABLE_PUSH {value}")
            # HEADER_TABLE_SIZE: our header blocks never use the dynamic table
        self._out.append(F.frame(F.SETTINGS, F.ACK, 0))

    # -- writing ------------------------------------------------------------------------

    def write_headers(self, sid: int, block: bytes, *, end_stream: bool = False) -> None:
        """Queue a header block (split into CONTINUATION frames if it must be)."""
        size = self.peer_max_frame
        flags = F.END_STREAM if end_stream else 0
        if len(block) <= size:
            self._out.append(F.frame_header(F.HEADERS, flags | F.END_HEADERS, sid, len(block)))
            self._out.append(block)
            return
        pieces = [block[i : i + size] for i in range(0, len(block), size)]
        self._out.append(F.frame(F.HEADERS, flags, sid, pieces[0]))
        for piece in pieces[1:-1]:
            self._out.append(F.frame(F.CONTINUATION, 0, sid, piece))
        self._out.append(F.frame(F.CONTINUATION, F.END_HEADERS, sid, pieces[-1]))

    def write_data(self, call: ServerCall, data: memoryview) -> int:
        """Queue as much of ``data`` as the flow-control windows allow; returns how many
        bytes were queued (0: wait for a WINDOW_UPDATE)."""
        room = min(self.send_window, call.send_window, len(data))
        if room <= 0:
            return 0
        frame_size = self.peer_max_frame
        sid = call.id
        out = self._out
        for start in range(0, room, frame_size):
            chunk = data[start : min(start + frame_size, room)]
            out.append(F.frame_header(F.DATA, 0, sid, len(chunk)))
            out.append(chunk)
        self.send_window -= room
        call.send_window -= room
        return room

    def reset_stream(self, sid: int, code: int) -> None:
        self._out.append(F.rst_stream(sid, code))

    def _reset(self, call: ServerCall, code: int) -> None:
        """End ``call`` because its stream broke a rule: RST_STREAM, and cancel it."""
        self.reset_stream(call.id, code)
        call._on_reset()

    def acknowledge(self, call: ServerCall | None, flow: int) -> None:
        """``flow`` received bytes were consumed: give them back to the peer (a
        WINDOW_UPDATE once half a window is owed; on the stream too while it is open)."""
        if not flow:
            return
        self._recv_unacked += flow
        if self._recv_unacked >= CONNECTION_WINDOW // 2:
            self._out.append(F.window_update(0, self._recv_unacked))
            self._recv_window += self._recv_unacked
            self._recv_unacked = 0
        if call is not None and not call._closed:
            call.recv_unacked += flow
            if call.recv_unacked >= self.stream_window // 2:
                self._out.append(F.window_update(call.id, call.recv_unacked))
                call.recv_window += call.recv_unacked
                call.recv_unacked = 0

    def wake_writer(self) -> None:
        self._writable.unpark_all()

    def flush(self) -> None:
        """Send what is queued now, as far as the socket takes it without waiting.

        A plain TCP connection writes straight from the caller (one system call, no task
        switch), unless the writer task is sending or holds bytes the socket did not
        take; those, and everything on a TLS connection, go through the writer task,
        which alone waits for the socket. Never blocks and never raises.
        """
        if not self._out:
            return
        if self._fd is None or self._sending or self._pending:
            self.wake_writer()
            return
        data = b"".join(self._out)
        self._out.clear()
        try:
            sent = os.write(self._fd, data)
        except BlockingIOError:
            sent = 0
        except OSError:  # the writer meets the error again and ends the connection
            sent = 0
        if sent < len(data):
            self._pending = memoryview(data)[sent:]
            self.wake_writer()

    def forget(self, call: ServerCall) -> None:
        if self.calls.get(call.id) is call:
            del self.calls[call.id]
            if not self.calls and self.server.limits.idle_timeout:
                self._read_scope.deadline = trio.current_time() + self.server.limits.idle_timeout

    async def _writer(self) -> None:
        send = self.stream.send_all
        try:
            while True:
                if self._pending is not None:
                    data, self._pending = self._pending, None
                elif self._out:
                    data = b"".join(self._out)
                    self._out.clear()
                else:
                    data = None
                if data:
                    self._sending = True
                    try:
                        await send(data)
                    finally:
                        self._sending = False
                elif self._closing:
                    return
                else:
                    await self._writable.park()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._closing = True
            self._nursery.cancel_scope.cancel()  # the peer is gone: so are its calls
        finally:
            self._writer_done.set()


def _parse_timeout(value: bytes) -> float | None:
    """Seconds of a grpc-timeout header ("100m", "5S"...), or None if malformed."""
    unit = _TIMEOUT_UNITS.get(value[-1:])
    digits = value[:-1]
    if unit is None or not digits.isdigit() or len(digits) > 8:
        return None
    return int(digits) * unit
