"""The gateway's merged answers over workers that disagree: RepositoryIndex (a worker
without any version of a model another has versions of adds no row of its own; LOADING
somewhere beats UNAVAILABLE elsewhere), ModelStatistics (a worker that fails the call
fails it, rather than leaving its counts out of the sums), and the routing of calls about
one model version, and of control calls, to the workers that hold it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import trio
from purerpc.grpclib.status import StatusCode

from rsrv.gateway._fleet import Fleet, IndexRow, WorkerLink
from rsrv.gateway._forward import INFERENCE, Forwarder, Relayed
from rsrv.gateway._services import GatewayServices
from rsrv.protocol import Admission
from rsrv.protocol.generated.inference import grpc_service_pb2 as pb
from rsrv.transport import UnaryResult


class Fixed:
    """fan_out answering each worker with ``answers[worker]``."""

    request_timeout = 60.0

    def __init__(self, fleet: Fleet, answers: dict[str, UnaryResult]):
        self.fleet, self.answers = fleet, answers

    async def fan_out(self, path, body, metadata=None, deadline=None, workers=None):
        targets = self.fleet.ready if workers is None else workers
        return {w.name: self.answers[w.name] for w in targets}


def ok(message) -> UnaryResult:
    return UnaryResult(StatusCode.OK, response=message.SerializeToString())


def fleet_of(*names: str) -> Fleet:
    return Fleet(
        [
            WorkerLink(n, f"h:{i}", "127.0.0.1", i, None, True, ready=True)
            for i, n in enumerate(names)
        ]
    )


def call(method: str) -> SimpleNamespace:
    return SimpleNamespace(path=INFERENCE + method, metadata={}, deadline=1e9)


def index(*rows: tuple[str, str, str, str]) -> pb.RepositoryIndexResponse:
    row = pb.RepositoryIndexResponse.ModelIndex
    return pb.RepositoryIndexResponse(
        models=[row(name=n, version=v, state=s, reason=r) for n, v, s, r in rows]
    )


async def test_the_index_has_one_row_per_model_version_across_workers():
    fleet = fleet_of("w0", "w1", "w2")
    answers = {
        "w0": ok(index(("lin", "1", "READY", ""), ("new", "1", "UNAVAILABLE", "broken"))),
        "w1": ok(index(("lin", "", "UNAVAILABLE", "unloaded"), ("new", "1", "LOADING", ""))),
        "w2": ok(index(("lin", "", "UNAVAILABLE", "unloaded"))),
    }
    services = GatewayServices(fleet, Fixed(fleet, answers), Admission(0), 4)
    merged = pb.RepositoryIndexResponse.FromString(
        await services.repository_index(b"", call("RepositoryIndex"))
    )
    rows = [(m.name, m.version, m.state, m.reason) for m in merged.models]
    assert rows == [
        ("lin", "1", "READY", "ready on w0; w1: unloaded; w2: unloaded"),
        ("new", "1", "LOADING", "w0: broken; w1: LOADING"),
    ]


async def test_statistics_fail_when_a_worker_fails_the_call():
    fleet = fleet_of("w0", "w1")
    empty = ok(pb.ModelStatisticsResponse())
    answers = {"w0": empty, "w1": UnaryResult(StatusCode.INTERNAL, "boom")}
    services = GatewayServices(fleet, Fixed(fleet, answers), Admission(0), 4)
    with pytest.raises(Relayed, match="w1: boom"):
        await services.model_statistics(b"", call("ModelStatistics"))
    answers["w1"] = UnaryResult(StatusCode.NOT_FOUND, "no such model there")
    await services.model_statistics(b"", call("ModelStatistics"))  # not there: fine
    # of one model: only the workers serving it are asked (w1 still loading it would
    # answer UNAVAILABLE)
    answers["w1"] = UnaryResult(StatusCode.UNAVAILABLE, "model 'm' is loading")
    fleet.workers[0].index = (IndexRow("m", "1", "READY", ""),)
    fleet.workers[1].index = (IndexRow("m", "1", "LOADING", ""),)
    fleet.rebuild_routes()
    body = pb.ModelStatisticsRequest(name="m").SerializeToString()
    await services.model_statistics(body, call("ModelStatistics"))


class Named:
    """A worker channel answering every call with its worker's name."""

    def __init__(self, name: str):
        self.name, self.opened = name, 1

    async def unary(self, path, body, *, metadata=(), timeout=None):
        return UnaryResult(StatusCode.OK, response=self.name.encode())


async def test_a_call_about_one_version_goes_to_a_worker_serving_it():
    workers = [
        WorkerLink(n, f"h:{i}", "127.0.0.1", i, Named(n), True, ready=True)
        for i, n in enumerate(("w0", "w1"))
    ]
    workers[0].index = (IndexRow("m", "1", "READY", ""),)
    workers[1].index = (IndexRow("m", "2", "READY", ""),)
    fleet = Fleet(workers)
    fleet.rebuild_routes()
    discovery = SimpleNamespace(settings=SimpleNamespace(interval_seconds=2.0))
    forward = Forwarder(fleet, discovery, router=None, request_timeout=60.0)
    deadline = trio.current_time() + 10
    for version, expected in (("2", b"w1"), ("1", b"w0")):
        body = pb.ModelReadyRequest(name="m", version=version).SerializeToString()
        answer = await forward.to_model(INFERENCE + "ModelReady", "m", body, {}, deadline, version)
        assert answer == expected


def test_a_model_directory_an_explicit_worker_lists_unloaded_is_not_held_there():
    fleet = fleet_of("w0", "w1")
    fleet.workers[0].index = (IndexRow("lin", "1", "READY", ""),)
    fleet.workers[1].index = (IndexRow("lin", "", "UNAVAILABLE", "unloaded"),)
    assert [w.name for w in fleet.holders("lin")] == ["w0"]
    fleet.workers[1].index = (IndexRow("lin", "1", "UNAVAILABLE", "load failed"),)
    assert [w.name for w in fleet.holders("lin")] == ["w0", "w1"]  # known there, broken


class Versions:
    """A worker channel answering ModelMetadata with its own ``versions``."""

    def __init__(self, *versions: str):
        self.versions, self.opened = versions, 1

    async def unary(self, path, body, *, metadata=(), timeout=None):
        answer = pb.ModelMetadataResponse(name="m", versions=self.versions)
        return UnaryResult(StatusCode.OK, response=answer.SerializeToString())


async def test_metadata_without_a_version_lists_every_workers_versions():
    workers = [
        WorkerLink("w0", "h:0", "127.0.0.1", 0, Versions("1"), True, ready=True),
        WorkerLink("w1", "h:1", "127.0.0.1", 1, Versions("2", "10"), True, ready=True),
    ]
    workers[0].index = (IndexRow("m", "1", "READY", ""),)
    workers[1].index = (IndexRow("m", "2", "READY", ""), IndexRow("m", "10", "READY", ""))
    fleet = Fleet(workers)
    fleet.rebuild_routes()
    discovery = SimpleNamespace(settings=SimpleNamespace(interval_seconds=2.0))
    forward = Forwarder(fleet, discovery, router=None, request_timeout=60.0)
    services = GatewayServices(fleet, forward, Admission(0), 4)
    body = pb.ModelMetadataRequest(name="m").SerializeToString()
    answer = pb.ModelMetadataResponse.FromString(
        await services.model_call(body, call("ModelMetadata"))
    )
    assert list(answer.versions) == ["1", "2", "10"]
