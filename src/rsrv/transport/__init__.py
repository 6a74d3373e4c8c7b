"""gRPC over HTTP/2 on trio: the wire layer of every rsrv process.

purerpc supplies the service definitions (generated servicers and stubs) and status
types; this package replaces its connection layer, which has no way to cancel a call
whose client reset the stream or went away, flushes once per frame, and runs on anyio.
Here HTTP/2 is spoken directly (``_frames``; header decoding by ``hpack``), every
connection and call is a trio task with a defined lifetime (see ``_connection``), limits
bound what one client can hold (``TransportLimits``), and TLS is served by
``trio.SSLStream``.

The client side (``_channel``: the pool and calls; ``_client``: a connection;
``_client_stream``: a call's stream; ``_client_calls``: what callers get) shares the
HTTP/2 endpoint code (``_endpoint``) and the message framing: a :class:`Channel` pools
connections to one endpoint and makes unary and bidirectional-streaming calls on raw
message bytes (``open_channel``, ``UnaryResult``, ``StreamingCall``, ``ClientLimits``).
"""

from rsrv.transport._call import ServerCall
from rsrv.transport._cap import ConnectionCap
from rsrv.transport._channel import (
    Channel,
    ClientLimits,
    StreamingCall,
    UnaryResult,
    grpc_timeout,
    open_channel,
)
from rsrv.transport._client_stream import DEADLINE_MESSAGE, CallEnded, MessageTooLarge
from rsrv.transport._connection import CONNECTION_SPECIFIC, NOT_METADATA, metadata_problem
from rsrv.transport._messages import MessageError
from rsrv.transport._server import (
    INFLATING_AT_ONCE,
    TLS_ERRORS,
    GrpcServer,
    ListenSettings,
    Method,
    TransportLimits,
    Unparsed,
    client_tls,
    client_tls_context,
    default_status,
    is_listen_error,
    listen_error,
    methods_of,
    request_decoder,
    server_tls,
    server_tls_context,
)

__all__ = [
    "DEADLINE_MESSAGE",
    "INFLATING_AT_ONCE",
    "CONNECTION_SPECIFIC",
    "NOT_METADATA",
    "TLS_ERRORS",
    "CallEnded",
    "Channel",
    "ClientLimits",
    "ConnectionCap",
    "GrpcServer",
    "ListenSettings",
    "MessageError",
    "MessageTooLarge",
    "Method",
    "ServerCall",
    "StreamingCall",
    "TransportLimits",
    "UnaryResult",
    "Unparsed",
    "client_tls",
    "client_tls_context",
    "default_status",
    "grpc_timeout",
    "is_listen_error",
    "metadata_problem",
    "listen_error",
    "methods_of",
    "open_channel",
    "request_decoder",
    "server_tls",
    "server_tls_context",
]
