"""The gateway's merged answers over workers that disagree: RepositoryIndex (a worker
without any version of a model another has versions of adds no row of its own; LOADING
somewhere beats UNAVAILABLE elsewhere), ModelStatistics (a worker that fails the call
fails it, rather than leaving its counts out of the sums), and the routing of calls about
one model version, and of control calls, to the workers that hold it."""

from __future__ import annotations

from contextlib import aclosing

import pytest
import trio
from purerpc.grpclib.status import StatusCode
from support.gateway import Answering, FakeDiscovery, client_call, fleet_of, ok

from rsrv.errors import FailedPrecondition, NotFound, Unavailable
from rsrv.gateway._fleet import Fleet, IndexRow
from rsrv.gateway._forward import CONTROL, INFERENCE, Forwarder, Relayed
from rsrv.gateway._services import GatewayServices
from rsrv.protocol import Admission
from rsrv.protocol.generated.inference import grpc_service_pb2 as pb
from rsrv.protocol.generated.rsrv.control.v1 import control_pb2 as cpb
from rsrv.transport import UnaryResult


class Fixed:
    """fan_out answering each worker with ``answers[worker]``."""

    request_timeout = 60.0

    def __init__(self, fleet: Fleet, answers: dict[str, UnaryResult]):
        self.fleet, self.answers = fleet, answers
        self.discovery = FakeDiscovery()

    async def fan_out(self, path, body, metadata=None, deadline=None, workers=None):
        targets = self.fleet.ready if workers is None else workers
        return {w.name: self.answers[w.name] for w in targets}


def index(*rows: tuple[str, str, str, str]) -> pb.RepositoryIndexResponse:
    row = pb.RepositoryIndexResponse.ModelIndex
    return pb.RepositoryIndexResponse(
        models=[row(name=n, version=v, state=s, reason=r) for n, v, s, r in rows]
    )


async def test_the_index_has_one_row_per_model_version_across_workers():
    fleet = fleet_of("w0", "w1", "w2", ready=True)
    answers = {
        "w0": ok(index(("lin", "1", "READY", ""), ("new", "1", "UNAVAILABLE", "broken"))),
        "w1": ok(index(("lin", "", "UNAVAILABLE", "unloaded"), ("new", "1", "LOADING", ""))),
        "w2": ok(index(("lin", "", "UNAVAILABLE", "unloaded"))),
    }
    services = GatewayServices(fleet, Fixed(fleet, answers), Admission(0), 4)
    merged = pb.RepositoryIndexResponse.FromString(
        await services.repository_index(b"", client_call("RepositoryIndex"))
    )
    rows = [(m.name, m.version, m.state, m.reason) for m in merged.models]
    assert rows == [
        ("lin", "1", "READY", "ready on w0; w1: unloaded; w2: unloaded"),
        ("new", "1", "LOADING", "w0: broken; w1: LOADING"),
    ]


async def test_statistics_fail_when_a_worker_fails_the_call():
    fleet = fleet_of("w0", "w1", ready=True)
    empty = ok(pb.ModelStatisticsResponse())
    answers = {"w0": empty, "w1": UnaryResult(StatusCode.INTERNAL, "boom")}
    services = GatewayServices(fleet, Fixed(fleet, answers), Admission(0), 4)
    with pytest.raises(Relayed, match="w1: boom"):
        await services.model_statistics(b"", client_call("ModelStatistics"))
    answers["w1"] = UnaryResult(StatusCode.NOT_FOUND, "no such model there")
    await services.model_statistics(b"", client_call("ModelStatistics"))  # not there: fine
    # of one model: only the workers serving it are asked (w1 still loading it would
    # answer UNAVAILABLE)
    answers["w1"] = UnaryResult(StatusCode.UNAVAILABLE, "model 'm' is loading")
    fleet.workers[0].index = (IndexRow("m", "1", "READY", ""),)
    fleet.workers[1].index = (IndexRow("m", "1", "LOADING", ""),)
    fleet.rebuild_routes()
    body = pb.ModelStatisticsRequest(name="m").SerializeToString()
    await services.model_statistics(body, client_call("ModelStatistics"))


async def test_a_call_about_one_version_goes_to_a_worker_serving_it():
    channels = {n: Answering(ok(n.encode())) for n in ("w0", "w1")}  # each says its name
    fleet = fleet_of("w0", "w1", channels=channels, ready=True)
    fleet.workers[0].index = (IndexRow("m", "1", "READY", ""),)
    fleet.workers[1].index = (IndexRow("m", "2", "READY", ""),)
    fleet.rebuild_routes()
    forward = Forwarder(fleet, FakeDiscovery(), router=None, request_timeout=60.0)
    deadline = trio.current_time() + 10
    for version, expected in (("2", b"w1"), ("1", b"w0")):
        body = pb.ModelReadyRequest(name="m", version=version).SerializeToString()
        answer = await forward.to_model(INFERENCE + "ModelReady", "m", body, {}, deadline, version)
        assert answer == expected


def test_a_model_directory_an_explicit_worker_lists_unloaded_is_not_held_there():
    fleet = fleet_of("w0", "w1", ready=True)
    fleet.workers[0].index = (IndexRow("lin", "1", "READY", ""),)
    fleet.workers[1].index = (IndexRow("lin", "", "UNAVAILABLE", "unloaded"),)
    assert [w.name for w in fleet.holders("lin")] == ["w0"]
    fleet.workers[1].index = (IndexRow("lin", "1", "UNAVAILABLE", "load failed"),)
    assert [w.name for w in fleet.holders("lin")] == ["w0", "w1"]  # known there, broken


def metadata(*versions: str) -> Answering:
    """A worker channel answering ModelMetadata with its own ``versions``."""
    return Answering(ok(pb.ModelMetadataResponse(name="m", versions=versions)))


async def test_metadata_without_a_version_lists_every_workers_versions():
    channels = {"w0": metadata("1"), "w1": metadata("2", "10")}
    fleet = fleet_of("w0", "w1", channels=channels, ready=True)
    fleet.workers[0].index = (IndexRow("m", "1", "READY", ""),)
    fleet.workers[1].index = (IndexRow("m", "2", "READY", ""), IndexRow("m", "10", "READY", ""))
    fleet.rebuild_routes()
    forward = Forwarder(fleet, FakeDiscovery(), router=None, request_timeout=60.0)
    services = GatewayServices(fleet, forward, Admission(0), 4)
    body = pb.ModelMetadataRequest(name="m").SerializeToString()
    answer = pb.ModelMetadataResponse.FromString(
        await services.model_call(body, client_call("ModelMetadata"))
    )
    assert list(answer.versions) == ["1", "2", "10"]


async def test_a_control_call_for_a_model_no_round_has_seen_yet_waits_for_one():
    """SetModelResidency right after the model was loaded: the routes do not list it
    until the next discovery round, which the call waits for (a refresh)."""
    fleet = fleet_of("w0", ready=True)
    fixed = Fixed(fleet, {"w0": ok(cpb.SetModelResidencyResponse())})

    def round_sees_the_load() -> None:
        fleet.workers[0].index = (IndexRow("lin", "1", "READY", ""),)

    fixed.discovery = FakeDiscovery(on_refresh=round_sees_the_load)
    services = GatewayServices(fleet, fixed, Admission(0), 4)
    body = cpb.SetModelResidencyRequest(name="lin").SerializeToString()
    await services.model_holders(body, client_call("SetModelResidency", CONTROL))
    assert fixed.discovery.refreshes == 1
    with pytest.raises(NotFound, match="'gone' is not on any ready worker"):
        body = cpb.SetModelResidencyRequest(name="gone").SerializeToString()
        await services.model_holders(body, client_call("SetModelResidency", CONTROL))


def shm_status(*regions: tuple[str, str]) -> UnaryResult:
    answer = pb.SystemSharedMemoryStatusResponse()
    for name, key in regions:
        answer.regions[name].CopyFrom(
            pb.SystemSharedMemoryStatusResponse.RegionStatus(name=name, key=key, byte_size=64)
        )
    return ok(answer)


async def test_shared_memory_status_is_what_every_worker_holds_alike():
    """Whichever worker answered, a region only some workers hold (or hold otherwise)
    looked registered, and a request using it failed on the others."""
    fleet = fleet_of("w0", "w1", ready=True)
    answers = {
        "w0": shm_status(("both", "/k"), ("w0 only", "/k"), ("other key", "/a")),
        "w1": shm_status(("both", "/k"), ("other key", "/b")),
    }
    services = GatewayServices(fleet, Fixed(fleet, answers), Admission(0), 4)
    status = client_call("SystemSharedMemoryStatus")

    async def regions(name: str = "") -> list[str]:
        body = pb.SystemSharedMemoryStatusRequest(name=name).SerializeToString()
        answer = await services.shm_status(body, status)
        return sorted(pb.SystemSharedMemoryStatusResponse.FromString(answer).regions)

    for _ in range(2):  # the same, whichever worker is asked first
        assert await regions() == ["both"]
    assert await regions("both") == ["both"]
    with pytest.raises(NotFound, match="'other key'"):
        await regions("other key")
    answers["w1"] = UnaryResult(StatusCode.NOT_FOUND, "Unable to find 'w0 only'")
    with pytest.raises(Relayed, match="worker w1: Unable to find"):
        await regions("w0 only")


class Hanging:
    """A worker channel that never answers (a stopped process)."""

    opened = 1

    async def unary(self, path, body, *, metadata=(), timeout=None, capped=True):
        await trio.sleep_forever()


@pytest.mark.parametrize("method", ["SystemSharedMemoryRegister", "SystemSharedMemoryUnregister"])
async def test_a_shared_memory_call_the_client_leaves_is_put_right_by_catch_up(method):
    """The client's deadline cuts the fan-out off while one worker hangs (the other has
    answered): where the call took effect is unknown, so catch-up is told to bring both
    in line (a register undone, an unregister finished), not left as it was."""
    done = ok(b"")
    channels = {"w0": Answering(done), "w1": Hanging()}
    fleet = fleet_of("w0", "w1", channels=channels, ready=True)
    forward = Forwarder(fleet, FakeDiscovery(), router=None, request_timeout=60.0)
    services = GatewayServices(fleet, forward, Admission(0), 4)
    register = method.endswith("Register")
    if not register:
        services.catchup.regions["r"] = b"registered through the gateway before"
    request = getattr(pb, method + "Request")(name="r").SerializeToString()
    handler = services.shm_register if register else services.shm_unregister
    with trio.move_on_after(0.05) as cut:
        await handler(request, client_call(method))
    assert cut.cancelled_caught
    assert services.catchup.regions == {}
    assert services.catchup.dropped == {"r": {"w0", "w1"}}  # removed wherever it is


class Recording(Answering):
    """Answering, keeping the bodies it was sent."""

    def __init__(self, result: UnaryResult):
        super().__init__(result)
        self.bodies: list[bytes] = []

    async def unary(self, path, body, *, metadata=(), timeout=None, capped=True):
        self.bodies.append(body)
        return self.result


async def test_a_trace_setting_update_naming_a_model_is_made_on_every_worker_alike():
    """A worker keeps one set of trace settings, whatever model an update names: naming
    a model only one worker has, the update reaches both without the name (with it, the
    other refused it and kept its old settings, and reads then disagreed)."""
    channels = {n: Recording(ok(pb.TraceSettingResponse())) for n in ("w0", "w1")}
    fleet = fleet_of("w0", "w1", channels=channels, ready=True)
    fleet.workers[0].index = (IndexRow("only0", "1", "READY", ""),)
    fleet.rebuild_routes()
    forward = Forwarder(fleet, FakeDiscovery(), router=None, request_timeout=60.0)
    services = GatewayServices(fleet, forward, Admission(0), 4)
    update = pb.TraceSettingRequest(model_name="only0")
    update.settings["trace_rate"].value.append("7")
    await services.trace_setting(update.SerializeToString(), client_call("TraceSetting"))
    update.model_name = ""
    assert [c.bodies for c in channels.values()] == [[update.SerializeToString()]] * 2
    update.model_name = "nope"
    with pytest.raises(NotFound, match="'nope' is not on any ready worker"):
        await services.trace_setting(update.SerializeToString(), client_call("TraceSetting"))
    fleet.workers[1].index = (IndexRow("failed", "1", "UNAVAILABLE", "load failed"),)
    fleet.rebuild_routes()
    update.model_name = "failed"  # (a worker answers UNAVAILABLE too)
    with pytest.raises(Unavailable, match="'failed' is not ready on any worker"):
        await services.trace_setting(update.SerializeToString(), client_call("TraceSetting"))
    assert [len(c.bodies) for c in channels.values()] == [1, 1]


async def test_a_failed_register_is_undone_only_where_it_may_have_taken_effect():
    """OK, or an outcome that does not say (a deadline on a call the worker received):
    undone there; refused (ALREADY_EXISTS: that registration is another's) or never
    sent (a deadline that passed before the call left): left alone."""
    fleet = fleet_of("ok", "exists", "late", "unsent", ready=True)
    answers = {
        "ok": ok(b""),
        "exists": UnaryResult(StatusCode.ALREADY_EXISTS, "already registered"),
        "late": UnaryResult(StatusCode.DEADLINE_EXCEEDED, "deadline"),
        "unsent": UnaryResult(StatusCode.DEADLINE_EXCEEDED, "deadline", reached_server=False),
    }
    undone = []

    class Recorded(Fixed):
        async def fan_out(self, path, body, metadata=None, deadline=None, workers=None):
            if workers is not None:
                undone.append(sorted(w.name for w in workers))
                return {w.name: ok(b"") for w in workers}
            return await super().fan_out(path, body, metadata, deadline, workers)

    services = GatewayServices(fleet, Recorded(fleet, answers), Admission(0), 4)
    request = pb.SystemSharedMemoryRegisterRequest(name="r", key="/k", byte_size=64)
    with pytest.raises(Relayed):
        await services.shm_register(
            request.SerializeToString(), client_call("SystemSharedMemoryRegister")
        )
    assert undone == [["late", "ok"]]


async def test_a_worker_whose_name_did_not_resolve_at_start_is_asked_again(monkeypatch):
    """(A worker named in DNS only after the gateway started was judged on another
    host for the gateway's whole life: shared memory was refused for ever.)"""
    from rsrv.gateway import _services

    fleet = fleet_of("w0", "late", ready=True)
    late = fleet.workers[1]
    late.host, late.address, late.local = "late.test", "late.test:1", None
    resolved = {}
    monkeypatch.setattr(_services, "is_local_host", lambda host: resolved.get(host))
    services = GatewayServices(
        fleet, Fixed(fleet, {"w0": ok(b""), "late": ok(b"")}), Admission(0), 4
    )
    request = pb.SystemSharedMemoryRegisterRequest(name="r", key="/k", byte_size=64)
    with pytest.raises(
        FailedPrecondition, match=r"late is at late.test:1 \(its name does not resolve\)"
    ):
        await services.shm_register(
            request.SerializeToString(), client_call("SystemSharedMemoryRegister")
        )
    resolved["late.test"] = True
    await services.shm_register(
        request.SerializeToString(), client_call("SystemSharedMemoryRegister")
    )
    assert late.local is True and services.catchup.regions == {"r": request.SerializeToString()}


async def test_a_stream_answers_each_request_on_its_own_even_one_too_large_or_malformed():
    """(An answer the stream's framing took past grpc.max_message_bytes ended the whole
    stream, cancelling the requests beside it; a malformed request was answered
    "WireError: ...", not ModelInfer's text.)"""

    class Sized:
        async def infer(self, path, head, body, metadata, deadline):
            size = 990 if head.id == "big" else 10  # (big: 998 bytes in all)
            return pb.ModelInferResponse(
                id=head.id, raw_output_contents=[bytes(size)]
            ).SerializeToString()

    fleet = fleet_of("w0", ready=True)
    services = GatewayServices(fleet, Sized(), Admission(0), 4, max_message_bytes=1000)
    bodies = [pb.ModelInferRequest(model_name="m", id=i).SerializeToString() for i in ("a", "big")]

    async def requests():
        for body in (bodies[0], bodies[1], b"\xff\xff\xff", bodies[0]):
            yield body

    stream = services.model_stream_infer(requests(), client_call("ModelStreamInfer"))
    async with aclosing(stream):  # (run to its end in this task, as the transport does)
        answers = [pb.ModelStreamInferResponse.FromString(a) async for a in stream]
    errors = sorted(a.error_message for a in answers if a.error_message)
    assert len(answers) == 4 and [a.infer_response.id for a in answers].count("a") == 2
    assert errors == [
        "malformed ModelInferRequest: truncated varint",
        "response of 1001 bytes exceeds the maximum 1000 (grpc.max_message_bytes)",
    ]
