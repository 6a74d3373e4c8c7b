"""What the clients share: :class:`ChannelClient` (a service's client on a ``Channel``),
and unary calls, protobuf in and out, retried with exponential backoff when the server
certainly never processed them."""

from __future__ import annotations

import math
import random
import ssl
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio
from purerpc.grpclib.status import StatusCode

from rsrv.client._errors import InferenceServerError
from rsrv.protocol import pushback_of
from rsrv.transport import (
    Channel,
    ClientLimits,
    StreamingCall,
    UnaryResult,
    metadata_problem,
    open_channel,
)

__all__ = ["ChannelClient", "RetryPolicy", "call_unary", "open_stream"]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retries of a call that failed UNAVAILABLE without being processed: it did not
    reach the server (refused connection, GOAWAY before it was processed,
    REFUSED_STREAM), or the server said so with a retry pushback
    (``grpc-retry-pushback-ms``: e.g. a gateway with no worker ready, a server shutting
    down) — never one the server may have processed. ``attempts`` counts the first one
    (1: never retry); attempt *n* waits ``initial_backoff * multiplier**n`` seconds
    (±20% jitter, at most ``max_backoff``), or the server's pushback when longer, before
    the next; none once the channel is closed. A call's timeout covers every attempt
    and wait. (Behind a gateway with no ready worker, the pushback is its discovery
    interval: with the defaults, 5 attempts 2 s apart, a call rides out about 8 s of no
    worker before it fails.)"""

    attempts: int = 5
    initial_backoff: float = 0.05
    max_backoff: float = 2.0
    multiplier: float = 2.0

    def backoff(self, attempt: int) -> float:
        try:
            delay = self.initial_backoff * self.multiplier**attempt
        except OverflowError:  # (a policy retrying for ever reaches large attempts)
            delay = self.max_backoff
        return min(delay * random.uniform(0.8, 1.2), self.max_backoff)


NO_RETRY = RetryPolicy(attempts=1)


async def call_unary(
    channel: Channel,
    path: str,
    payload: bytes,
    *,
    metadata: Sequence[tuple[str, str]] = (),
    timeout: float | None = None,
    retry: RetryPolicy = NO_RETRY,
) -> UnaryResult:
    """``channel.unary`` with ``retry``; the last attempt's result (never raises)."""
    deadline = math.inf if timeout is None else trio.current_time() + timeout
    attempt = 0
    while True:
        remaining = None if deadline == math.inf else deadline - trio.current_time()
        if remaining is not None and remaining <= 0:
            return UnaryResult(
                StatusCode.DEADLINE_EXCEEDED,
                "deadline exceeded (client timeout) before the server could be reached",
                reached_server=False,
            )
        result = await channel.unary(path, payload, metadata=metadata, timeout=remaining)
        attempt += 1
        pushback = pushback_of(result.trailers)
        if (
            result.status is not StatusCode.UNAVAILABLE
            or (result.reached_server and pushback is None)
            or attempt >= retry.attempts
            or channel.closed  # (the client was closed: no attempt can succeed)
        ):
            return result
        delay = max(retry.backoff(attempt - 1), pushback or 0.0)
        if trio.current_time() + delay >= deadline:
            return result
        if await _closed_during(channel, delay):
            return result


async def _closed_during(channel: Channel, seconds: float) -> bool:
    """Sleep ``seconds``, or until ``channel`` is closed (then True: a call waiting to be
    retried ends at once, not after the server's pushback, however long)."""
    with trio.move_on_after(seconds):
        await channel.wait_closed()
    return channel.closed


@asynccontextmanager
async def open_stream(
    channel: Channel,
    path: str,
    *,
    metadata: Sequence[tuple[str, str]] = (),
    timeout: float | None = None,
    retry: RetryPolicy = NO_RETRY,
) -> AsyncIterator[StreamingCall]:
    """``channel.stream`` with ``retry`` of its opening: a stream whose connection could
    not be made is opened again, as :func:`call_unary` sends a call again. Once the
    stream is open nothing is retried: what was sent on it may have been processed, and
    a refusal the server sends later (REFUSED_STREAM, GOAWAY) ends it with
    ``reached_server`` False for the caller to open another."""
    deadline = math.inf if timeout is None else trio.current_time() + timeout
    attempt = 0
    while True:
        remaining = None if deadline == math.inf else max(deadline - trio.current_time(), 0.0)
        async with channel.stream(path, metadata=metadata, timeout=remaining) as call:
            attempt += 1
            delay = None
            if (
                call.done
                and not call.reached_server
                and attempt < retry.attempts
                and not channel.closed  # (the client was closed: no attempt can succeed)
            ):
                delay = retry.backoff(attempt - 1)
            if delay is None or trio.current_time() + delay >= deadline:
                yield call
                return
        await _closed_during(channel, delay)  # (closed: the next attempt ends at once)


class ChannelClient:
    """A client of one gRPC service (``service``, its path prefix) on a
    :class:`Channel`: to ``host:port`` (``tls``: a client ``ssl.SSLContext``, verified
    against ``server_hostname`` or ``host``; ``limits``), opened on ``async with`` and
    closed on exit (entering it again while open raises RuntimeError); or a running
    ``channel`` it was given (owned by the caller; then host, port, tls and limits are
    unused and it needs no ``async with``). ``headers`` go with every call (e.g. a
    restricted protocol's header; ValueError for one a call cannot carry);
    ``retry``: see :class:`RetryPolicy`. A call that does not succeed raises
    :class:`InferenceServerError`."""

    service = ""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 8001,
        *,
        tls: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        headers: Mapping[str, str] | None = None,
        limits: ClientLimits = ClientLimits(),  # noqa: B008 (frozen)
        retry: RetryPolicy = RetryPolicy(),  # noqa: B008 (frozen)
        channel: Channel | None = None,
    ):
        if not isinstance(port, int) or isinstance(port, bool):
            raise TypeError(f"port must be an int, not {type(port).__name__}")
        if not 0 < port < 65536:
            raise ValueError(f"port {port} is not a TCP port (1 to 65535)")
        for name, value in (headers or {}).items():
            problem = metadata_problem(name, value)
            if problem is not None:
                raise ValueError(f"headers[{name!r}]: {problem}")
        self._channel = channel
        self._open = lambda: open_channel(
            host, port, tls=tls, server_hostname=server_hostname, limits=limits
        )
        self._stack: AsyncExitStack | None = None
        self._metadata = tuple((headers or {}).items())
        self.retry = retry

    async def _call(self, method: str, request: Any, response_type: Any, timeout) -> Any:
        """``method`` with protobuf ``request``: the parsed ``response_type`` message."""
        payload = request.SerializeToString()
        return response_type.FromString(await self._call_serialized(method, payload, timeout))

    async def _call_serialized(self, method: str, payload: bytes, timeout) -> bytes:
        """``method`` with a serialized request: the serialized response."""
        result = await call_unary(
            self.channel,
            self.service + method,
            payload,
            metadata=self._metadata,
            timeout=timeout,
            retry=self.retry,
        )
        if not result.ok:
            raise InferenceServerError.of(result)
        return result.response

    async def __aenter__(self):
        if self._stack is not None:
            raise RuntimeError(f"this {type(self).__name__} is open already (enter it once)")
        if self._channel is None:
            stack = AsyncExitStack()
            self._channel = await stack.enter_async_context(self._open())
            self._stack = stack  # (only once open: a failed open may be tried again)
        return self

    async def __aexit__(self, *exc) -> None:
        if self._stack is not None:
            stack, self._stack = self._stack, None
            self._channel = None
            await stack.__aexit__(*exc)

    @property
    def channel(self) -> Channel:
        if self._channel is None:
            raise RuntimeError(f"use the client as `async with {type(self).__name__}(...)`")
        return self._channel
