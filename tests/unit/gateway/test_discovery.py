"""Discovery against scripted workers (a fake channel answering each RPC from a table):
routes from RepositoryIndex and ModelControlStatus, when the control status is asked for,
restarts seen through its ``instance``, and what a failed control call leaves known
(catch-up: test_catchup.py)."""

from __future__ import annotations

import logging

import trio
from purerpc.grpclib.status import StatusCode
from support.gateway import ok, worker_link

from rsrv.config import GatewayConfig
from rsrv.gateway._discovery import (
    CONTROL_STATUS,
    REPOSITORY_INDEX,
    SERVER_READY,
    STARTING_SECONDS,
    Discovery,
)
from rsrv.gateway._fleet import Fleet, WorkerLink
from rsrv.protocol.generated.inference import grpc_service_pb2 as pb
from rsrv.protocol.generated.rsrv.control.v1 import control_pb2 as cpb
from rsrv.transport import UnaryResult


class ScriptedChannel:
    """Answers each path from ``answers`` (a message, or a StatusCode to fail with)."""

    def __init__(self, answers: dict):
        self.answers = answers
        self.calls: list[str] = []
        self.opened = 1  # connections opened so far

    async def unary(self, path, body, *, metadata=(), timeout=None, capped=True):
        self.calls.append(path.rsplit("/", 1)[1])
        answer = self.answers[path]
        if isinstance(answer, StatusCode):
            return UnaryResult(answer, f"scripted {answer.name}")
        return ok(answer)


def worker_answers(models: list[str], subs: list[str] = (), instance: str = "a") -> dict:
    index = pb.RepositoryIndexResponse(
        models=[pb.RepositoryIndexResponse.ModelIndex(name=m, state="READY") for m in models]
    )
    control = cpb.ModelControlStatusResponse(
        instance=instance,
        models=[cpb.ModelStatus(name=m, state="READY") for m in [*models, *subs]],
    )
    return {
        SERVER_READY: pb.ServerReadyResponse(ready=True),
        REPOSITORY_INDEX: index,
        CONTROL_STATUS: control,
    }


def fleet_of(channel: ScriptedChannel) -> tuple[Fleet, WorkerLink, Discovery]:
    worker = worker_link("w0", 1, channel)
    fleet = Fleet([worker])
    return fleet, worker, Discovery(fleet, GatewayConfig(endpoints=["127.0.0.1:1"]))


async def test_sub_models_route_and_a_restart_between_rounds_is_seen():
    channel = ScriptedChannel(worker_answers(["meta"], subs=["part"], instance="first"))
    fleet, worker, discovery = fleet_of(channel)
    await discovery.round()
    assert fleet.routes == {"meta": ("w0",), "part": ("w0",)}
    assert worker.ready and not worker.restarted
    channel.calls.clear()
    await discovery.round()
    # Nothing changed: round robin does not ask for the control status again.
    assert channel.calls == ["ServerReady", "RepositoryIndex"]
    assert fleet.routes == {"meta": ("w0",), "part": ("w0",)}
    # Restarted between two rounds, never seen down: a new connection, a new instance.
    channel.answers[CONTROL_STATUS].instance = "second"
    channel.opened += 1
    await discovery.round()
    assert worker.ready and worker.restarted


async def test_the_control_status_is_read_again_when_the_index_changes():
    channel = ScriptedChannel(worker_answers(["meta"], subs=["part"]))
    fleet, _, discovery = fleet_of(channel)
    await discovery.round()
    channel.answers.update(worker_answers(["meta", "other"], subs=["part", "more"]))
    await discovery.round()
    assert set(fleet.routes) == {"meta", "other", "part", "more"}


async def test_a_mode_that_reads_costs_asks_every_round():
    channel = ScriptedChannel(worker_answers(["lin"]))
    worker = worker_link("w0", 1, channel)
    config = GatewayConfig(endpoints=["127.0.0.1:1"])
    discovery = Discovery(Fleet([worker]), config, needs_control=True)
    for _ in range(3):
        await discovery.round()
    assert channel.calls.count("ModelControlStatus") == 3


async def test_a_worker_without_the_control_service_is_routed_by_its_index(caplog):
    channel = ScriptedChannel(worker_answers(["lin"]))
    channel.answers[CONTROL_STATUS] = StatusCode.UNIMPLEMENTED
    fleet, worker, discovery = fleet_of(channel)
    with caplog.at_level(logging.WARNING, "rsrv.gateway"):
        await discovery.round()
    assert fleet.routes == {"lin": ("w0",)} and worker.control is None
    assert not caplog.records  # expected of a worker that is not rsrv: not a warning


async def test_a_worker_refusing_the_gateways_call_for_its_key_is_warned_about(caplog):
    """Its RepositoryIndex refused for a restricted protocol's missing header: the worker
    never looked ready, and nothing said why (taken for a worker going away)."""

    class Restricted(ScriptedChannel):
        async def unary(self, path, body, **kwargs):
            if path == REPOSITORY_INDEX:
                message = "This protocol is restricted, expecting header 'admin-key'"
                return UnaryResult(StatusCode.UNAVAILABLE, message)
            return await super().unary(path, body, **kwargs)

    fleet, worker, discovery = fleet_of(Restricted(worker_answers(["lin"])))
    with caplog.at_level(logging.WARNING, "rsrv.gateway"):
        await discovery.round()
    assert not worker.ready
    assert (
        "worker w0 answered UNAVAILABLE to RepositoryIndex: This protocol is restricted, "
        "expecting header 'admin-key' (the gateway's calls carry worker_client.headers)"
    ) in caplog.text


async def test_a_failed_control_call_keeps_what_is_known_of_a_ready_worker(caplog):
    channel = ScriptedChannel(worker_answers(["meta"], subs=["part"]))
    fleet, worker, discovery = fleet_of(channel)
    await discovery.round()
    channel.answers[CONTROL_STATUS] = StatusCode.INTERNAL
    channel.opened += 1  # (so that it is asked again)
    with caplog.at_level(logging.WARNING, "rsrv.gateway"):
        await discovery.round()
    assert "part" in fleet.routes  # the last answer stands
    assert "INTERNAL to ModelControlStatus" in caplog.text
    # Down, then back with its control status failing: nothing of the old run is kept.
    channel.answers[SERVER_READY] = pb.ServerReadyResponse(ready=False)
    await discovery.round()
    channel.answers[SERVER_READY] = pb.ServerReadyResponse(ready=True)
    await discovery.round()
    assert worker.ready and worker.control is None and "part" not in fleet.routes
    # Asked again every round until it answers, warning once per streak of failures;
    # then the sub-model is routed again.
    caplog.clear()
    with caplog.at_level(logging.WARNING, "rsrv.gateway"):
        await discovery.round()
    assert worker.control is None and "ModelControlStatus" not in caplog.text
    channel.answers[CONTROL_STATUS] = worker_answers(["meta"], subs=["part"])[CONTROL_STATUS]
    await discovery.round()
    assert worker.control is not None and fleet.routes["part"] == ("w0",)
    channel.calls.clear()
    await discovery.round()
    assert channel.calls == ["ServerReady", "RepositoryIndex"]  # answered: not asked again


async def test_a_worker_busy_at_its_inflight_cap_is_answering_not_down(caplog):
    """(A worker whose in-flight cap the gateway's own calls filled refused the probes
    RESOURCE_EXHAUSTED, and was taken out of the routes at peak load, the gateway not
    ready when all were.)"""
    channel = ScriptedChannel(worker_answers(["lin"]))
    fleet, worker, discovery = fleet_of(channel)
    await discovery.round()
    caplog.clear()
    for busy in (REPOSITORY_INDEX, SERVER_READY, CONTROL_STATUS):
        channel.answers[busy] = StatusCode.RESOURCE_EXHAUSTED
        with caplog.at_level(logging.WARNING, "rsrv.gateway"):
            await discovery.round()
        assert worker.ready and fleet.routes["lin"] == ("w0",) and worker.probe_failures == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # busy as it comes back: not ready until it answers
    channel.answers = worker_answers(["lin"])
    channel.answers[SERVER_READY] = pb.ServerReadyResponse(ready=False)
    await discovery.round()
    channel.answers[SERVER_READY] = StatusCode.RESOURCE_EXHAUSTED
    await discovery.round()
    assert not worker.ready and "lin" not in fleet.routes
    channel.answers = worker_answers(["lin"])
    await discovery.round()
    assert worker.ready and fleet.routes["lin"] == ("w0",)


async def test_a_worker_refusing_every_probe_longer_than_any_call_lasts_is_stuck(autojump_clock):
    """(Its slots held by calls that never end, a hung execution say, it stayed ready for
    ever, every client call refused RESOURCE_EXHAUSTED.) Past worker_client.
    request_timeout_seconds of refusals it gets no traffic, until it answers again."""
    channel = ScriptedChannel(worker_answers(["lin"]))
    fleet, worker, discovery = fleet_of(channel)  # (request_timeout_seconds: 60)
    await discovery.round()
    channel.answers[SERVER_READY] = StatusCode.RESOURCE_EXHAUSTED
    await discovery.round()
    await trio.sleep(59)
    await discovery.round()
    assert worker.ready  # busy, so far
    channel.answers = worker_answers(["lin"])  # a probe answered ends the streak
    await discovery.round()
    channel.answers[SERVER_READY] = StatusCode.RESOURCE_EXHAUSTED
    await discovery.round()
    await trio.sleep(59)
    await discovery.round()
    assert worker.ready
    await trio.sleep(2)
    await discovery.round()
    assert not worker.ready and "lin" not in fleet.routes
    channel.answers = worker_answers(["lin"])
    await discovery.round()
    assert worker.ready and fleet.routes["lin"] == ("w0",)


async def test_a_restart_whose_first_control_call_fails_is_seen_at_the_next_answer():
    channel = ScriptedChannel(worker_answers(["lin"], instance="first"))
    _, worker, discovery = fleet_of(channel)
    await discovery.round()
    channel.opened += 1  # restarted between two rounds ...
    channel.answers[CONTROL_STATUS] = StatusCode.UNAVAILABLE  # ... and not answering yet
    await discovery.round()
    assert not worker.restarted and worker.instance == "first"
    channel.answers[CONTROL_STATUS] = worker_answers(["lin"], instance="second")[CONTROL_STATUS]
    await discovery.round()
    assert worker.restarted and worker.instance == "second"


class HangingChannel:
    """A wedged worker: every call runs to its timeout."""

    opened = 1

    async def unary(self, path, body, *, metadata=(), timeout=None, capped=True):
        await trio.sleep(timeout)
        return UnaryResult(StatusCode.DEADLINE_EXCEEDED, "deadline exceeded (client timeout)")


async def test_requests_cut_short_while_refreshing_leave_discovery_running(autojump_clock):
    """Requests for a model with no route wake a round and wait for it; their deadlines
    (shorter than a round, which waits for a wedged worker's probes) cancel only their
    wait, never the round: the routes keep being rebuilt."""
    channel = ScriptedChannel(worker_answers(["m"]))
    channel.answers[SERVER_READY] = pb.ServerReadyResponse(ready=False)
    channel.answers[REPOSITORY_INDEX] = pb.RepositoryIndexResponse()
    wedged = worker_link("wedged", 2, HangingChannel())
    worker = worker_link("w0", 1, channel)
    fleet = Fleet([wedged, worker])
    discovery = Discovery(fleet, GatewayConfig(endpoints=["127.0.0.1:2", "127.0.0.1:1"]))
    assert discovery.settings.probe_timeout_seconds > 0.9
    async with trio.open_nursery() as nursery:
        await nursery.start(discovery.run)

        async def requests():
            while True:
                with trio.move_on_after(0.9):
                    await discovery.refresh()
                await trio.sleep(0.3)

        nursery.start_soon(requests)
        await trio.sleep(5)
        channel.answers.update(worker_answers(["m"]))  # its model is loaded
        rounds = discovery.rounds
        await trio.sleep(30)
        assert discovery.rounds > rounds + 5
        assert fleet.routes == {"m": ("w0",)}
        nursery.cancel_scope.cancel()


async def test_a_worker_that_never_answered_is_reported_once(caplog, autojump_clock):
    """A mistyped endpoint (connection refused from the start) is warned about once,
    once it has not answered for STARTING_SECONDS (before, it may be starting: a node
    starts its gateway beside its workers, and every start logged a warning); a worker
    that answered before and goes away is reported as not ready instead."""
    channel = ScriptedChannel(worker_answers(["m"]))
    channel.answers[SERVER_READY] = StatusCode.UNAVAILABLE
    _, _, discovery = fleet_of(channel)
    with caplog.at_level(logging.INFO, "rsrv.gateway"):
        for _ in range(3):
            await discovery.round()
            await trio.sleep(STARTING_SECONDS / 4)
        assert caplog.text.count("UNAVAILABLE to ServerReady") == 3
        assert "WARNING" not in caplog.text and "has not answered yet" in caplog.text
        for _ in range(3):
            await discovery.round()
            await trio.sleep(STARTING_SECONDS / 4)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "UNAVAILABLE to ServerReady" in warnings[0].getMessage()


async def test_a_call_that_finds_the_worker_unreachable_mid_probe_has_the_last_word():
    """The probe's answers came before the call's failure: the worker stays out of the
    routes until a probe begun after that failure answers."""
    channel = ScriptedChannel(worker_answers(["m"]))
    fleet, worker, discovery = fleet_of(channel)
    await discovery.round()
    assert fleet.routes == {"m": ("w0",)}
    answer = channel.unary

    async def unreachable_after_answering(path, body, **kw):
        result = await answer(path, body, **kw)
        if path == REPOSITORY_INDEX:
            fleet.mark_unreachable(worker)  # a call's failure, between two probe calls
        return result

    channel.unary = unreachable_after_answering
    await discovery.round()
    assert not worker.ready and fleet.routes == {}
    channel.unary = answer
    await discovery.round()
    assert worker.ready and fleet.routes == {"m": ("w0",)}


async def test_a_refresh_after_a_change_through_the_gateway_waits_for_its_round(autojump_clock):
    """A model loaded through the gateway moments after a refresh (which holds back the
    next one for ``refresh_min_seconds``): a refresh still waits for the round that
    shows it, so a control call right after the load finds the model."""
    channel = ScriptedChannel(worker_answers([]))
    fleet, worker, discovery = fleet_of(channel)
    async with trio.open_nursery() as nursery:
        await nursery.start(discovery.run)
        await discovery.refresh()  # (an unknown model's)
        channel.answers.update(worker_answers(["lin"]))  # the load, accepted
        discovery.changed()
        await discovery.refresh()
        assert fleet.holders("lin") == [worker]
        rounds = discovery.rounds
        await discovery.refresh()  # nothing changed since: held back, no round
        assert discovery.rounds == rounds
        nursery.cancel_scope.cancel()


class SlowChannel(ScriptedChannel):
    """ServerReady answered after half a second: a round takes that long."""

    async def unary(self, path, body, **kwargs):
        if path == SERVER_READY:
            await trio.sleep(0.5)
        return await super().unary(path, body, **kwargs)


async def test_requests_during_a_refresh_wait_for_its_round(autojump_clock):
    """Five requests for a model that has just appeared, 50 ms apart, while the round the
    first one woke takes 0.5 s: each waits for that round, then finds the model (the
    four after the first returned at once, held back by refresh_min_seconds, and were
    answered NOT_FOUND)."""
    channel = SlowChannel(worker_answers([]))
    fleet, worker, discovery = fleet_of(channel)
    assert discovery.settings.refresh_min_seconds > 0.2
    async with trio.open_nursery() as nursery:
        await nursery.start(discovery.run)
        channel.answers.update(worker_answers(["new"]))
        found = []

        async def request(delay: float) -> None:
            await trio.sleep(delay)
            await discovery.refresh()
            found.append(fleet.holders("new") == [worker])

        async with trio.open_nursery() as requests:
            for i in range(5):
                requests.start_soon(request, 0.05 * i)
        assert found == [True] * 5
        nursery.cancel_scope.cancel()
