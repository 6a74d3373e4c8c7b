"""Discovery: which worker is up and what it serves, learnt by probing on an interval.

Each round asks every worker, concurrently and each within ``probe_timeout_seconds``,
for ServerReady and RepositoryIndex, then swaps the new routes in. ModelControlStatus
(it costs a worker more: 8 ms p50 against 3.7 ms at 1,000 models that served requests)
is asked every round when the scheduling mode reads costs (``needs_control``), else when
a worker is newly ready, its index changed, or its channel opened a new connection (a
worker that restarted between two rounds broke the old one; load opens more too), and
again every round until such an ask has been answered. It lists every model the worker
serves, the sub-models a meta calls too (RepositoryIndex leaves them out), and the
worker process's ``instance``, which tells a restart; a worker without the control
service (UNIMPLEMENTED) is routed by its index alone. A worker that does not answer gets
no traffic from that round on, and gets it back at the first round it answers. A
request for a model no worker is known to serve wakes the discovery task for a round now
(at most one per ``refresh_min_seconds``) and waits for it before it is refused; its
deadline cuts short its wait, never the round.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable

import trio
from purerpc.grpclib.status import StatusCode

from rsrv.config import GatewayConfig
from rsrv.gateway._fleet import Fleet, IndexRow, WorkerLink
from rsrv.protocol import RESTRICTED_MESSAGE
from rsrv.protocol.generated.inference import grpc_service_pb2 as pb
from rsrv.protocol.generated.rsrv.control.v1 import control_pb2 as control_pb

__all__ = ["CONTROL_STATUS", "Discovery", "SERVER_READY", "REPOSITORY_INDEX"]

log = logging.getLogger("rsrv.gateway")

SERVER_READY = "/inference.GRPCInferenceService/ServerReady"
REPOSITORY_INDEX = "/inference.GRPCInferenceService/RepositoryIndex"
CONTROL_STATUS = "/rsrv.control.v1.ControlService/ModelControlStatus"
_EMPTY = b""

#: A worker that has not answered yet is taken as starting (a process started beside the
#: gateway imports JAX first) for this long after its first probe; see Discovery._call.
STARTING_SECONDS = 30.0


class Discovery:
    """Keeps ``fleet`` current. ``before_round()`` runs first in every round (the
    fleet's membership, from DNS); ``on_round()`` after it (the scheduler's tick);
    ``needs_control`` asks every ready worker for ModelControlStatus every round."""

    def __init__(
        self,
        fleet: Fleet,
        config: GatewayConfig,
        *,
        needs_control: bool = False,
        on_round: Callable[[], None] = lambda: None,
        before_round: Callable[[], Awaitable[None]] | None = None,
    ):
        self.fleet = fleet
        self.settings = config.discovery
        # a worker busy for longer than any call of the gateway's lasts is stuck, not busy
        self._busy_limit = config.worker_client.request_timeout_seconds
        self.headers: Iterable[tuple[str, str]] = tuple(config.worker_client.headers.items())
        self.needs_control = needs_control
        self.on_round = on_round
        self.before_round = before_round
        self.rounds = 0
        self._failing: set[tuple[str, str]] = set()  # (worker, path) whose failure was logged
        self._first_probe: dict[str, float] = {}  # worker -> when it was first probed
        self._started = 0  # rounds begun (``rounds``: completed)
        self._round_done = trio.Event()  # set as each round completes
        self._wake = trio.Event()
        self._last_refresh = -float("inf")
        self._refresh_round = 0  # the round the last refresh woke (requests wait for it)
        self._change_round = 0  # the round that shows the last change made through the gateway
        self._background: trio.Nursery | None = None  # run()'s: workers probed apart
        self._apart: set[str] = set()  # the workers being probed apart (see round)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Probe every interval until cancelled; ``started()`` after the first round."""
        async with trio.open_nursery() as background:
            self._background = background
            try:
                await self.round()
                task_status.started()
                while True:
                    with trio.move_on_after(self.settings.interval_seconds):
                        await self._wake.wait()
                    self._wake = trio.Event()
                    await self.round()
            finally:
                self._background = None

    def wake(self) -> None:
        """Run the next round now (an operator's repack)."""
        self._wake.set()

    def changed(self) -> None:
        """A change was made through the gateway (a model loaded or unloaded): run the
        next round now. Until it has completed, :meth:`refresh` waits for it."""
        self._change_round = self._started + 1
        self._wake.set()

    def stale(self) -> None:
        """A call found the routes out of date (a worker answered NOT_FOUND for a model
        they gave it, or was found unreachable): wake the next round, at most once per
        ``refresh_min_seconds`` (a client asking for an unknown model, or a worker
        refusing every call while it answers the probes, must not turn each request
        into a probe of the whole fleet)."""
        self._woken_round()

    def _woken_round(self) -> int:
        """The round the last refresh woke: a new one now, unless one was woken within
        ``refresh_min_seconds``."""
        now = trio.current_time()
        if now - self._last_refresh >= self.settings.refresh_min_seconds:
            self._last_refresh = now
            self._refresh_round = self._started + 1
            self._wake.set()
        return self._refresh_round

    async def round(self) -> None:
        """One round, in the caller's task (:meth:`run`'s; tests). A worker that
        answered before and is not ready now is probed apart, in :meth:`run`'s
        background (a wedged one takes its whole probe timeout), so that neither this
        round nor the next waits for it (:meth:`refresh` waits for rounds: an unknown
        model's NOT_FOUND took that long); once it answers ready again, the routes are
        rebuilt and a round runs at once."""
        self._started += 1
        if self.before_round is not None:
            await self.before_round()  # membership first (DNS)
        async with trio.open_nursery() as nursery:
            for worker in self.fleet.workers:
                if worker.name in self._apart:
                    continue  # (still probed from an earlier round)
                if self._background is not None and not worker.ready and worker.ever_answered:
                    self._background.start_soon(self._probe_apart, worker)
                else:
                    nursery.start_soon(self._probe, worker)
        self.fleet.rebuild_routes()
        self.rounds += 1
        self.on_round()
        self._round_done.set()
        self._round_done = trio.Event()

    async def _probe_apart(self, worker: WorkerLink) -> None:
        self._apart.add(worker.name)
        try:
            await self._probe(worker)
        finally:
            self._apart.discard(worker.name)
        if worker.ready and self.fleet.by_name.get(worker.name) is worker:  # back
            self.fleet.rebuild_routes()
            self.wake()  # (a round now: its catch-up and the scheduler's tick, as usual)

    async def changes_seen(self) -> None:
        """Wait until a round has shown the last change made through the gateway
        (:meth:`changed`); at once when one has. Cancelling the caller cancels only
        the wait."""
        await self._round(self._change_round)

    async def refresh(self) -> None:
        """Wait for the round that shows the last change made through the gateway, when
        it has not completed yet (:meth:`changed`); else wake the discovery task for a
        round now and wait until a round begun after this call has completed. Within
        ``refresh_min_seconds`` of the last such wake-up (an unknown model must not turn
        every request into a probe of the whole fleet), it only waits for the round that
        one woke, if it has not completed. The round runs in the discovery task:
        cancelling the caller (its deadline, a reset) cancels only the wait."""
        target = self._change_round
        if self.rounds >= target:
            target = self._woken_round()  # (an earlier one completed already: no wait)
        await self._round(target)

    async def _round(self, number: int) -> None:
        """Wait until round ``number`` has completed."""
        while self.rounds < number:
            await self._round_done.wait()

    def forget_worker(self, worker: str) -> None:
        """``worker`` left the fleet (DNS): drop what is kept of it."""
        self._failing = {key for key in self._failing if key[0] != worker}
        self._first_probe.pop(worker, None)

    async def _call(self, worker: WorkerLink, path: str) -> tuple[StatusCode, bytes | None]:
        """The call's status, and its response when it succeeded. A failure is logged,
        unless the worker is going away (UNAVAILABLE from a worker that has answered
        before) or has no control service: as a warning the first time, then at debug
        level until that call succeeds again (a failure that repeats every round is
        reported once). A worker that has never answered is starting, for
        :data:`STARTING_SECONDS` after it was first probed: its failures are logged at
        info level meanwhile (a mistyped endpoint is warned about after that)."""
        timeout = self.settings.probe_timeout_seconds
        # (not behind the clients' calls: a worker busy with as many as the gateway
        # sends it at once is answering, and must not look wedged)
        result = await worker.channel.unary(
            path, _EMPTY, metadata=self.headers, timeout=timeout, capped=False
        )
        key = (worker.name, path)
        if result.status == StatusCode.OK and result.response is not None:
            self._failing.discard(key)
            return result.status, result.response
        if result.status == StatusCode.RESOURCE_EXHAUSTED:  # at its in-flight cap: busy
            log.debug("worker %s is busy: %s", worker.name, result.message)
            return result.status, None
        # A worker that answered before and is now unreachable is going away (the
        # "not ready" warning says so); one that never answered is warned about; so is
        # one refusing the gateway's own call for its restricted protocol's header.
        restricted = result.message.startswith(RESTRICTED_MESSAGE)
        quiet = (
            result.status == StatusCode.UNAVAILABLE and worker.ever_answered and not restricted
        ) or (result.status == StatusCode.UNIMPLEMENTED and path == CONTROL_STATUS)
        if not quiet and not worker.ever_answered:
            first = self._first_probe.setdefault(worker.name, trio.current_time())
            if trio.current_time() - first < STARTING_SECONDS:
                log.info(
                    "worker %s has not answered yet (%s to %s: %s)",
                    worker.name,
                    result.status.name,
                    path.rsplit("/", 1)[1],
                    result.message,
                )
                return result.status, None
        if not quiet:
            (log.debug if key in self._failing else log.warning)(
                "worker %s answered %s to %s: %s%s",
                worker.name,
                result.status.name,
                path.rsplit("/", 1)[1],
                result.message,
                " (the gateway's calls carry worker_client.headers)" if restricted else "",
            )
            self._failing.add(key)
        return result.status, None

    def _still_busy(self, worker: WorkerLink, was_ready: bool) -> bool:
        """Whether a worker whose probe found it at its in-flight cap stays as it was
        (busy, not wedged): ready or not, until it has refused every probe for longer
        than any call of the gateway's lasts (worker_client.request_timeout_seconds),
        when its slots are held by calls that do not end: then not ready."""
        now = trio.current_time()
        if worker.busy_since is None:
            worker.busy_since = now
        if not was_ready or now - worker.busy_since < self._busy_limit:
            return was_ready
        log.warning(
            "worker %s (%s) has refused every probe at its in-flight cap for %.0f s, "
            "longer than worker_client.request_timeout_seconds: no traffic until it answers",
            worker.name,
            worker.address,
            now - worker.busy_since,
        )
        return False

    async def _probe(self, worker: WorkerLink) -> None:
        was_ready, marks = worker.ready, worker.unreachable_marks
        ready, index, control = False, worker.index, worker.control
        with trio.move_on_after(self.settings.probe_timeout_seconds * 3):
            status, answer = await self._call(worker, SERVER_READY)
            if status == StatusCode.RESOURCE_EXHAUSTED:  # at its in-flight cap: busy,
                worker.ever_answered, ready = True, self._still_busy(worker, was_ready)
            else:
                worker.busy_since = None
            if answer is not None:
                worker.ever_answered = True
                ready = pb.ServerReadyResponse.FromString(answer).ready
                status, answer = await self._call(worker, REPOSITORY_INDEX)
                if status == StatusCode.RESOURCE_EXHAUSTED:
                    ready = was_ready  # busy: its last index stands
                elif answer is not None:
                    index = tuple(
                        IndexRow(m.name, m.version, m.state, m.reason)
                        for m in pb.RepositoryIndexResponse.FromString(answer).models
                    )
                    # A worker is not ServerReady while it loads a model (strict
                    # readiness); its READY models still serve, and control RPCs (the
                    # next load) must still reach it.
                    ready = ready or any(row.state == "LOADING" for row in index)
                else:
                    ready = False
                if ready and (
                    self.needs_control
                    or worker.control_due
                    or not was_ready
                    or index != worker.index
                    or worker.channel.opened != worker.opened
                ):
                    # due until answered: an ask the round's time limit cuts short stays due
                    worker.opened, worker.control_due = worker.channel.opened, True
                    status, answer = await self._call(worker, CONTROL_STATUS)
                    if answer is not None:
                        control = control_pb.ModelControlStatusResponse.FromString(answer)
                    elif status == StatusCode.UNIMPLEMENTED or not was_ready:
                        control = None  # no control service, or nothing known of this run
                    # UNIMPLEMENTED is an answer; any other failure: asked again next round
                    worker.control_due = answer is None and status != StatusCode.UNIMPLEMENTED
        if worker.unreachable_marks != marks:
            ready = False  # a call found it unreachable meanwhile: that is newer news
            was_ready = worker.ready
        if ready and not was_ready and control is worker.control:
            control = None  # cut short: the last answer may be of a process now gone
        worker.probe_failures = 0 if ready else worker.probe_failures + 1
        worker.ready, worker.index, worker.control = ready, index, control
        worker.away |= not ready
        if control is not None and control.instance:
            if worker.instance and control.instance != worker.instance:
                worker.restarted = True  # between two rounds, unseen otherwise
            worker.instance = control.instance
        if ready != was_ready:
            if ready:
                log.info("worker %s (%s) is ready", worker.name, worker.address)
            else:
                log.warning("worker %s (%s) is not ready", worker.name, worker.address)
        elif worker.restarted:
            log.warning("worker %s (%s) restarted", worker.name, worker.address)
