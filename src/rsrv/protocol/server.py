"""The gRPC transport: purerpc, hardened for serving.

purerpc 0.8 is a clean HTTP/2 gRPC implementation with four gaps that matter to a
server, each closed here by a small subclass rather than a fork:

* its ``Server`` binds every interface (and sets SO_REUSEPORT, so two servers can silently
  share a port): :class:`GrpcServer` binds the configured host only;
* an oversized message raises inside the connection loop and drops the whole HTTP/2
  connection (purerpc issue #18): :class:`_ReadBuffer` discards that message's bytes and
  hands the stream a marker, so only that call fails with RESOURCE_EXHAUSTED;
* the HTTP/2 window is ``2 x max_message_length``, which overflows 2**31-1 for large
  limits: :class:`_Connection` caps it;
* a handler exception becomes CANCELLED with a Python repr, and grpc-timeout is parsed but
  not enforced: :func:`_guard` maps every exception to its status and enforces the deadline.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import math
import struct
from collections.abc import Callable

import anyio
import purerpc
import trio
from purerpc.grpc_proto import GRPCProtoSocket, GRPCProtoStream
from purerpc.grpc_socket import SocketWrapper
from purerpc.grpclib.buffers import MessageReadBuffer
from purerpc.grpclib.config import GRPCConfiguration
from purerpc.grpclib.connection import GRPCConnection
from purerpc.grpclib.events import MessageReceived, RequestReceived
from purerpc.grpclib.exceptions import RpcFailedError
from purerpc.grpclib.status import Status, StatusCode
from purerpc.rpc import Cardinality
from purerpc.server import BoundRPCMethod, ConnectionHandler

from rsrv.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from rsrv.protocol.status import to_rpc_error

log = logging.getLogger(__name__)

MAX_WINDOW = 2**31 - 1  # the largest HTTP/2 flow-control window

#: Absolute trio deadline of the current call (from grpc-timeout), or inf.
call_deadline: contextvars.ContextVar[float] = contextvars.ContextVar(
    "call_deadline", default=math.inf)


class _Oversize(bytes):
    """Stands in for a discarded message that exceeded the limit."""

    size: int


class _ReadBuffer(MessageReadBuffer):
    """Like purerpc's, but an oversized message is discarded instead of raising.

    Discarded bytes are reported in ``discarded_flow`` so the connection acknowledges
    them at once (a message larger than the HTTP/2 window must not stall the peer); the
    stream then receives an :class:`_Oversize` marker in the message's place.
    """

    def __init__(self, message_encoding, max_message_length):
        super().__init__(message_encoding, max_message_length)
        self._skip = 0  # bytes of an oversized message still to discard
        self._oversize = 0
        self.discarded_flow = 0

    def _parse_one_message(self):
        if self._skip:
            take = min(self._skip, len(self._buffer))
            if take:
                self.discarded_flow += self._buffer.popleft_flowcontrol(take)[1]
                self._skip -= take
            if self._skip:
                return None, 0
            marker = _Oversize()
            marker.size = self._oversize
            return marker, 0
        if self._message_length is None:
            if len(self._buffer) < 5:
                return None, 0
            header, self._flow_controlled_length = self._buffer.popleft_flowcontrol(5)
            self._compressed_flag, self._message_length = struct.unpack(">?I", header)
            if self._message_length > self._max_message_length:
                self.discarded_flow += self._flow_controlled_length
                self._skip = self._oversize = self._message_length
                self._compressed_flag = self._message_length = self._flow_controlled_length = None
                return self._parse_one_message()
        if len(self._buffer) < self._message_length:
            return None, 0
        data, flow = self._buffer.popleft_flowcontrol(self._message_length)
        flow += self._flow_controlled_length
        if self._compressed_flag:
            data = self.decompress(data)
        self._compressed_flag = self._message_length = self._flow_controlled_length = None
        return data, flow


class _Connection(GRPCConnection):
    def _set_h2_connection_local_settings(self):
        super()._set_h2_connection_local_settings()
        from h2.settings import SettingCodes

        window = min(2 * self.config.max_message_length, MAX_WINDOW)
        self.h2_connection.local_settings[SettingCodes.INITIAL_WINDOW_SIZE] = window

    def _request_received(self, event):
        events = super()._request_received(event)
        self.message_read_buffers[event.stream_id] = _ReadBuffer(
            events[0].message_encoding, self.config.max_message_length)
        return events

    def _data_received(self, event):
        events = super()._data_received(event)
        buffer = self.message_read_buffers.get(event.stream_id)
        if buffer is not None and buffer.discarded_flow:
            self.h2_connection.acknowledge_received_data(buffer.discarded_flow, event.stream_id)
            buffer.discarded_flow = 0
        return events


class _Stream(GRPCProtoStream):
    async def receive_event(self):
        event = await super(GRPCProtoStream, self)._receive()
        if isinstance(event, MessageReceived):
            if isinstance(event.data, _Oversize):
                limit = self._grpc_connection.config.max_message_length
                raise RpcFailedError(Status(
                    StatusCode.RESOURCE_EXHAUSTED,
                    f"received message of {event.data.size} bytes, larger than the maximum "
                    f"{limit} (endpoints.max_message_bytes)"))
            if hasattr(self, "_incoming_message_type"):
                message = self._incoming_message_type()
                message.ParseFromString(event.data)
                event.data = message
        return event


class _Socket(GRPCProtoSocket):
    StreamClass = _Stream

    def __init__(self, config: GRPCConfiguration, sock):
        super().__init__(config, sock)
        self._grpc_connection = _Connection(config=config)
        self._socket = SocketWrapper(self._grpc_connection, sock)


class _Handler(ConnectionHandler):
    def __init__(self, services: dict, server, max_message_bytes: int):
        super().__init__(services, server)
        self.config = GRPCConfiguration(client_side=False, max_message_length=max_message_bytes)

    async def __call__(self, stream_):
        try:
            async with _Socket(self.config, stream_) as grpc_socket:
                async with anyio.create_task_group() as tg:
                    async for stream in grpc_socket.listen():
                        tg.start_soon(self.request_received, stream)
        except (anyio.BrokenResourceError, anyio.EndOfStream, ConnectionError):
            pass  # the client went away
        except Exception:
            log.warning("gRPC connection failed", exc_info=True)


class Admission:
    """The in-flight cap (``endpoints.max_concurrent_requests``; 0 = uncapped)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.inflight = 0
        self.shed = 0
        self.closed = False

    def close(self) -> None:
        """Refuse every new call from now on (graceful shutdown)."""
        self.closed = True

    def __enter__(self):
        if self.closed:
            raise Unavailable("server is shutting down")
        if self.limit and self.inflight >= self.limit:
            self.shed += 1
            raise ResourceExhausted(f"server is at its in-flight limit of {self.limit} "
                                    "requests (endpoints.max_concurrent_requests)")
        self.inflight += 1

    def __exit__(self, *exc):
        self.inflight -= 1


def guard_service(service: purerpc.Service, admission: Admission | None,
                  max_message_bytes: int) -> purerpc.Service:
    """Wrap every method: admission, deadline, status mapping, response size."""
    wrapped = purerpc.Service(service.name)
    for name, bound in service.methods.items():
        streaming = bound.signature.cardinality in (Cardinality.UNARY_STREAM,
                                                   Cardinality.STREAM_STREAM)
        fn = _guard_stream if streaming else _guard
        wrapped.methods[name] = BoundRPCMethod(
            functools.partial(fn, bound.method_fn, admission, max_message_bytes), bound.signature)
    return wrapped


def _deadline_of(request: RequestReceived) -> float:
    timeout = getattr(request, "timeout", None)
    return trio.current_time() + timeout.total_seconds() if timeout is not None else math.inf


async def _guard(fn: Callable, admission: Admission | None, max_bytes: int, message, request):
    deadline = _deadline_of(request)
    token = call_deadline.set(deadline)
    try:
        with admission if admission is not None else _nullcontext():
            with trio.move_on_at(deadline) as scope:
                response = await fn(message, request)
            if scope.cancelled_caught:
                raise DeadlineExceeded("deadline (grpc-timeout) expired before the call finished")
        if response.ByteSize() > max_bytes:
            raise ResourceExhausted(f"response of {response.ByteSize()} bytes exceeds the maximum "
                                    f"{max_bytes} (endpoints.max_message_bytes)")
        return response
    except RpcFailedError:
        raise
    except Exception as e:
        raise to_rpc_error(e) from None
    finally:
        call_deadline.reset(token)


async def _guard_stream(fn: Callable, admission: Admission | None, max_bytes: int,
                        message, request):
    # Streams carry per-message errors in-band (ModelStreamInfer's error_message); only
    # failures of the stream itself are mapped to a status here.
    try:
        with admission if admission is not None else _nullcontext():
            async for response in fn(message, request):
                yield response
    except RpcFailedError:
        raise
    except Exception as e:
        raise to_rpc_error(e) from None


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class GrpcServer:
    """Serve purerpc services on ``host:port`` (port 0 picks a free port)."""

    def __init__(self, services: list[purerpc.Service], host: str, port: int,
                 max_message_bytes: int):
        self._services = {s.name: s for s in services}
        self.host, self.port = host, port
        self.max_message_bytes = max_message_bytes
        self._exception_count = 0  # ConnectionHandler bookkeeping
        self._connection_count = 0

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled; ``task_status.started(port)`` once accepting."""
        listener = await anyio.create_tcp_listener(local_host=self.host, local_port=self.port)
        async with listener:
            self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
            task_status.started(self.port)
            await listener.serve(_Handler(self._services, self, self.max_message_bytes))
