"""What the protocol services need from the process behind them.

The services (:class:`~rsrv.protocol.InferenceService`, :class:`~rsrv.protocol.
ControlService`) translate protobuf to and from the calls below and nothing else; a
worker implements them (``rsrv.worker.Worker``), and a process that answers some RPCs
itself (a gateway) implements what it answers. The data handed across is plain
snapshots, so the protocol layer never reaches into a worker's internals.

Errors are ``rsrv.errors`` exceptions (NotFound for an unknown model or version,
Unavailable for one that is not ready, ...); the transport turns them into statuses.

Versions: the protocol parses a request's version string (``rsrv.versions.parse_version``)
and passes the number, or None for "the newest ready version"; a served model reports
its version as the decimal string the protocol sends back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from rsrv.bundle import Bundle
from rsrv.protocol._calls import Admission
from rsrv.protocol._logs import LogSettings
from rsrv.protocol._shm import SharedMemoryRegistry
from rsrv.versions import VersionPolicy

__all__ = [
    "DURATIONS",
    "ControlBackend",
    "ControlSnapshot",
    "Duration",
    "IndexEntry",
    "InferenceBackend",
    "LoadOverride",
    "ModelControl",
    "ModelStatisticsSnapshot",
    "ServedModelView",
]


class ServedModelView(Protocol):
    """One loaded version of a model, as far as the protocol is concerned."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str:
        """The version the protocol reports (its number, in decimal)."""
        ...

    @property
    def bundle(self) -> Bundle: ...

    @property
    def max_batch_size(self) -> int:
        """Rows one execution of it may hold, the scheduler's cap (0: unbatched, meta)."""
        ...

    def check_rows(self, rows: int) -> None:
        """InvalidArgument when a request whose inputs hold ``rows`` rows on their batch
        axis cannot run (as the scheduler would say it); nothing where that is not
        known before the request runs (a preprocess hook may change the rows)."""
        ...

    @property
    def version_policy(self) -> VersionPolicy:
        """The version policy its model is served under."""
        ...

    @property
    def max_queue_delay(self) -> float:
        """Seconds a batch of it may wait for more requests (the scheduler's queue delay)."""
        ...


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """One RepositoryIndex entry: one version of a model, or a model with no version
    tried (``version`` "": not loaded, or failed before any version was tried)."""

    name: str
    version: str
    state: str  # READY / UNAVAILABLE / LOADING
    reason: str = ""


@dataclass(frozen=True, slots=True)
class LoadOverride:
    """What RepositoryModelLoad's ``config`` parameter changes for that load (the
    documented subset, specs/protocol.md §2): the scheduler's cap on rows per execution,
    the version policy and the queue delay (seconds). ``check(bundle, max_batch_size,
    policy)`` raises
    InvalidArgument when the config asks for something the version about to load cannot
    be (a field that must equal what rsrv derives); the backend calls it for every
    version it loads, before anything changes."""

    max_batch_size: int | None = None
    version_policy: VersionPolicy | None = None
    check: Callable[[Bundle, int, VersionPolicy], None] | None = None
    max_queue_delay: float | None = None


class Duration(Protocol):
    """A count of events and their total nanoseconds."""

    count: int
    ns: int


#: The durations of Triton's InferStatistics, by field name (specs/protocol.md §2).
DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


@dataclass(frozen=True, slots=True)
class ModelStatisticsSnapshot:
    """Triton's ModelStatistics of one model (specs/protocol.md §2). ``durations`` has
    one entry per name of :data:`DURATIONS`."""

    name: str
    version: str
    last_inference_ms: int
    inference_count: int
    execution_count: int
    durations: Mapping[str, Duration]
    batch_executions: Mapping[int, int] = field(default_factory=dict)  # size -> count


@dataclass(frozen=True, slots=True)
class ModelControl:
    """One model in ModelControlStatus (specs/weights.md, control.proto)."""

    name: str
    state: str
    kind: str = ""  # "" until loaded
    residency: str = ""  # unpinned / system / device ("" for a meta without models)
    device_resident: bool = False
    host_resident: bool = False
    weight_bytes: int = 0
    weight: float = 0.0
    queue_depth: int = 0
    compute_seconds: float = 0.0
    requests_served: int = 0
    rows_served: int = 0
    dispatches: int = 0
    max_batch_size: int = 0
    batch_input_name: str = ""
    batch_axis: int = -1


@dataclass(frozen=True, slots=True)
class ControlSnapshot:
    discipline: str
    control_mode: str
    weight_cache_budget_bytes: int
    weight_cache_resident_bytes: int
    weight_cache_loads: int
    weight_cache_evictions: int
    models: list[ModelControl]
    instance: str = ""  # changes each time the worker process starts


class InferenceBackend(Protocol):
    """What ``inference.GRPCInferenceService`` calls."""

    shm: SharedMemoryRegistry
    log_settings: LogSettings
    admission: Admission  # streams admit each request on them
    max_message_bytes: int
    max_requests_per_stream: int

    @property
    def platform(self) -> str: ...

    @property
    def ready(self) -> bool: ...

    @property
    def extensions(self) -> list[str]: ...

    def model(self, name: str, version: int | None = None) -> ServedModelView:
        """Version ``version`` of ``name``, ready; None: its newest ready version.
        NotFound (unknown model or version) / Unavailable (not ready) otherwise."""
        ...

    def model_ready(self, name: str, version: int | None = None) -> bool: ...

    def ready_versions(self, name: str) -> list[str]:
        """The ready versions of ``name``, ascending (ModelMetadata's ``versions``)."""
        ...

    def hold(self, model: ServedModelView) -> AbstractContextManager[object]:
        """Keep ``model`` (what :meth:`model` just gave, with no checkpoint since) able
        to run one request while the block runs, whatever reload or retirement comes
        meanwhile (the request's decoding may take a while); the value it gives goes to
        :meth:`infer`. A request of a model unloaded meanwhile fails NotFound; a meta
        model's calls are each held from when they are made."""
        ...

    async def infer(
        self,
        model: ServedModelView,
        inputs: Mapping[str, np.ndarray],
        deadline: float | None,
        held: object = None,
    ) -> dict[str, np.ndarray]:
        """Run one request of validated client inputs on that version (held by
        :meth:`hold`, given as ``held``); returns the client outputs."""
        ...

    def record(
        self, model: ServedModelView, ok: bool, seconds: float, status: str, rows: int
    ) -> None:
        """Count one request of that version (``status`` as the client receives it)."""
        ...

    def statistics(self, name: str, version: int | None) -> list[ModelStatisticsSnapshot]:
        """Snapshots of ``name``'s ready versions (``version``: that one only); an
        empty ``name``: of every ready version of every model."""
        ...

    async def index(self) -> list[IndexEntry]:
        """RepositoryIndex's rows, every model's versions and states."""
        ...

    async def load_model(
        self,
        name: str,
        override: LoadOverride | None = None,
        files: Mapping[str, bytes] | None = None,
    ) -> None:
        """RepositoryModelLoad; ``files``: the ``file:`` parameters, by relative path."""
        ...

    async def unload_model(self, name: str) -> None: ...


class ControlBackend(Protocol):
    """What ``rsrv.control.v1.ControlService`` calls."""

    def control_status(self) -> ControlSnapshot: ...

    async def set_residency(self, name: str, residency: str) -> str:
        """Set ``name``'s residency floor; returns the floor in force. Explicit mode only
        (FailedPrecondition otherwise)."""
        ...

    def set_weight(self, name: str, weight: float) -> float:
        """Set ``name``'s fair-share weight; returns the weight in force."""
        ...

    def weight_of(self, name: str) -> float: ...

    async def compact_memory(self, reload: list[str]) -> tuple[int, int]:
        """Free every evictable weight, reload ``reload``; returns (reloaded models,
        resident bytes after)."""
        ...
