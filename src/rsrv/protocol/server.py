"""The gRPC transport: purerpc, hardened for serving.

purerpc 0.8 is a clean HTTP/2 gRPC implementation with gaps that matter to a server,
each closed here by a small subclass rather than a fork:

* its ``Server`` binds every interface (and sets SO_REUSEPORT, so two servers can silently
  share a port): :class:`GrpcServer` binds the configured host only;
* an oversized message raises inside the connection loop and drops the whole HTTP/2
  connection (purerpc issue #18): :class:`_ReadBuffer` discards that message's bytes and
  hands the stream a marker, so only that call fails with RESOURCE_EXHAUSTED;
* a gzip-compressed message is inflated as zlib, and any decompression error (or an
  unknown ``grpc-encoding``) drops the connection too: gzip and deflate are inflated
  here, up to the message limit, and a failure fails only that call;
* a request that is not a valid protobuf becomes CANCELLED with a Python repr: it is
  INVALID_ARGUMENT here;
* the HTTP/2 window is ``2 x max_message_length``, which overflows 2**31-1 for large
  limits: :class:`_Connection` caps it;
* a handler exception becomes CANCELLED with a Python repr, and grpc-timeout is parsed but
  not enforced: :func:`_guard` maps every exception to its status and enforces the deadline
  (a streaming handler enforces its own: ModelStreamInfer).
"""

from __future__ import annotations

import contextvars
import functools
import logging
import math
import struct
import zlib
from collections.abc import Callable
from contextlib import AsyncExitStack

import anyio
import purerpc
import trio
from google.protobuf.message import DecodeError
from h2.settings import SettingCodes, Settings
from purerpc.grpc_proto import GRPCProtoSocket, GRPCProtoStream
from purerpc.grpc_socket import SocketWrapper
from purerpc.grpclib.buffers import MessageReadBuffer
from purerpc.grpclib.config import GRPCConfiguration
from purerpc.grpclib.connection import GRPCConnection
from purerpc.grpclib.events import MessageReceived, RequestReceived
from purerpc.grpclib.exceptions import MessageTooLargeError, RpcFailedError
from purerpc.grpclib.status import Status, StatusCode
from purerpc.rpc import Cardinality
from purerpc.server import BoundRPCMethod, ConnectionHandler

from rsrv.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from rsrv.protocol.status import to_rpc_error

log = logging.getLogger(__name__)

MAX_WINDOW = 2**31 - 1  # the largest HTTP/2 flow-control window

#: Absolute trio deadline of the current call (from grpc-timeout), or inf.
call_deadline: contextvars.ContextVar[float] = contextvars.ContextVar(
    "call_deadline", default=math.inf
)


class _Failed(bytes):
    """Stands in for a message that cannot be delivered (too large, undecodable): the
    stream fails with ``status``, the connection and its other calls carry on."""

    status: Status


def _failed(code: StatusCode, message: str) -> _Failed:
    marker = _Failed()
    marker.status = Status(code, message)
    return marker


def _too_large(size: int | str, limit: int) -> _Failed:
    return _failed(
        StatusCode.RESOURCE_EXHAUSTED,
        f"received message of {size} bytes, larger than the maximum {limit} "
        "(endpoints.max_message_bytes)",
    )


class _ReadBuffer(MessageReadBuffer):
    """Like purerpc's, but a message that cannot be delivered fails only its stream.

    An oversized message is discarded instead of raising: discarded bytes are reported in
    ``discarded_flow`` so the connection acknowledges them at once (a message larger than
    the HTTP/2 window must not stall the peer). The stream then receives a
    :class:`_Failed` marker in the message's place; so does a compressed message that
    cannot be decompressed (purerpc inflates gzip as zlib and raises inside the
    connection loop, dropping the connection), uses an unsupported encoding, or inflates
    past the limit.
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
            return _too_large(self._oversize, self._max_message_length), 0
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
            data = self._inflate(data)
        self._compressed_flag = self._message_length = self._flow_controlled_length = None
        return data, flow

    def _inflate(self, data: bytes) -> bytes:
        encoding = self._message_encoding
        if encoding not in ("gzip", "deflate"):
            return _failed(
                StatusCode.UNIMPLEMENTED,
                f"message compressed with {encoding!r}; rsrv accepts gzip and "
                "deflate (or no compression)",
            )
        limit = self._max_message_length
        inflater = zlib.decompressobj(32 + zlib.MAX_WBITS)  # zlib or gzip header
        try:
            out = inflater.decompress(data, limit + 1)
        except zlib.error as e:
            return _failed(StatusCode.INTERNAL, f"cannot decompress the {encoding} message: {e}")
        if len(out) > limit:
            return _too_large(f"more than {limit} (decompressed)", limit)
        return out


class _Connection(GRPCConnection):
    def _set_h2_connection_local_settings(self):
        # purerpc's own settings would ask for a 2 x max_message_length window, which h2
        # refuses above 2**31-1: build them whole, with the window capped.
        self.h2_connection.local_settings = Settings(
            client=self.config.client_side,
            initial_values={
                SettingCodes.MAX_CONCURRENT_STREAMS: self.MAX_CONCURRENT_STREAMS,
                SettingCodes.INITIAL_WINDOW_SIZE: min(
                    2 * self.config.max_message_length, MAX_WINDOW
                ),
                SettingCodes.MAX_FRAME_SIZE: self.MAX_INBOUND_FRAME_SIZE,
                SettingCodes.MAX_HEADER_LIST_SIZE: self.MAX_HEADER_LIST_SIZE,
            },
        )
        self.h2_connection.max_inbound_frame_size = self.MAX_INBOUND_FRAME_SIZE

    def _request_received(self, event):
        events = super()._request_received(event)
        self.message_read_buffers[event.stream_id] = _ReadBuffer(
            events[0].message_encoding, self.config.max_message_length
        )
        return events

    def _data_received(self, event):
        events = super()._data_received(event)
        buffer = self.message_read_buffers.get(event.stream_id)
        if buffer is not None and buffer.discarded_flow:
            self.h2_connection.acknowledge_received_data(buffer.discarded_flow, event.stream_id)
            buffer.discarded_flow = 0
        return events


class _Stream(GRPCProtoStream):
    async def send_message(self, message):
        # purerpc's writer enforces the message limit but its error would reach the
        # client as CANCELLED with a repr; nothing has been written when it raises.
        try:
            await super().send_message(message)
        except MessageTooLargeError:
            limit = self._grpc_connection.config.max_message_length
            raise RpcFailedError(
                Status(
                    StatusCode.RESOURCE_EXHAUSTED,
                    f"response of {message.ByteSize()} bytes exceeds the maximum {limit} "
                    "(endpoints.max_message_bytes)",
                )
            ) from None

    async def receive_event(self):
        event = await super(GRPCProtoStream, self)._receive()
        if isinstance(event, MessageReceived):
            if isinstance(event.data, _Failed):
                raise RpcFailedError(event.data.status)
            if hasattr(self, "_incoming_message_type"):
                message = self._incoming_message_type()
                try:
                    message.ParseFromString(event.data)
                except DecodeError as e:  # purerpc would answer CANCELLED + a traceback
                    raise RpcFailedError(
                        Status(
                            StatusCode.INVALID_ARGUMENT,
                            f"cannot parse the request as {message.DESCRIPTOR.full_name}: {e}",
                        )
                    ) from None
                event.data = message
        return event


class _Socket(GRPCProtoSocket):
    StreamClass = _Stream

    def __init__(self, config: GRPCConfiguration, sock, receive_buffer_size=1024 * 1024):
        # GRPCSocket.__init__ (purerpc 0.8) with our connection class: the base would
        # first build a plain GRPCConnection, whose settings fail for large limits.
        AsyncExitStack.__init__(self)
        self._grpc_connection = _Connection(config=config)
        self._socket = SocketWrapper(self._grpc_connection, sock)
        self._receive_buffer_size = receive_buffer_size
        self._streams = {}


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

    def check_open(self) -> None:
        if self.closed:
            raise Unavailable("server is shutting down")

    def __enter__(self):
        self.check_open()
        if self.limit and self.inflight >= self.limit:
            self.shed += 1
            raise ResourceExhausted(
                f"server is at its in-flight limit of {self.limit} "
                "requests (endpoints.max_concurrent_requests)"
            )
        self.inflight += 1

    def __exit__(self, *exc):
        self.inflight -= 1


def guard_service(service: purerpc.Service, admission: Admission) -> purerpc.Service:
    """Wrap every method: unary calls get admission, their deadline and status mapping;
    streams get status mapping and are refused once the server shuts down."""
    wrapped = purerpc.Service(service.name)
    for name, bound in service.methods.items():
        streaming = bound.signature.cardinality in (
            Cardinality.UNARY_STREAM,
            Cardinality.STREAM_STREAM,
        )
        fn = _guard_stream if streaming else _guard
        wrapped.methods[name] = BoundRPCMethod(
            functools.partial(fn, bound.method_fn, admission), bound.signature
        )
    return wrapped


def deadline_of(request: RequestReceived) -> float:
    """The call's absolute trio deadline from its grpc-timeout header (inf if none)."""
    timeout = getattr(request, "timeout", None)
    return trio.current_time() + timeout.total_seconds() if timeout is not None else math.inf


async def _guard(fn: Callable, admission: Admission, message, request):
    deadline = deadline_of(request)
    token = call_deadline.set(deadline)
    try:
        with admission:
            with trio.move_on_at(deadline) as scope:
                response = await fn(message, request)
            if scope.cancelled_caught:
                raise DeadlineExceeded("deadline (grpc-timeout) expired before the call finished")
        return response  # a response above the size limit fails in _Stream.send_message
    except Exception as e:
        raise to_rpc_error(_single(e)) from None
    finally:
        call_deadline.reset(token)


async def _guard_stream(fn: Callable, admission: Admission, message, request):
    # Streams carry per-message errors in-band (ModelStreamInfer's error_message); only
    # failures of the stream itself are mapped to a status here. A stream holds no
    # admission slot (an idle open stream must not count as in flight): the handler
    # admits each request on it.
    try:
        admission.check_open()
        async for response in fn(message, request):
            yield response
    except Exception as e:
        raise to_rpc_error(_single(e)) from None


def _single(exc: BaseException) -> BaseException:
    """The error inside nested one-member exception groups: a failure that crossed
    nurseries (a stream's request pump, a meta model's calls) keeps its own status."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


class GrpcServer:
    """Serve purerpc services on ``host:port`` (port 0 picks a free port)."""

    def __init__(
        self, services: list[purerpc.Service], host: str, port: int, max_message_bytes: int
    ):
        self._services = {s.name: s for s in services}
        self.host, self.port = host, port
        self.max_message_bytes = max_message_bytes

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled; ``task_status.started(port)`` once accepting."""
        listener = await anyio.create_tcp_listener(local_host=self.host, local_port=self.port)
        async with listener:
            self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
            task_status.started(self.port)
            await listener.serve(_Handler(self._services, self, self.max_message_bytes))
