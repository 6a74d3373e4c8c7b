"""Loading a worker's models: every version a model's policy selects built beside the
load it replaces and switched to on success, versions retired, models unloaded.

One lock per model name orders its loads and its unload: a load in progress finishes
before the name goes, so it never registers a version with the scheduler afterwards.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path

import msgspec
import trio

from rsrv.bundle import Bundle, discover, load_bundle, model_versions, version_policy_of
from rsrv.config import ModelSchedConfig, WorkerConfig
from rsrv.errors import BundleError, InvalidArgument
from rsrv.protocol import LoadOverride
from rsrv.runtime import Compiler, FileReplaced, WeightManager
from rsrv.scheduler import Scheduler
from rsrv.versions import DEFAULT_POLICY, VersionPolicy
from rsrv.worker._executor import DeviceExecutor
from rsrv.worker._models import LoadState, ModelEntry, ModelSet, VersionEntry, build_model
from rsrv.worker._pipeline import Pipeline
from rsrv.worker._watcher import fingerprint

__all__ = ["ModelLoader"]

log = logging.getLogger(__name__)

#: Loads of one version when its files are renamed in meanwhile (a load of the new ones)
_ATTEMPTS = 3


class ModelLoader:
    """Builds, switches, retires and unloads the models of one worker.

    ``compiler`` is set once the worker runs (its cache directory is created then);
    ``residency`` holds the floors set by SetModelResidency and ``fair_weights`` the
    weights set by SetModelPolicy, by model name, kept across reloads until the model is
    unloaded.
    """

    def __init__(
        self,
        config: WorkerConfig,
        models: ModelSet,
        weights: WeightManager,
        executor: DeviceExecutor,
        scheduler: Scheduler,
        pipeline: Pipeline,
    ):
        self.config = config
        self.models = models
        self.weights = weights
        self.executor = executor
        self.scheduler = scheduler
        self.pipeline = pipeline
        self.compiler: Compiler | None = None
        self.residency: dict[str, str] = {}
        self.fair_weights: dict[str, float] = {}
        # The models to load at startup are known (every one has its entry): before,
        # none LOADING proves nothing.
        self.startup_known = config.model_control_mode == "explicit"
        self._loading: dict[str, trio.Lock] = {}

    async def load_startup_set(self) -> None:
        """Load every model of the repository at once (dynamic and static modes); a
        repository that cannot be read is logged, and nothing loads."""
        try:
            paths = discover(Path(self.config.model_repo))
        except BundleError as e:
            log.error("%s", e)
            self.startup_known = True
            return
        for path in paths:
            self.models.entries[path.name] = ModelEntry(path.name, path)
        self.startup_known = True
        async with trio.open_nursery() as nursery:
            for path in paths:
                nursery.start_soon(self.load, path)

    async def load(
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
        sched = self.policy_of(name)
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
            for n in sorted(set(entry.versions) - set(found)):
                self._retire(entry, n, "its directory is gone")
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
        recheck = None
        if override is not None:  # (a version's files renamed in while it loads)

            def recheck(bundle: Bundle) -> None:
                self._check_override(bundle, override, sched, policy)

        for n in selected:
            version = entry.versions.get(n)
            if version is None:
                version = entry.versions[n] = VersionEntry(n, found[n])
            version.path = found[n]
            if force or version.model is None or version.fingerprint != prints[n]:
                await self._build(entry, version, prints[n], sched, bundles.get(n), recheck)
            else:  # serving its files as they are: nothing to report (a "kept serving")
                version.reason = ""
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
        recheck: Callable[[Bundle], None] | None = None,
    ) -> None:
        """Build one version beside the load it replaces; switch only on success. One
        whose weights file is renamed in while it loads is built again from the files
        now there (their fingerprint taken again, ``recheck`` run on their bundle: a
        RepositoryModelLoad config), up to ``_ATTEMPTS`` times; then it fails."""
        name, number = entry.name, version.number
        if version.model is None:  # (a failed load tried again: LOADING, as Triton says)
            version.state, version.reason = LoadState.LOADING, ""
        for attempt in range(1, _ATTEMPTS + 1):
            served = None
            try:
                if attempt > 1:  # (read again: the files were renamed in)
                    prints = await trio.to_thread.run_sync(fingerprint, version.path)
                    bundle = await trio.to_thread.run_sync(load_bundle, version.path, name)
                    if recheck is not None:
                        recheck(bundle)
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
                        self.residency.get(name, sched.residency)
                    )
                    self.executor.versions[served.key] = served
                    await self.weights.add(served.key, served.bundle.weights, served.residency)
                    costs = await self.executor.warm_up(served)
                break
            except Exception as e:  # a bad bundle must never take the worker down
                if served is not None:
                    self.executor.retire(served.key)
                if isinstance(e, FileReplaced) and attempt < _ATTEMPTS:
                    # renamed in while it loaded (a bundle rewritten at once): the new files
                    log.info("model %s version %d: %s; loading it again", name, number, e)
                    continue
                self._build_failed(name, version, e)
                return
        previous = version.model
        self.pipeline.serving(served)
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
            if name in self.fair_weights:  # set by SetModelPolicy: kept until unload
                self.scheduler.set_weight(name, self.fair_weights[name])
            self.scheduler.warm_costs(name, costs, served.version)
            served.max_queue_delay = self.scheduler.queue_delay(name, served.version)
        elif previous is not None and previous.compiled:  # (now a meta: the old one drains)
            self.scheduler.remove_version(name, previous.version)

    @staticmethod
    def _build_failed(name: str, version: VersionEntry, error: Exception) -> None:
        # (the text, not the exception: a log record that keeps it, with its frames,
        # keeps what they hold, a failed load's model.py module among them)
        reason = version.reason = str(error)
        if version.model is None:
            version.state = LoadState.UNAVAILABLE
            log.error("model %s version %d unavailable: %s", name, version.number, reason)
        else:
            log.error(
                "reload of model %s version %d failed; its load %d keeps serving: %s",
                name,
                version.number,
                version.model.generation,
                reason,
            )

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

    async def settled(self, name: str) -> None:
        """Wait until no load or unload of ``name`` is under way (at once when none is):
        a control call sent right after RepositoryModelLoad finds the model loaded."""
        lock = self._loading.get(name)
        if lock is not None and lock.locked():
            async with lock:
                pass

    @contextlib.asynccontextmanager
    async def locked(self, names: Iterable[str]) -> AsyncIterator[None]:
        """The load locks of ``names``: no load or unload of those models runs in the
        block. (Taken in name order, so that two holders never wait on each other.)"""
        async with contextlib.AsyncExitStack() as stack:
            for name in sorted(set(names)):
                await stack.enter_async_context(self._loading.setdefault(name, trio.Lock()))
            yield

    def policy_of(self, name: str) -> ModelSchedConfig:
        """``scheduler.models.<name>`` of the worker's file, or the defaults."""
        return self.config.scheduler.models.get(name) or ModelSchedConfig()

    async def unload(self, name: str) -> None:
        """Stop serving every version of ``name`` (queued requests fail with NOT_FOUND)
        and forget its residency floor and counters; nothing if it is not known.

        Under the model's load lock: a load in progress finishes first, so it cannot
        register its version with the scheduler after the name is gone."""
        async with self._loading.setdefault(name, trio.Lock()):
            entry = self.models.entries.pop(name, None)
            self.residency.pop(name, None)
            self.fair_weights.pop(name, None)
            # Counters start again at the next load, like the scheduler's (and Triton's).
            self.pipeline.forget(name)
            self.scheduler.remove_model(name)  # the executor retires its weights once drained
        if entry is not None:
            log.info("model %s unloaded (versions %s)", name, _numbers(entry.versions) or "none")


def _numbers(versions) -> str:
    """``1, 2, 3``: version numbers for a message."""
    return ", ".join(str(n) for n in sorted(versions))
