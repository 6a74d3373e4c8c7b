"""An in-process gRPC server on rsrv's own transport (``GrpcServer``) with raw-bytes test
methods, for the transport's client tests and the channel benchmark.

:func:`echo_server` runs it in the caller's trio loop on 127.0.0.1 and yields an
:class:`EchoServer` holding the port and what the handlers saw (calls started, in flight
at once, cancelled), so a test can check what reached the server application.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
from purerpc.grpclib.status import StatusCode

from rsrv.transport import GrpcServer, MessageError, Method, TransportLimits

SERVICE = "/rsrv.test.Echo/"
UNARY = SERVICE + "Unary"  # answers the request's bytes
SLEEP = SERVICE + "Sleep"  # sleeps float(request) seconds (inf: until cancelled), answers b"slept"
HOLD = SERVICE + "Hold"  # waits until EchoServer.release is set, answers b"held"
FAIL = SERVICE + "Fail"  # request b"CODE:message": fails with that status (e.g. b"5:gone")
SIZED = SERVICE + "Sized"  # answers int(request) bytes
STREAM = SERVICE + "Stream"  # bidirectional: answers every message as it comes
STREAM_SIZED = SERVICE + "StreamSized"  # bidirectional: answers int(message) bytes to each
HEADERS = SERVICE + "Headers"  # answers the call's metadata and deadline (see _headers)


def _same(data: bytes) -> bytes:
    return data


class EchoServer:
    """Counters of the handlers, and the server once it runs."""

    def __init__(self) -> None:
        self.server: GrpcServer | None = None
        self.port = 0
        self.started = 0  # calls whose handler began
        self.active = 0  # handlers running now
        self.max_active = 0
        self.cancelled = 0  # handlers ended by cancellation (RST_STREAM, deadline, close)
        self.release = trio.Event()  # HOLD calls answer once set

    def methods(self) -> list[Method]:
        return [
            Method(UNARY, self._tracked(self._unary), _same, _same),
            Method(SLEEP, self._tracked(self._sleep), _same, _same),
            Method(HOLD, self._tracked(self._hold), _same, _same),
            Method(FAIL, self._tracked(self._fail), _same, _same),
            Method(SIZED, self._tracked(self._sized), _same, _same),
            Method(HEADERS, self._headers, _same, _same),
            Method(
                STREAM,
                self._stream,
                _same,
                _same,
                client_streaming=True,
                server_streaming=True,
            ),
            Method(
                STREAM_SIZED,
                self._stream_sized,
                _same,
                _same,
                client_streaming=True,
                server_streaming=True,
            ),
        ]

    def _tracked(self, handler):
        async def run(request: bytes, call) -> bytes:
            self.started += 1
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            try:
                return await handler(request)
            except trio.Cancelled:
                self.cancelled += 1
                raise
            finally:
                self.active -= 1

        return run

    async def _unary(self, request: bytes) -> bytes:
        return request

    async def _sleep(self, request: bytes) -> bytes:
        await trio.sleep(float(request) if request else math.inf)
        return b"slept"

    async def _hold(self, request: bytes) -> bytes:
        await self.release.wait()
        return b"held"

    async def _fail(self, request: bytes) -> bytes:
        code, _, message = request.decode().partition(":")
        raise MessageError(StatusCode(int(code)), message)

    async def _sized(self, request: bytes) -> bytes:
        return bytes(int(request))

    async def _headers(self, request: bytes, call) -> bytes:
        """``name=value`` lines of the call's metadata, sorted, then ``deadline=yes`` or
        ``deadline=no`` (whether a grpc-timeout arrived)."""
        lines = sorted(f"{k}={v}" for k, v in call.metadata.items())
        lines.append(f"deadline={'yes' if call.deadline != math.inf else 'no'}")
        return "\n".join(lines).encode()

    async def _stream_sized(self, requests, call):
        async for request in requests:
            yield bytes(int(request))

    async def _stream(self, requests, call):
        """Answers come from a task of their own, through a ``trio.as_safe_channel``
        the generator reads and yields from: it holds a nursery across its yields."""
        self.started += 1
        ended = False
        try:
            async with _echoed(requests) as answers:
                async for answer in answers:
                    yield answer
            ended = True
        finally:  # cancelled, or closed while suspended at a yield
            if not ended:
                self.cancelled += 1


@trio.as_safe_channel
async def _echoed(requests):
    send, receive = trio.open_memory_channel(0)

    async def pump() -> None:
        async with send:
            async for request in requests:
                await send.send(request)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pump)
        async with receive:
            async for answer in receive:
                yield answer


@asynccontextmanager
async def echo_server(
    *,
    port: int = 0,
    limits: TransportLimits | None = None,
    tls=None,
    state: EchoServer | None = None,
    trailers_of=None,
) -> AsyncIterator[EchoServer]:
    """Serve the test methods on 127.0.0.1:``port`` (0: a free port) for the block's
    duration; ``state`` carries counters over from an earlier server (a restart);
    ``trailers_of`` as GrpcServer takes it."""
    echo = state or EchoServer()
    server = GrpcServer(
        echo.methods(), "127.0.0.1", port, limits=limits, tls=tls, trailers_of=trailers_of
    )
    async with trio.open_nursery() as nursery:
        echo.port = await nursery.start(server.serve)
        echo.server = server
        try:
            yield echo
        finally:
            await server.close(timeout=1)
            nursery.cancel_scope.cancel()


async def wait_for(predicate, what: str = "", timeout: float = 10.0) -> None:
    """Poll ``predicate`` in trio until it is true; fail after ``timeout`` s (a hang guard
    only, never a measured time)."""
    with trio.move_on_after(timeout):
        while not predicate():
            await trio.sleep(0.002)
        return
    raise AssertionError(f"timed out waiting for {what or predicate}")
