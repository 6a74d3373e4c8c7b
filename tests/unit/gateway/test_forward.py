"""Forwarding: failover past a worker that left the fleet; a request no worker processed
(none ready, none reachable, or refused with a worker's own retry pushback) fails
UNAVAILABLE with the gateway's retry pushback, and one a worker may have processed never
carries one."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import trio
from purerpc.grpclib.status import StatusCode
from support.gateway import Answering, FakeDiscovery, fleet_of, ok

from rsrv.errors import Unavailable
from rsrv.gateway._fleet import IndexRow
from rsrv.gateway._forward import INFERENCE, Forwarder, Relayed
from rsrv.protocol import grpc_trailers
from rsrv.transport import UnaryResult

REFUSED = UnaryResult(StatusCode.UNAVAILABLE, "connection refused", reached_server=False)
BUSY = UnaryResult(StatusCode.UNAVAILABLE, "worker busy")  # it may have processed it
SHUTTING_DOWN = UnaryResult(
    StatusCode.UNAVAILABLE,
    "server is shutting down",
    trailers=(("grpc-retry-pushback-ms", "0"),),
)


def forwarder(*results: UnaryResult) -> Forwarder:
    names = [f"w{i}" for i in range(len(results))]
    channels = {n: Answering(r) for n, r in zip(names, results, strict=True)}
    fleet = fleet_of(*names, channels=channels, ready=True)
    return Forwarder(fleet, FakeDiscovery(), router=None, request_timeout=60.0)


async def forward(f: Forwarder) -> BaseException:
    order = [w.name for w in f.fleet.workers]
    with pytest.raises((Relayed, Unavailable)) as info:
        await f.try_in_order(INFERENCE + "ModelInfer", b"", {}, trio.current_time() + 10, order)
    return info.value


@pytest.mark.parametrize(
    ("results", "pushback"),
    [
        ((REFUSED, REFUSED), "2000"),  # reached no worker
        ((SHUTTING_DOWN, REFUSED), "2000"),  # the one reached refused it unprocessed
        ((BUSY, REFUSED), None),  # one may have processed it
        ((REFUSED, BUSY), None),
    ],
)
async def test_a_retry_pushback_only_when_no_worker_processed_it(results, pushback):
    error = await forward(forwarder(*results))
    assert error.code == "UNAVAILABLE"
    assert dict(grpc_trailers(error)).get("grpc-retry-pushback-ms") == pushback


async def test_a_worker_found_unreachable_wakes_a_round_at_most_so_often():
    """(Each call woke a round at once: a worker refusing every call REFUSED_STREAM
    while it answered the probes turned 1,000 calls into 300 rounds in 1.8 s.)"""
    f = forwarder(REFUSED, ok(b"ok"))
    await f.try_in_order(INFERENCE + "ModelInfer", b"", {}, trio.current_time() + 10, ["w0", "w1"])
    assert (f.discovery.stales, f.discovery.wakes) == (1, 0)  # (rate-limited: Discovery.stale)


async def test_a_worker_past_the_gateways_request_timeout_is_named_as_such():
    """(the client, which set no deadline, read "deadline exceeded (client timeout)")"""
    late = UnaryResult(StatusCode.DEADLINE_EXCEEDED, "deadline exceeded (client timeout)")
    f = forwarder(late)
    f.request_timeout = 1.0
    with pytest.raises(Relayed) as info:
        await f.try_in_order(INFERENCE + "ModelInfer", b"", {}, math.inf, ["w0"])
    assert (info.value.code, str(info.value)) == (
        "DEADLINE_EXCEEDED",
        "worker w0 did not answer within worker_client.request_timeout_seconds (1 s)",
    )
    # the worker's own DEADLINE_EXCEEDED (its queue's timeout, say) stays as it is
    f = forwarder(UnaryResult(StatusCode.DEADLINE_EXCEEDED, "waited 30.000s in the queue"))
    f.request_timeout = 1.0
    with pytest.raises(Relayed, match="waited 30.000s in the queue"):
        await f.try_in_order(INFERENCE + "ModelInfer", b"", {}, math.inf, ["w0"])


async def test_no_worker_ready_carries_a_pushback():
    f = forwarder(BUSY)
    f.fleet.workers[0].ready = False
    with pytest.raises(Unavailable, match="no worker is ready") as info:
        f.any_ready()  # (a request for a model no ready worker serves)
    assert grpc_trailers(info.value) == (("grpc-retry-pushback-ms", "2000"),)
    with pytest.raises(Unavailable, match="no worker is ready") as info:
        await f.fan_out(INFERENCE + "RepositoryIndex", b"")
    assert grpc_trailers(info.value) == (("grpc-retry-pushback-ms", "2000"),)


async def test_a_model_whose_workers_are_down_is_unavailable_not_unknown():
    """Another worker is ready but does not serve it: not that worker's NOT_FOUND
    ("unknown model"), but UNAVAILABLE with the retry pushback; for ModelInfer, and for
    ModelReady, ModelMetadata and ModelConfig alike (they answered NOT_FOUND)."""
    f = forwarder(ok(b"other"), ok(b"m"))
    up, down = f.fleet.workers
    down.ready, down.index = False, (IndexRow("m", "1", "READY", ""),)
    head = SimpleNamespace(model="m", version="")
    calls = [
        f.infer(INFERENCE + "ModelInfer", head, b"", {}, trio.current_time() + 10),
        f.to_model(INFERENCE + "ModelMetadata", "m", b"", {}, trio.current_time() + 10),
    ]
    for call in calls:
        with pytest.raises(
            Unavailable, match=r"'m' is served by no ready worker \(not ready: w1\)"
        ) as info:
            await call
        assert grpc_trailers(info.value) == (("grpc-retry-pushback-ms", "2000"),)
    up.index = (IndexRow("n", "1", "READY", ""),)
    down.index = ()  # not served anywhere: the ready worker's own answer
    assert (
        await f.infer(INFERENCE + "ModelInfer", head, b"", {}, trio.current_time() + 10) == b"other"
    )


async def test_a_worker_found_down_since_routing_is_passed_over():
    """First in the order but no longer ready (stopped, say: a call there would hang
    until its deadline): the next replica answers, and the work in flight is moved to
    it; when no worker in the order is ready any more, UNAVAILABLE with the pushback at
    once, as for a request routed when none was."""
    f = forwarder(ok(b"w0"), ok(b"w1"))
    f.fleet.workers[0].ready = False
    moved: list[str] = []
    deadline = trio.current_time() + 10
    answer = await f.try_in_order(
        INFERENCE + "ModelInfer", b"", {}, deadline, ["w0", "w1"], on_failover=moved.append
    )
    assert answer == b"w1" and moved == ["w1"]
    assert f.counters.routed == {("w1", "OK"): 1}
    with pytest.raises(Unavailable, match=r"no worker is ready \(w0 went down\)") as info:
        await f.try_in_order(INFERENCE + "ModelInfer", b"", {}, deadline, ["w0"])
    assert grpc_trailers(info.value) == (("grpc-retry-pushback-ms", "2000"),)
    assert f.counters.routed == {("w1", "OK"): 1}  # (w0 never called)


async def test_failover_skips_a_worker_that_left_the_fleet_meanwhile():
    f = forwarder(REFUSED, BUSY, ok(b"ok"))
    f.fleet.remove("w1")  # DNS dropped it after the request was routed
    order = ["w0", "w1", "w2"]
    answer = await f.try_in_order(
        INFERENCE + "ModelInfer", b"", {}, trio.current_time() + 10, order
    )
    assert answer == b"ok"


async def test_a_call_that_ends_after_its_worker_left_the_fleet_leaves_no_series(autojump_clock):
    """A worker leaves DNS while a call to it is in flight: its counters leave with it,
    and the call, finishing later, does not bring them back."""

    class Slow(Answering):
        async def unary(self, path, body, *, metadata=(), timeout=None, capped=True):
            await trio.sleep(1)
            return self.result

    f = forwarder(ok(b"ok"))
    worker = f.fleet.workers[0]
    worker.channel = Slow(worker.channel.result)
    async with trio.open_nursery() as nursery:
        deadline = trio.current_time() + 10
        nursery.start_soon(f.try_in_order, INFERENCE + "ModelInfer", b"", {}, deadline, ["w0"])
        await trio.sleep(0.1)
        f.fleet.remove("w0")  # as Gateway._resolve_dns does
    assert f.counters.routed == {} and f.counters.failovers == {}


async def test_a_call_the_client_cuts_off_is_counted_as_the_client_sees_it(autojump_clock):
    """A call its client's deadline or cancel ends while the worker holds it (a worker
    that hangs) is counted among the calls routed to that worker."""

    class Hanging(Answering):
        async def unary(self, path, body, *, metadata=(), timeout=None, capped=True):
            await trio.sleep_forever()

    f = forwarder(ok(b"ok"))
    worker = f.fleet.workers[0]
    worker.channel = Hanging(worker.channel.result)
    deadline = trio.current_time() + 1
    with trio.move_on_at(deadline):  # the client's deadline, as the server enforces it
        await f.try_in_order(INFERENCE + "ModelInfer", b"", {}, deadline, ["w0"])
    with trio.move_on_after(0.5):  # the client went away first
        await f.try_in_order(INFERENCE + "ModelInfer", b"", {}, deadline + 10, ["w0"])
    # its client's timer started before the call was sent: it resets just before ours
    with trio.move_on_after(0.99):
        await f.try_in_order(INFERENCE + "ModelInfer", b"", {}, trio.current_time() + 1, ["w0"])
    assert f.counters.routed == {("w0", "DEADLINE_EXCEEDED"): 2, ("w0", "CANCELLED"): 1}
    assert worker.inflight == 0


async def test_a_held_request_waits_at_most_half_its_time_left(autojump_clock):
    waited: list[float] = []

    class Hold:
        async def wait(self, until=math.inf):
            waited.append(until)

    class Ticket:
        order, hold = ["w0"], Hold()

        def redirect(self, worker):
            pass

        def release(self):
            pass

    f = forwarder(ok(b"ok"))
    f.fleet.routes = {"m": ("w0",)}
    f.router = SimpleNamespace(route=lambda model, head, replicas: Ticket())
    head = SimpleNamespace(model="m", version="")
    now = trio.current_time()
    for deadline in (now + 0.3, math.inf):
        assert await f.infer(INFERENCE + "ModelInfer", head, b"", {}, deadline) == b"ok"
    assert waited == [now + 0.15, math.inf]


async def test_a_call_gets_the_clients_deadline_up_to_the_request_timeout(autojump_clock):
    timeouts: list[float] = []

    class Recording(Answering):
        async def unary(self, path, body, *, metadata=(), timeout=None, capped=True):
            timeouts.append(timeout)
            return self.result

    f = forwarder(ok(b"ok"))
    f.fleet.workers[0].channel = Recording(ok(b"ok"))
    for deadline in (trio.current_time() + 30, trio.current_time() + 300, math.inf):
        await f.try_in_order(INFERENCE + "ModelInfer", b"", {}, deadline, ["w0"])
    assert timeouts == [30, 60, 60]  # a worker that hangs holds a call 60 s at most


async def test_a_fan_out_past_its_deadline_answers_each_worker_deadline_exceeded():
    """Not an exception group of every worker's DeadlineExceeded (which a client would
    read as INTERNAL): one result per worker, as for any failure there."""
    f = forwarder(UnaryResult(StatusCode.OK), UnaryResult(StatusCode.OK))
    results = await f.fan_out(INFERENCE + "ServerReady", b"", deadline=trio.current_time())
    assert {n: (r.status, r.reached_server) for n, r in results.items()} == {
        "w0": (StatusCode.DEADLINE_EXCEEDED, False),
        "w1": (StatusCode.DEADLINE_EXCEEDED, False),
    }


# -- versions across workers (a rolling upgrade) ---------------------------------------------


class RoundRobin:
    """The router's interface over rsrv's round robin."""

    def __init__(self):
        from rsrv.gateway._routing import RoundRobinRouter

        self.router = RoundRobinRouter()

    def route(self, model, head, replicas):
        return self.router.route(model, replicas)


def upgrading(w0_answer: UnaryResult) -> Forwarder:
    """w0 holds m/1 and m/2, w1 only m/1."""
    channels = {"w0": Answering(w0_answer), "w1": Answering(ok(b"from w1"))}
    fleet = fleet_of("w0", "w1", channels=channels, ready=True)
    w0, w1 = fleet.workers
    w0.index = (IndexRow("m", "1", "READY", ""), IndexRow("m", "2", "READY", ""))
    w1.index = (IndexRow("m", "1", "READY", ""),)
    fleet.rebuild_routes()
    return Forwarder(fleet, FakeDiscovery(), RoundRobin(), request_timeout=60.0)


@pytest.mark.parametrize(
    "w0_answer",
    [
        UnaryResult(StatusCode.UNAVAILABLE, "server is shutting down", trailers=grpc_trailers({})),
        UnaryResult(StatusCode.UNAVAILABLE, "connection refused", reached_server=False),
        UnaryResult(StatusCode.NOT_FOUND, "Request for unknown model: 'm' is not found"),
    ],
    ids=["shutting down", "unreachable", "not found"],
)
async def test_an_unversioned_call_prefers_the_newest_and_fails_over_to_the_rest(w0_answer):
    """Newest holder first (w0, m/2); one that cannot take the call gives way to the
    holder of m/1, as one server that lost m/2 would answer with m/1."""
    forwarder = upgrading(w0_answer)
    head = SimpleNamespace(model="m", version="")
    deadline = trio.current_time() + 10
    assert await forwarder.infer(INFERENCE + "ModelInfer", head, b"", {}, deadline) == b"from w1"


async def test_a_replica_that_lists_no_version_is_not_held_to_be_older():
    """w1 serves enc only as a meta's sub-model (its index hides it): nothing is known to
    differ in version, so both replicas take unversioned calls."""
    from rsrv.protocol.generated.rsrv.control.v1 import control_pb2 as cpb

    channels = {"w0": Answering(ok(b"w0")), "w1": Answering(ok(b"w1"))}
    fleet = fleet_of("w0", "w1", channels=channels, ready=True)
    w0, w1 = fleet.workers
    w0.index = (IndexRow("enc", "1", "READY", ""),)
    w1.index = (IndexRow("pipe", "1", "READY", ""),)
    w1.control = cpb.ModelControlStatusResponse(
        models=[
            cpb.ModelStatus(name="pipe", state="READY"),
            cpb.ModelStatus(name="enc", state="READY"),
        ]
    )
    fleet.rebuild_routes()
    assert fleet.routes["enc"] == ("w0", "w1") and "enc" not in fleet.newest_routes
    forwarder = Forwarder(fleet, FakeDiscovery(), RoundRobin(), request_timeout=60.0)
    head = SimpleNamespace(model="enc", version="")
    deadline = trio.current_time() + 10
    got = {
        await forwarder.infer(INFERENCE + "ModelInfer", head, b"", {}, deadline) for _ in range(4)
    }
    assert got == {b"w0", b"w1"}
