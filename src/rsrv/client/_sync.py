"""A synchronous facade of :class:`InferenceClient` for code that does not run trio.

It owns exactly one thread: a daemon thread running a trio loop that holds the client's
channel. Each method hands its call to that loop and blocks until it returns;
:meth:`SyncInferenceClient.close` (or leaving ``with``) closes the channel and joins
the thread. No other thread is started, here or in the transport.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import trio

from rsrv.client._inference import InferenceClient

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
    "infer",
    "register_system_shared_memory",
    "unregister_system_shared_memory",
    "system_shared_memory_status",
)


class SyncInferenceClient:
    """``InferenceClient``'s unary calls, blocking (same arguments, results and
    ``InferenceServerError``s). Connects on construction (the constructor takes
    ``InferenceClient``'s arguments); safe to call from several threads at once (the
    calls run concurrently on the one trio loop). Streaming is async only.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 8001, **kwargs: Any):
        self._client = InferenceClient(host, port, **kwargs)
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="rsrv-client", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as e:  # surfaced by the constructor
            self._error = e
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with self._client:
            self._ready.set()
            await self._stop.wait()

    def _run(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if self._token is None or not self._thread.is_alive():
            raise RuntimeError("the client is closed")
        method = getattr(self._client, name)
        return trio.from_thread.run(
            functools.partial(method, *args, **kwargs), trio_token=self._token
        )

    def close(self) -> None:
        """Close the channel and join the client's thread (idempotent)."""
        if self._thread.is_alive() and self._token is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join()
        self._token = None

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
