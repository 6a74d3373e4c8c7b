"""The ``rsrv gateway`` process: its task tree, readiness and graceful stop.

One nursery holds the worker channels, the discovery prober (which also drives the
scheduler's tick and repacks), the gRPC server and the admin HTTP server; signals and
the supervisor link are ``rsrv.lifeline.serve_process``'s, as for a worker::

    Gateway.run
    ├── worker channels        one pooled HTTP/2 client per worker (joining and leaving
    │                          with DNS when endpoints_dns is set)
    ├── Discovery.run          probe every worker each interval; routes; scheduler tick
    ├── GrpcServer.serve       the KServe V2 surface and the control services
    └── serve_gateway_admin    /healthz /readyz /metrics  (when listen.metrics is set)
"""

from __future__ import annotations

import logging
import math

import trio
from purerpc.grpclib.status import StatusCode

from rsrv.config import GatewayConfig, join_address, split_address, unusable_tls
from rsrv.gateway._admin import serve_gateway_admin
from rsrv.gateway._control import GatewayControl
from rsrv.gateway._discovery import Discovery
from rsrv.gateway._fleet import Fleet, WorkerLink, is_local_host
from rsrv.gateway._forward import CONTROL, Forwarder
from rsrv.gateway._scheduling import Scheduling
from rsrv.gateway._services import GatewayServices
from rsrv.protocol import (
    Admission,
    HealthService,
    grpc_status,
    grpc_trailers,
    guard,
    restrictions_of,
)
from rsrv.protocol.generated.rsrv.control.v1 import control_pb2 as control_pb
from rsrv.transport import (
    TLS_ERRORS,
    ClientLimits,
    GrpcServer,
    client_tls,
    open_channel,
)

__all__ = ["Gateway"]

log = logging.getLogger("rsrv.gateway")


class Gateway:
    """Everything one ``rsrv gateway`` process serves. Start it with :meth:`run`."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        workers = []
        for name, address in zip(config.names, config.endpoints, strict=True):
            host, port = split_address(address)
            workers.append(WorkerLink(name, address, host, port, None, is_local_host(host)))
        self.fleet = Fleet(workers)
        self.scheduler = Scheduling(
            config.scheduling, self.fleet, config.discovery.startup_wait_seconds
        )
        self.discovery = Discovery(
            self.fleet,
            config,
            needs_control=self.scheduler.needs_control,
            on_round=self._after_round,
            before_round=self._resolve_dns,
        )
        self.forwarder = Forwarder(
            self.fleet,
            self.discovery,
            self.scheduler,
            request_timeout=config.worker_client.request_timeout_seconds,
            headers=config.worker_client.headers.items(),
        )
        grpc = config.grpc
        self.admission = Admission(
            grpc.max_concurrent_requests_per_worker * len(workers),
            "grpc.max_concurrent_requests_per_worker x workers",
        )
        self.services = GatewayServices(
            self.fleet,
            self.forwarder,
            self.admission,
            grpc.max_requests_per_stream,
            grpc.max_message_bytes,
        )
        self.control = GatewayControl(self.scheduler, self.discovery)
        self.stopping = False
        self.port: int | None = None
        self._nursery: trio.Nursery | None = None
        self._resolved: dict[str, dict[str, tuple[str, int]]] = {}  # by endpoints_dns entry
        self._unresolved: set[str] = set()  # endpoints_dns entries failing to resolve now
        host, port = split_address(config.listen.grpc)
        self.health = HealthService.beside(lambda: self.ready, config.grpc.max_connections)
        restrictions = restrictions_of(config.grpc.restricted, "grpc.restricted")
        if config.worker_client.headers and not any(
            "gateway-control" in r.protocols for r in restrictions
        ):
            log.warning(
                "grpc.restricted leaves gateway-control open: any client of the gateway may "
                "steer its placement (set-replicas, set-policy, repack), and a repack's "
                "CompactMemory goes to the workers with worker_client.headers"
            )
        try:
            self.server = GrpcServer.configured(
                guard(
                    [
                        *self.services.methods(),
                        *self.control.methods(),
                        # grpc.health.v1: "ready" is gateway.ready (a ready worker, not
                        # stopping)
                        *self.health.methods(),
                    ],
                    self.admission,
                    restrictions,
                ),
                host,
                port,
                grpc,
                status_of=grpc_status,
                trailers_of=grpc_trailers,
                message_setting="grpc.max_message_bytes",
            )
            worker_tls = client_tls(config.worker_client)
        except TLS_ERRORS as e:
            raise unusable_tls(config.tls_files(), e) from None
        limits = ClientLimits(
            max_concurrent_streams=config.worker_client.max_concurrent_streams,
            max_send_message_bytes=grpc.max_message_bytes,
            max_receive_message_bytes=grpc.max_message_bytes,
            message_setting="grpc.max_message_bytes",
        )
        self._channel_settings = (worker_tls, limits)

    @property
    def ready(self) -> bool:
        """Serving, and at least one worker ready."""
        return self.port is not None and not self.stopping and bool(self.fleet.ready)

    def scheduler_metrics(self):
        return self.scheduler.metrics()

    def _after_round(self) -> None:
        catchup = self.services.catchup
        fleet = self.fleet
        catchup.forget_absent(fleet.known_models(), all(w.ready for w in fleet.workers))
        catchup.start(self.fleet.returned())
        outcome = self.scheduler.tick()
        if outcome is not None and outcome.compaction is not None and self._nursery:
            self._nursery.start_soon(self._compact, outcome.compaction.reload)

    async def _compact(self, reload: dict[str, list[str]]) -> None:
        """CompactMemory on the workers a repack changed (scheduling.compaction_mode)."""
        for name, models in reload.items():
            worker = self.fleet.by_name.get(name)
            if worker is None or not worker.ready:
                continue
            body = control_pb.CompactMemoryRequest(reload_models=models).SerializeToString()
            result = await self.forwarder.call(
                worker, CONTROL + "CompactMemory", body, self.forwarder.headers, math.inf
            )
            if result.status != StatusCode.OK:
                log.warning("CompactMemory on %s after a repack: %s", name, result.message)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled (or :meth:`shutdown`); ``started(port)`` once the
        gRPC server listens (after the first discovery round)."""
        cfg = self.config
        host = split_address(cfg.listen.grpc)[0]
        async with trio.open_nursery() as channels:
            self._channels = channels
            for worker in self.fleet.workers:
                await channels.start(self._hold_channel, worker)
            async with trio.open_nursery() as nursery:
                self._nursery = self.services.catchup.nursery = nursery
                await nursery.start(self.discovery.run)
                await nursery.start(self.health.run)
                self.port = await nursery.start(self.server.serve)
                log.info(
                    "gateway listening on %s:%d%s, %d worker(s), scheduling %s",
                    host,
                    self.port,
                    " (TLS)" if self.server.tls else "",
                    len(self.fleet.workers),
                    cfg.scheduling.mode,
                )
                if cfg.listen.metrics is not None:
                    admin_host, admin_port = split_address(cfg.listen.metrics)
                    await nursery.start(serve_gateway_admin, self, admin_host, admin_port)
                    log.info("admin HTTP on %s:%d", admin_host, admin_port)
                task_status.started(self.port)
            channels.cancel_scope.cancel()  # the last call has been answered: close them

    async def _hold_channel(self, worker: WorkerLink, *, task_status=trio.TASK_STATUS_IGNORED):
        """Keep ``worker``'s channel open until the worker leaves the fleet."""
        tls, limits = self._channel_settings
        worker.leaving = trio.Event()
        async with open_channel(worker.host, worker.port, tls=tls, limits=limits) as channel:
            worker.channel = channel
            task_status.started()
            await worker.leaving.wait()
            with trio.move_on_after(self.config.worker_client.request_timeout_seconds):
                while worker.inflight:  # calls already sent finish first
                    await trio.sleep(0.05)

    async def _resolve_dns(self) -> None:
        """Bring the fleet in line with what ``endpoints_dns`` resolves to now: new
        addresses join (probed before they get traffic), vanished ones leave. A name
        that fails to resolve, or takes longer than a probe, keeps the workers it last
        resolved to. A name with both IPv4 and IPv6 addresses (a dual-stack Service
        lists each pod once per family) is taken by its IPv4 addresses, which a worker
        listening on ``0.0.0.0`` or ``::`` both accept."""
        if not self.config.endpoints_dns:
            return
        found: dict[str, tuple[str, int]] = {}
        for entry in self.config.endpoints_dns:
            host, port = split_address(entry)
            infos = None
            limit = self.config.discovery.probe_timeout_seconds
            failure = None
            with trio.move_on_after(limit) as timer:
                try:
                    infos = await trio.socket.getaddrinfo(host, port, type=trio.socket.SOCK_STREAM)
                except OSError as e:
                    failure = f"cannot resolve {entry}: {e}"
            if timer.cancelled_caught:
                failure = f"resolving {entry} took over {limit:g} s"
            if infos is None:  # (once per streak of failures: not every round)
                (log.debug if entry in self._unresolved else log.warning)(
                    "%s (keeping its workers)", failure
                )
                self._unresolved.add(entry)
                found.update(self._resolved.get(entry, {}))
                continue
            if entry in self._unresolved:
                self._unresolved.discard(entry)
                log.info("%s resolves again", entry)
            families = {info[0] for info in infos}
            family = trio.socket.AF_INET if trio.socket.AF_INET in families else None
            resolved = self._resolved[entry] = {}
            for info_family, _, _, _, sockaddr in infos:
                if family is None or info_family == family:
                    resolved[join_address(sockaddr[0], port)] = (sockaddr[0], port)
            found.update(resolved)
        current = {w.name for w in self.fleet.workers if w.from_dns}
        for name in sorted(current - found.keys()):
            log.info("worker %s left (no longer in DNS)", name)
            self.fleet.remove(name).leaving.set()
            for part in (self.discovery, self.scheduler, self.services.catchup):
                part.forget_worker(name)
        for name in sorted(found.keys() - current):
            host, port = found[name]
            worker = WorkerLink(name, name, host, port, None, is_local_host(host), from_dns=True)
            await self._channels.start(self._hold_channel, worker)
            self.fleet.add(worker)  # with its channel: a probe may call it from now on
            log.info("worker %s joined (from DNS)", name)
        self.admission.limit = self.config.grpc.max_concurrent_requests_per_worker * max(
            1, len(self.fleet.workers)
        )

    async def shutdown(self) -> None:
        """Graceful stop: refuse new calls, let the ones in flight finish (within
        ``grpc.shutdown_grace_seconds``), then close the connections and stop."""
        self.stopping = True
        self.admission.close()
        with trio.move_on_after(self.config.grpc.shutdown_grace_seconds) as scope:
            while self.admission.inflight:
                await trio.sleep(0.01)
        if scope.cancelled_caught:
            log.warning(
                "shutdown grace period expired with %d call(s) in flight", self.admission.inflight
            )
        await self.server.close(ending=self.admission.refusal())
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()
