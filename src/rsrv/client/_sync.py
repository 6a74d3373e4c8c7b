"""A synchronous facade of :class:`InferenceClient` for code that does not run trio.

It owns exactly one thread: a daemon thread running a trio loop that holds the client's
channel. Each method hands its call to that loop and blocks until it returns;
:meth:`SyncInferenceClient.close` (or leaving ``with``) ends the calls still running
(InferenceServerError UNAVAILABLE "the client was closed"), closes the channel and joins
the thread, and a client dropped unclosed has its loop stopped when it is collected.
No other thread is started for an address given as an IP address; a host name is
looked up in one of trio's worker threads, which trio keeps idle for a few seconds
after the lookup and then ends.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from purerpc.grpclib.status import StatusCode

from rsrv.client._errors import InferenceServerError
from rsrv.client._inference import InferenceClient
from rsrv.client._tensors import InferResult, build_request
from rsrv.protocol.generated.inference import grpc_service_pb2 as pb

__all__ = ["SyncInferenceClient"]

#: The InferenceClient methods the facade offers, with the same arguments.
_METHODS = (
    "server_live",
    "server_ready",
    "server_metadata",
    "model_ready",
    "model_metadata",
    "model_config",
    "model_statistics",
    "repository_index",
    "load_model",
    "unload_model",
    "register_system_shared_memory",
    "unregister_system_shared_memory",
    "system_shared_memory_status",
)


class _Loop:
    """The thread's trio loop holding ``client``; apart from the facade, so that the
    thread does not keep the facade alive."""

    def __init__(self, client: InferenceClient):
        self.client = client
        self.token: trio.lowlevel.TrioToken | None = None
        self.error: BaseException | None = None
        self._stop: trio.Event | None = None
        self._calls: set[trio.CancelScope] = set()  # the facade's calls running
        self._call_ended = trio.lowlevel.ParkingLot()
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._main, name="rsrv-client", daemon=True)
        self.thread.start()
        self._ready.wait()

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as e:  # surfaced by the constructor
            self.error = e
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with self.client:
            self._ready.set()
            await self._stop.wait()
            for scope in self._calls:  # (before trio cancels them with its Cancelled)
                scope.cancel()
            while self._calls:
                await self._call_ended.park()

    async def call(self, fn: Callable[[], Awaitable[Any]], scope: trio.CancelScope) -> Any:
        """Run one facade call on the loop, within ``scope`` (see :meth:`cancel`). One
        the client's closing cuts short (waiting between retries, for a connection, for
        its answer) raises InferenceServerError UNAVAILABLE, never trio's Cancelled into
        the caller's thread."""
        started = not self._stop.is_set()
        if started:
            with scope:
                self._calls.add(scope)
                try:
                    return await fn()
                finally:
                    self._calls.discard(scope)
                    self._call_ended.unpark_all()
        # (cut short by the close, the scope having swallowed its Cancelled: it may have
        # been processed; never started: certainly not)
        raise InferenceServerError(
            StatusCode.UNAVAILABLE, "the client was closed", reached_server=started
        )

    def stop(self) -> None:
        """Ask the loop to close the channel and end; from any thread, without waiting."""
        self._soon(lambda: self._stop.set())

    def cancel(self, scope: trio.CancelScope) -> None:
        """Cancel a call's ``scope`` on the loop (its stream is reset); from any thread,
        without waiting."""
        self._soon(scope.cancel)

    def _soon(self, fn: Callable[[], object]) -> None:
        if self.token is not None:
            try:
                self.token.run_sync_soon(fn)
            except trio.RunFinishedError:
                pass


class SyncInferenceClient:
    """``InferenceClient``'s unary calls, blocking (same arguments, results and
    ``InferenceServerError``s). The constructor takes ``InferenceClient``'s arguments
    and starts the client's trio loop; the connection opens at the first call (a wrong
    address fails that call, after its retries); safe to call from several threads at once (the
    calls run concurrently on the one trio loop). Streaming is async only. Its methods
    block, so a trio task must not call them (trio raises RuntimeError); :meth:`close`
    works from any thread.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 8001, **kwargs: Any):
        self._loop = _Loop(InferenceClient(host, port, **kwargs))
        if self._loop.error is not None:
            self._loop.thread.join()
            raise self._loop.error
        self._finalizer = weakref.finalize(self, self._loop.stop)

    def _run(self, name: str, *args: Any, **kwargs: Any) -> Any:
        loop = self._loop
        if loop.token is None or not loop.thread.is_alive():
            raise RuntimeError("the client is closed")
        method = functools.partial(getattr(loop.client, name), *args, **kwargs)
        scope = trio.CancelScope()
        try:
            return trio.from_thread.run(loop.call, method, scope, trio_token=loop.token)
        except trio.RunFinishedError:
            raise RuntimeError("the client is closed") from None
        except BaseException as e:
            if not isinstance(e, Exception):  # interrupted (Ctrl-C): ends on the loop too
                loop.cancel(scope)
            raise

    def infer(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> InferResult:
        """``InferenceClient.infer`` (the same arguments), blocking: the request is
        encoded and the answer parsed in the calling thread (on the client's loop they
        held up every other thread's call, beyond its timeout); ``timeout`` covers the
        encoding too."""
        start = time.monotonic()
        payload = build_request(*args, **kwargs).SerializeToString()
        left = None if timeout is None else timeout - (time.monotonic() - start)
        response = self._run("infer_serialized", payload, timeout=left)
        return InferResult(pb.ModelInferResponse.FromString(response))

    def close(self) -> None:
        """Close the channel and join the client's thread (idempotent)."""
        self._finalizer.detach()
        self._loop.stop()
        if self._loop.thread is not threading.current_thread():
            self._loop.thread.join()
        self._loop.token = None

    def __enter__(self) -> SyncInferenceClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _blocking(name: str):
    original = getattr(InferenceClient, name)

    @functools.wraps(original)
    def method(self: SyncInferenceClient, *args: Any, **kwargs: Any) -> Any:
        return self._run(name, *args, **kwargs)

    return method


for _name in _METHODS:
    setattr(SyncInferenceClient, _name, _blocking(_name))
