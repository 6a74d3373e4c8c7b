"""Exceptions -> gRPC status, decided once.

Every rsrv error carries its status name in ``code`` (``rsrv.errors``); this module turns
any exception a handler raises into the purerpc ``(StatusCode, message)`` pair the
transport sends (``rsrv.transport.GrpcServer(status_of=grpc_status)``), so a client
never receives a Python repr or traceback.

Mapping (an exception group with a single member is its member: a failure that crossed
nurseries, e.g. a stream's request pump or a meta model's calls, keeps its status):

* ``RsrvError`` (and subclasses, e.g. ``rsrv.protocol._shm.AlreadyExists``): its ``code``.
* ``purerpc.RpcFailedError``: its own status, unchanged.
* purerpc ``MessageTooLargeError``: RESOURCE_EXHAUSTED.
* ``TimeoutError`` / ``trio.TooSlowError``: DEADLINE_EXCEEDED.
* ``MemoryError``: RESOURCE_EXHAUSTED.  ``NotImplementedError``: UNIMPLEMENTED.
* ``trio.Cancelled`` / ``KeyboardInterrupt`` and other non-``Exception``: CANCELLED.
* anything else: INTERNAL with ``"TypeName: message"`` (never a traceback).

:func:`grpc_trailers` gives the custom trailers sent with the status: an
``Unavailable`` with ``retry_after`` sends ``grpc-retry-pushback-ms`` (gRPC's retry
pushback: the request was not processed; retry after that many milliseconds).

Messages are capped at ``MAX_MESSAGE_CHARS`` characters: they travel percent-encoded in
the ``grpc-message`` trailer, and clients cap metadata size (gRPC C-core: 8 KiB).
"""

from __future__ import annotations

import trio
from purerpc.grpclib import exceptions as _exc
from purerpc.grpclib.status import StatusCode

from rsrv.errors import RsrvError, Unavailable, alone

__all__ = [
    "HTTP_STATUS",
    "MAX_MESSAGE_CHARS",
    "PUSHBACK",
    "grpc_status",
    "grpc_trailers",
    "http_status",
    "pushback_of",
]

#: The trailer of gRPC's retry pushback (gRFC A6): milliseconds before a retry.
PUSHBACK = "grpc-retry-pushback-ms"

MAX_MESSAGE_CHARS = 2000


def _cap(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    suffix = "... (truncated)"
    return message[: MAX_MESSAGE_CHARS - len(suffix)] + suffix


def _type_message(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def grpc_trailers(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """The custom trailers a client receives with ``exc``'s status."""
    exc = alone(exc)
    if isinstance(exc, Unavailable) and exc.retry_after is not None:
        return ((PUSHBACK, str(max(0, round(exc.retry_after * 1000)))),)
    return ()


def pushback_of(trailers) -> float | None:
    """The retry pushback in seconds among ``trailers`` ((name, value) pairs); None when
    there is none, or it is negative (do not retry) or malformed."""
    for name, value in trailers:
        if name == PUSHBACK:
            try:
                ms = int(value)
            except ValueError:
                return None
            return ms / 1000 if ms >= 0 else None
    return None


def grpc_status(exc: BaseException) -> tuple[StatusCode, str]:
    """The purerpc status code and message a client receives for ``exc``."""
    exc = alone(exc)
    if isinstance(exc, RsrvError):
        try:
            code = StatusCode[exc.code]
        except KeyError:
            return StatusCode.INTERNAL, _cap(
                f"{_type_message(exc)} (unknown status code {exc.code!r})"
            )
        if code is StatusCode.OK:  # an error never reports OK
            code = StatusCode.INTERNAL
        return code, _cap(str(exc) or type(exc).__name__)
    if isinstance(exc, _exc.RpcFailedError):
        status = exc.status
        return status.status_code, _cap(status.status_message)
    if isinstance(exc, _exc.MessageTooLargeError):
        return StatusCode.RESOURCE_EXHAUSTED, _cap(str(exc) or "message too large")
    if isinstance(exc, TimeoutError | trio.TooSlowError):
        return StatusCode.DEADLINE_EXCEEDED, _cap(str(exc) or "deadline exceeded")
    if isinstance(exc, MemoryError):
        return StatusCode.RESOURCE_EXHAUSTED, _cap(_type_message(exc))
    if isinstance(exc, NotImplementedError):
        return StatusCode.UNIMPLEMENTED, _cap(str(exc) or "not implemented")
    if not isinstance(exc, Exception):
        return StatusCode.CANCELLED, _cap(str(exc) or "cancelled")
    return StatusCode.INTERNAL, _cap(_type_message(exc))


#: The HTTP status of each gRPC status (the REST wire, specs/http.md §4).
HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 400,
    "OUT_OF_RANGE": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "ABORTED": 409,
    "RESOURCE_EXHAUSTED": 429,
    "UNIMPLEMENTED": 501,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}


def http_status(exc: BaseException) -> tuple[int, str]:
    """The HTTP status and message a REST client receives for ``exc``: the message is
    :func:`grpc_status`'s; the status is the exception's own ``http_status`` attribute
    when it has one (a wire-level case such as 413 for a body above the limit), else
    :data:`HTTP_STATUS` of its gRPC status (500 for any other)."""
    exc = alone(exc)
    code, message = grpc_status(exc)
    explicit = getattr(exc, "http_status", None)
    return explicit or HTTP_STATUS.get(code.name, 500), message
