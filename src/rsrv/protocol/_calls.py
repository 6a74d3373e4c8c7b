"""What every call passes through before its handler: access, admission and deadline.

:func:`guard` wraps the methods of the worker's services:

* **Restricted protocols** (Triton's model): each RPC belongs to a protocol group
  (:data:`PROTOCOLS`); a group listed in ``endpoints.restricted`` needs a header with a
  given value, and a call without it fails with UNAVAILABLE and Triton's message
  ("This protocol is restricted, expecting header '<name>'").
* **Admission**: a unary call takes an in-flight slot (``endpoints.
  max_concurrent_requests``) for its whole life; past the cap it is RESOURCE_EXHAUSTED,
  and once the server drains every new call is UNAVAILABLE. A streaming call holds no
  slot itself (an idle open stream is not in flight): its handler admits each request.
* **Deadline**: the call's grpc-timeout is published in :data:`call_deadline` for the
  handler (the transport enforces it).
"""

from __future__ import annotations

import contextvars
import hmac
import math
from collections.abc import Iterable, Mapping
from contextlib import aclosing
from dataclasses import dataclass, replace

import trio

from rsrv.errors import ResourceExhausted, Unavailable
from rsrv.transport import Method

__all__ = [
    "PROTOCOLS",
    "RESTRICTED_MESSAGE",
    "UNADMITTED",
    "Admission",
    "Restriction",
    "call_deadline",
    "deadline_cut_off",
    "guard",
    "protocol_of",
]

#: Absolute trio deadline of the current call (from grpc-timeout), or inf.
call_deadline: contextvars.ContextVar[float] = contextvars.ContextVar(
    "call_deadline", default=math.inf
)

#: How long before its deadline a call's reset still counts as the deadline's: a
#: client's timer starts before its request is sent, and ours when it arrives, so the
#: client gives up (and resets the call) that much before our deadline passes.
DEADLINE_SLACK_SECONDS = 0.05


def deadline_cut_off(deadline: float) -> bool:
    """Whether a call with ``deadline`` (trio's clock) that ended cancelled was cut off
    by its deadline (DEADLINE_EXCEEDED), rather than abandoned by its client
    (CANCELLED): the deadline has passed, or the reset came within
    :data:`DEADLINE_SLACK_SECONDS` of it."""
    return trio.current_time() >= deadline - DEADLINE_SLACK_SECONDS


#: Protocol groups: Triton's names for its RPCs, and ``control`` for rsrv's control service.
PROTOCOLS: Mapping[str, tuple[str, ...]] = {
    "health": ("ServerLive", "ServerReady", "ModelReady", "Check", "Watch"),
    "metadata": ("ServerMetadata", "ModelMetadata"),
    "inference": ("ModelInfer", "ModelStreamInfer"),
    "model-config": ("ModelConfig",),
    "model-repository": ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload"),
    "statistics": ("ModelStatistics",),
    "shared-memory": (
        "SystemSharedMemoryStatus",
        "SystemSharedMemoryRegister",
        "SystemSharedMemoryUnregister",
        "CudaSharedMemoryStatus",
        "CudaSharedMemoryRegister",
        "CudaSharedMemoryUnregister",
    ),
    "trace": ("TraceSetting",),
    "logging": ("LogSettings",),
    "control": (
        "ModelControlStatus",
        "SetModelResidency",
        "SetModelPolicy",
        "CompactMemory",
    ),
    # (a gateway's own: rsrv.gateway.v1.GatewayControl)
    "gateway-control": (
        "GetSchedulingStatus",
        "SetSchedulingPolicy",
        "SetModelPlacement",
        "Repack",
    ),
}
_GROUP_OF = {rpc: group for group, rpcs in PROTOCOLS.items() for rpc in rpcs}

#: Methods that take no in-flight slot and are not refused while the server drains: the
#: standard health service (``grpc.health.v1.Health``), so that a probe is never shed at
#: the cap and sees NOT_SERVING, not UNAVAILABLE, during a graceful shutdown.
UNADMITTED = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})


def protocol_of(path: str) -> str | None:
    """The protocol group of a method path ("/pkg.Service/Method"), None if unknown."""
    return _GROUP_OF.get(path.rsplit("/", 1)[-1])


#: How a call refused for its missing header begins (Triton's words).
RESTRICTED_MESSAGE = "This protocol is restricted"


@dataclass(frozen=True, slots=True)
class Restriction:
    """Calls of ``protocols`` need header ``header`` (lower case) equal to ``value``."""

    protocols: frozenset[str]
    header: str
    value: str

    def check(self, metadata: Mapping[str, str]) -> None:
        sent = metadata.get(self.header)
        if sent is None or not hmac.compare_digest(sent.encode(), self.value.encode()):
            raise Unavailable(f"{RESTRICTED_MESSAGE}, expecting header '{self.header}'")


class Admission:
    """The in-flight cap (0 = uncapped); ``setting`` names it in the refusal."""

    def __init__(self, limit: int, setting: str = "endpoints.max_concurrent_requests"):
        self.limit = limit
        self.setting = setting
        self.inflight = 0
        self.shed = 0
        self.closed = False

    def close(self) -> None:
        """Refuse every new call from now on (graceful shutdown)."""
        self.closed = True

    def check_open(self) -> None:
        if self.closed:
            raise self.refusal()

    @staticmethod
    def refusal() -> Unavailable:
        """What a call the draining server did not process gets (with a retry pushback:
        a client may send it again, elsewhere or after a restart); a stream left open
        when the server stops is ended with it too."""
        return Unavailable("server is shutting down", retry_after=0.0)

    def __enter__(self):
        self.check_open()
        if self.limit and self.inflight >= self.limit:
            self.shed += 1
            raise ResourceExhausted(
                f"server is at its in-flight limit of {self.limit} requests ({self.setting})"
            )
        self.inflight += 1

    def __exit__(self, *exc):
        self.inflight -= 1


def guard(
    methods: Iterable[Method], admission: Admission, restrictions: Iterable[Restriction] = ()
) -> list[Method]:
    """``methods`` with restriction, admission and deadline around their handlers
    (admission not for :data:`UNADMITTED` methods)."""
    by_protocol: dict[str, Restriction] = {}
    for r in restrictions:
        for protocol in r.protocols:
            by_protocol[protocol] = r
    guarded = []
    for method in methods:
        restriction = by_protocol.get(protocol_of(method.path) or "")
        # An uncapped admission of its own, never closed: counts nothing the server reads.
        gate = Admission(0) if method.path in UNADMITTED else admission
        if method.client_streaming or method.server_streaming:
            handler = _stream_handler(method.handler, gate, restriction)
        else:
            handler = _unary_handler(method.handler, gate, restriction)
        guarded.append(replace(method, handler=handler))
    return guarded


def _unary_handler(fn, admission: Admission, restriction: Restriction | None):
    async def handler(message, call):
        if restriction is not None:
            restriction.check(call.metadata)
        call_deadline.set(call.deadline)  # this call's task context only
        with admission:
            return await fn(message, call)

    return handler


def _stream_handler(fn, admission: Admission, restriction: Restriction | None):
    async def handler(messages, call):
        if restriction is not None:
            restriction.check(call.metadata)
        admission.check_open()
        call_deadline.set(call.deadline)
        async with aclosing(fn(messages, call)) as responses:
            async for response in responses:
                yield response

    return handler
