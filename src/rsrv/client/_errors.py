"""The one exception of ``rsrv.client``'s clients."""

from __future__ import annotations

from purerpc.grpclib.exceptions import RpcFailedError
from purerpc.grpclib.status import Status, StatusCode

from rsrv.protocol import pushback_of

__all__ = ["InferenceServerError"]


class InferenceServerError(RpcFailedError):
    """A call that did not succeed: ``code`` (a purerpc ``StatusCode``) and ``message``
    (the server's grpc-message; for a transport failure, what failed), plus
    ``reached_server`` (False when the server certainly never processed the call: it
    was never sent, or the server refused it with a retry pushback), ``retry_after``
    (that pushback, in seconds; None without one) and, for a failed request of a stream,
    ``request_id``.

    Transport failures are UNAVAILABLE, an expired deadline DEADLINE_EXCEEDED. A failed
    request of a stream carries only the server's text, with code UNKNOWN. Being a
    purerpc ``RpcFailedError``, it also has ``status`` (code and message).
    """

    def __init__(
        self,
        code: StatusCode,
        message: str,
        *,
        reached_server: bool = True,
        request_id: str = "",
        retry_after: float | None = None,
    ):
        super().__init__(Status(code, message))
        self.code = code
        self.message = message
        self.reached_server = reached_server
        self.request_id = request_id
        self.retry_after = retry_after

    @classmethod
    def of(cls, result) -> InferenceServerError:
        """The error of a failed call's result (``rsrv.transport.UnaryResult``)."""
        pushback = pushback_of(result.trailers)
        return cls(
            result.status,
            result.message,
            reached_server=result.reached_server and pushback is None,
            retry_after=pushback,
        )

    def __reduce__(self):  # (across processes: its arguments are not its ``args``)
        keywords = {
            "reached_server": self.reached_server,
            "request_id": self.request_id,
            "retry_after": self.retry_after,
        }
        return _rebuild, (type(self), self.code, self.message, keywords)

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


def _rebuild(cls: type, code: StatusCode, message: str, keywords: dict) -> InferenceServerError:
    return cls(code, message, **keywords)
