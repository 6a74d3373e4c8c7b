"""Clients of a running server: the tritonclient client factory and inputs, status
assertions, the control service from synchronous code, and a raw purerpc channel."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import trio
import tritonclient.grpc as grpcclient
from purerpc.grpclib.status import StatusCode
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from rsrv.client import ControlClient, InferenceServerError
from support.serving import url

# -- tritonclient ------------------------------------------------------------------------------


def connect(server, **kwargs) -> grpcclient.InferenceServerClient:
    """A tritonclient.grpc client of a running worker or :class:`ServerProcess`;
    ``kwargs`` go to the client (``ssl=True``, ``channel_args``, ...)."""
    return grpcclient.InferenceServerClient(url(server), **kwargs)


def infer_input(name: str, array: np.ndarray, datatype: str | None = None) -> grpcclient.InferInput:
    """Input tensor ``name`` holding ``array``; its datatype follows the array's dtype
    (tritonclient's own mapping) unless given."""
    tensor = grpcclient.InferInput(
        name, list(array.shape), datatype or np_to_triton_dtype(array.dtype)
    )
    tensor.set_data_from_numpy(array)
    return tensor


def index(client: grpcclient.InferenceServerClient) -> dict[str, tuple[str, str]]:
    """RepositoryIndex as {name: (state, reason)}."""
    return {m.name: (m.state, m.reason) for m in client.get_model_repository_index().models}


def stats_of(client: grpcclient.InferenceServerClient, model: str):
    """``model``'s ModelStatistics."""
    (stats,) = client.get_inference_statistics(model).model_stats
    return stats


# -- failures ------------------------------------------------------------------------------------


@contextlib.contextmanager
def raises_status(code: str, *fragments: str) -> Iterator[pytest.ExceptionInfo]:
    """Expect an InferenceServerException with gRPC status ``code`` (e.g. "NOT_FOUND")
    whose message contains every fragment."""
    with pytest.raises(InferenceServerException) as info:
        yield info
    check_error(info.value, code, *fragments)


def check_error(error: InferenceServerException, code: str, *fragments: str) -> None:
    assert error.status() == f"StatusCode.{code}", (error.status(), error.message())
    message = error.message() or ""
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert "Traceback" not in message


def failure(call: Callable[[], object]) -> tuple[str, str]:
    """(status, message) of a tritonclient call that must fail, e.g.
    ("StatusCode.NOT_FOUND", "Request for unknown model: 'b'")."""
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value.status(), info.value.message()


def status_of(call: Callable[[], object]) -> str:
    """The gRPC status a call failed with, e.g. 'StatusCode.NOT_FOUND'."""
    return failure(call)[0]


# -- the control service -------------------------------------------------------------------------


@contextlib.contextmanager
def server_error(code: StatusCode, *needles: str) -> Iterator[pytest.ExceptionInfo]:
    """``rsrv.client``'s InferenceServerError with status ``code`` and every needle in
    its message."""
    with pytest.raises(InferenceServerError) as info:
        yield info
    assert info.value.code is code, str(info.value)
    for needle in needles:
        assert needle in info.value.message, f"{needle!r} not in {info.value.message!r}"


def control(worker, method: str, *args, **kwargs):
    """``await ControlClient(...).<method>(*args, **kwargs)`` on ``worker``, from
    synchronous test code (a trio loop of the calling thread's own)."""

    async def call():
        async with ControlClient("127.0.0.1", worker.port) as client:
            return await getattr(client, method)(*args, **kwargs)

    return trio.run(call)


def model_statuses(worker) -> dict:
    """ModelControlStatus of every model, by name, through our own control client."""
    return {m.name: m for m in control(worker, "status").models}


def model_status(worker, name: str):
    """``name``'s ModelControlStatus (scheduler counters, queue depth, residency)."""
    return model_statuses(worker)[name]


# -- a raw purerpc client: no local deadline, one HTTP/2 connection -------------------------

SERVICE = "inference.GRPCInferenceService"


class RawChannel:
    """Calls over ONE purerpc connection (purerpc never reconnects). Unlike grpcio, purerpc
    sends ``grpc-timeout`` but enforces nothing itself, so a DEADLINE_EXCEEDED seen here
    was decided by the server. Failures raise purerpc's ``RpcFailedError`` (``.status``)."""

    def __init__(self, channel, port: int):
        self._channel = channel
        self._authority = f"127.0.0.1:{port}"

    async def _start(self, method: str, request_type, response_type, timeout: float | None):
        import datetime

        stream = await self._channel._grpc_socket.start_request(
            "http",
            SERVICE,
            method,
            request_type.DESCRIPTOR.full_name,
            self._authority,
            None if timeout is None else datetime.timedelta(seconds=timeout),
        )
        stream.expect_message_type(response_type)
        return stream

    async def unary(self, method: str, request, response_type, *, timeout: float | None = None):
        from purerpc.wrappers import (
            extract_message_from_singleton_stream,
            send_single_message_client,
        )

        stream = await self._start(method, type(request), response_type, timeout)
        await send_single_message_client(stream, request)
        return await extract_message_from_singleton_stream(stream)

    async def stream(
        self,
        method: str,
        requests: list,
        response_type,
        *,
        timeout: float | None = None,
        keep_open: bool = True,
    ) -> list:
        """Send ``requests`` on one stream (left open when ``keep_open``) and collect the
        responses until the server ends the stream (which raises on a non-OK status)."""
        from purerpc.wrappers import stream_to_async_iterator

        stream = await self._start(method, type(requests[0]), response_type, timeout)
        for request in requests:
            await stream.send_message(request)
        if not keep_open:
            await stream.close()
        return [response async for response in stream_to_async_iterator(stream)]


@contextlib.asynccontextmanager
async def raw_channel(worker):
    import purerpc

    async with purerpc.insecure_channel("127.0.0.1", worker.port) as channel:
        yield RawChannel(channel, worker.port)


def rpc_status(error) -> tuple[str, str]:
    """(status name, message) of a purerpc RpcFailedError."""
    return error.status.status_code.name, error.status.status_message
