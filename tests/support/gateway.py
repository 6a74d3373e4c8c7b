"""Fake worker links for the gateway's unit tests: a fleet of workers whose channels
answer from this process, what a worker reports serving, a client call's envelope, and
discovery's few settings."""

from __future__ import annotations

from types import SimpleNamespace

from purerpc.grpclib.status import StatusCode

from rsrv.config import SchedulingConfig
from rsrv.gateway._fleet import Fleet, IndexRow, WorkerLink
from rsrv.gateway._forward import INFERENCE
from rsrv.gateway._scheduling import Scheduling
from rsrv.protocol.generated.rsrv.control.v1 import control_pb2 as cpb
from rsrv.transport import UnaryResult


class Answering:
    """A worker channel answering every call with ``result``."""

    opened = 1  # connections opened so far

    def __init__(self, result: UnaryResult):
        self.result = result

    async def unary(self, path, body, *, metadata=(), timeout=None, capped=True):
        return self.result


def ok(message) -> UnaryResult:
    """An OK answer carrying ``message`` (a protobuf message, or bytes)."""
    body = message if isinstance(message, bytes) else message.SerializeToString()
    return UnaryResult(StatusCode.OK, response=body)


def worker_link(name: str, port: int = 1, channel=None, *, ready: bool = False) -> WorkerLink:
    """A worker on 127.0.0.1:``port`` (this host, so shared memory reaches it)."""
    return WorkerLink(name, f"127.0.0.1:{port}", "127.0.0.1", port, channel, True, ready=ready)


def fleet_of(*names: str, channels=None, ready: bool = False) -> Fleet:
    """Workers ``names`` on ports 0, 1, ..., each with ``channels[name]`` (None: none)."""
    channels = channels or {}
    return Fleet([worker_link(n, i, channels.get(n), ready=ready) for i, n in enumerate(names)])


def serve_models(worker: WorkerLink, models: list[str], discipline: str = "fifo") -> None:
    """``worker`` is ready, serving ``models`` (batch input "x" on axis 0)."""
    worker.ready = True
    worker.index = tuple(IndexRow(m, "1", "READY", "") for m in models)
    worker.control = cpb.ModelControlStatusResponse(
        discipline=discipline,
        instance=worker.name,
        models=[
            cpb.ModelStatus(
                name=m, state="READY", max_batch_size=8, batch_input_name="x", batch_axis=0
            )
            for m in models
        ],
    )


def packed(*names: str, **settings) -> tuple[Fleet, Scheduling]:
    """Workers ``names``, each serving model "m" (:func:`serve_models`), under an
    lpt_packing :class:`Scheduling` (``settings``: more of its config) that has placed
    them (one tick)."""
    fleet = fleet_of(*names)
    for worker in fleet.workers:
        serve_models(worker, ["m"])
    fleet.rebuild_routes()
    scheduling = Scheduling(SchedulingConfig(mode="lpt_packing", **settings), fleet)
    scheduling.tick()
    return fleet, scheduling


def client_call(method: str, service: str = INFERENCE) -> SimpleNamespace:
    """What a gateway service reads of a client's call to ``method`` of ``service``
    (a path prefix: the KServe V2 service's, or rsrv's ``CONTROL``)."""
    return SimpleNamespace(path=service + method, metadata={}, deadline=1e9)


class FakeDiscovery:
    """What the forwarder and the services use of Discovery: its interval (retry
    pushback), the wake-ups calls give it (counted; each runs ``on_wake``), and
    refreshes (counted; each runs ``on_refresh``): the hooks stand for the round."""

    def __init__(self, interval_seconds: float = 2.0, on_refresh=lambda: None, on_wake=None):
        self.settings = SimpleNamespace(interval_seconds=interval_seconds)
        self.on_refresh = on_refresh
        self.on_wake = on_wake or (lambda: None)
        self.wakes = self.stales = self.changes = self.refreshes = 0

    def wake(self) -> None:
        self.wakes += 1
        self.on_wake()

    def stale(self) -> None:
        self.stales += 1

    def changed(self) -> None:
        self.changes += 1

    async def changes_seen(self) -> None:
        pass

    async def refresh(self) -> None:
        self.refreshes += 1
        self.on_refresh()
