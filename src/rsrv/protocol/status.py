"""Exceptions -> gRPC status, decided once.

Every rsrv error carries its status name in ``code`` (``rsrv.errors``); this module turns
any exception into a purerpc ``(StatusCode, message)`` pair, or into the purerpc
``RpcFailedError`` subclass that a handler raises so that purerpc closes the stream with
that status (purerpc 0.8's server catches ``RpcFailedError`` and sends ``error.status``;
anything else becomes CANCELLED with a ``repr(sys.exc_info())`` traceback, which must
never reach a client).

Mapping:

* ``RsrvError`` (and subclasses, e.g. ``rsrv.protocol.shm.AlreadyExists``): its ``code``.
* ``purerpc.RpcFailedError``: its own status, unchanged.
* purerpc ``MessageTooLargeError``: RESOURCE_EXHAUSTED.
* ``TimeoutError`` / ``trio.TooSlowError``: DEADLINE_EXCEEDED.
* ``MemoryError``: RESOURCE_EXHAUSTED.  ``NotImplementedError``: UNIMPLEMENTED.
* ``trio.Cancelled`` / ``KeyboardInterrupt`` and other non-``Exception``: CANCELLED.
* anything else: INTERNAL with ``"TypeName: message"`` (never a traceback).

Messages are capped at ``MAX_MESSAGE_CHARS`` characters: they travel percent-encoded in
the ``grpc-message`` trailer, and clients cap metadata size (gRPC C-core: 8 KiB).
"""

from __future__ import annotations

import trio
from purerpc.grpclib import exceptions as _exc
from purerpc.grpclib.status import Status, StatusCode

from rsrv.errors import RsrvError

__all__ = ["MAX_MESSAGE_CHARS", "grpc_status", "to_rpc_error"]

MAX_MESSAGE_CHARS = 2000

_RPC_ERRORS: dict[StatusCode, type[_exc.RpcFailedError]] = {
    StatusCode.CANCELLED: _exc.CancelledError,
    StatusCode.UNKNOWN: _exc.UnknownError,
    StatusCode.INVALID_ARGUMENT: _exc.InvalidArgumentError,
    StatusCode.DEADLINE_EXCEEDED: _exc.DeadlineExceededError,
    StatusCode.NOT_FOUND: _exc.NotFoundError,
    StatusCode.ALREADY_EXISTS: _exc.AlreadyExistsError,
    StatusCode.PERMISSION_DENIED: _exc.PermissionDeniedError,
    StatusCode.RESOURCE_EXHAUSTED: _exc.ResourceExhaustedError,
    StatusCode.FAILED_PRECONDITION: _exc.FailedPreconditionError,
    StatusCode.ABORTED: _exc.AbortedError,
    StatusCode.OUT_OF_RANGE: _exc.OutOfRangeError,
    StatusCode.UNIMPLEMENTED: _exc.UnimplementedError,
    StatusCode.INTERNAL: _exc.InternalError,
    StatusCode.UNAVAILABLE: _exc.UnavailableError,
    StatusCode.DATA_LOSS: _exc.DataLossError,
    StatusCode.UNAUTHENTICATED: _exc.UnauthenticatedError,
}


def _cap(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    suffix = "... (truncated)"
    return message[: MAX_MESSAGE_CHARS - len(suffix)] + suffix


def _type_message(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def grpc_status(exc: BaseException) -> tuple[StatusCode, str]:
    """The purerpc status code and message a client receives for ``exc``."""
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


def to_rpc_error(exc: BaseException) -> _exc.RpcFailedError:
    """The purerpc exception a handler raises (``raise to_rpc_error(e) from e``)."""
    if isinstance(exc, _exc.RpcFailedError):
        return exc
    code, message = grpc_status(exc)
    cls = _RPC_ERRORS.get(code)
    if cls is None:
        return _exc.RpcFailedError(Status(code, message))
    return cls(message)
