"""Errors that carry their wire status.

Every layer raises these; the protocol layer maps ``code`` to a gRPC status once
(``rsrv.protocol._status``), so no handler decides a status ad hoc.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def nursery_unwrapped() -> Iterator[None]:
    """Around ``async with trio.open_nursery()`` (or a block that holds one): what its
    one failing task raised (the block's own exception, most often) comes out as
    itself, not in the group the nursery wraps it in. Exactly that layer is removed: a
    group the task raised stays a group, and the exception keeps its own context and
    cause (what it was raised while handling still shows in its traceback)."""
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) != 1:
            raise
        exc = group.exceptions[0]
        context, suppress = exc.__context__, exc.__suppress_context__
        try:
            raise exc  # (sets its __context__ to the group: put back below)
        finally:
            exc.__context__, exc.__suppress_context__ = context, suppress
            del exc, group, context  # (no reference cycle through this frame)


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
