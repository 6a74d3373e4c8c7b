"""A gRPC client channel to one endpoint: pooled HTTP/2 connections, a cap on calls in
flight, unary and bidirectional-streaming calls on raw message bytes.

Messages are bytes in and bytes out (no protobuf here): the gateway forwards them
untouched, and ``rsrv.client`` encodes and decodes them. Calls never raise for a
status: a unary call returns a :class:`UnaryResult`, a streaming call carries its
status once it has ended. Transport failures are ``UNAVAILABLE``, with
``reached_server`` False when the server certainly did not process the call (so a
caller may retry it or send it elsewhere).

Usage, with a nursery of the channel's own::

    async with open_channel("127.0.0.1", 8001) as channel:
        result = await channel.unary("/inference.GRPCInferenceService/ServerLive", b"")

or bound to a nursery the caller owns, for as long as that nursery lives::

    channel = Channel("127.0.0.1", 8001)
    await nursery.start(channel.run)
    ...
    await channel.aclose()
"""

from __future__ import annotations

import math
import ssl
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio
from purerpc.grpclib.status import StatusCode

from rsrv.errors import nursery_unwrapped
from rsrv.transport import _frames as F
from rsrv.transport._client import ClientConnection, connect
from rsrv.transport._client_calls import StreamingCall, UnaryResult, unary_result
from rsrv.transport._client_stream import DEADLINE_MESSAGE, CallEnded, ClientStream

__all__ = ["Channel", "ClientLimits", "StreamingCall", "UnaryResult", "open_channel"]

Metadata = Sequence[tuple[str, str]]
_USER_AGENT = b"rsrv-channel/1"


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """What a :class:`Channel` may hold and how it spreads its calls.

    ``max_concurrent_streams``: calls in flight on the channel at once; further calls
    wait, first come first served (their deadline runs while they wait); an uncapped
    call (``Channel.unary(capped=False)``) is not counted.
    ``max_connections``: HTTP/2 connections to the endpoint, opened lazily; a new one
    is opened when every open one carries ``streams_per_connection`` calls, or the
    server's SETTINGS_MAX_CONCURRENT_STREAMS, or is closing (beyond this number only
    for an uncapped call that finds every one full: one spare connection, apart). Messages above
    ``max_send_message_bytes`` fail without being sent (a unary call RESOURCE_EXHAUSTED,
    a stream's message :class:`MessageTooLarge`, the stream going on), received
    ones above ``max_receive_message_bytes`` (decompressed) RESOURCE_EXHAUSTED.
    ``connect_timeout``: a connection (TCP and TLS) must be up within this.
    ``accept_compressed``: ask the server to compress its responses (gzip, deflate),
    which are then inflated as they arrive, on the event loop (for small answers on a
    slow link); without it, a compressed response fails its call INTERNAL (as the server was not
    asked to compress; inflating it would hold the event loop). ``message_setting``
    names the setting behind both message limits in their errors (None: these
    fields).
    """

    max_concurrent_streams: int = 256
    max_connections: int = 4
    streams_per_connection: int = 64
    max_send_message_bytes: int = 1 << 28
    max_receive_message_bytes: int = 1 << 28
    connect_timeout: float = 10.0
    accept_compressed: bool = False
    message_setting: str | None = None


class _Unreachable(Exception):
    """No connection to the server could be had (the call never left)."""


@dataclass(eq=False, slots=True)
class _Opening:
    """An open under way that other calls wait for: ``done`` once it ended, with the
    ``error`` it failed with, if it failed."""

    done: trio.Event = field(default_factory=trio.Event)
    error: str | None = None


class Channel:
    """Calls to one gRPC endpoint over pooled HTTP/2 connections (see the module doc).

    ``tls``: a client ``ssl.SSLContext`` (e.g. ``ssl.create_default_context(cafile=...)``;
    ``load_cert_chain`` for mutual TLS), verified against ``server_hostname`` or
    ``host``; None for plaintext HTTP/2. The channel's connections run as tasks of
    :meth:`run`; a call made before ``run`` started fails UNAVAILABLE.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        tls: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        limits: ClientLimits = ClientLimits(),  # noqa: B008 (frozen)
    ):
        self.host, self.port = host, port
        self.tls = tls
        self.server_hostname = server_hostname
        self.limits = limits
        self._send_setting = limits.message_setting or "ClientLimits.max_send_message_bytes"
        self.connections: list[ClientConnection] = []
        self.opened = 0  # connections opened so far (a server restart makes a new one)
        self._spare: ClientConnection | None = None  # uncapped calls' when the pool is full
        # the open of the spare under way (one at a time: concurrent uncapped calls
        # opened one each, all but the last kept by nobody until the idle timeout)
        self._spare_opening: _Opening | None = None
        self._slots = trio.Semaphore(limits.max_concurrent_streams)
        self._opening = 0
        self._changed = trio.lowlevel.ParkingLot()
        self._nursery: trio.Nursery | None = None
        self._closed = trio.Event()  # (set by aclose)
        self._blocks: dict[str, bytes] = {}  # path -> its prebuilt request header block
        authority = host if ":" not in host else f"[{host}]"
        self._common = [
            (b":authority", f"{authority}:{port}".encode()),
            (b"te", b"trailers"),
            (b"content-type", b"application/grpc"),
            (b"user-agent", _USER_AGENT),
        ]
        if limits.accept_compressed:
            self._common.append((b"grpc-accept-encoding", b"identity,gzip,deflate"))
        self._scheme = b"https" if tls is not None else b"http"

    @property
    def closed(self) -> bool:
        """True from :meth:`aclose` on: every later call fails UNAVAILABLE, never sent."""
        return self._closed.is_set()

    async def wait_closed(self) -> None:
        """Return once the channel is closed (:meth:`aclose`)."""
        await self._closed.wait()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Hold the channel's connections until cancelled or :meth:`aclose`; meant for
        ``await nursery.start(channel.run)``."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None  # (a later call: UNAVAILABLE, "not running")

    async def aclose(self) -> None:
        """Close every connection (GOAWAY) and stop :meth:`run`; calls still in flight
        end UNAVAILABLE ("the client closed the channel ..."), later calls fail
        UNAVAILABLE (never sent)."""
        self._closed.set()
        for conn in [*self.connections, *filter(None, [self._spare])]:
            conn.closed_here = True
            conn.close()
        with trio.move_on_after(1):  # idle ones send GOAWAY and close
            for conn in list(self.connections):
                if not conn.streams:
                    await conn.finished.wait()
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    # -- calls ----------------------------------------------------------------------------

    async def unary(
        self,
        path: str,
        request: bytes,
        *,
        metadata: Metadata = (),
        timeout: float | None = None,
        capped: bool = True,
    ) -> UnaryResult:
        """Call ``path`` ("/package.Service/Method") with one request message; never
        raises for a status. ``timeout`` (seconds) is sent as grpc-timeout and enforced
        here too: past it the stream is reset (RST_STREAM CANCEL) and the result is
        DEADLINE_EXCEEDED. Cancelling the calling task resets the stream as well. A call
        the server refused unprocessed (GOAWAY past its stream, REFUSED_STREAM) is sent
        once more, on a connection that takes calls; refused again, it is UNAVAILABLE
        with ``reached_server`` False.
        ``capped=False``: the call does not take one of the ``max_concurrent_streams``
        slots (nor wait for one), nor wait for a connection with room (every one full,
        it takes the channel's spare one: see ``_connection``): for the few calls that
        must not queue behind the others, such as a health probe of a server busy with
        them."""
        if timeout is None:
            return await self._unary(path, request, metadata, math.inf, None, capped)
        deadline = trio.current_time() + timeout
        opened: list[ClientStream] = []
        with trio.move_on_at(deadline):
            return await self._unary(path, request, metadata, deadline, opened, capped)
        return UnaryResult(
            StatusCode.DEADLINE_EXCEEDED,
            DEADLINE_MESSAGE,
            reached_server=bool(opened),
        )

    async def _unary(self, path, request, metadata, deadline, opened, capped) -> UnaryResult:
        if len(request) > self.limits.max_send_message_bytes:
            return UnaryResult(
                StatusCode.RESOURCE_EXHAUSTED,
                f"request of {len(request)} bytes is larger than the channel's maximum "
                f"{self.limits.max_send_message_bytes} ({self._send_setting})",
                reached_server=False,
            )
        stream = None
        slots = self._slots if capped else None
        if slots is not None:
            try:
                slots.acquire_nowait()  # no checkpoint here: the call waits for its answer
            except trio.WouldBlock:
                await slots.acquire()
        try:
            for attempt in (1, 2):
                try:
                    conn = await self._connection(capped)
                except _Unreachable as e:
                    return UnaryResult(StatusCode.UNAVAILABLE, str(e), reached_server=False)
                block = self._block(path, metadata, deadline)
                stream = conn.open_stream(block, deadline=deadline, unary=True)
                if opened is not None:
                    opened.append(stream)
                try:
                    await stream.send(request, end=True)
                except CallEnded:
                    pass
                await stream.wait_done()
                if stream.reached_server or attempt == 2:
                    break
                # Refused unprocessed by a server that is up (GOAWAY past it, a connection
                # rotated or idle-closed; REFUSED_STREAM): once more, on a connection that
                # takes calls, as gRPC's transparent retry does. (Not sent: should the
                # deadline come while it reconnects, the call did not reach the server.)
                if opened is not None:
                    opened.clear()
        finally:
            if stream is not None and not stream.done:
                stream.cancel(StatusCode.DEADLINE_EXCEEDED)  # or an outer cancel
            if slots is not None:
                slots.release()
        return unary_result(stream)

    @asynccontextmanager
    async def stream(
        self,
        path: str,
        *,
        metadata: Metadata = (),
        timeout: float | None = None,
    ) -> AsyncIterator[StreamingCall]:
        """A bidirectional-streaming call: ``send``, ``end`` (half-close), ``async for``
        the responses; its status once the iteration ends. Leaving the block before
        the call has ended cancels it (RST_STREAM CANCEL, status CANCELLED). The
        deadline (``timeout``) covers the whole call, waiting for a slot included."""
        deadline = math.inf if timeout is None else trio.current_time() + timeout
        call = StreamingCall(deadline)
        acquired = False
        try:  # (the slot is given back whatever ends the call: a cancel while connecting)
            try:
                with trio.move_on_at(deadline):
                    await self._slots.acquire()
                    acquired = True
                    conn = await self._connection()
                    block = self._block(path, metadata, deadline)
                    call._stream = conn.open_stream(block, deadline=deadline)
                    conn.flush()
                if call._stream is None:
                    call._failed(StatusCode.DEADLINE_EXCEEDED, DEADLINE_MESSAGE)
            except _Unreachable as e:
                call._failed(StatusCode.UNAVAILABLE, str(e), reached_server=False)
            yield call
        finally:
            if call._stream is not None:
                call._stream.cancel()
            if acquired:
                self._slots.release()

    # -- the pool -------------------------------------------------------------------------

    async def _connection(self, capped: bool = True) -> ClientConnection:
        """A connection with room for one more stream: the least loaded, or a new one
        (see ClientLimits); waits while every connection is full, unless not ``capped``:
        then any with room, or else a spare connection beyond ``max_connections``, kept
        apart from the pool (capped calls never use it; not counted in ``opened``).
        Raises _Unreachable."""
        limits = self.limits
        while True:
            if self.closed or self._nursery is None:
                raise _Unreachable(
                    "the channel is closed" if self.closed else "the channel is not running"
                )
            best = None
            for conn in self.connections:
                if conn.available and (best is None or conn.load < best.load):
                    best = conn
            if best is not None and (best.load < limits.streams_per_connection or not capped):
                return best
            live = [c for c in self.connections if not c.draining]  # (GOAWAY: finishing)
            # A server whose SETTINGS allow no stream now (MAX_CONCURRENT_STREAMS 0): its
            # calls wait for them to change (RFC 9113 §5.1.2; as gRPC clients queue them)
            # rather than open a stream it refuses, or a connection after another.
            refusing = any(c.peer_max_streams == 0 for c in live)
            if len(live) + self._opening < limits.max_connections and not refusing:
                conn = await self._open()
                if conn.available:
                    return conn
                continue
            if not capped and not refusing:
                spare = self._spare
                if spare is not None and spare.available:
                    return spare
                if spare is not None and not spare.draining and spare.peer_max_streams == 0:
                    await self._changed.park()
                    continue
                opening = self._spare_opening
                if opening is not None:  # (one open at a time: its failure is everyone's)
                    await opening.done.wait()
                    if opening.error is not None:
                        raise _Unreachable(opening.error)
                    continue
                if spare is not None:
                    spare.close()  # (GOAWAY: what it carries finishes)
                self._spare_opening = opening = _Opening()
                try:
                    spare = self._spare = await self._open(pooled=False)
                except _Unreachable as e:
                    opening.error = str(e)
                    raise
                finally:
                    self._spare_opening = None
                    opening.done.set()
                if spare.available:
                    return spare
                continue
            if best is not None and not self._opening:
                return best  # every connection is busy and no more may be opened
            await self._changed.park()  # for the connection being opened, or a free stream

    async def _open(self, pooled: bool = True) -> ClientConnection:
        """A new connection, once the server's SETTINGS arrived (so its stream limit
        and windows are known before streams are opened on it); in the pool unless
        not ``pooled``."""
        limits = self.limits
        where = f"{self.host}:{self.port}"
        self._opening += pooled
        conn = None
        try:
            with trio.move_on_after(limits.connect_timeout) as timer:
                try:
                    stream = await connect(self.host, self.port, self.tls, self.server_hostname)
                except (OSError, ssl.SSLError, trio.BrokenResourceError) as e:
                    raise _Unreachable(f"cannot connect to {where}: {_why(e)}") from None
                conn = ClientConnection(
                    stream,
                    stream_window=2 * limits.max_receive_message_bytes,  # (capped there)
                    max_send=limits.max_send_message_bytes,
                    max_receive=limits.max_receive_message_bytes,
                    on_change=self._on_change,
                    accept_compressed=limits.accept_compressed,
                    send_setting=self._send_setting,
                    receive_setting=limits.message_setting
                    or "ClientLimits.max_receive_message_bytes",
                )
                self._nursery.start_soon(conn.run)
                await conn.ready.wait()
            if timer.cancelled_caught:
                raise _Unreachable(
                    f"cannot connect to {where} within {limits.connect_timeout:g} s "
                    "(ClientLimits.connect_timeout)"
                )
            if conn.closed or conn.draining:  # (a GOAWAY with its settings: takes none)
                raise _Unreachable(f"the connection to {where} ended before HTTP/2 settings")
        except BaseException:
            if conn is not None:
                conn.close()  # it never served: GOAWAY, closed
            raise
        finally:
            self._opening -= pooled
            self._changed.unpark_all()
        if pooled:
            self.connections.append(conn)
            self.opened += 1
        return conn

    def _on_change(self, conn: ClientConnection) -> None:
        if conn.closed:
            if conn in self.connections:
                self.connections.remove(conn)
            elif conn is self._spare:
                self._spare = None
        self._changed.unpark_all()

    def _block(self, path: str, metadata: Metadata, deadline: float) -> bytes:
        """The request's header block: prebuilt per path, then grpc-timeout and
        metadata as literals."""
        block = self._blocks.get(path)
        if block is None:
            if len(self._blocks) >= 1024:
                self._blocks.clear()
            block = self._blocks[path] = F.header_block(
                [(b":method", b"POST"), (b":scheme", self._scheme), (b":path", path.encode())]
                + self._common
            )
        if deadline == math.inf and not metadata:
            return block
        extra = []
        if deadline != math.inf:
            extra.append((b"grpc-timeout", grpc_timeout(deadline - trio.current_time())))
        for name, value in metadata:
            extra.append((name.lower().encode("latin-1"), value.encode("latin-1")))
        return block + F.header_fields(extra)


@asynccontextmanager
async def open_channel(
    host: str,
    port: int,
    *,
    tls: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
    limits: ClientLimits = ClientLimits(),  # noqa: B008 (frozen)
) -> AsyncIterator[Channel]:
    """A running :class:`Channel` for the block's duration (closed on exit). An
    exception raised in the block comes out as itself, not in an exception group (the
    channel's own tasks raise none)."""
    channel = Channel(host, port, tls=tls, server_hostname=server_hostname, limits=limits)
    with nursery_unwrapped():
        async with trio.open_nursery() as nursery:
            await nursery.start(channel.run)
            try:
                yield channel
            finally:
                await channel.aclose()


def grpc_timeout(seconds: float) -> bytes:
    """A grpc-timeout header value: at most 8 digits and a unit, rounded up."""
    seconds = max(seconds, 0.0)
    for unit, scale in ((b"u", 1e6), (b"m", 1e3), (b"S", 1.0), (b"M", 1 / 60), (b"H", 1 / 3600)):
        value = math.ceil(seconds * scale)
        if value < 100_000_000:
            return b"%d" % max(value, 1) + unit
    return b"99999999H"


def _why(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    if isinstance(error, trio.BrokenResourceError) and error.__cause__ is not None:
        return str(error.__cause__)
    return str(error) or type(error).__name__
