"""The worker: everything one ``rsrv serve`` process serves (see rsrv.worker._main).

One root trio nursery holds every long-lived task: the weight-transfer worker, the
dispatch loop, the gRPC server, the admin HTTP server and the repository watcher; model
loads run in it too. Cancelling the nursery is shutdown; no task or thread outlives it.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import trio

from rsrv.config import ConfigError, WorkerConfig, unusable_tls
from rsrv.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from rsrv.protocol import (
    Admission,
    ControlService,
    ControlSnapshot,
    HealthService,
    IndexEntry,
    InferenceService,
    LoadOverride,
    LogSettings,
    ModelStatisticsSnapshot,
    SharedMemoryRegistry,
    grpc_status,
    grpc_trailers,
    guard,
    restrictions_of,
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
from rsrv.threads import run_sync
from rsrv.transport import TLS_ERRORS, GrpcServer, methods_of
from rsrv.worker import _files as files_override
from rsrv.worker import _reporting as reporting
from rsrv.worker._executor import DeviceExecutor
from rsrv.worker._loading import ModelLoader
from rsrv.worker._models import (
    LoadState,
    ModelSet,
    ServedModel,
)
from rsrv.worker._pipeline import Pipeline

log = logging.getLogger(__name__)
MAX_NAME_BYTES = 255  # a directory name (NAME_MAX)
#: How long a stop waits for the REST port's graceful close: hypercorn gives the answers
#: under way a second (its graceful_timeout), then ends its ASGI lifespan.
REST_CLOSE_SECONDS = 3.0


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
        own. Raises ConfigError when ``model_repo`` is not a directory (a mistyped path
        would serve nothing, and say ready), when ``runtime.weight_staging`` names a route
        the device cannot take, or a TLS file of ``endpoints`` cannot be read or used."""
        if not Path(config.model_repo).is_dir():
            raise ConfigError(f"model_repo {config.model_repo}: not a directory")
        self.config = config
        self.instance = uuid.uuid4().hex  # ModelControlStatus.instance: new at each start
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
        self.hold = self.pipeline.hold  # InferenceBackend.hold (one call less per request)
        self.shm = SharedMemoryRegistry(
            enabled=config.endpoints.system_shared_memory,
            max_regions=config.endpoints.max_shm_regions,
        )
        self.log_settings = LogSettings(config.logging.level, config.logging.format)
        self.max_message_bytes = config.endpoints.max_message_bytes
        self.max_requests_per_stream = config.endpoints.max_requests_per_stream
        self.admission = Admission(config.endpoints.max_concurrent_requests)
        self.restrictions = restrictions_of(config.endpoints.restricted, "endpoints.restricted")
        self.port: int | None = None
        self.http_port: int | None = None  # the REST port bound, once serving
        self.rest_stop = trio.Event()  # set: the REST port closes gracefully
        self.rest_stopped = trio.Event()  # set once it has
        self.loader = ModelLoader(
            config, self.models, self.weights, self.executor, self.scheduler, self.pipeline
        )
        self.watcher = None  # the RepositoryWatcher, in dynamic mode
        self._nursery: trio.Nursery | None = None
        ep = config.endpoints
        self.inference = InferenceService(self)  # the REST endpoint answers through it too
        methods = [
            m
            for service in (self.inference, ControlService(self))
            for m in methods_of(service.service)
        ]
        # grpc.health.v1: ready while ServerReady is and the worker is not draining.
        self.health = HealthService.beside(
            lambda: self.ready and not self.admission.closed, ep.max_connections
        )
        methods += self.health.methods()
        try:
            self.server = GrpcServer.configured(
                guard(methods, self.admission, self.restrictions),
                ep.host,
                ep.port,
                ep,
                status_of=grpc_status,
                trailers_of=grpc_trailers,
            )
        except TLS_ERRORS as e:
            raise unusable_tls(ep.tls_files(), e) from None

    # -- facts the protocol reports ---------------------------------------------------

    @property
    def platform(self) -> str:
        return platform()

    @property
    def ready(self) -> bool:
        """Live, the models to load at startup known, and every model that is not broken
        has finished loading."""
        if not self.loader.startup_known:  # (the port listens before they are)
            return False
        entries = self.models.entries.values()
        return all(e.state is not LoadState.LOADING for e in entries)

    @property
    def extensions(self) -> list[str]:
        ext = ["model_repository", "model_configuration", "statistics", "logging", "parameters"]
        if self.config.endpoints.system_shared_memory:
            ext.append("system_shared_memory")
        return ext

    def model_ready(self, name: str, version: int | None = None) -> bool:
        """READY (that version, or any), and for a meta model, every model it calls is
        ready too."""
        if not self.models.ready(name, version):
            return False
        served = self.models.get(name, version)
        return all(self.models.ready(c) for c in served.bundle.signature.calls)

    def model(self, name: str, version: int | None = None) -> ServedModel:
        return self.models.get(name, version)

    def ready_versions(self, name: str) -> list[str]:
        entry = self.models.entries.get(name)
        return [] if entry is None else [str(v.number) for v in entry.ready()]

    async def infer(
        self, model: ServedModel, inputs, deadline: float | None, held: object = None
    ) -> dict:
        return await self.pipeline.infer(model, inputs, deadline=deadline, held=held)

    def record(self, model: ServedModel, ok: bool, seconds: float, status: str, rows: int):
        self.pipeline.record(model, ok, seconds, status, rows)

    def statistics(self, name: str, version: int | None) -> list[ModelStatisticsSnapshot]:
        return reporting.statistics(self, name, version)

    async def index(self) -> list[IndexEntry]:
        in_repository = set()
        if self.config.model_control_mode == "explicit":
            in_repository = await run_sync(reporting.repository_names, Path(self.config.model_repo))
        return reporting.index(self, in_repository)

    def control_status(self) -> ControlSnapshot:
        return reporting.control(self)

    def weight_of(self, name: str) -> float:
        self._scheduled(name)
        return self.scheduler.stats(name).weight

    def set_weight(self, name: str, weight: float) -> float:
        """SetModelPolicy: ``name``'s fair-share weight, live, kept across reloads until
        the model is unloaded."""
        self._scheduled(name)
        self.scheduler.set_weight(name, weight)
        self.loader.fair_weights[name] = weight
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

        Tasks: weight transfers, the dispatch loop, the health poller, the gRPC server,
        and when configured the admin HTTP server, the KServe V2 REST server and the
        repository watcher.
        """
        from rsrv.worker._admin import serve_admin
        from rsrv.worker._rest import serve_rest
        from rsrv.worker._watcher import RepositoryWatcher

        cfg = self.config
        ep = cfg.endpoints
        self.loader.compiler = Compiler(Path(cfg.cache_dir), cfg.cache_max_bytes)
        server = self.server
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(self.weights.run)
                await nursery.start(self.scheduler.run)
                await nursery.start(self.health.run)
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
                if ep.http_port is not None:
                    self.http_port = await nursery.start(serve_rest, self, self.inference)
                    log.info("KServe V2 REST on %s:%d", ep.host, self.http_port)
                if cfg.model_control_mode == "dynamic":
                    self.watcher = RepositoryWatcher(
                        Path(cfg.model_repo),
                        cfg.model_poll_seconds,
                        self.loader.load,
                        self.loader.unload,
                    )
                    # Fingerprint before the startup load: a bundle that changes while
                    # it loads is reloaded by the watcher, not taken as applied.
                    await trio.to_thread.run_sync(self.watcher.seed)
                if cfg.model_control_mode != "explicit":
                    await self.loader.load_startup_set()
                if self.watcher is not None:
                    await nursery.start(self.watcher.run)
                task_status.started(self.port)
        finally:
            self.shm.close()

    async def shutdown(self) -> None:
        """Graceful stop: refuse new calls, answer everything accepted (within
        ``endpoints.shutdown_grace_seconds``), release shared memory, then cancel. Also
        during start-up (the port listens while models load; the loads are cancelled)."""
        grace = self.config.endpoints.shutdown_grace_seconds
        self.admission.close()
        self.scheduler.hurry()  # what is accepted runs without waiting for company
        with trio.move_on_after(grace if self.port is not None else 0) as scope:
            # Accepted calls may still be decoding or in a preprocess hook: the scheduler
            # keeps admitting and dispatching until every one has been answered. (Not
            # listening yet, early in start-up: nothing was accepted.)
            while self.admission.inflight:
                await trio.sleep(0.01)
            await self.scheduler.drain()
        if scope.cancelled_caught and self.port is not None:
            log.warning(
                "shutdown grace period of %.1f s expired with %d call(s) in flight",
                grace,
                self.admission.inflight,
            )
        regions = len(self.shm.status())
        self.shm.close()
        log.info("shutdown: released %d shared memory region(s); stopping", regions)
        # The last answers are flushed, open streams (idle now) are ended UNAVAILABLE,
        # then GOAWAY: clients see a clean end.
        await self.server.close(ending=self.admission.refusal())
        if self.http_port is not None:  # its answers under way (503s too) are finished
            self.rest_stop.set()
            with trio.move_on_after(REST_CLOSE_SECONDS):
                await self.rest_stopped.wait()
        if self._nursery is not None:  # (None: stopped before its tasks started)
            self._nursery.cancel_scope.cancel()

    async def load_model(
        self,
        name: str,
        override: LoadOverride | None = None,
        files: dict[str, bytes] | None = None,
    ) -> None:
        """RepositoryModelLoad: (re)load every version of ``name`` its version policy
        selects, from the repository (explicit mode). ``override``: the config
        override's settings, for this load; ``files``: ``file:`` contents, written into
        the model's directory first when its per-model config allows it."""
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
        if files:
            allowed = self.loader.policy_of(name).allow_file_overrides
            await trio.to_thread.run_sync(
                files_override.write, Path(self.config.model_repo), name, files, allowed
            )
        try:
            found = path.is_dir()
        except OSError as e:  # never the repository path: it is the server's business
            raise InvalidArgument(f"failed to load {name!r}: {e.strerror}") from None
        if not found:  # Triton's words first
            raise NotFound(
                f"failed to load {name!r}, failed to poll from model repository: no such "
                "model in the repository"
            )
        await self._unabandoned(self.loader.load, path, force=True, override=override)
        entry = self.models.entries.get(name)
        if entry is None:  # unloaded meanwhile
            return
        failures = [
            f"version {n}: {entry.versions[n].reason}"
            for n in entry.selected
            if entry.versions[n].reason
        ]
        if entry.problem or failures:
            reasons = ([entry.problem] if entry.problem else []) + failures
            raise FailedPrecondition(f"failed to load {name!r}: {'; '.join(reasons)}")

    async def _unabandoned(self, fn, *args, **kwargs) -> None:
        """Await ``fn(*args, **kwargs)`` run as a task of the worker's: a caller that gives
        up (its client's deadline, a disconnect) leaves it to finish, as Triton does,
        instead of cutting it off between its steps (a load cut off so kept weights
        registered and pinned, and its model LOADING for good: ServerReady false).
        Raises what it raised; Unavailable when the worker stopped it."""
        done = trio.Event()
        ended: list[Exception | None] = []  # what it raised, None: returned (empty: cancelled)

        async def task() -> None:
            try:
                await fn(*args, **kwargs)
                ended.append(None)
            except Exception as e:
                ended.append(e)
            finally:
                done.set()

        self._nursery.start_soon(task)
        await done.wait()
        if not ended:
            raise Unavailable("the worker stopped before it was done")
        error = ended.pop()  # (the list, in task's frame, would hold it: a cycle through
        if error is not None:  # its traceback, keeping the request until a collection)
            try:
                raise error
            finally:
                del error

    async def unload_model(self, name: str) -> None:
        """RepositoryModelUnload (explicit mode): every version; queued requests fail
        with NOT_FOUND."""
        self._require_explicit("RepositoryModelUnload")
        if name not in self.models.entries:
            raise NotFound(f"Request for unknown model: '{name}' is not found (not loaded)")
        await self.loader.unload(name)

    async def set_residency(self, name: str, residency: str) -> str:
        """SetModelResidency (explicit mode): change the floor of every served version of
        a model; for a meta model, of every model it calls. Returns the floor set."""
        self._require_explicit(  # (first, as the repository RPCs: whatever the model)
            "SetModelResidency",
            "; residency then comes from scheduler.models.<name>.residency",
        )
        served = await self._settled(name)
        # Under the load locks of the models changed: a load or unload of one of them
        # comes before or after, whole (a reload would miss the floor, an unload forget it
        # too early). (A meta reloaded with other calls meanwhile: locked again.)
        names = {t.name for t in self._weight_owners(served)}
        while True:
            async with self.loader.locked(names):
                targets = self._weight_owners(self.models.get(name))  # (served now)
                if {t.name for t in targets} <= names:
                    await self._set_residency(targets, residency)
                    for version in self._served(name):  # a meta reports its models' floor
                        version.residency = residency
                    return residency
                names |= {t.name for t in targets}

    async def _set_residency(self, targets: list[ServedModel], residency: str) -> None:
        """Every target's floor, or none: one that cannot be changed puts those changed
        before it back (as far as they can be), and no floor is kept for reloads."""
        done: list[tuple[ServedModel, str]] = []
        try:
            for target in targets:
                await self.weights.set_residency(target.key, residency)
                done.append((target, target.residency))
                target.residency = residency
        except BaseException:
            for target, previous in reversed(done):
                with trio.CancelScope(shield=True):
                    try:
                        await self.weights.set_residency(target.key, previous)
                        target.residency = previous
                    except Exception as e:
                        log.warning("%s stays %s: %s", target.key, residency, e)
            raise
        for target in targets:
            self.loader.residency[target.name] = residency  # kept until unload

    async def compact_memory(self, reload: list[str]) -> tuple[int, int]:
        """CompactMemory: free every evictable device weight, then reload ``reload`` (every
        served version; a meta model's weights are those of the models it calls);
        returns how many models were reloaded and the resident bytes after."""
        keys: dict[str, None] = {}  # ordered, without duplicates
        served = [await self._settled(name) for name in reload]  # (every name checked first)
        for model in served:
            keys.update((t.key, None) for t in self._weight_owners(model))
        reloaded = await self.weights.compact_and_reload(list(keys))
        return reloaded, self.weights.cache.resident_bytes

    async def _settled(self, name: str) -> ServedModel:
        """Model ``name`` as served (NotFound / Unavailable otherwise), once a load or
        unload of it in progress has ended, and of each model it calls (a meta): a
        control call right after RepositoryModelLoad finds the model loaded."""
        await self.loader.settled(name)
        served = self.models.get(name)
        if served.bundle.kind == "meta":
            for callee in served.bundle.signature.calls:
                await self.loader.settled(callee)
        return served

    def _served(self, name: str) -> list[ServedModel]:
        """Every served version of ``name``, ascending."""
        entry = self.models.entries.get(name)
        return [] if entry is None else [v.model for v in entry.ready()]

    def _weight_owners(self, served) -> list:
        """The versions whose weights ``served`` stands for: every served version of its
        model, or of each model a meta calls."""
        if served.bundle.kind == "meta":
            return [
                version
                for callee in served.bundle.signature.calls
                if self.models.get(callee)  # NotFound / Unavailable for a missing one
                for version in self._served(callee)
            ]
        return self._served(served.name)

    def _require_explicit(self, rpc: str, hint: str = "") -> None:
        """The one check of the RPCs that only explicit mode accepts."""
        mode = self.config.model_control_mode
        if mode != "explicit":
            raise FailedPrecondition(
                f"{rpc} is only effective when model_control_mode is "
                f"'explicit'; this worker runs in '{mode}' mode{hint}"
            )
