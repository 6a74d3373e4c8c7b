"""``grpc.health.v1.Health``: the standard gRPC health service, on every rsrv port.

Kubernetes' gRPC probes, ``grpc_health_probe`` and gRPC load balancers ask it for the
status of a *service name*. rsrv answers four names, two for each question a probe asks
(:data:`HEALTH_SERVICES`):

* ``""`` (a probe's default) and ``"live"``: liveness, SERVING whenever the server
  answers at all, while models load and while it drains too;
* ``"ready"`` and ``"inference.GRPCInferenceService"``: readiness, SERVING when the
  server's ``ready()`` says so (a worker: ServerReady and not draining; a gateway: a ready
  worker behind it and not draining), else NOT_SERVING;
* any other name: Check fails NOT_FOUND; Watch streams SERVICE_UNKNOWN and stays open
  (the gRPC rule for unknown services).

Guarantees:

* ``Check`` never waits: it reads ``ready()`` once and answers.
* ``Watch`` sends the current status at once, then every change, each within
  ``poll_seconds`` (0.25 s) of ``ready()`` changing, never the same status twice in a
  row; it ends only when the client ends it or the server stops (its close ends it
  UNAVAILABLE, ``GrpcServer.close(ending=...)``). One
  task (:meth:`HealthService.run`) polls ``ready()`` for every stream, which waits
  without a timer of its own; at most ``max_watches`` streams are open at once (half
  the server's connection limit: :meth:`HealthService.beside`), more fail
  RESOURCE_EXHAUSTED.
* Neither takes an in-flight slot nor is refused while the server drains:
  :func:`rsrv.protocol.guard` lets them through (``UNADMITTED``), so a probe is never shed
  at ``max_concurrent_requests`` and sees NOT_SERVING, not UNAVAILABLE, during a graceful
  shutdown. Restricted protocols still apply (they belong to the ``health`` group).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import trio

from rsrv.errors import NotFound, ResourceExhausted
from rsrv.protocol.generated.grpc.health.v1 import health_pb2 as pb
from rsrv.protocol.generated.grpc.health.v1.health_grpc import HealthServicer
from rsrv.transport import Method, methods_of

__all__ = ["HEALTH_SERVICES", "HealthService"]

#: Service names the health service knows, and what each reports: ``live`` or ``ready``.
HEALTH_SERVICES: Mapping[str, str] = {
    "": "live",
    "live": "live",
    "ready": "ready",
    "inference.GRPCInferenceService": "ready",
}

SERVING = pb.HealthCheckResponse.SERVING
NOT_SERVING = pb.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = pb.HealthCheckResponse.SERVICE_UNKNOWN


class HealthService(HealthServicer):
    """The health service of one server, over one question: ``ready()``, is it ready
    now? (It is live as long as it answers.) Watch streams follow changes while
    :meth:`run` runs."""

    @classmethod
    def beside(cls, ready: Callable[[], bool], max_connections: int) -> HealthService:
        """For a server holding at most ``max_connections`` connections: at most half
        of them with a Watch. A Watch is owed answers for as long as it lasts, so its
        connection is never closed to make room at the connection cap; Watches alone
        never fill the cap."""
        return cls(ready, max_watches=max(1, max_connections // 2))

    def __init__(self, ready: Callable[[], bool], *, max_watches: int, poll_seconds: float = 0.25):
        self.ready = ready
        self.max_watches = max_watches
        self.poll_seconds = poll_seconds
        self.watches = 0  # Watch streams open now
        self._polled: bool | None = None  # ready() at the last poll (None: not polled yet)
        self._changes = 0  # changes the polls have seen
        self._changed = trio.Event()  # set, and replaced, when a poll sees a change
        self._polled_now = trio.Event()  # set, and replaced, at every poll

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Poll ``ready()`` every ``poll_seconds`` for every Watch stream at once: the
        streams report what the polls see."""
        self._polled = self.ready()
        task_status.started()
        while True:
            await trio.sleep(self.poll_seconds)
            ready = self.ready()
            if ready != self._polled:
                self._polled = ready
                self._changes += 1
                self._changed.set()
                self._changed = trio.Event()
            self._polled_now.set()
            self._polled_now = trio.Event()

    def status(self, service: str, ready: bool | None = None) -> int:
        """The ServingStatus of ``service``, ready or not as ``ready`` says (None:
        ``ready()`` now): SERVICE_UNKNOWN for an unknown name."""
        kind = HEALTH_SERVICES.get(service)
        if kind is None:
            return SERVICE_UNKNOWN
        if kind == "live":
            return SERVING
        if ready is None:
            ready = self.ready()
        return SERVING if ready else NOT_SERVING

    def methods(self) -> list[Method]:
        """Check and Watch, for the server's method table (pass them through ``guard``)."""
        return methods_of(self.service)

    async def Check(self, message, request):
        status = self.status(message.service)
        if status == SERVICE_UNKNOWN:
            raise NotFound(
                f"unknown service {message.service!r}; this server reports "
                + ", ".join(repr(name) for name in HEALTH_SERVICES)
            )
        return pb.HealthCheckResponse(status=status)

    async def Watch(self, message, request):
        if self.watches >= self.max_watches:
            raise ResourceExhausted(
                f"{self.watches} health Watch streams are open on this server, the most "
                "it keeps; use Check, or close a Watch"
            )
        self.watches += 1
        try:
            service = message.service
            seen = self._changes
            last = self.status(service)  # the first answer: ready() now
            yield pb.HealthCheckResponse(status=last)
            while True:
                if self._changes == seen:  # no change missed while it was sending
                    # In step with the polls, until they see a change; ahead of them
                    # (the first answer), until the next poll says what is current.
                    ahead = self.status(service, self._polled) != last
                    await (self._polled_now if ahead else self._changed).wait()
                seen = self._changes
                status = self.status(service, self._polled)
                if status != last:
                    last = status
                    yield pb.HealthCheckResponse(status=status)
        finally:
            self.watches -= 1
