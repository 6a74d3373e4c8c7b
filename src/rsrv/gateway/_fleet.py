"""The workers behind the gateway, and the routes: which ready worker serves which model.

The worker list is fixed by the gateway file; what each worker serves and whether it is
up is learnt by discovery (``_discovery``) and by the calls themselves. Routes are
rebuilt from that knowledge and swapped in one assignment, so a request sees either the
old table or the new one, never half of each.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from purerpc.grpclib.status import StatusCode

__all__ = ["CallResult", "Fleet", "IndexRow", "WorkerChannel", "WorkerLink", "is_local_host"]

log = logging.getLogger("rsrv.gateway")


class CallResult(Protocol):
    """The outcome of one unary call to a worker (see ``rsrv.transport``)."""

    status: StatusCode
    message: str
    response: bytes | None
    trailers: tuple[tuple[str, str], ...]
    reached_server: bool


class WorkerChannel(Protocol):
    """What the gateway needs of a connection to one worker: raw-bytes unary calls,
    bidirectional streams, and ``opened``, the connections opened so far
    (``rsrv.transport.Channel`` implements it)."""

    opened: int

    async def unary(
        self,
        path: str,
        request: bytes,
        *,
        metadata: Iterable[tuple[str, str]] = (),
        timeout: float | None = None,
        capped: bool = True,
    ) -> CallResult: ...

    def stream(
        self, path: str, *, metadata: Iterable[tuple[str, str]] = (), timeout: float | None = None
    ) -> Any: ...


@dataclass(frozen=True, slots=True)
class IndexRow:
    """One row of a worker's RepositoryIndex."""

    name: str
    version: str
    state: str
    reason: str


def is_local_host(host: str) -> bool | None:
    """Whether ``host`` names this machine, so that a system shared-memory region here
    is visible there: every address it resolves to is loopback, unspecified (``0.0.0.0``
    and ``::`` reach this machine), or one of this machine's own. None when the name
    does not resolve now (it may later: a Kubernetes Service not yet published)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    return bool(infos) and all(_is_own(family, sockaddr) for family, _, _, _, sockaddr in infos)


def _is_own(family: int, sockaddr: tuple) -> bool:
    address = sockaddr[0]
    ip = ipaddress.ip_address(address.partition("%")[0])
    if ip.is_loopback or ip.is_unspecified:
        return True
    # The kernel routes an address of this machine's to itself, from that very address
    # (a UDP connect sends nothing).
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9, *sockaddr[2:]))
            return probe.getsockname()[0] == address
    except OSError:
        return False


@dataclass
class WorkerLink:
    """One worker: its address, its channel, and what the gateway knows of it.

    ``ready``: its last probe answered ServerReady true, and no call has since found it
    unreachable. ``index``: its last RepositoryIndex. ``control``: its last
    ModelControlStatus (a protobuf message), None when it has no control service.
    ``instance``: the last ``control.instance`` seen; ``restarted``: it changed since
    (set by discovery, cleared once the gateway has acted on it); ``away``: it has not
    been ready at some moment since its last catch-up began (True until its first; set
    by whatever takes it out of the routes, and by a catch-up the worker shed or timed
    out; cleared by :meth:`Fleet.returned`); ``opened``: the
    channel's connection count when discovery last asked for the control status;
    ``control_due``: that ask has not been answered yet (asked again next round).
    """

    name: str
    address: str
    host: str
    port: int
    channel: WorkerChannel
    local: bool | None  # on this machine (is_local_host); None: its name did not resolve
    from_dns: bool = False
    ready: bool = False
    index: tuple[IndexRow, ...] = ()
    control: Any = None
    ever_answered: bool = False
    probe_failures: int = 0  # probe rounds in a row without an answer
    busy_since: float | None = None  # since when every probe found it at its in-flight cap
    instance: str = ""
    restarted: bool = False
    away: bool = True
    opened: int = -1
    control_due: bool = False
    inflight: int = 0  # calls the gateway has open on it
    leaving: Any = None  # a trio.Event set when the worker leaves the fleet
    unreachable_marks: int = 0  # times a call found it unreachable (mark_unreachable)
    routed: dict[str, int] = field(default_factory=dict)  # calls sent to it, by status
    failovers: dict[str, int] = field(default_factory=dict)  # calls moved on from it

    @property
    def serving(self) -> frozenset[str]:
        """Models READY on this worker (any version): its index's, and the sub-models of
        its metas, which only its ModelControlStatus lists."""
        ready = {row.name for row in self.index if row.state == "READY"}
        if self.control is not None:
            ready.update(m.name for m in self.control.models if m.state == "READY")
        return frozenset(ready)

    def ready_versions(self, model: str) -> set[str]:
        """The versions of ``model`` READY here, by its last index."""
        return {
            row.version
            for row in self.index
            if row.name == model and row.version and row.state == "READY"
        }

    def knows(self, model: str) -> bool:
        """Whether ``model`` is on this worker in any state (index or control status);
        not a model directory an explicit-mode worker only lists as "unloaded"."""
        return any(row.name == model and not _unloaded(row) for row in self.index) or (
            self.control is not None and any(m.name == model for m in self.control.models)
        )


def _version_order(version: str) -> tuple[int, str]:
    """Versions in numeric order (``"10"`` after ``"9"``); any other text after them."""
    return (int(version), "") if version.isascii() and version.isdigit() else (1 << 62, version)


def _unloaded(row: IndexRow) -> bool:
    """An explicit-mode worker's row for a model directory it has no entry for."""
    return not row.version and row.state == "UNAVAILABLE" and row.reason == "unloaded"


@dataclass
class Fleet:
    """Every worker, and ``routes``: model name -> names of the ready workers on which
    it is READY, sorted; ``version_routes``: (model, version) -> those on which that
    version is READY; ``newest_routes``: model -> those holding its newest READY
    version, only for a model whose workers do not all hold it (a rolling upgrade)."""

    workers: list[WorkerLink]
    routes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    version_routes: dict[tuple[str, str], tuple[str, ...]] = field(default_factory=dict)
    newest_routes: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.by_name = {w.name: w for w in self.workers}

    def add(self, worker: WorkerLink) -> None:
        """A worker found by DNS; it gets traffic once a probe finds it ready."""
        self.workers.append(worker)
        self.by_name[worker.name] = worker

    def remove(self, name: str) -> WorkerLink:
        """A worker DNS no longer lists: no more traffic, at once."""
        worker = self.by_name.pop(name)
        self.workers.remove(worker)
        worker.ready = False
        self.rebuild_routes()
        return worker

    @property
    def ready(self) -> list[WorkerLink]:
        return [w for w in self.workers if w.ready]

    def rebuild_routes(self) -> None:
        routes: dict[str, list[str]] = {}
        versions: dict[tuple[str, str], list[str]] = {}
        for worker in self.workers:
            if worker.ready:
                for model in worker.serving:
                    routes.setdefault(model, []).append(worker.name)
                for row in worker.index:
                    if row.version and row.state == "READY":
                        versions.setdefault((row.name, row.version), []).append(worker.name)
        self.routes = {model: tuple(sorted(names)) for model, names in routes.items()}
        self.version_routes = {key: tuple(sorted(names)) for key, names in versions.items()}
        newest: dict[str, tuple[str, tuple[str, ...]]] = {}
        listed: dict[str, set[str]] = {}  # model -> workers whose index gives its versions
        for (model, version), names in self.version_routes.items():
            listed.setdefault(model, set()).update(names)
            best = newest.get(model)
            if best is None or _version_order(version) > _version_order(best[0]):
                newest[model] = (version, names)
        self.newest_routes = {}
        for model, (_, names) in newest.items():
            routed = self.routes.get(model, ())
            # (a replica whose index does not list the model, e.g. it serves it only as
            # a meta's sub-model, is not known to hold another version: it stays)
            holders = tuple(n for n in routed if n in names or n not in listed[model])
            if holders != routed:
                self.newest_routes[model] = holders

    def returned(self) -> list[WorkerLink]:
        """The ready workers to bring in line (catch-up): away since their last one
        began, or restarted. Clears both marks."""
        back = [w for w in self.ready if w.away or w.restarted]
        for worker in self.workers:
            worker.restarted = False
        for worker in back:
            worker.away = False
        return back

    def mark_unreachable(self, worker: WorkerLink) -> None:
        """A call found ``worker`` unreachable: it gets no traffic until a probe
        answers again."""
        worker.unreachable_marks += 1
        if worker.ready:
            log.warning("worker %s (%s) is unreachable", worker.name, worker.address)
            worker.ready, worker.away = False, True
            self.rebuild_routes()

    def known_models(self) -> set[str]:
        """Every model some worker lists, in any state (its last index or control
        status, ready or not: a worker restarting still counts)."""
        known: set[str] = set()
        for worker in self.workers:
            known.update(row.name for row in worker.index)
            if worker.control is not None:
                known.update(m.name for m in worker.control.models)
        return known

    def holders(self, model: str) -> list[WorkerLink]:
        """Ready workers that have ``model`` in any state (for control calls that act on a
        model that is loading or unavailable too, or on a meta's sub-model)."""
        return [w for w in self.workers if w.ready and w.knows(model)]
