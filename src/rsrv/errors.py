"""Errors that carry their wire status.

Every layer raises these; the protocol layer maps ``code`` to a gRPC status once
(``rsrv.protocol._status``), so no handler decides a status ad hoc.
"""

from __future__ import annotations


def alone(exc: BaseException) -> BaseException:
    """``exc`` out of the exception groups of one that wrap it (a trio nursery wraps
    what its one failing task raises); a group of several stays a group."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


class RsrvError(Exception):
    """Base error. ``code`` names the gRPC status the client receives."""

    code = "INTERNAL"


class InvalidArgument(RsrvError):
    code = "INVALID_ARGUMENT"


class NotFound(RsrvError):
    code = "NOT_FOUND"


class ResourceExhausted(RsrvError):
    code = "RESOURCE_EXHAUSTED"


class DeadlineExceeded(RsrvError):
    code = "DEADLINE_EXCEEDED"


class FailedPrecondition(RsrvError):
    code = "FAILED_PRECONDITION"


class Unavailable(RsrvError):
    """``retry_after`` (seconds), when given: the request was not processed, and the
    client may send it again after that long (0: after its own backoff); it travels as
    the ``grpc-retry-pushback-ms`` trailer (``rsrv.protocol.grpc_trailers``)."""

    code = "UNAVAILABLE"

    def __init__(self, message: str = "", *, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class Internal(RsrvError):
    code = "INTERNAL"


class BundleError(RsrvError):
    """A bundle is invalid. The message names the bundle file and field at fault."""

    code = "UNAVAILABLE"
