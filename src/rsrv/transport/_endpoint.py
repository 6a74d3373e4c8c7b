"""What both ends of an HTTP/2 connection do alike (RFC 9113): reading frames and
dispatching them to streams, the peer's settings and flow-control windows, and
writing — frames queued, then written straight from the caller when the socket takes
them, by the writer task when it does not.

:class:`Http2Endpoint` is the base of the server's :class:`~._connection.ServerConnection`
and the client's :class:`~._client.ClientConnection`; each adds what its side alone
does (the server: requests, the client preface, idleness; the client: opening streams,
GOAWAY, the pool's bookkeeping). A stream object (``ServerCall``, ``ClientStream``)
has ``id``, ``send_window``, ``recv_window``, ``recv_unacked`` and ``_closed``, and
its received messages (``_inbox``, ``_reader``, ``_deferred``, ``_refill()``: see
:meth:`received` and :meth:`take_message`), and takes ``_on_data(data, flow)``, ``_on_end()``,
``_on_reset(code)`` and ``_window_opened()`` from the reader.

Every limit here is enforced on what the peer sends: frame size (``FrameReader``),
header block size, flow-control windows (an overrun: FLOW_CONTROL_ERROR). A protocol
error raises :class:`~._frames.ConnectionError_` out of :meth:`Http2Endpoint._dispatch`;
the read loop answers it with GOAWAY and ends.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import trio

from rsrv.transport import _frames as F

CONNECTION_WINDOW = 2**30  # what the connection-level receive window is raised to
#: The largest stream window advertised: a stream whose handler does not read holds up
#: to its window unacknowledged, so it takes several such streams, not one or two, to
#: exhaust the connection's window and hold up every other call on it.
MAX_STREAM_WINDOW = CONNECTION_WINDOW // 8
MAX_FRAME = 2**24 - 1  # the largest frame we accept
MAX_HEADER_BLOCK = 64 * 1024  # a header block, CONTINUATION frames included
MAX_HEADER_LIST = 16 * 1024  # decoded header list size (SETTINGS_MAX_HEADER_LIST_SIZE)
MAX_CONTINUATIONS = 64  # frames of one header block, HEADERS included (empty ones cost too)
#: Entries of one SETTINGS frame: RFC 9113 defines 6 (and extensions a few more); a frame
#: of thousands only costs its reader.
MAX_SETTINGS = 32
#: Answers the reader queues itself (PING and SETTINGS acknowledgements, resets of the
#: peer's streams, statuses of requests refused before they became calls) that may wait
#: unsent at once: a peer that sends PINGs and reads nothing must not grow the queue.
MAX_UNSENT_ANSWERS = 1000
RECEIVE_SIZE = 256 * 1024
INBOX_LIMIT = 4  # complete messages a stream may hold unread before flow control stops


def set_keepalive(sock) -> None:
    """TCP keepalive, so a peer that vanished without a FIN is noticed (~8 min)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 300)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 30)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 5)
    except OSError:
        pass


class Http2Endpoint:
    """Protocol state and I/O of one HTTP/2 connection, either side.

    ``streams`` maps open stream ids to their stream objects. ``stream_window`` is the
    per-stream receive window we advertise (SETTINGS_INITIAL_WINDOW_SIZE), at most
    MAX_STREAM_WINDOW.
    """

    def __init__(self, stream: trio.abc.Stream, stream_window: int, parse=None):
        self.stream = stream
        self.streams: dict[int, Any] = {}
        # what we told the peer, and what we owe it
        self.stream_window = min(stream_window, MAX_STREAM_WINDOW)
        self._recv_window = CONNECTION_WINDOW  # connection-level, left before WINDOW_UPDATE
        self._recv_unacked = 0
        # what the peer told us
        self.send_window = F.DEFAULT_WINDOW  # connection-level
        self.peer_initial_window = F.DEFAULT_WINDOW
        self.peer_max_frame = F.DEFAULT_FRAME
        self._decoder = F.HeaderDecoder(MAX_HEADER_LIST, parse)
        self._frames = F.FrameReader(MAX_FRAME)
        self._settled = False  # the peer's first SETTINGS arrived
        self._continuing: tuple[int, int, list[bytes]] | None = None  # HEADERS cont'd
        self._continued_bytes = 0  # of the block being continued
        self._last_stream = 0  # highest stream id opened (by the client)
        self._out: list[bytes] = []  # frames queued, not yet written
        self._out_bytes = 0  # bytes in _out
        self._writable = trio.lowlevel.ParkingLot()
        # plain TCP: flush() writes straight to the socket (see there)
        self._fd = stream.socket.fileno() if isinstance(stream, trio.SocketStream) else None
        self._shut = False  # the socket is (being) closed: nothing more is written
        self._unsent_answers = 0  # frames _answer queued since the queue was last empty
        # Reading waits while more than this is unsent (None: never; the server's side,
        # so that a peer that sends and does not read cannot grow the output queue)
        self.max_unsent: int | None = None
        self._writing = 0  # bytes the writer task is sending
        self._sent = trio.lowlevel.ParkingLot()  # the writer sent something
        self._pending: memoryview | None = None  # bytes flush() could not write
        self._closing = False
        self._writer_done = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._goaway_sent = False

    def local_settings(self, max_streams: int | None = None) -> bytes:
        """Our SETTINGS frame and the WINDOW_UPDATE raising the connection window: the
        first frames each side sends (after the client's preface)."""
        values = {}
        if max_streams is not None:
            values[F.MAX_CONCURRENT_STREAMS] = max_streams
        values.update(
            {
                F.INITIAL_WINDOW_SIZE: self.stream_window,
                F.MAX_FRAME_SIZE: MAX_FRAME,
                F.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST,
                F.ENABLE_PUSH: 0,
            }
        )
        return F.settings(values) + F.window_update(0, CONNECTION_WINDOW - F.DEFAULT_WINDOW)

    # -- hooks of each side -----------------------------------------------------------

    #: The largest SETTINGS_ENABLE_PUSH the peer may send: 1 from a client; a server
    #: sending 1 is a PROTOCOL_ERROR (RFC 9113 §6.5.2).
    peer_may_push = 1

    def _headers_complete(self, sid: int, flags: int, block: bytes) -> None:
        raise NotImplementedError

    def _on_settled(self) -> None:
        """The peer's first SETTINGS frame arrived."""

    def _on_goaway(self, last_stream_id: int, code: int) -> None:
        """The peer sent GOAWAY."""

    def _on_peer_max_streams(self, value: int) -> None:
        """The peer's SETTINGS_MAX_CONCURRENT_STREAMS."""

    def _broken(self) -> None:
        """The socket failed while writing: the peer is gone."""
        self._closing = True
        self._nursery.cancel_scope.cancel()

    # -- reading ------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        """Read until the peer closes, resets or breaks the protocol (GOAWAY with its
        error code then), or ``_closing`` is set."""
        receive = self.stream.receive_some if self._fd is None else self._receive_plain
        while not self._closing:
            if self.max_unsent is not None and (self._pending is not None or self._writing):
                await self._unsent_below(self.max_unsent)
            try:
                data = await receive(RECEIVE_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return  # reset by the peer, or a TLS stream cut short
            if not data:
                return  # the peer closed the connection
            try:
                self._receive(data)
            except F.ConnectionError_ as e:
                self._protocol_error(e)
                self._send_goaway(e.code, str(e))
                return
            self.flush()

    async def _receive_plain(self, size: int) -> bytes:
        """What a plain TCP socket holds, up to ``size`` bytes, once it holds something:
        trio's ``receive_some`` without its wrappers (a read loop's main cost when its
        peer sends small messages one at a time). Like it, a checkpoint, and cancelled
        only before anything is read."""
        fd = self._fd
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        while True:
            try:
                data = os.read(fd, size)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(fd)  # (the checkpoint: nothing read yet)
                waited = True
                continue
            except OSError as e:  # reset by the peer
                raise trio.BrokenResourceError(str(e)) from e
            if not waited:
                await trio.lowlevel.cancel_shielded_checkpoint()
            return data

    def _receive(self, data: bytes) -> None:
        self._dispatch(self._frames.feed(data))

    def _protocol_error(self, error: F.ConnectionError_) -> None:
        """The peer broke the protocol (before GOAWAY is sent)."""

    def _dispatch(self, frames) -> None:
        for kind, flags, sid, payload in frames:
            if not self._settled:
                if kind != F.SETTINGS or flags & F.ACK:
                    raise F.ConnectionError_(F.PROTOCOL_ERROR, "the preface must be SETTINGS")
                self._settled = True
                self._on_settled()
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
                code = F.parse_u32(payload, "RST_STREAM")
                stream = self.streams.get(sid)
                if stream is not None:
                    stream._on_reset(code)
            elif kind == F.SETTINGS:
                self._on_settings(flags, sid, payload)
            elif kind == F.PING:
                if sid != 0:
                    raise F.ConnectionError_(F.PROTOCOL_ERROR, "PING on a stream")
                if len(payload) != 8:  # (RFC 9113 §6.7)
                    raise F.ConnectionError_(F.FRAME_SIZE_ERROR, "PING not of 8 bytes")
                if not flags & F.ACK:
                    self._answer(F.frame(F.PING, F.ACK, 0, payload))
            elif kind == F.PRIORITY:
                if sid == 0:
                    raise F.ConnectionError_(F.PROTOCOL_ERROR, "PRIORITY on stream 0")
                if len(payload) != 5:  # a stream error (RFC 9113 §6.3)
                    stream = self.streams.get(sid)
                    if stream is None:
                        self._answer(F.rst_stream(sid, F.FRAME_SIZE_ERROR))
                    elif not stream._closed:
                        self._reset(stream, F.FRAME_SIZE_ERROR)
            elif kind == F.GOAWAY:
                if sid != 0:
                    raise F.ConnectionError_(F.PROTOCOL_ERROR, "GOAWAY on a stream")
                if len(payload) < 8:
                    raise F.ConnectionError_(F.FRAME_SIZE_ERROR, "GOAWAY shorter than 8 bytes")
                self._on_goaway(F.parse_u32(payload[:4], "GOAWAY"), F.parse_u32(payload[4:8], ""))
            elif kind == F.PUSH_PROMISE:
                raise F.ConnectionError_(F.PROTOCOL_ERROR, "push is disabled")
            # unknown frame types are ignored (RFC 9113 §4.1)

    def _on_data(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0 or sid % 2 == 0 or sid > self._last_stream:
            raise F.ConnectionError_(F.PROTOCOL_ERROR, f"DATA on stream {sid}, never opened")
        flow = len(payload)
        self._recv_window -= flow
        if self._recv_window < 0:
            raise F.ConnectionError_(F.FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        stream = self.streams.get(sid)
        if stream is None or stream._closed:  # finished, refused or reset: count, drop
            self.acknowledge(None, flow)
            return
        stream.recv_window -= flow
        if stream.recv_window < 0:
            self._reset(stream, F.FLOW_CONTROL_ERROR)
            self.acknowledge(None, flow)
            return
        stream._on_data(F.strip_padding(flags, payload), flow)
        if flags & F.END_STREAM:
            stream._on_end()

    def _on_headers(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0 or sid % 2 == 0:
            raise F.ConnectionError_(F.PROTOCOL_ERROR, f"HEADERS on stream {sid}")
        block = F.strip_padding(flags, payload)
        if flags & F.PRIORITY_FLAG:
            if len(block) < 5:
                raise F.ConnectionError_(F.FRAME_SIZE_ERROR, "HEADERS priority cut short")
            block = block[5:]
        if len(block) > MAX_HEADER_BLOCK:  # (before anything decodes it)
            raise F.ConnectionError_(F.ENHANCE_YOUR_CALM, "header block too large")
        if not flags & F.END_HEADERS:
            self._continuing = (sid, flags, [block])
            self._continued_bytes = len(block)
            return
        self._headers_complete(sid, flags, block)

    def _on_continuation(self, flags: int, sid: int, payload: bytes) -> None:
        if self._continuing is None or self._continuing[0] != sid:
            raise F.ConnectionError_(F.PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
        _, first_flags, pieces = self._continuing
        pieces.append(payload)
        self._continued_bytes += len(payload)
        if self._continued_bytes > MAX_HEADER_BLOCK or len(pieces) > MAX_CONTINUATIONS:
            raise F.ConnectionError_(F.ENHANCE_YOUR_CALM, "header block too large")
        if flags & F.END_HEADERS:
            self._continuing = None
            self._headers_complete(sid, first_flags, b"".join(pieces))

    def _on_window_update(self, sid: int, payload: bytes) -> None:
        increment = F.parse_u32(payload, "WINDOW_UPDATE")
        if sid == 0:
            if increment == 0:
                raise F.ConnectionError_(F.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            blocked = self.send_window <= 0  # (else no stream waits on this window)
            self.send_window += increment
            if self.send_window > F.MAX_WINDOW:
                raise F.ConnectionError_(F.FLOW_CONTROL_ERROR, "connection window overflow")
            if blocked and self.send_window > 0:
                for stream in self.streams.values():
                    stream._window_opened()
            return
        if sid > self._last_stream:
            raise F.ConnectionError_(F.PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {sid}")
        stream = self.streams.get(sid)
        if stream is None or stream._closed:  # (reset already, or done sending)
            return
        if increment == 0:
            self._reset(stream, F.PROTOCOL_ERROR)
            return
        stream.send_window += increment
        if stream.send_window > F.MAX_WINDOW:
            self._reset(stream, F.FLOW_CONTROL_ERROR)
            return
        stream._window_opened()

    def _on_settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid != 0:
            raise F.ConnectionError_(F.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & F.ACK:
            if payload:
                raise F.ConnectionError_(F.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) > 6 * MAX_SETTINGS:
            raise F.ConnectionError_(F.ENHANCE_YOUR_CALM, "SETTINGS of too many entries")
        window = None
        for key, value in F.parse_settings(payload):
            if key == F.INITIAL_WINDOW_SIZE:
                if value > F.MAX_WINDOW:
                    raise F.ConnectionError_(F.FLOW_CONTROL_ERROR, "initial window too large")
                window = value  # (the last one counts: applied once, below)
            elif key == F.MAX_FRAME_SIZE:
                if not F.DEFAULT_FRAME <= value <= MAX_FRAME:
                    raise F.ConnectionError_(F.PROTOCOL_ERROR, f"MAX_FRAME_SIZE {value}")
                self.peer_max_frame = value
            elif key == F.ENABLE_PUSH and value > self.peer_may_push:
                raise F.ConnectionError_(F.PROTOCOL_ERROR, f"ENABLE_PUSH {value}")
            elif key == F.MAX_CONCURRENT_STREAMS:
                self._on_peer_max_streams(value)
            # HEADER_TABLE_SIZE: our header blocks never use the dynamic table
        if window is not None:
            self._on_initial_window(window)
        self._answer(F.frame(F.SETTINGS, F.ACK, 0))

    def _on_initial_window(self, value: int) -> None:
        """The peer's SETTINGS_INITIAL_WINDOW_SIZE changed: every stream's send window
        moves by the difference (RFC 9113 §6.9.2), one beyond 2**31 - 1 a connection
        error; streams wake when their window grew."""
        delta, self.peer_initial_window = value - self.peer_initial_window, value
        if not delta:
            return
        for stream in self.streams.values():
            stream.send_window += delta
            if stream.send_window > F.MAX_WINDOW:
                raise F.ConnectionError_(F.FLOW_CONTROL_ERROR, "a stream's window overflows")
            if delta > 0:
                stream._window_opened()

    # -- writing ------------------------------------------------------------------------

    def write_headers(self, sid: int, block: bytes, *, end_stream: bool = False) -> None:
        """Queue a header block (split into CONTINUATION frames if it must be)."""
        size = self.peer_max_frame
        flags = F.END_STREAM if end_stream else 0
        if len(block) <= size:
            self._out.append(F.frame_header(F.HEADERS, flags | F.END_HEADERS, sid, len(block)))
            self._out.append(block)
            self._out_bytes += 9 + len(block)
            return
        pieces = [block[i : i + size] for i in range(0, len(block), size)]
        self.queue(F.frame(F.HEADERS, flags, sid, pieces[0]))
        for piece in pieces[1:-1]:
            self.queue(F.frame(F.CONTINUATION, 0, sid, piece))
        self.queue(F.frame(F.CONTINUATION, F.END_HEADERS, sid, pieces[-1]))

    def queue(self, frame: bytes) -> None:
        """Queue one frame (sent at the next flush)."""
        self._out.append(frame)
        self._out_bytes += len(frame)

    def write_data(self, stream, data: memoryview, end_stream: bool = False) -> int:
        """Queue as much of ``data`` as the flow-control windows allow; returns how many
        bytes were queued (0: wait for a WINDOW_UPDATE). With ``end_stream`` the frame
        that carries the last byte of ``data`` ends the stream."""
        room = min(self.send_window, stream.send_window, len(data))
        if room <= 0:
            return 0
        frame_size = self.peer_max_frame
        sid = stream.id
        out = self._out
        last = F.END_STREAM if end_stream and room == len(data) else 0
        for start in range(0, room, frame_size):
            end = min(start + frame_size, room)
            chunk = data[start:end]
            out.append(F.frame_header(F.DATA, last if end == room else 0, sid, len(chunk)))
            out.append(chunk)
        self._out_bytes += room + 9 * -(-room // frame_size)
        self.send_window -= room
        stream.send_window -= room
        return room

    def reset_stream(self, sid: int, code: int) -> None:
        self.queue(F.rst_stream(sid, code))

    def _reset(self, stream, code: int) -> None:
        """End ``stream`` because it broke a rule: RST_STREAM, and tell the stream."""
        self._answer(F.rst_stream(stream.id, code))
        stream._on_reset(code)

    def _answer(self, frame: bytes) -> None:
        """Queue a frame the peer's own frame calls for (from the reader); see
        :meth:`_answered`."""
        self._answered()
        self.queue(frame)

    def _answered(self) -> None:
        """Count one answer the reader queues itself (an acknowledgement, a reset, a
        refused request's status). Raises ConnectionError_ (ENHANCE_YOUR_CALM) when more
        than MAX_UNSENT_ANSWERS wait unsent: the peer sends and does not read."""
        self._unsent_answers += 1
        if self._unsent_answers > MAX_UNSENT_ANSWERS:
            raise F.ConnectionError_(
                F.ENHANCE_YOUR_CALM, "the peer does not read what its frames call for"
            )

    def _send_goaway(self, code: int, why: str = "") -> None:
        self._goaway_sent = True
        self.queue(F.goaway(self._last_stream, code, why.encode()[:256]))
        self.flush()

    def received(self, stream, flow: int) -> None:
        """``flow`` bytes reached ``stream``: given back to the peer now, or held back
        while its inbox holds more than INBOX_LIMIT unread messages (see
        :meth:`take_message`)."""
        if len(stream._inbox) <= INBOX_LIMIT:
            self.acknowledge(stream, flow)
        else:
            stream._deferred += flow

    def take_message(self, stream):
        """The first message of ``stream``'s inbox (there is one), consumed: the flow
        control held back while its inbox was full is given back once it has room."""
        message = stream._inbox.popleft()
        stream._reader.consumed(message)
        stream._refill()
        if stream._deferred and len(stream._inbox) < INBOX_LIMIT:
            self.acknowledge(stream, stream._deferred)
            stream._deferred = 0
            self.flush()
        return message

    def acknowledge(self, stream, flow: int) -> None:
        """``flow`` received bytes were consumed: give them back to the peer (a
        WINDOW_UPDATE once half the stream's window is owed, on the stream while it is
        open; on the connection once a sixteenth of its window is, so that little of it
        sits acknowledged but not given back)."""
        if not flow:
            return
        self._recv_unacked += flow
        if self._recv_unacked >= CONNECTION_WINDOW // 16:
            self.queue(F.window_update(0, self._recv_unacked))
            self._recv_window += self._recv_unacked
            self._recv_unacked = 0
        if stream is not None and not stream._closed:
            stream.recv_unacked += flow
            if stream.recv_unacked >= self.stream_window // 2:
                self.queue(F.window_update(stream.id, stream.recv_unacked))
                stream.recv_window += stream.recv_unacked
                stream.recv_unacked = 0

    async def _close_socket(self) -> None:
        """Close the socket, for good: frames queued from now on are dropped."""
        self._shut = True
        self._take_out()
        await trio.aclose_forcefully(self.stream)

    def _take_out(self) -> bytes:
        """What is queued, as one piece; the queue is then empty."""
        data = b"".join(self._out)
        self._out.clear()
        self._out_bytes = 0
        return data

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
        if self._shut:
            self._take_out()  # the socket is closed: its descriptor may be another's now
            return
        if self._fd is None or self._writing or self._pending:
            self.wake_writer()
            return
        data = self._take_out()
        self._unsent_answers = 0  # (what stays pending is counted again from here)
        try:
            sent = os.write(self._fd, data)
        except BlockingIOError:
            sent = 0
        except OSError:  # the writer meets the error again and ends the connection
            sent = 0
        if sent < len(data):
            self._pending = memoryview(data)[sent:]
            self.wake_writer()

    async def _writer(self) -> None:
        send = self.stream.send_all
        try:
            while True:
                if self._pending is not None:
                    data, self._pending = self._pending, None
                elif self._out:
                    data = self._take_out()
                    self._unsent_answers = 0
                else:
                    data = None
                if data:
                    self._writing = len(data)
                    try:
                        await send(data)
                    finally:
                        self._writing = 0
                        self._sent.unpark_all()
                elif self._closing:
                    return
                else:
                    await self._writable.park()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._broken()
        finally:
            self._writer_done.set()
            self._sent.unpark_all()

    def _unsent(self) -> int:
        """Bytes queued or being written, not yet taken by the socket; O(1)."""
        pending = len(self._pending) if self._pending is not None else 0
        return self._writing + pending + self._out_bytes

    async def _unsent_below(self, limit: int) -> None:
        """Wait (reading nothing) while more than ``limit`` bytes are unsent, until half
        of it is left, or the writer has ended."""
        if self._unsent() <= limit:
            return
        while self._unsent() > limit // 2 and not self._writer_done.is_set():
            await self._sent.park()

    async def _drain_writer(self, timeout: float = 1.0) -> None:
        """Let the writer send what is queued (a GOAWAY, the last frames), then stop it."""
        self._closing = True
        self.wake_writer()
        with trio.move_on_after(timeout):
            await self._writer_done.wait()
