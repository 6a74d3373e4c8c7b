"""The set of models a worker serves, and how one is loaded.

Loading (validate, compile, copy weights, warm up) runs in worker threads, never on
the dispatch loop, so every other model keeps serving while one loads. A model's
entry only switches to its new version once that version is fully ready.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from pathlib import Path

import trio

from rsrv.bundle import Bundle, load_bundle
from rsrv.errors import BundleError, NotFound, Unavailable
from rsrv.runtime import CompiledModel, Compiler, compile_bundle
from rsrv.scheduler import ModelSpec

log = logging.getLogger(__name__)

#: The one version every model reports (model versions: specs/protocol.md).
SERVED_VERSION = "1"


class LoadState(enum.StrEnum):
    """Where a model entry is in its life, as RepositoryIndex reports it."""

    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"
    LOADING = "LOADING"


@dataclass(eq=False, slots=True)
class ServedModel:
    """One load of a model. Its device weights belong to the WeightManager, under
    :attr:`key`, so they can be evicted and reloaded independently.

    ``version`` is the version the protocol reports (every model has one, "1");
    ``generation`` counts loads in this process, so that a reload and the load it
    replaces have distinct keys while both serve.
    """

    bundle: Bundle
    compiled: CompiledModel | None  # None for a meta model
    generation: int
    residency: str = "system"
    version: str = SERVED_VERSION

    @property
    def name(self) -> str:
        return self.bundle.name

    @property
    def key(self) -> str:
        """The executable key: this load's identity in the scheduler and weight cache."""
        return f"{self.name}@{self.generation}"

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
        )


@dataclass(slots=True)
class ModelEntry:
    """A model name as the repository index reports it."""

    name: str
    path: Path
    state: LoadState = LoadState.LOADING
    reason: str = ""
    model: ServedModel | None = None


class ModelSet:
    """Name -> :class:`ModelEntry`; the single place that says what is served."""

    def __init__(self) -> None:
        self.entries: dict[str, ModelEntry] = {}
        self._generations = 0

    def get(self, name: str) -> ServedModel:
        """The ready model called ``name``; NotFound / Unavailable otherwise."""
        entry = self.entries.get(name)
        if entry is None:
            raise NotFound(f"unknown model {name!r}")
        if entry.model is None:
            why = f": {entry.reason}" if entry.reason else ""
            raise Unavailable(f"model {name!r} is {entry.state.lower()}{why}")
        return entry.model

    def ready(self, name: str) -> bool:
        entry = self.entries.get(name)
        return entry is not None and entry.state is LoadState.READY

    def next_generation(self) -> int:
        self._generations += 1
        return self._generations


async def build_model(path: Path, compiler: Compiler, generation: int) -> ServedModel:
    """Validate and compile one bundle (in worker threads); weights are placed later.

    Raises BundleError for an invalid bundle and for a module that fails to compile.
    """
    bundle = await trio.to_thread.run_sync(load_bundle, path)
    if bundle.kind == "meta":
        return ServedModel(bundle, None, generation)
    try:
        compiled = await trio.to_thread.run_sync(compile_bundle, bundle, compiler)
    except Exception as e:
        raise BundleError(f"{path}: compilation failed: {e}") from None
    log.info(
        "model %s loaded: %d module(s) in %.2f s (%d from cache), %d weight bytes",
        bundle.name,
        len(compiled.executables),
        compiled.compile_seconds,
        compiled.cache_hits,
        bundle.weight_bytes,
    )
    return ServedModel(bundle, compiled, generation)
