"""The worker: everything one ``rsrv serve`` process serves (see rsrv.worker._main).

One root trio nursery holds every long-lived task: the weight-transfer worker, the
dispatch loop, the gRPC server, the admin HTTP server and the repository watcher; model
loads run in it too. Cancelling the nursery is shutdown; no task or thread outlives it.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import msgspec
import trio

from rsrv.bundle import Bundle, discover, load_bundle, model_versions, version_policy_of
from rsrv.config import ConfigError, ModelSchedConfig, WorkerConfig, unusable_tls
from rsrv.errors import BundleError, FailedPrecondition, InvalidArgument, NotFound
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
from rsrv.transport import TLS_ERRORS, GrpcServer, methods_of
from rsrv.versions import DEFAULT_POLICY, VersionPolicy
from rsrv.worker import _files as files_override
from rsrv.worker import _reporting as reporting
from rsrv.worker._executor import DeviceExecutor
from rsrv.worker._models import (
    LoadState,
    ModelEntry,
    ModelSet,
    ServedModel,
    VersionEntry,
    build_model,
)
from rsrv.worker._pipeline import Pipeline
from rsrv.worker._restrictions import restrictions_of
from rsrv.worker._watcher import fingerprint

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
        cannot take, or a TLS file of ``endpoints`` cannot be read or used."""
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
        self.http_port: int | None = None  # the REST port bound, once serving
        self.compiler: Compiler | None = None
        self._loading: dict[str, trio.Lock] = {}
        self._residency: dict[str, str] = {}  # floors set by SetModelResidency, by name
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
        self.health = HealthService(
            lambda: self.ready and not self.admission.closed, max_watches=ep.max_connections
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
        """Live and every model that is not broken has finished loading."""
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

    async def infer(self, model: ServedModel, inputs, deadline: float | None) -> dict:
        return await self.pipeline.infer(model, inputs, deadline=deadline)

    def record(self, model: ServedModel, ok: bool, seconds: float, status: str, rows: int):
        self.pipeline.record(model, ok, seconds, status, rows)

    def statistics(self, name: str, version: int | None) -> list[ModelStatisticsSnapshot]:
        return reporting.statistics(self, name, version)

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

        Tasks: weight transfers, the dispatch loop, the health poller, the gRPC server,
        and when configured the admin HTTP server, the KServe V2 REST server and the
        repository watcher.
        """
        from rsrv.worker._admin import serve_admin
        from rsrv.worker._rest import serve_rest
        from rsrv.worker._watcher import RepositoryWatcher

        cfg = self.config
        ep = cfg.endpoints
        self.compiler = Compiler(Path(cfg.cache_dir))
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
        # The last answers are flushed, then GOAWAY: clients see a clean end.
        await self.server.close()
        if self._nursery is not None:  # (None: stopped before its tasks started)
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
            allowed = self._policy(name).allow_file_overrides
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
        await self._load(path, force=True, override=override)
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

    async def unload_model(self, name: str) -> None:
        """RepositoryModelUnload (explicit mode): every version; queued requests fail
        with NOT_FOUND."""
        self._require_explicit("RepositoryModelUnload")
        if name not in self.models.entries:
            raise NotFound(f"Request for unknown model: '{name}' is not found (not loaded)")
        await self._unload(name)

    async def _unload(self, name: str) -> None:
        # Under the model's load lock: a load in progress finishes first, so it cannot
        # register its version with the scheduler after the name is gone.
        async with self._loading.setdefault(name, trio.Lock()):
            entry = self.models.entries.pop(name, None)
            self._residency.pop(name, None)
            # Counters start again at the next load, like the scheduler's (and Triton's).
            self.pipeline.forget(name)
            self.scheduler.remove_model(name)  # the executor retires its weights once drained
        if entry is not None:
            log.info("model %s unloaded (versions %s)", name, _numbers(entry.versions) or "none")

    async def set_residency(self, name: str, residency: str) -> str:
        """SetModelResidency (explicit mode): change the floor of every served version of
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
        for version in self._served(name):  # a meta reports the floor it set on its models
            version.residency = residency
        return residency

    async def compact_memory(self, reload: list[str]) -> tuple[int, int]:
        """CompactMemory: free every evictable device weight, then reload ``reload`` (every
        served version; a meta model's weights are those of the models it calls);
        returns how many models were reloaded and the resident bytes after."""
        keys: dict[str, None] = {}  # ordered, without duplicates
        for name in reload:
            keys.update((t.key, None) for t in self._weight_owners(self.models.get(name)))
        reloaded = await self.weights.compact_and_reload(list(keys))
        return reloaded, self.weights.cache.resident_bytes

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

    async def _load(
        self, path: Path, *, force: bool = False, override: LoadOverride | None = None
    ) -> None:
        """(Re)load the model directory ``path``: every version its policy selects.

        A version is built beside the load it replaces and switched to only on success;
        it is rebuilt when new, when its files changed since the serving load read them,
        or with ``force``. Versions that leave the selection retire once the selected
        ones have been tried (requests queued for them finish first), unless none of
        those is ready: then they keep serving. ``override`` (a RepositoryModelLoad
        config) is checked against every selected version before anything changes:
        InvalidArgument, and nothing happened.
        """
        name = path.name
        async with self._loading.setdefault(name, trio.Lock()):
            created = name not in self.models.entries
            entry = self.models.entries.setdefault(name, ModelEntry(name, path))
            entry.path = path
            try:
                await self._sync(entry, force, override)
            except InvalidArgument:
                if created:
                    self.models.entries.pop(name, None)
                raise
            finally:
                entry.loading = False

    async def _sync(self, entry: ModelEntry, force: bool, override: LoadOverride | None) -> None:
        name = entry.name
        try:
            found = await trio.to_thread.run_sync(model_versions, entry.path)
            if not found:
                raise BundleError(
                    f"{entry.path}: no manifest, and no version directory holding one"
                )
        except BundleError as e:
            self._model_failed(entry, str(e))
            return
        sched = self._policy(name)
        policy = (
            (override.version_policy if override else None)
            or sched.version_policy
            or await trio.to_thread.run_sync(version_policy_of, found)
            or DEFAULT_POLICY
        )
        selected = policy.select(found)
        if not selected:  # Triton's words first
            self._model_failed(
                entry,
                f"at least one version must be available under the version policy of model "
                f"'{name}' ({policy.describe()}; versions in the repository: "
                f"{_numbers(found)})",
            )
            return
        if override is not None and override.max_batch_size is not None:
            sched = msgspec.structs.replace(sched, max_batch_size=override.max_batch_size or None)
        if override is not None and override.max_queue_delay is not None:
            sched = msgspec.structs.replace(sched, max_queue_delay_seconds=override.max_queue_delay)
        prints = {n: await trio.to_thread.run_sync(fingerprint, found[n]) for n in selected}
        bundles: dict[int, Bundle] = {}
        if override is not None:  # checked before anything changes
            for n in selected:
                try:
                    bundle = await trio.to_thread.run_sync(load_bundle, found[n], name)
                except BundleError:
                    continue  # the build below reports it
                self._check_override(bundle, override, sched, policy)
                bundles[n] = bundle
        entry.problem, entry.policy, entry.selected = "", policy, tuple(selected)
        for n in selected:
            version = entry.versions.get(n)
            if version is None:
                version = entry.versions[n] = VersionEntry(n, found[n])
            version.path = found[n]
            if force or version.model is None or version.fingerprint != prints[n]:
                await self._build(entry, version, prints[n], sched, bundles.get(n))
        chosen = any(entry.versions[n].model is not None for n in selected)
        for n in sorted(set(entry.versions) - set(selected)):
            version = entry.versions[n]
            if version.model is not None and not chosen:
                version.reason = (
                    f"kept serving: none of the versions {policy.describe()} selects "
                    f"({_numbers(selected)}) is ready"
                )
                continue
            gone = "its directory is gone" if n not in found else "left the version policy"
            self._retire(entry, n, gone)
        for version in entry.ready():
            version.model.version_policy = policy

    def _check_override(
        self,
        bundle: Bundle,
        override: LoadOverride,
        sched: ModelSchedConfig,
        policy: VersionPolicy,
    ) -> None:
        """A RepositoryModelLoad config against one version about to load."""
        sizes = bundle.batch_sizes
        if override.max_batch_size is not None:
            cap = override.max_batch_size
            if sizes and not 1 <= cap <= sizes[-1]:
                raise InvalidArgument(
                    f"config override for {bundle.name!r}: max_batch_size {cap} is not "
                    f"between 1 and the largest compiled batch size {sizes[-1]} of "
                    f"{bundle.path} (compiled sizes: {list(sizes)})"
                )
            if not sizes and cap != 0:
                raise InvalidArgument(
                    f"config override for {bundle.name!r}: max_batch_size must be 0: "
                    f"{bundle.path} has no compiled batch sizes (it runs one request at a time)"
                )
        if override.check is not None:
            rows = 0
            if sizes:
                rows = min(sched.max_batch_size or sizes[-1], sizes[-1])
            override.check(bundle, rows, policy)

    async def _build(
        self,
        entry: ModelEntry,
        version: VersionEntry,
        prints,
        sched: ModelSchedConfig,
        bundle: Bundle | None,
    ) -> None:
        """Build one version beside the load it replaces; switch only on success."""
        name, number = entry.name, version.number
        served = None
        try:
            served = await build_model(
                version.path,
                self.compiler,
                self.models.next_generation(),
                number,
                name,
                bundle,
            )
            self._check_calls(served)
            costs = {}
            if served.compiled:
                served.residency = self.weights.residency_for(
                    self._residency.get(name, sched.residency)
                )
                self.executor.versions[served.key] = served
                await self.weights.add(served.key, served.bundle.weights, served.residency)
                costs = await self.executor.warm_up(served)
        except Exception as e:  # a bad bundle must never take the worker down
            if served is not None:
                self.executor.retire(served.key)
            version.reason = str(e)
            if version.model is None:
                version.state = LoadState.UNAVAILABLE
                log.error("model %s version %d unavailable: %s", name, number, e)
            else:
                log.error(
                    "reload of model %s version %d failed; its load %d keeps serving: %s",
                    name,
                    number,
                    version.model.generation,
                    e,
                )
            return
        previous = version.model
        spec = served.spec().with_policy(sched) if served.compiled else None
        served.max_batch_size = spec.max_rows if spec else 0
        served.version_policy = entry.policy
        version.model, version.state, version.reason = served, LoadState.READY, ""
        version.fingerprint = prints
        log.info(
            "model %s version %d ready (load %d%s): %d weight bytes, residency %s",
            name,
            number,
            served.generation,
            f", replacing load {previous.generation}" if previous else "",
            served.bundle.weight_bytes,
            served.residency if served.compiled else "none (meta)",
        )
        if spec is not None:
            self.scheduler.add_model(spec)
            self.scheduler.warm_costs(name, costs, served.version)
            served.max_queue_delay = self.scheduler.queue_delay(name, served.version)

    def _retire(self, entry: ModelEntry, number: int, why: str) -> None:
        """Stop serving version ``number``; requests queued for it finish first."""
        version = entry.versions.pop(number)
        self.pipeline.drop(entry.name, str(number))
        served = version.model
        if served is not None and served.compiled:
            self.scheduler.remove_version(entry.name, served.version)
        if served is not None:
            log.info(
                "model %s version %d retired (%s); requests queued for it finish first",
                entry.name,
                number,
                why,
            )

    def _model_failed(self, entry: ModelEntry, reason: str) -> None:
        """A failure of the model as a whole: its ready versions keep serving."""
        entry.problem, entry.selected = reason, ()
        if entry.model is None:
            log.error("model %s unavailable: %s", entry.name, reason)
        else:
            log.error("model %s: %s; its ready versions keep serving", entry.name, reason)

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


def _numbers(versions) -> str:
    """``1, 2, 3``: version numbers for a message."""
    return ", ".join(str(n) for n in sorted(versions))
