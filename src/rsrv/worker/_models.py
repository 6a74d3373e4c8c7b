"""The set of models a worker serves, and how one is loaded.

A model (a directory of the repository) has numbered versions (specs/bundle.md §1); its
version policy picks those served, side by side. Loading a version (validate, compile,
copy weights, warm up) runs in worker threads, never on the dispatch loop, so every
other model keeps serving while one loads. A version only switches to a new load once
that load is fully ready.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from rsrv.bundle import Bundle, load_bundle
from rsrv.errors import BundleError, NotFound, Unavailable
from rsrv.runtime import CompiledModel, Compiler, compile_bundle
from rsrv.scheduler import ModelSpec, check_rows
from rsrv.versions import DEFAULT_POLICY, VersionPolicy

log = logging.getLogger(__name__)


class LoadState(enum.StrEnum):
    """Where a model entry is in its life, as RepositoryIndex reports it."""

    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"
    LOADING = "LOADING"


@dataclass(eq=False, slots=True)
class ServedModel:
    """One load of one version of a model. Its device weights belong to the
    WeightManager, under :attr:`key`, so they can be evicted and reloaded independently.

    ``version`` is the version the protocol reports (the number of its directory; "1"
    for a bundle directly in the model directory); ``generation`` counts loads in this
    process, so that a reload and the load it replaces have distinct keys while both
    serve. ``max_batch_size`` is the rows one execution holds (the scheduler's cap; 0:
    unbatched or meta), ``version_policy`` the policy its model is served under,
    ``max_queue_delay`` the seconds a batch of it may wait for more requests.
    """

    bundle: Bundle
    compiled: CompiledModel | None  # None for a meta model
    generation: int
    version: str = "1"
    residency: str = "system"
    max_batch_size: int = 0
    version_policy: VersionPolicy = DEFAULT_POLICY
    max_queue_delay: float = 0.0
    # The counters its requests are recorded in (its name's, its version's), set when it
    # starts serving: a request that outlives its model's unload or its version's
    # retirement is recorded in counters no longer reported, never in a later load's.
    statistics: tuple[Any, ...] = ()
    meta_statistics: Any = None  # (a meta model's: its requests and their device time)

    @property
    def name(self) -> str:
        return self.bundle.name

    key: str = field(init=False)  # this load's identity in the scheduler and weight cache

    def __post_init__(self) -> None:
        self.key = f"{self.name}@{self.generation}"

    def check_rows(self, rows: int) -> None:
        """The scheduler's check of a request's rows, for the codec to make before it
        decodes the request's data; only where a client's rows are the executable's (a
        batched model without a preprocess hook)."""
        if rows <= self.max_batch_size:  # (at most the largest compiled size)
            return
        sizes = self.bundle.batch_sizes
        if self.compiled is not None and sizes and self.bundle.hooks.preprocess is None:
            check_rows(self.name, rows, sizes, self.max_batch_size)

    def spec(self) -> ModelSpec:
        """What the scheduler needs of this version (lay the config over it with
        :meth:`ModelSpec.with_policy`)."""
        sig = self.bundle.signature
        return ModelSpec(
            name=self.name,
            batch_sizes=self.bundle.batch_sizes,
            input_axes=tuple(t.batch_axis for t in sig.executable_inputs),
            output_axes=tuple(t.batch_axis for t in sig.executable_outputs),
            executable=self.key,
            version=self.version,
        )


@dataclass(slots=True)
class VersionEntry:
    """One version of a model: the bundle directory it is read from, and its load.
    ``fingerprint`` is that of the files the serving load read (taken before reading),
    so a change on disk is seen as one."""

    number: int
    path: Path
    state: LoadState = LoadState.LOADING
    reason: str = ""
    model: ServedModel | None = None
    fingerprint: Any = None


@dataclass(slots=True)
class ModelEntry:
    """A model of the repository: its versions as RepositoryIndex reports them.

    ``problem`` is a failure of the model as a whole (its directory's layout, a policy
    that selects no version); ``selected`` the versions its policy selected at the last
    load; ``loading`` is true until its first load has finished."""

    name: str
    path: Path
    versions: dict[int, VersionEntry] = field(default_factory=dict)
    loading: bool = True
    problem: str = ""
    policy: VersionPolicy = DEFAULT_POLICY
    selected: tuple[int, ...] = ()

    def ready(self) -> list[VersionEntry]:
        """The versions that serve, ascending."""
        return [v for _, v in sorted(self.versions.items()) if v.model is not None]

    @property
    def model(self) -> ServedModel | None:
        """The newest ready version: what a request naming no version runs on."""
        ready = self.ready()
        return ready[-1].model if ready else None

    @property
    def state(self) -> LoadState:
        if self.model is not None:
            return LoadState.READY
        if self.loading or any(v.state is LoadState.LOADING for v in self.versions.values()):
            return LoadState.LOADING
        return LoadState.UNAVAILABLE

    @property
    def reason(self) -> str:
        reasons = [v.reason for _, v in sorted(self.versions.items()) if v.reason]
        return "; ".join(([self.problem] if self.problem else []) + reasons)


class ModelSet:
    """Name -> :class:`ModelEntry`; the single place that says what is served."""

    def __init__(self) -> None:
        self.entries: dict[str, ModelEntry] = {}
        self._generations = 0

    def get(self, name: str, version: int | None = None) -> ServedModel:
        """Version ``version`` of ``name``, ready (None: its newest ready version);
        NotFound / Unavailable otherwise, in Triton's words where its clients match
        them (model_repository_manager.cc / model_lifecycle.cc)."""
        entry = self.entries.get(name)
        if entry is None:
            raise NotFound(f"Request for unknown model: '{name}' is not found")
        if version is None:
            if entry.model is None:
                why = f": {entry.reason}" if entry.reason else ""
                raise Unavailable(f"model {name!r} is {entry.state.lower()}{why}")
            return entry.model
        found = entry.versions.get(version)
        if found is None:
            known = ", ".join(str(n) for n in sorted(entry.versions)) or "none"
            raise NotFound(
                f"Request for unknown model: '{name}' version {version} is not found "
                f"(versions of '{name}': {known}; its version policy: {entry.policy.describe()})"
            )
        if found.model is None:
            why = f": {found.reason}" if found.reason else ""
            raise Unavailable(
                f"Request for unknown model: '{name}' version {version} is not at ready "
                f"state ({found.state.lower()}{why})"
            )
        return found.model

    def ready(self, name: str, version: int | None = None) -> bool:
        entry = self.entries.get(name)
        if entry is None:
            return False
        if version is None:
            return entry.model is not None
        found = entry.versions.get(version)
        return found is not None and found.model is not None

    def next_generation(self) -> int:
        self._generations += 1
        return self._generations


async def build_model(
    path: Path,
    compiler: Compiler,
    generation: int,
    version: int = 1,
    name: str | None = None,
    bundle: Bundle | None = None,
) -> ServedModel:
    """Validate and compile version ``version`` of model ``name`` from the bundle
    directory ``path`` (in worker threads; ``bundle``: already validated); weights are
    placed later.

    Raises BundleError for an invalid bundle and for a module that fails to compile.
    """
    if bundle is None:
        bundle = await trio.to_thread.run_sync(load_bundle, path, name)
    if bundle.kind == "meta":
        return ServedModel(bundle, None, generation, str(version))
    try:
        compiled = await trio.to_thread.run_sync(compile_bundle, bundle, compiler)
    except Exception as e:
        raise BundleError(f"{path}: compilation failed: {e}") from None
    log.info(
        "model %s loaded: version %d, %d module(s) in %.2f s (%d from cache), %d weight bytes",
        bundle.name,
        version,
        len(compiled.executables),
        compiled.compile_seconds,
        compiled.cache_hits,
        bundle.weight_bytes,
    )
    return ServedModel(bundle, compiled, generation, str(version))
