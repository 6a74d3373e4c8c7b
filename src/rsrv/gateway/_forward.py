"""Forwarding a call to workers: to the replica the scheduler picks (with failover), to
a worker holding a model, or to every ready worker at once.

Bodies travel as bytes, untouched. A worker's status reaches the client unchanged,
with one exception: NOT_FOUND and UNAVAILABLE move the call on to the next replica
(the model is not there, or the worker is going away), and only when every replica
has answered so does the client see the last of them. The client's deadline goes
with every hop as the time left, and the client's headers go with the call.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import trio
from purerpc.grpclib.status import StatusCode

from rsrv.errors import DeadlineExceeded, RsrvError, Unavailable
from rsrv.gateway._discovery import Discovery
from rsrv.gateway._fleet import CallResult, Fleet, WorkerLink
from rsrv.gateway._peek import InferHead
from rsrv.protocol import deadline_cut_off, pushback_of
from rsrv.transport import DEADLINE_MESSAGE, UnaryResult

__all__ = [
    "CONTROL",
    "INFERENCE",
    "Forwarder",
    "Relayed",
    "RouteTicket",
    "Router",
    "forwarded_headers",
]

log = logging.getLogger("rsrv.gateway")

INFERENCE = "/inference.GRPCInferenceService/"  # the KServe V2 service's path prefix
CONTROL = "/rsrv.control.v1.ControlService/"  # rsrv's control service's

#: Statuses after which the call moves on to the next replica.
FAILOVER = frozenset({StatusCode.NOT_FOUND, StatusCode.UNAVAILABLE})
_HOP_HEADERS = frozenset({"te", "content-type", "user-agent", "grpc-timeout"})


class Relayed(RsrvError):
    """A worker's status, passed on to the client as it was."""

    def __init__(self, status: StatusCode, message: str):
        super().__init__(message)
        self.code = status.name


class Hold(Protocol):
    """What a routed request waits at before it is sent (``_hold.RunGate``), at most
    until ``until`` (trio time)."""

    async def wait(self, until: float = math.inf) -> None: ...


class RouteTicket(Protocol):
    """One routing decision: the replicas to try in order, and what the request waits at
    first (None: nothing); released exactly once."""

    order: list[str]
    hold: Hold | None

    def redirect(self, worker: str) -> None:
        """The request failed over: its work in flight is now on ``worker``."""

    def release(self) -> None: ...


class Router(Protocol):
    """The scheduling mode (``_scheduling``): picks replicas for one request."""

    def route(
        self, model: str, head: InferHead | None, replicas: tuple[str, ...]
    ) -> RouteTicket: ...


def forwarded_headers(metadata: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The client's own headers (restricted-protocol headers included), without the
    ones each hop sets itself."""
    return tuple(
        (k, v) for k, v in metadata.items() if k not in _HOP_HEADERS and not k.startswith("grpc-")
    )


@dataclass
class ForwardCounters:
    """What the gateway's metrics report about forwarded calls, by (worker, status), of
    the workers in the fleet (each worker keeps its own counts: they leave with it)."""

    routed: dict[tuple[str, str], int] = field(default_factory=dict)
    failovers: dict[tuple[str, str], int] = field(default_factory=dict)


def _count(table: dict[str, int], status: StatusCode) -> None:
    table[status.name] = table.get(status.name, 0) + 1


class Forwarder:
    """Sends calls to workers for the gateway's services."""

    def __init__(
        self,
        fleet: Fleet,
        discovery: Discovery,
        router: Router,
        *,
        request_timeout: float,
        headers: Iterable[tuple[str, str]] = (),
    ):
        self.fleet = fleet
        self.discovery = discovery
        self.router = router
        self.request_timeout = request_timeout
        self.headers = tuple(headers)  # the gateway's own calls (fan-outs)
        self._rotation = 0

    @property
    def counters(self) -> ForwardCounters:
        workers = self.fleet.workers
        return ForwardCounters(
            routed={(w.name, s): n for w in workers for s, n in w.routed.items()},
            failovers={(w.name, s): n for w in workers for s, n in w.failovers.items()},
        )

    # -- one call to one worker -------------------------------------------------------

    async def call(
        self,
        worker: WorkerLink,
        path: str,
        body: bytes,
        metadata: Iterable[tuple[str, str]],
        deadline: float,
    ) -> CallResult:
        """One unary call with the time left of ``deadline``, at most the worker
        client's request timeout (a worker that hangs holds a call, and its admission
        slot, no longer than that). Raises DeadlineExceeded when no time is left. A
        worker that could not be reached is taken out of the routes at once."""
        remaining = deadline - trio.current_time()
        if remaining <= 0:
            raise DeadlineExceeded("deadline exceeded before the request reached a worker")
        worker.inflight += 1
        try:
            result = await worker.channel.unary(
                path, body, metadata=metadata, timeout=min(remaining, self.request_timeout)
            )
        finally:
            worker.inflight -= 1
        if (
            result.status == StatusCode.DEADLINE_EXCEEDED
            and result.message == DEADLINE_MESSAGE  # (the channel's timeout, not the worker's)
            and self.request_timeout < remaining
        ):  # the gateway's own limit, not the client's deadline: say so
            result.message = (
                f"worker {worker.name} did not answer within "
                f"worker_client.request_timeout_seconds ({self.request_timeout:g} s)"
            )
        if result.status == StatusCode.UNAVAILABLE and not result.reached_server:
            self.fleet.mark_unreachable(worker)
            self.discovery.stale()
        return result

    # -- routed by the scheduler ------------------------------------------------------

    async def replicas(self, model: str) -> tuple[str, ...]:
        """The ready workers serving ``model``; after one refresh if none is known.
        Empty when still none (the caller then asks any ready worker, whose answer
        is the one a client of a single worker would get)."""
        found = self.fleet.routes.get(model)
        if not found:
            await self.discovery.refresh()
            found = self.fleet.routes.get(model)
        return found or ()

    def _none_ready(self, message: str = "no worker is ready") -> Unavailable:
        """UNAVAILABLE for a request no worker processed: the client may send it again
        once discovery has had a round to find a worker (retry pushback)."""
        return Unavailable(message, retry_after=self.discovery.settings.interval_seconds)

    def any_ready(self) -> list[WorkerLink]:
        """Every ready worker, starting from a rotating one."""
        ready = self.fleet.ready
        if not ready:
            raise self._none_ready()
        self._rotation = (self._rotation + 1) % len(ready)
        return ready[self._rotation :] + ready[: self._rotation]

    async def infer(
        self, path: str, head: InferHead, body: bytes, metadata: Mapping[str, str], deadline: float
    ) -> bytes:
        """A ModelInfer body to the replica the router picks, failing over on
        NOT_FOUND / UNAVAILABLE. Returns the worker's response bytes; raises
        :class:`Relayed` with the worker's status otherwise."""
        replicas = await self.replicas(head.model)
        if replicas:
            preferred = self.of_version(head.model, head.version)
            ticket = self.router.route(head.model, head, preferred or replicas)
            order = ticket.order
            if preferred and not head.version:  # the newest's holders first; the others
                order = [*order, *(n for n in replicas if n not in order)]  # fail over
            try:
                if ticket.hold is not None:  # (at most half the time it has left)
                    await ticket.hold.wait((trio.current_time() + deadline) / 2)
                return await self.try_in_order(
                    path, body, metadata, deadline, order, on_failover=ticket.redirect
                )
            finally:
                ticket.release()
        return await self.try_in_order(path, body, metadata, deadline, self.unserved(head.model))

    async def to_model(
        self,
        path: str,
        model: str,
        body: bytes,
        metadata: Mapping[str, str],
        deadline: float,
        version: str = "",
    ) -> bytes:
        """A call about ``model`` (ModelReady, ModelMetadata, ModelConfig) to a worker
        serving it (first one that has ``version``, or without one the newest version,
        READY: :meth:`of_version`), failing over like ModelInfer."""
        names = list(await self.replicas(model)) or self.unserved(model)
        having = self.of_version(model, version)
        names = [*having, *(n for n in names if n not in having)]
        return await self.try_in_order(path, body, metadata, deadline, names)

    def unserved(self, model: str) -> list[str]:
        """Who answers for ``model`` when no ready worker is known to serve it, even after
        a refresh: served by workers that are down, UNAVAILABLE (raised: worth retrying);
        else :meth:`askable`: a worker that has it in another state (loading, failed:
        UNAVAILABLE, as that worker would say), or any worker (its NOT_FOUND, with the
        text a client of that worker would get)."""
        if not self.fleet.ready:
            raise self._none_ready()
        down = [w.name for w in self.fleet.workers if not w.ready and model in w.serving]
        if down:
            raise self._none_ready(
                f"model {model!r} is served by no ready worker (not ready: {', '.join(down)})"
            )
        return self.askable(model)

    def askable(self, model: str) -> list[str]:
        """Who answers for ``model`` where no ready worker serves it: the ready workers
        that have it in another state (loading, failed), else one ready worker
        (UNAVAILABLE "no worker is ready" when none is)."""
        return [w.name for w in self.fleet.holders(model) or self.any_ready()[:1]]

    def of_version(self, model: str, version: str) -> tuple[str, ...]:
        """The ready workers that answer for ``version`` of ``model`` as one server
        would: those on which it is READY; with no version, those holding the newest
        READY version, when not every replica does (during a rolling upgrade, an
        unversioned request must not get the old version on half its calls: the others
        stay its failover). Empty: no such preference (every replica answers alike, or
        none is known)."""
        if version:
            return self.fleet.version_routes.get((model, version), ())
        return self.fleet.newest_routes.get(model, ())

    async def try_in_order(
        self,
        path: str,
        body: bytes,
        metadata: Mapping[str, str],
        deadline: float,
        order: list[str],
        on_failover: Callable[[str], object] | None = None,
    ) -> bytes:
        """``body`` to the workers named in ``order``, one after the other until one
        answers with a status other than NOT_FOUND / UNAVAILABLE. When none was ready,
        or none of them processed it (unreachable, or refused with a retry pushback), the
        UNAVAILABLE carries a retry pushback."""
        headers = forwarded_headers(metadata)
        last: CallResult | None = None
        last_worker: WorkerLink | None = None
        answer: CallResult | None = None  # the failure to answer with: see below
        reached = False  # some worker may have processed it
        by_name = self.fleet.by_name
        for name in order:
            worker = by_name.get(name)
            if worker is None or not worker.ready:
                continue  # it left the fleet (DNS), or was found down, since routing
            if last is not None:
                _count(last_worker.failovers, last.status)
            if on_failover is not None:
                on_failover(name)  # the work in flight is on this worker (no-op: routed there)
            try:
                result = await self.call(worker, path, body, headers, deadline)
            except DeadlineExceeded:
                raise  # (not sent: no time was left)
            except BaseException:  # cut off by the client: counted as the client sees it
                expired = deadline_cut_off(deadline)
                _count(
                    worker.routed, StatusCode.DEADLINE_EXCEEDED if expired else StatusCode.CANCELLED
                )
                raise
            _count(worker.routed, result.status)
            if result.status == StatusCode.OK and result.response is not None:
                return result.response
            if result.status not in FAILOVER:
                raise Relayed(result.status, result.message)
            if result.status == StatusCode.NOT_FOUND:
                self.discovery.stale()  # its index may be stale
            if answer is None or result.status != StatusCode.NOT_FOUND:
                answer = result  # (a worker's UNAVAILABLE says more than another's NOT_FOUND)
            last, last_worker = result, worker
            # (a worker's own pushback: it refused the call before processing it)
            reached |= result.reached_server and pushback_of(result.trailers) is None
        if answer is None:  # every one found down (or gone) since routing: none was called
            raise self._none_ready(f"no worker is ready ({', '.join(order)} went down)")
        if not reached:
            raise self._none_ready(answer.message)
        raise Relayed(answer.status, answer.message)

    # -- every ready worker ---------------------------------------------------------------

    async def fan_out(
        self,
        path: str,
        body: bytes,
        metadata: Mapping[str, str] | None = None,
        deadline: float = math.inf,
        workers: list[WorkerLink] | None = None,
    ) -> dict[str, CallResult]:
        """``body`` to every ready worker (or ``workers``) at once; each one's result
        by worker name. Raises Unavailable (with a retry pushback) when no worker is
        ready."""
        targets = self.fleet.ready if workers is None else workers
        if not targets:
            raise self._none_ready()
        headers = self.headers if metadata is None else forwarded_headers(metadata)
        results: dict[str, CallResult] = {}

        async def one(worker: WorkerLink) -> None:
            try:
                result = await self.call(worker, path, body, headers, deadline)
            except DeadlineExceeded as e:  # (a result, as for any worker's failure)
                result = UnaryResult(StatusCode.DEADLINE_EXCEEDED, str(e), reached_server=False)
            results[worker.name] = result

        async with trio.open_nursery() as nursery:
            for worker in targets:
                nursery.start_soon(one, worker)
        return results


def first_failure(results: Mapping[str, CallResult]) -> Relayed | None:
    """The first worker's failure (by name order) as the client will see it: named by
    worker, unless every worker failed alike (then as one worker would say it)."""
    answers = {(r.status, r.message) for r in results.values()}
    if len(answers) == 1:
        ((status, message),) = answers
        if status != StatusCode.OK:
            return Relayed(status, message)
    for name in sorted(results):
        result = results[name]
        if result.status != StatusCode.OK:
            return Relayed(result.status, f"worker {name}: {result.message}")
    return None


def merge_each(results: Mapping[str, CallResult], decode: Callable[[bytes], object]) -> list:
    """The decoded OK responses, by worker name order."""
    return [
        decode(results[name].response)
        for name in sorted(results)
        if results[name].status == StatusCode.OK and results[name].response is not None
    ]
