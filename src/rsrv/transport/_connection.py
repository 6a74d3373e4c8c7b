"""One HTTP/2 connection of the gRPC server (each call on it: ``_call.ServerCall``).

A :class:`ServerConnection` runs two tasks: a reader that feeds the socket to h2 and
turns its events into calls, and a writer that sends whatever h2 has queued (so the
frames of every call finished in one scheduling pass leave in one write). Each call runs
in its own task, started by the server (:meth:`GrpcServer._run_call`), under the
connection's nursery.

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
from typing import TYPE_CHECKING

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import trio
from h2.errors import ErrorCodes
from h2.settings import SettingCodes, Settings
from h2.utilities import SizeLimitDict
from purerpc.grpclib.status import StatusCode

from rsrv.transport._call import ServerCall
from rsrv.transport._messages import InflateBudget, MessageReader

if TYPE_CHECKING:
    from rsrv.transport._server import GrpcServer

log = logging.getLogger("rsrv.transport")

MAX_WINDOW = 2**31 - 1  # the largest HTTP/2 flow-control window
CONNECTION_WINDOW = 2**30  # what the connection-level window is raised to
MAX_FRAME = 2**24 - 1  # the largest DATA frame we accept
RECEIVE_SIZE = 256 * 1024
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_RESERVED = frozenset(
    {b"te", b"content-type", b"grpc-timeout", b"grpc-encoding", b"grpc-accept-encoding"}
)


class ServerConnection:
    """One client connection: h2 state, a reader task and a writer task."""

    def __init__(self, stream: trio.abc.Stream, server: GrpcServer, peer: str):
        self.stream = stream
        self.server = server
        self.peer = peer
        limits = server.limits
        config = h2.config.H2Configuration(
            client_side=False,
            header_encoding=None,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
        )
        conn = self.h2 = h2.connection.H2Connection(config)
        # h2 remembers how each of the last 65,536 streams closed (to tell a late frame
        # from a protocol error): megabytes per long-lived connection. Streams open at
        # once are capped far lower, so a few thousand are plenty.
        conn._closed_streams = SizeLimitDict(
            size_limit=max(1024, 8 * limits.max_streams_per_connection)
        )
        conn.local_settings = Settings(
            client=False,
            initial_values={
                SettingCodes.MAX_CONCURRENT_STREAMS: limits.max_streams_per_connection,
                SettingCodes.INITIAL_WINDOW_SIZE: min(2 * limits.max_message_bytes, MAX_WINDOW),
                SettingCodes.MAX_FRAME_SIZE: MAX_FRAME,
                SettingCodes.MAX_HEADER_LIST_SIZE: 16384,
            },
        )
        conn.max_inbound_frame_size = MAX_FRAME
        self.calls: dict[int, ServerCall] = {}
        self.budget = InflateBudget(limits.max_message_bytes)
        self._writable = trio.lowlevel.ParkingLot()
        self._closing = False
        self._writer_done = trio.Event()
        self._opened = trio.current_time()
        self._idle_since = self._opened
        self._nursery: trio.Nursery | None = None
        self._read_scope = trio.CancelScope()
        self._timer: trio.CancelScope | None = None  # around the reader's receive
        self._preface = False

    async def run(self) -> None:
        """Serve the connection until it ends; every call on it ends with it."""
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(CONNECTION_WINDOW)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._writer)
                with self._read_scope:
                    await self._reader()
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
        self._send_goaway()
        self._read_scope.cancel()

    # -- reading ------------------------------------------------------------------------

    def _read_deadline(self) -> float:
        limits = self.server.limits
        if not self._preface:
            return self._opened + limits.handshake_timeout
        if not self.calls and limits.idle_timeout:
            return self._idle_since + limits.idle_timeout
        return math.inf

    async def _reader(self) -> None:
        receive = self.stream.receive_some
        conn = self.h2
        while not self._closing:
            # The deadline moves when the last call ends (forget) while this waits.
            with trio.CancelScope(deadline=self._read_deadline()) as timer:
                self._timer = timer
                try:
                    data = await receive(RECEIVE_SIZE)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return  # reset by the peer, or a TLS stream cut short
            self._timer = None
            if timer.cancelled_caught:
                log.debug("closing %s connection from %s", self._why_idle(), self.peer)
                self._send_goaway()
                return
            if not data:
                return  # the peer closed the connection
            try:
                events = conn.receive_data(data)
            except h2.exceptions.ProtocolError as e:
                log.debug("HTTP/2 protocol error from %s: %s", self.peer, e)
                return  # h2 queued a GOAWAY; run() flushes it
            self._preface = True
            for event in events:
                self._dispatch(event)
            self.wake_writer()

    def _why_idle(self) -> str:
        return "an idle" if self._preface else "a silent (no HTTP/2 preface)"

    def _send_goaway(self) -> None:
        try:
            self.h2.close_connection(ErrorCodes.NO_ERROR)
        except h2.exceptions.ProtocolError:
            pass

    def _dispatch(self, event) -> None:
        kind = type(event)
        if kind is h2.events.DataReceived:
            call = self.calls.get(event.stream_id)
            if call is None:
                self.acknowledge(event.stream_id, event.flow_controlled_length)
            else:
                call._on_data(event.data, event.flow_controlled_length)
        elif kind is h2.events.RequestReceived:
            self._on_request(event)
        elif kind is h2.events.StreamEnded:
            call = self.calls.get(event.stream_id)
            if call is not None:
                call._on_end()
        elif kind is h2.events.StreamReset:
            call = self.calls.get(event.stream_id)
            if call is not None:
                call._on_reset()
        elif kind is h2.events.WindowUpdated:
            if event.stream_id:
                call = self.calls.get(event.stream_id)
                if call is not None:
                    call._window_opened()
            else:
                for call in self.calls.values():
                    call._window_opened()
        elif kind is h2.events.RemoteSettingsChanged:
            for call in self.calls.values():
                call._window_opened()

    def _on_request(self, event: h2.events.RequestReceived) -> None:
        sid = event.stream_id
        method = path = content_type = encoding = timeout = None
        metadata: dict[str, str] = {}
        for name, value in event.headers:
            if name[0] == 58:  # b":"
                if name == b":path":
                    path = value
                elif name == b":method":
                    method = value
            elif name == b"content-type":
                content_type = value
            elif name == b"grpc-timeout":
                timeout = value
            elif name == b"grpc-encoding":
                encoding = value
            elif name not in _RESERVED:
                metadata[name.decode("latin-1")] = value.decode("latin-1")
        if method != b"POST" or not (content_type or b"").startswith(b"application/grpc"):
            status = b"405" if method != b"POST" else b"415"
            self.h2.send_headers(sid, [(b":status", status)], end_stream=True)
            return
        deadline = math.inf
        text_path = (path or b"").decode("latin-1")
        call = ServerCall(self, sid, text_path, metadata, deadline)
        call._reader = MessageReader(
            encoding.decode("latin-1") if encoding else None,
            self.server.limits.max_message_bytes,
            self.budget,
        )
        self.calls[sid] = call
        self._idle_since = math.inf
        if timeout is not None:
            seconds = _parse_timeout(timeout)
            if seconds is None:
                call.finish(StatusCode.INVALID_ARGUMENT, f"malformed grpc-timeout {timeout!r}")
                call.release()
                return
            call.deadline = trio.current_time() + seconds
        if event.stream_ended:
            call._on_end()
        self._nursery.start_soon(self.server._run_call, call)

    # -- writing ------------------------------------------------------------------------

    def acknowledge(self, stream_id: int, flow: int) -> None:
        if flow:
            try:
                self.h2.acknowledge_received_data(flow, stream_id)
            except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
                pass

    def wake_writer(self) -> None:
        self._writable.unpark_all()

    def forget(self, call: ServerCall) -> None:
        if self.calls.get(call.id) is call:
            del self.calls[call.id]
            if not self.calls:
                self._idle_since = trio.current_time()
                if self._timer is not None:
                    self._timer.deadline = self._read_deadline()

    async def _writer(self) -> None:
        conn = self.h2
        send = self.stream.send_all
        try:
            while True:
                data = conn.data_to_send()
                if data:
                    await send(data)
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
