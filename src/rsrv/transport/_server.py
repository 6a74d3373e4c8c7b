"""The gRPC server: listeners, TLS, connection limits, and running one call.

Services are tables of :class:`Method` (see :func:`methods_of` for purerpc servicers).
A handler raises any exception to fail its call; ``status_of`` (given by the protocol
layer) turns it into the status the client receives, so the transport never decides a
status for an application error and never sends a traceback; ``trailers_of``, when
given, adds custom trailers for it (e.g. ``grpc-retry-pushback-ms``).
"""

from __future__ import annotations

import errno
import logging
import socket
import ssl
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import purerpc
import trio
from google.protobuf.message import DecodeError
from purerpc.grpclib.exceptions import RpcFailedError
from purerpc.grpclib.status import StatusCode
from purerpc.rpc import Cardinality

from rsrv import threads
from rsrv.errors import nursery_unwrapped
from rsrv.transport._call import ServerCall
from rsrv.transport._cap import ConnectionCap
from rsrv.transport._connection import ServerConnection
from rsrv.transport._endpoint import set_keepalive
from rsrv.transport._messages import MessageError

log = logging.getLogger("rsrv.transport")

#: Compressed request messages a server inflates at once (each in a worker thread).
INFLATING_AT_ONCE = 2

#: Request messages larger than this are parsed in a worker thread (protobuf parses
#: 4 MiB in ~0.3 ms on a small VM, 64 MiB in ~33 ms; a thread hop costs 0.1-0.2 ms).
PARSE_ON_LOOP_BYTES = 4 << 20

#: accept() failures that mean "out of descriptors or memory for now": wait, retry.
_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}


@dataclass(frozen=True, slots=True)
class Method:
    """One RPC of a service.

    ``handler(request, call)`` for a unary request, ``handler(requests, call)`` with an
    async iterator of requests for a streaming one (an :class:`Unparsed` in place of a
    message that cannot be decoded: the handler may answer it and read on); it returns
    the response, or is an
    async generator of responses for a streaming response, which the server runs in a
    task of its own (``trio.as_safe_channel``), so it may hold a nursery across its
    yields. ``decode`` parses a request
    message's bytes, ``encode`` serializes a response; a handler may return (or yield)
    the response's bytes, serialized already, which go out as they are. ``parse_large``:
    ``decode`` parses (protobuf): a message above :data:`PARSE_ON_LOOP_BYTES` is parsed in a
    worker thread, so that the loop goes on serving other calls meanwhile.
    """

    path: str  # "/package.Service/Method"
    handler: Callable[..., Any]
    decode: Callable[[bytes], Any]
    encode: Callable[[Any], bytes]
    client_streaming: bool = False
    server_streaming: bool = False
    parse_large: bool = False

    async def parse(self, raw: bytes) -> Any:
        """``decode(raw)``, in a worker thread when it is large and ``parse_large``."""
        if self.parse_large and len(raw) > PARSE_ON_LOOP_BYTES:
            return await threads.run_sync(self.decode, raw)
        return self.decode(raw)


def methods_of(service: purerpc.Service) -> list[Method]:
    """The methods of a purerpc service (e.g. ``Servicer().service``)."""
    methods = []
    for name, bound in service.methods.items():
        sig = bound.signature
        card = sig.cardinality
        methods.append(
            Method(
                path=f"/{service.name}/{name}",
                handler=bound.method_fn,
                decode=request_decoder(sig.request_type),
                encode=sig.response_type.SerializeToString,
                parse_large=True,
                client_streaming=card in (Cardinality.STREAM_UNARY, Cardinality.STREAM_STREAM),
                server_streaming=card in (Cardinality.UNARY_STREAM, Cardinality.STREAM_STREAM),
            )
        )
    return methods


@dataclass(frozen=True, slots=True)
class TransportLimits:
    """What one client may hold of the server (see specs/protocol.md, Security)."""

    max_message_bytes: int = 1 << 28
    max_connections: int = 1000
    max_streams_per_connection: int = 128
    receive_timeout: float = 60.0  # a request message must arrive whole within this
    handshake_timeout: float = 10.0  # TLS + HTTP/2 preface
    idle_timeout: float = 600.0  # a connection with no call open is closed; 0: never
    # A connection's reader stops reading while more than this waits unsent to its
    # client (until half is left): a client that sends and does not read holds no more.
    max_unsent_bytes: int = 16 << 20
    # the configuration key that sets max_message_bytes, named when a message exceeds it
    message_setting: str = "endpoints.max_message_bytes"


class ListenSettings(Protocol):
    """A server's listening settings as rsrv's configuration files name them (a
    worker's ``endpoints``, a gateway's ``grpc``)."""

    max_message_bytes: int
    max_connections: int
    max_streams_per_connection: int
    receive_timeout_seconds: float
    idle_connection_seconds: float
    tls_cert_file: str | None
    tls_key_file: str | None
    tls_client_ca_file: str | None


Trailers = Sequence[tuple[str, str]]


def default_status(exc: BaseException) -> tuple[StatusCode, str]:
    """The status of an exception when the server is given no mapping."""
    if isinstance(exc, RpcFailedError):
        return exc.status.status_code, exc.status.status_message
    return StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


class GrpcServer:
    """Serve :class:`Method` tables on ``host:port`` (port 0 picks a free port).

    ``tls``: a server ``ssl.SSLContext`` (see :func:`server_tls_context`), or None for
    plaintext HTTP/2. ``status_of`` maps a handler's exception to its status, and
    ``trailers_of`` (optional) to custom trailers sent with that status (lower-case
    names, text values).
    """

    def __init__(
        self,
        methods: Iterable[Method],
        host: str,
        port: int,
        *,
        limits: TransportLimits | None = None,
        tls: ssl.SSLContext | None = None,
        status_of: Callable[[BaseException], tuple[StatusCode, str]] = default_status,
        trailers_of: Callable[[BaseException], Trailers] | None = None,
    ):
        self.methods = {m.path: m for m in methods}
        self.host, self.port = host, port
        self.limits = limits or TransportLimits()
        self.tls = tls
        self.status_of = status_of
        self.trailers_of = trailers_of
        # compressed requests inflating at once (each in a worker thread)
        self.inflating = trio.CapacityLimiter(INFLATING_AT_ONCE)
        self.cap: ConnectionCap[ServerConnection] = ConnectionCap(
            self.limits.max_connections, ServerConnection.quiet_since, log, "max_connections"
        )
        self.connections = self.cap.open  # open connections, oldest first
        self._listeners: list[trio.SocketListener] = []

    @classmethod
    def configured(
        cls,
        methods: Iterable[Method],
        host: str,
        port: int,
        settings: ListenSettings,
        *,
        status_of: Callable[[BaseException], tuple[StatusCode, str]] = default_status,
        trailers_of: Callable[[BaseException], Trailers] | None = None,
        message_setting: str = "endpoints.max_message_bytes",
    ) -> GrpcServer:
        """A server with the limits and TLS (:func:`server_tls`) of ``settings``; the
        TLS handshake must finish within the receive timeout; ``message_setting`` is
        the key of ``max_message_bytes`` in the file ``settings`` come from (named when a
        message exceeds it). Raises one of TLS_ERRORS when a TLS file cannot be read or
        used."""
        s = settings
        return cls(
            methods,
            host,
            port,
            limits=TransportLimits(
                max_message_bytes=s.max_message_bytes,
                max_connections=s.max_connections,
                max_streams_per_connection=s.max_streams_per_connection,
                receive_timeout=s.receive_timeout_seconds,
                handshake_timeout=s.receive_timeout_seconds,
                idle_timeout=s.idle_connection_seconds,
                message_setting=message_setting,
            ),
            tls=server_tls(s),
            status_of=status_of,
            trailers_of=trailers_of,
        )

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled or closed; ``task_status.started(port)`` once
        accepting. Binds the host given, nothing else (no SO_REUSEPORT); with port 0
        only the host's first address is bound. A bind that fails raises its OSError
        naming the port (:func:`listen_error`)."""
        try:
            listeners = await trio.open_tcp_listeners(self.port, host=self.host)
        except OSError as e:
            if not is_listen_error(e):
                raise
            raise listen_error(e, "gRPC", self.host, self.port) from e
        if self.port == 0:
            for extra in listeners[1:]:
                await extra.aclose()
            listeners = listeners[:1]
        self._listeners = listeners
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(self._accept, listener, nursery)
            task_status.started(self.port)

    async def close(self, timeout: float = 2.0, *, ending: BaseException | None = None) -> None:
        """Stop accepting, then close every connection: what each has queued is sent,
        then GOAWAY. Returns once they are closed (at most ``timeout`` seconds). Calls
        still running are cancelled: answer them first (the worker drains before this).
        With ``ending``, an idle stream (every request on it answered: nothing is cut
        short) is answered ``ending``'s status first, a clean end rather than its
        connection closed under it; a call still at work is not (``ending`` may say it
        was never processed: a retry pushback)."""
        for listener in self._listeners:
            await listener.aclose()
        if ending is not None:
            idle = [c for conn in self.connections for c in conn.calls.values() if c.idle]
            for call in idle:
                call.end_with(ending)
            with trio.move_on_after(timeout):
                while not all(call.closed for call in idle):
                    await trio.sleep(0.01)
        for conn in list(self.connections):
            conn.goaway()
        with trio.move_on_after(timeout):
            while self.connections:
                await trio.sleep(0.01)

    async def _accept(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as e:
                if e.errno not in _CAPACITY_ERRNOS:
                    raise
                log.error("accept failed (%s): retrying in 0.1 s", e.strerror)
                await trio.sleep(0.1)
                continue
            except trio.ClosedResourceError:
                return
            admitted, oldest = self.cap.make_room()
            if not admitted:
                await trio.aclose_forcefully(stream)
                continue
            if oldest is not None:
                # (its calls, if any, wait on their client: they are cancelled; it
                # does not linger, no longer counted: a request that crosses the GOAWAY
                # may be lost in the close, not refused)
                oldest.goaway(linger=False)
            self.cap.starting += 1
            nursery.start_soon(self._serve_connection, stream)

    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        peer = _peer(stream)
        set_keepalive(stream.socket)
        conn = None  # (None: not in ``connections`` yet, counted as starting)
        try:
            if self.tls is not None:
                stream = trio.SSLStream(stream, self.tls, server_side=True)
                with trio.move_on_after(self.limits.handshake_timeout) as timer:
                    await stream.do_handshake()
                if timer.cancelled_caught:
                    log.debug("TLS handshake from %s timed out", peer)
                    return
            conn = ServerConnection(stream, self, peer)
            self.connections[conn] = None
            self.cap.starting -= 1
            await conn.run()
        except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError) as e:
            log.debug("connection from %s ended: %s", peer, e)
        except Exception:  # one connection's failure must never take the server down
            log.exception("connection from %s failed", peer)
        finally:
            if conn is None:
                self.cap.starting -= 1
            else:
                self.connections.pop(conn, None)
            await trio.aclose_forcefully(stream)

    async def _run_call(self, call: ServerCall) -> None:
        """One call, start to end: dispatch, deadline, status, cleanup."""
        code, message, trailers = StatusCode.OK, "", ()
        method = self.methods.get(call.path)
        try:
            # One scope: RST_STREAM cancels it (the call is then closed: nothing to
            # answer), and it carries the grpc-timeout deadline.
            with call.scope:
                try:
                    if method is None:
                        service, _, name = call.path.lstrip("/").rpartition("/")
                        raise MessageError(
                            StatusCode.UNIMPLEMENTED,
                            f"Method {name} is not implemented in service {service}",
                        )
                    call.streams_requests(method.client_streaming)
                    await self._invoke(method, call)
                except Exception as e:
                    code, message = self.status_of(e)
                    if self.trailers_of is not None:
                        trailers = self.trailers_of(e)
            if call.scope.cancelled_caught and call.ended_by is not None:  # (the server's)
                code, message = self.status_of(call.ended_by)
                trailers = self.trailers_of(call.ended_by) if self.trailers_of else ()
            elif call.scope.cancelled_caught:  # a reset, or the deadline
                code, trailers = StatusCode.DEADLINE_EXCEEDED, ()
                streaming = method.client_streaming or method.server_streaming
                message = "deadline (grpc-timeout) expired before the " + (
                    "stream ended" if streaming else "call finished"
                )
            call.finish(code, message, trailers)  # a no-op after a reset
        finally:
            call.release()

    async def _invoke(self, method: Method, call: ServerCall) -> None:
        if method.client_streaming:
            request = _requests(method, call)
        else:
            request = await method.parse(await call.receive_single())
        if method.server_streaming:
            # The handler's generator runs in a task of its own: it may hold a nursery
            # across its yields, and closing it suspended at a yield in a call that was
            # cancelled (a reset, the deadline) must end only this call.
            with nursery_unwrapped():  # (the handler's own exception, to status_of)
                async with trio.as_safe_channel(method.handler)(request, call) as responses:
                    async for response in responses:
                        await call.send(_encode(method, response, self.limits))
        else:
            response = await method.handler(request, call)
            await call.send(_encode(method, response, self.limits), flush=False)  # (+ trailers)


@dataclass(frozen=True, slots=True)
class Unparsed:
    """What a streaming handler is given in place of a request message that cannot be
    decoded (``error``: why, INVALID_ARGUMENT): the messages after it are read on."""

    error: MessageError


async def _requests(method: Method, call: ServerCall):
    while (raw := await call.receive()) is not None:
        try:
            message = await method.parse(raw)
        except MessageError as e:  # (a message that was received whole: the next may be fine)
            message = Unparsed(e)
        yield message


_LISTEN_ERRNOS = frozenset({errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES})


def is_listen_error(error: BaseException) -> bool:
    """Whether ``error`` says a port cannot be listened on: taken, not this host's, not
    allowed, or a host name that does not resolve."""
    return isinstance(error, socket.gaierror) or getattr(error, "errno", None) in _LISTEN_ERRNOS


def listen_error(error: OSError, what: str, host: str, port: int) -> OSError:
    """``error`` (a bind that failed, a host that does not resolve) naming the port it was
    for, ``what`` ("gRPC", "REST", ...): of the same type and errno, so that callers
    still tell such errors apart."""
    return type(error)(error.errno, f"{what} port {host}:{port}: {error.strerror or error}")


def request_decoder(message_type) -> Callable[[bytes], Any]:
    """``message_type.FromString``, failing the call with INVALID_ARGUMENT."""
    parse = message_type.FromString
    name = message_type.DESCRIPTOR.full_name

    def decode(raw: bytes):
        try:
            return parse(raw)
        except DecodeError as e:
            raise MessageError(
                StatusCode.INVALID_ARGUMENT, f"cannot parse the request as {name}: {e}"
            ) from None

    return decode


def _encode(method: Method, response: Any, limits: TransportLimits) -> bytes:
    payload = response if isinstance(response, bytes) else method.encode(response)
    if len(payload) > limits.max_message_bytes:
        raise MessageError(
            StatusCode.RESOURCE_EXHAUSTED,
            f"response of {len(payload)} bytes exceeds the maximum "
            f"{limits.max_message_bytes} ({limits.message_setting})",
        )
    return payload


def _peer(stream: trio.SocketStream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
    except OSError:
        return "?"
    return f"{host}:{port}"


def server_tls_context(
    cert_file: str, key_file: str, client_ca_file: str | None = None
) -> ssl.SSLContext:
    """A TLS context for the gRPC endpoint (HTTP/2 by ALPN, TLS 1.2 or newer).

    With ``client_ca_file``, clients must present a certificate signed by that CA
    (mutual TLS). Raises OSError / ssl.SSLError / ValueError when a file cannot be read
    or used (an encrypted key included: nobody is there to type its passphrase).
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file, password=_no_passphrase)
    context.set_alpn_protocols(["h2"])
    if client_ca_file:
        context.load_verify_locations(client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_tls_context(
    ca_file: str, cert_file: str | None = None, key_file: str | None = None
) -> ssl.SSLContext:
    """A TLS context for calling a server whose certificate ``ca_file`` signed (and
    presenting ``cert_file`` with ``key_file``, for mutual TLS). Raises OSError /
    ssl.SSLError / ValueError when a file cannot be read or used (an encrypted key
    included)."""
    context = ssl.create_default_context(cafile=ca_file)
    if cert_file is not None:
        context.load_cert_chain(cert_file, key_file, password=_no_passphrase)
    return context


class CallerTls(Protocol):
    """A caller's TLS settings as rsrv's configuration files name them (a gateway's
    ``worker_client``)."""

    tls_ca_file: str | None
    tls_cert_file: str | None
    tls_key_file: str | None


def server_tls(settings: ListenSettings) -> ssl.SSLContext | None:
    """The TLS context of a server's settings (a worker's ``endpoints``, a gateway's
    ``grpc``); None when no certificate is set. Raises one of TLS_ERRORS."""
    if not settings.tls_cert_file:
        return None
    s = settings
    return server_tls_context(s.tls_cert_file, s.tls_key_file, s.tls_client_ca_file)


def client_tls(settings: CallerTls) -> ssl.SSLContext | None:
    """The TLS context of a caller's settings (a gateway's ``worker_client``); None when
    no CA is set. Raises one of TLS_ERRORS."""
    if settings.tls_ca_file is None:
        return None
    return client_tls_context(settings.tls_ca_file, settings.tls_cert_file, settings.tls_key_file)


def _no_passphrase() -> bytes:
    """OpenSSL's passphrase prompt for an encrypted key, answered: there is no terminal
    to type it on (a supervised process), so the key must be unencrypted."""
    raise ValueError("the private key is encrypted; give an unencrypted key")


#: What building a TLS context raises for a file that cannot be read or used.
TLS_ERRORS = (OSError, ssl.SSLError, ValueError)
