"""The worker: everything one ``rsrv serve`` process serves (see rsrv.worker._main).

One root trio nursery holds every long-lived task: the weight-transfer worker, the
dispatch loop, the gRPC server, the admin HTTP server and the repository watcher; model
loads run in it too. Cancelling the nursery is shutdown; no task or thread outlives it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import trio

from rsrv.bundle import discover
from rsrv.config import ConfigError, ModelSchedConfig, WorkerConfig
from rsrv.errors import BundleError, FailedPrecondition, InvalidArgument, NotFound
from rsrv.protocol import (
    Admission,
    ControlService,
    ControlSnapshot,
    IndexEntry,
    InferenceService,
    LogSettings,
    ModelStatisticsSnapshot,
    SharedMemoryRegistry,
    grpc_status,
    guard,
)
from rsrv.runtime import (
    AllocatorStats,
    Compiler,
    DeviceInfo,
    WeightManager,
    allocator_limit,
    open_device,
    platform,
    staging_route,
    weight_budget,
)
from rsrv.runtime import device as default_device
from rsrv.scheduler import Scheduler
from rsrv.transport import GrpcServer, TransportLimits, methods_of, server_tls_context
from rsrv.worker import _reporting as reporting
from rsrv.worker._executor import DeviceExecutor
from rsrv.worker._models import LoadState, ModelEntry, ModelSet, ServedModel, build_model
from rsrv.worker._pipeline import Pipeline
from rsrv.worker._restrictions import restrictions_of

log = logging.getLogger(__name__)
MAX_NAME_BYTES = 255  # a directory name (NAME_MAX)


class Worker:
    """Everything one ``rsrv serve`` process serves. Start it with :meth:`run`."""

    def __init__(
        self,
        config: WorkerConfig,
        *,
        device: DeviceInfo | None = None,
        allocator: AllocatorStats | None = None,
    ):
        """``device``: what :func:`rsrv.runtime.open_device` reported (opened here when
        None). ``allocator``: where the weight budget and the warm-up scratch measurement
        read the allocator's statistics; None (always, outside tests) reads the device's
        own. Raises ConfigError when ``runtime.weight_staging`` names a route the device
        cannot take."""
        self.config = config
        self.models = ModelSet()
        self.device = open_device() if device is None else device
        device = default_device()
        runtime = config.runtime
        try:
            staging = staging_route(device, runtime.weight_staging)
        except ValueError as e:
            raise ConfigError(f"runtime.weight_staging = {runtime.weight_staging!r}: {e}") from None
        allocator = device if allocator is None else allocator
        limit = allocator_limit(allocator)
        self.weights = WeightManager(
            weight_budget(runtime, limit),
            device,
            config.scheduler.compaction_interval,
            # An explicit byte budget is kept as given; a derived one leaves room for the
            # largest scratch measured while warming models up.
            resize=None
            if runtime.weight_cache_bytes is not None
            else (lambda scratch: weight_budget(runtime, limit, scratch)),
            staging=staging,
            allocator=allocator,
        )
        log.info("weight staging %s", staging.describe())
        log.info(
            "weight cache budget: %s (allocator limit: %s)",
            "off, every model resident"
            if self.weights.cache.budget is None
            else f"{self.weights.cache.budget} bytes",
            "none reported" if limit is None else f"{limit} bytes",
        )
        self.executor = DeviceExecutor(self.weights, runtime.inline_execution_seconds)
        self.scheduler = Scheduler(config.scheduler, self.executor)
        self.pipeline = Pipeline(self.models, self.scheduler, config.scheduler.meta_concurrency)
        self.shm = SharedMemoryRegistry(
            enabled=config.endpoints.system_shared_memory,
            max_regions=config.endpoints.max_shm_regions,
        )
        self.log_settings = LogSettings(config.logging.level, config.logging.format)
        self.max_message_bytes = config.endpoints.max_message_bytes
        self.max_requests_per_stream = config.endpoints.max_requests_per_stream
        self.admission = Admission(config.endpoints.max_concurrent_requests)
        self.restrictions = restrictions_of(config.endpoints)
        self.port: int | None = None
        self.compiler: Compiler | None = None
        self._loading: dict[str, trio.Lock] = {}
        self._residency: dict[str, str] = {}  # floors set by SetModelResidency, by name
        self.watcher = None  # the RepositoryWatcher, in dynamic mode
        self.server: GrpcServer | None = None
        self._nursery: trio.Nursery | None = None

    # -- facts the protocol reports ---------------------------------------------------

    @property
    def platform(self) -> str:
        return platform()

    @property
    def ready(self) -> bool:
        """Live and every model that is not broken has finished loading."""
        entries = self.models.entries.values()
        return all(e.state is not LoadState.LOADING for e in entries)

    @property
    def extensions(self) -> list[str]:
        ext = ["model_repository", "model_configuration", "statistics", "logging", "parameters"]
        if self.config.endpoints.system_shared_memory:
            ext.append("system_shared_memory")
        return ext

    def model_ready(self, name: str) -> bool:
        """READY, and for a meta model, every model it calls is ready too."""
        if not self.models.ready(name):
            return False
        served = self.models.entries[name].model
        return all(self.models.ready(c) for c in served.bundle.signature.calls)

    def model(self, name: str) -> ServedModel:
        return self.models.get(name)

    def max_batch_size(self, name: str) -> int:
        """Rows one dispatch of ``name`` may hold (0: unbatched model or meta)."""
        served = self.models.get(name)
        return self.scheduler.spec(name).max_rows if served.compiled else 0

    async def infer(self, name: str, inputs, deadline: float | None) -> dict:
        return await self.pipeline.infer(name, inputs, deadline=deadline)

    def record(self, name: str, ok: bool, seconds: float, status: str, rows: int) -> None:
        self.pipeline.stats(name).record(ok, seconds, status, rows)

    def statistics(self, name: str) -> ModelStatisticsSnapshot:
        return reporting.statistics(self, name)

    def statistics_names(self) -> list[str]:
        return sorted(n for n in self.models.entries if self.models.ready(n))

    def index(self) -> list[IndexEntry]:
        return reporting.index(self)

    def control_status(self) -> ControlSnapshot:
        return reporting.control(self)

    def weight_of(self, name: str) -> float:
        self._scheduled(name)
        return self.scheduler.stats(name).weight

    def set_weight(self, name: str, weight: float) -> float:
        """SetModelPolicy: ``name``'s fair-share weight, live."""
        self._scheduled(name)
        self.scheduler.set_weight(name, weight)
        return self.scheduler.stats(name).weight

    def _scheduled(self, name: str) -> None:
        if self.models.get(name).bundle.kind == "meta":
            raise FailedPrecondition(
                f"{name!r} is a meta model: it has no scheduling policy of its own "
                "(its calls are scheduled as requests of the models it calls; set theirs)"
            )

    # -- lifecycle ----------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled. ``task_status.started(port)`` once every model at startup
        has been tried (ready or reported unavailable) and the gRPC port accepts calls.

        Tasks: weight transfers, the dispatch loop, the gRPC server, and when configured
        the admin HTTP server and the repository watcher.
        """
        from rsrv.worker._admin import serve_admin
        from rsrv.worker._watcher import RepositoryWatcher

        cfg = self.config
        ep = cfg.endpoints
        self.compiler = Compiler(Path(cfg.cache_dir))
        methods = [
            m
            for service in (InferenceService(self), ControlService(self))
            for m in methods_of(service.service)
        ]
        server = self.server = GrpcServer(
            guard(methods, self.admission, self.restrictions),
            ep.host,
            ep.port,
            limits=TransportLimits(
                max_message_bytes=ep.max_message_bytes,
                max_connections=ep.max_connections,
                max_streams_per_connection=ep.max_streams_per_connection,
                receive_timeout=ep.receive_timeout_seconds,
                handshake_timeout=ep.receive_timeout_seconds,
                idle_timeout=ep.idle_connection_seconds,
            ),
            tls=server_tls_context(ep.tls_cert_file, ep.tls_key_file, ep.tls_client_ca_file)
            if ep.tls_cert_file
            else None,
            status_of=grpc_status,
        )
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(self.weights.run)
                await nursery.start(self.scheduler.run)
                self.port = await nursery.start(server.serve)
                log.info(
                    "gRPC listening on %s:%d%s",
                    ep.host,
                    self.port,
                    " (TLS)" if server.tls else "",
                )
                if cfg.endpoints.metrics_port is not None:
                    await nursery.start(
                        serve_admin, self, cfg.endpoints.host, cfg.endpoints.metrics_port
                    )
                    log.info("admin HTTP on %s:%d", cfg.endpoints.host, cfg.endpoints.metrics_port)
                if cfg.model_control_mode == "dynamic":
                    self.watcher = RepositoryWatcher(
                        Path(cfg.model_repo), cfg.model_poll_seconds, self._load, self._unload
                    )
                    # Fingerprint before the startup load: a bundle that changes while
                    # it loads is reloaded by the watcher, not taken as applied.
                    await trio.to_thread.run_sync(self.watcher.seed)
                if cfg.model_control_mode != "explicit":
                    await self._load_startup_set()
                if self.watcher is not None:
                    await nursery.start(self.watcher.run)
                task_status.started(self.port)
        finally:
            self.shm.close()

    async def shutdown(self) -> None:
        """Graceful stop: refuse new calls, answer everything accepted (within
        ``endpoints.shutdown_grace_seconds``), release shared memory, then cancel."""
        grace = self.config.endpoints.shutdown_grace_seconds
        self.admission.close()
        with trio.move_on_after(grace) as scope:
            # Accepted calls may still be decoding or in a preprocess hook: the scheduler
            # keeps admitting and dispatching until every one has been answered.
            while self.admission.inflight:
                await trio.sleep(0.01)
            await self.scheduler.drain()
        if scope.cancelled_caught:
            log.warning(
                "shutdown grace period of %.1f s expired with %d call(s) in flight",
                grace,
                self.admission.inflight,
            )
        regions = len(self.shm.status())
        self.shm.close()
        log.info("shutdown: released %d shared memory region(s); stopping", regions)
        if self.server is not None:
            # The last answers are flushed, then GOAWAY: clients see a clean end.
            await self.server.close()
        self._nursery.cancel_scope.cancel()

    async def _load_startup_set(self) -> None:
        try:
            paths = discover(Path(self.config.model_repo))
        except BundleError as e:
            log.error("%s", e)
            return
        for path in paths:
            self.models.entries[path.name] = ModelEntry(path.name, path)
        async with trio.open_nursery() as nursery:
            for path in paths:
                nursery.start_soon(self._load, path)

    async def load_model(self, name: str) -> None:
        """RepositoryModelLoad: (re)load ``name`` from the repository (explicit mode)."""
        self._require_explicit("RepositoryModelLoad")
        if (
            not name
            or name.startswith(".")
            or any(c in name for c in "/\\\0")
            or len(name.encode()) > MAX_NAME_BYTES
        ):
            shown = name if len(name) <= 80 else name[:80] + "..."
            raise InvalidArgument(
                f"failed to load {shown!r}: a model name is the name of a directory "
                f"directly under the repository (at most {MAX_NAME_BYTES} bytes)"
            )
        path = Path(self.config.model_repo) / name
        try:
            found = path.is_dir()
        except OSError as e:  # never the repository path: it is the server's business
            raise InvalidArgument(f"failed to load {name!r}: {e.strerror}") from None
        if not found:
            raise NotFound(f"failed to load {name!r}: no such model in the repository")
        entry = self.models.entries.setdefault(name, ModelEntry(name, path))
        if entry.model is None:
            entry.state = LoadState.LOADING
        await self._load(path)
        if entry.model is None or entry.reason:
            raise FailedPrecondition(f"failed to load {name!r}: {entry.reason}")

    async def unload_model(self, name: str) -> None:
        """RepositoryModelUnload (explicit mode): queued requests fail with NOT_FOUND."""
        self._require_explicit("RepositoryModelUnload")
        if name not in self.models.entries:
            raise NotFound(f"unknown model {name!r}")
        await self._unload(name)

    async def _unload(self, name: str) -> None:
        # Under the model's load lock: a load in progress finishes first, so it cannot
        # register its version with the scheduler after the name is gone.
        async with self._loading.setdefault(name, trio.Lock()):
            entry = self.models.entries.pop(name, None)
            self._residency.pop(name, None)
            # Counters start again at the next load, like the scheduler's (and Triton's).
            self.pipeline.statistics.pop(name, None)
            self.pipeline.meta.stats.pop(name, None)
            if entry is not None and entry.model is not None and entry.model.compiled:
                self.scheduler.remove_model(name)  # the executor retires its weights once drained
        log.info("model %s unloaded", name)

    async def set_residency(self, name: str, residency: str) -> str:
        """SetModelResidency (explicit mode): change the floor of the current version of
        a model; for a meta model, of every model it calls. Returns the floor set."""
        served = self.models.get(name)
        self._require_explicit(
            "SetModelResidency",
            "; residency then comes from scheduler.models.<name>.residency",
        )
        for target in self._weight_owners(served):
            await self.weights.set_residency(target.key, residency)
            target.residency = residency
            self._residency[target.name] = residency  # kept across reloads until unload
        served.residency = residency  # a meta reports the floor it set on its models
        return residency

    async def compact_memory(self, reload: list[str]) -> tuple[int, int]:
        """CompactMemory: free every evictable device weight, then reload ``reload`` (a
        meta model's weights are those of the models it calls); returns how many models
        were reloaded and the resident bytes after."""
        keys: dict[str, None] = {}  # ordered, without duplicates
        for name in reload:
            keys.update((t.key, None) for t in self._weight_owners(self.models.get(name)))
        reloaded = await self.weights.compact_and_reload(list(keys))
        return reloaded, self.weights.cache.resident_bytes

    def _weight_owners(self, served) -> list:
        """The versions whose weights ``served`` stands for: itself, or a meta's models."""
        if served.bundle.kind == "meta":
            return [self.models.get(c) for c in served.bundle.signature.calls]
        return [served]

    def _require_explicit(self, rpc: str, hint: str = "") -> None:
        """The one check of the RPCs that only explicit mode accepts."""
        mode = self.config.model_control_mode
        if mode != "explicit":
            raise FailedPrecondition(
                f"{rpc} is only effective when model_control_mode is "
                f"'explicit'; this worker runs in '{mode}' mode{hint}"
            )

    async def _load(self, path: Path) -> None:
        """Build a new version beside the old one; switch atomically only on success."""
        name = path.name
        lock = self._loading.setdefault(name, trio.Lock())
        async with lock:
            entry = self.models.entries.setdefault(name, ModelEntry(name, path))
            policy = self._policy(name)
            served = None
            try:
                served = await build_model(path, self.compiler, self.models.next_generation())
                self._check_calls(served)
                costs = {}
                if served.compiled:
                    served.residency = self.weights.residency_for(
                        self._residency.get(name, policy.residency)
                    )
                    self.executor.versions[served.key] = served
                    await self.weights.add(served.key, served.bundle.weights, served.residency)
                    costs = await self.executor.warm_up(served)
            except Exception as e:  # a bad bundle must never take the worker down
                if served is not None:
                    self.executor.retire(served.key)
                entry.reason = str(e)
                if entry.model is None:
                    entry.state = LoadState.UNAVAILABLE
                    log.error("model %s unavailable: %s", name, e)
                else:
                    log.error(
                        "reload of model %s failed; version %s (load %d) keeps serving: %s",
                        name,
                        entry.model.version,
                        entry.model.generation,
                        e,
                    )
                return
            previous = entry.model
            entry.model, entry.state, entry.reason = served, LoadState.READY, ""
            log.info(
                "model %s version %s ready (load %d%s): %d weight bytes, residency %s",
                name,
                served.version,
                served.generation,
                f", replacing load {previous.generation}" if previous else "",
                served.bundle.weight_bytes,
                served.residency if served.compiled else "none (meta)",
            )
            if served.compiled:
                self.scheduler.add_model(served.spec().with_policy(policy))
                self.scheduler.warm_costs(name, costs)

    def _check_calls(self, served) -> None:
        """A meta may not call a meta, and no meta may come to call the one loading."""
        name = served.name
        for callee in served.bundle.signature.calls:
            entry = self.models.entries.get(callee)
            if entry is not None and entry.model is not None and entry.model.bundle.kind == "meta":
                raise BundleError(
                    f"{served.bundle.manifest_path}: meta.calls: {callee!r} is a "
                    "meta model; meta models may not call other meta models"
                )
        if served.bundle.kind == "meta":
            callers = [
                e.name
                for e in self.models.entries.values()
                if e.model and e.name != name and name in e.model.bundle.signature.calls
            ]
            if callers:
                raise BundleError(
                    f"{served.bundle.manifest_path}: kind: meta model {name!r} is "
                    f"called by meta model(s) {', '.join(callers)}"
                )
        if not self.models.entries.get(name) or not self.models.entries[name].model:
            missing = [c for c in served.bundle.signature.calls if c not in self.models.entries]
            if missing:
                log.warning(
                    "meta model %s calls %s, not (yet) in the repository", name, ", ".join(missing)
                )

    def _policy(self, name: str) -> ModelSchedConfig:
        return self.config.scheduler.models.get(name) or ModelSchedConfig()
