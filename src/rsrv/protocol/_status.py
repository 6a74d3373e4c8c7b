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

Messages are capped at ``MAX_MESSAGE_CHARS`` characters: they travel percent-encoded in
the ``grpc-message`` trailer, and clients cap metadata size (gRPC C-core: 8 KiB).
"""

from __future__ import annotations

import trio
from purerpc.grpclib import exceptions as _exc
from purerpc.grpclib.status import StatusCode

from rsrv.errors import RsrvError

__all__ = ["MAX_MESSAGE_CHARS", "grpc_status"]

MAX_MESSAGE_CHARS = 2000


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
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
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
