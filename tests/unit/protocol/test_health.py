"""The health service's Watch on trio's mock clock: one poll of ``ready()`` serves every
stream (a thousand idle streams cost no timers of their own), each change reaches every
stream within a poll, a first answer fresher than the last poll is corrected by the next
one, and the streams open at once are capped."""

from __future__ import annotations

import pytest
import trio

from rsrv.errors import ResourceExhausted
from rsrv.protocol._health import NOT_SERVING, SERVING, HealthService
from rsrv.protocol.generated.grpc.health.v1 import health_pb2 as pb


class Readiness:
    """``ready()`` as a switch, counting its calls."""

    def __init__(self) -> None:
        self.value = True
        self.calls = 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.value


async def watch(health: HealthService, seen: list, service: str = "ready") -> None:
    async for answer in health.Watch(pb.HealthCheckRequest(service=service), None):
        seen.append(answer.status)


async def test_one_poll_serves_every_watch_stream(autojump_clock):
    ready = Readiness()
    health = HealthService(ready, max_watches=2000)
    streams = [[] for _ in range(1000)]
    async with trio.open_nursery() as nursery:
        await nursery.start(health.run)
        for seen in streams:
            nursery.start_soon(watch, health, seen)
        await trio.sleep(0.01)
        calls = ready.calls
        await trio.sleep(10)  # 40 polls
        assert ready.calls - calls == 40  # not 40 per stream
        ready.value = False
        await trio.sleep(0.3)
        assert all(seen == [SERVING, NOT_SERVING] for seen in streams)
        nursery.cancel_scope.cancel()
    assert health.watches == 0


async def test_a_first_answer_ahead_of_the_polls_is_corrected_by_the_next(autojump_clock):
    """Ready for less than a poll: the stream that saw it is told it is over."""
    ready = Readiness()
    ready.value = False
    health = HealthService(ready, max_watches=10)
    seen: list = []
    async with trio.open_nursery() as nursery:
        await nursery.start(health.run)  # polled: not ready
        ready.value = True
        nursery.start_soon(watch, health, seen)
        await trio.sleep(0.1)
        ready.value = False  # before the next poll
        await trio.sleep(0.3)
        assert seen == [SERVING, NOT_SERVING]
        nursery.cancel_scope.cancel()


async def test_watch_streams_are_capped():
    """At most half a server's connection cap: each Watch keeps its connection busy
    for its life, so Watches alone never fill the cap."""
    assert HealthService.beside(Readiness(), 1000).max_watches == 500
    assert HealthService.beside(Readiness(), 1).max_watches == 1
    health = HealthService.beside(Readiness(), 4)
    request = pb.HealthCheckRequest(service="")
    first, second = health.Watch(request, None), health.Watch(request, None)
    assert (await anext(first)).status == SERVING and (await anext(second)).status == SERVING
    with pytest.raises(ResourceExhausted, match="2 health Watch streams"):
        await anext(health.Watch(request, None))
    await first.aclose()
    third = health.Watch(request, None)
    assert (await anext(third)).status == SERVING  # one closed: room again
    await second.aclose()
    await third.aclose()
