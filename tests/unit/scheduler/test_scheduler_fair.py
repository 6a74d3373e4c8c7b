"""Fair sharing under saturation: weights, cheap vs expensive models, cold models,
live weight changes, latency-budget escalation, no banked credit."""

from __future__ import annotations

import math

import pytest
import trio
from support.assertions import raises
from support.scheduler import FakeExecutor, client_loop, scheduler_of, spec

from rsrv.config import MAX_WEIGHT, MIN_WEIGHT
from rsrv.errors import InvalidArgument
from rsrv.scheduler import Scheduler


async def saturate(
    sched: Scheduler,
    ex: FakeExecutor,
    clients: dict[str, int],
    seconds: float,
    waits: dict[str, list[float]] | None = None,
    think: dict[str, float] | None = None,
    during=None,
) -> None:
    """Run closed-loop clients (``clients[model]`` each, 1 row per request) for
    ``seconds`` of mock time. ``during(sched)``, if given, runs alongside."""
    with trio.move_on_after(seconds):
        async with trio.open_nursery() as nursery:
            await nursery.start(sched.run)
            for model, n in clients.items():
                for _ in range(n):
                    nursery.start_soon(
                        client_loop,
                        sched,
                        model,
                        1,
                        (think or {}).get(model, 0.0),
                        None if waits is None else waits.setdefault(model, []),
                    )
            if during is not None:
                nursery.start_soon(during, sched)


def shares(ex: FakeExecutor, models, since: float, until: float) -> dict[str, float]:
    time = {m: ex.device_time(m, since, until) for m in models}
    total = sum(time.values())
    return {m: t / total for m, t in time.items()}


# per batch: a fixed part plus a part per compiled row; costs differ 15x across models
BASE = {"a": 0.002, "b": 0.010, "c": 0.004, "d": 0.030}


def cost(model: str, size: int) -> float:
    return BASE[model] * (1 + size / 8)


async def test_device_time_shares_follow_weights_under_saturation(autojump_clock):
    weights = {"a": 1.0, "b": 1.0, "c": 2.0, "d": 4.0}
    ex, sched = scheduler_of(*(spec(name, weight=w) for name, w in weights.items()), cost=cost)
    await saturate(sched, ex, {m: 12 for m in weights}, seconds=20.0)
    got = shares(ex, weights, since=2.0, until=20.0)
    total = sum(weights.values())
    for m, w in weights.items():
        assert got[m] == pytest.approx(w / total, rel=0.10), (m, got)


async def test_weight_two_gets_twice_the_device_time_of_weight_one(autojump_clock):
    ex, sched = scheduler_of(spec("one", weight=1.0), spec("two", weight=2.0), cost=0.01)
    await saturate(sched, ex, {"one": 12, "two": 12}, seconds=12.0)
    ratio = ex.device_time("two", 2.0) / ex.device_time("one", 2.0)
    assert ratio == pytest.approx(2.0, rel=0.05)


async def test_a_cheap_model_is_not_starved_by_an_expensive_one(autojump_clock):
    costs = {"cheap": 0.002, "dear": 0.1}
    ex, sched = scheduler_of(spec("cheap"), spec("dear"), cost=lambda model, size: costs[model])
    waits: dict[str, list[float]] = {}
    await saturate(sched, ex, {"cheap": 12, "dear": 12}, seconds=6.0, waits=waits)
    got = shares(ex, ["cheap", "dear"], since=1.0, until=6.0)
    assert got["cheap"] == pytest.approx(0.5, rel=0.10)
    # the cheap model waits at most one expensive batch and one of its own
    assert max(waits["cheap"][100:]) <= 0.1 + 0.002 + 1e-9


async def test_a_cold_model_gets_bounded_queue_wait(autojump_clock):
    ex, sched = scheduler_of(spec("hot1"), spec("hot2"), spec("cold"), cost=0.02)
    waits: dict[str, list[float]] = {}
    await saturate(
        sched,
        ex,
        {"hot1": 16, "hot2": 16, "cold": 1},
        seconds=20.0,
        waits=waits,
        think={"cold": 0.1},
    )
    hot = sched.stats("hot1").requests
    cold = sched.stats("cold").requests
    assert cold * 10 <= hot, (cold, hot)  # the cold model sends >= 10x fewer requests
    # it waits at most for the batch in flight and one more
    assert max(waits["cold"]) <= 2 * 0.02 + 1e-9
    assert sched.stats("cold").wait_percentiles["p99"] <= 2 * 0.02 + 1e-9


async def test_set_weight_changes_shares_live(autojump_clock):
    ex, sched = scheduler_of(spec("a"), spec("b"), cost=0.02)

    async def reweigh(sched):
        await trio.sleep(6.0)
        sched.set_weight("a", 3.0)

    await saturate(sched, ex, {"a": 12, "b": 12}, seconds=16.0, during=reweigh)
    before = ex.device_time("a", 1.0, 6.0) / ex.device_time("b", 1.0, 6.0)
    after = ex.device_time("a", 7.0, 16.0) / ex.device_time("b", 7.0, 16.0)
    assert before == pytest.approx(1.0, rel=0.05)
    assert after == pytest.approx(3.0, rel=0.05)
    assert sched.stats("a").weight == 3.0


async def test_an_idle_model_banks_no_credit(autojump_clock):
    ex, sched = scheduler_of(spec("busy"), spec("late"), cost=0.02, ema_halflife_seconds=30.0)

    async def arrive_late(sched):
        await trio.sleep(10.0)  # `busy` had the device to itself meanwhile
        async with trio.open_nursery() as nursery:
            for _ in range(12):
                nursery.start_soon(client_loop, sched, "late")

    await saturate(sched, ex, {"busy": 12}, seconds=12.0, during=arrive_late)
    # straight away an even split, not a burst for the newcomer
    got = shares(ex, ["busy", "late"], since=10.0, until=10.5)
    assert got["late"] == pytest.approx(0.5, rel=0.10)


async def test_a_model_whose_batch_is_running_is_not_idle(autojump_clock):
    """A model whose queue empties at each dispatch and refills while its own batch runs
    was never idle: the charge of that batch does not fade. Equal weights, 1 s batches,
    ``b`` saturated, ``a`` sent one request every 0.95 s: an even split (it was 54/46
    when re-entry counted the running batch as idle time)."""
    ex, sched = scheduler_of(spec("a", (8,)), spec("b", (8,)), cost=1.0, ema_halflife_seconds=2.0)
    sched.warm_costs("a", {8: 1.0})
    sched.warm_costs("b", {8: 1.0})

    async def send_a(sched):
        async with trio.open_nursery() as nursery:
            while True:
                nursery.start_soon(client_loop, sched, "a", 1, math.inf)
                await trio.sleep(0.95)

    await saturate(sched, ex, {"b": 4}, seconds=200.0, during=send_a)
    got = shares(ex, ["a", "b"], since=20.0, until=200.0)
    assert got["a"] == pytest.approx(0.5, abs=0.01)


@pytest.mark.parametrize("budget", [None, 0.05])
async def test_latency_budget_escalates_under_fair(autojump_clock, budget):
    small = spec("small", weight=1.0, latency_budget=budget)
    ex, sched = scheduler_of(spec("big", weight=20.0), small, cost=0.01)
    sched.warm_costs("big", {s: 0.01 for s in (1, 4, 8)})
    sched.warm_costs("small", {s: 0.01 for s in (1, 4, 8)})
    waits: dict[str, list[float]] = {}
    await saturate(sched, ex, {"big": 16, "small": 4}, seconds=5.0, waits=waits)
    latency = max(waits["small"][10:]) + 0.01  # queue wait + its batch
    if budget is None:
        assert latency > 0.05  # by weight alone it waits ~20 batches
    else:
        assert latency <= budget + 1e-9


async def test_latency_budget_escalates_for_a_version_other_than_the_default(autojump_clock):
    """Versions side by side: requests for version 1 carry its budget, though version 2
    (added last, the default) has none."""
    ex, sched = scheduler_of(
        spec("big", weight=20.0), spec("small", version="1", latency_budget=0.05), cost=0.01
    )
    sched.add_model(spec("small", version="2", executable="small@2"))
    for name, version in (("big", None), ("small", "1"), ("small", "2")):
        sched.warm_costs(name, {s: 0.01 for s in (1, 4, 8)}, version)
    waits: dict[str, list[float]] = {}

    async def small_v1(sched):
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(
                    client_loop, sched, "small", 1, 0.0, waits.setdefault("1", []), "1"
                )

    await saturate(sched, ex, {"big": 16}, seconds=5.0, during=small_v1)
    assert max(waits["1"][10:]) + 0.01 <= 0.05 + 1e-9


@pytest.mark.parametrize("bad", [float("inf"), 5e-324, 0.0, -1.0, float("nan"), 1e-4, 1e4])
async def test_weights_outside_the_range_are_refused(autojump_clock, bad):
    """inf would starve every other model; a subnormal one would push virtual time to
    inf for good."""
    _, sched = scheduler_of(spec("a"))
    with raises(InvalidArgument, "weight must be between 0.001 and 1000"):
        sched.set_weight("a", bad)
    with raises(InvalidArgument, "weight must be between"):
        spec("b", weight=bad)
    assert sched.stats("a").weight == 1.0


async def test_shares_recover_after_an_extreme_weight(autojump_clock):
    """The smallest and largest weights, then back to 1: within a few seconds the two
    models share equally again (the lead a weight change leaves is kept in device
    seconds, not multiplied by the weight ratio)."""
    ex, sched = scheduler_of(spec("a"), spec("b"), cost=0.02)

    async def swing(sched):
        await trio.sleep(3.0)
        sched.set_weight("a", MIN_WEIGHT)
        await trio.sleep(3.0)
        sched.set_weight("a", MAX_WEIGHT)
        await trio.sleep(3.0)
        sched.set_weight("a", 1.0)

    await saturate(sched, ex, {"a": 12, "b": 12}, seconds=20.0, during=swing)
    low = ex.device_time("a", 4.0, 6.0) / ex.device_time("b", 4.0, 6.0)
    high = ex.device_time("b", 7.0, 9.0) / max(ex.device_time("a", 7.0, 9.0), 1e-9)
    after = ex.device_time("a", 12.0, 20.0) / ex.device_time("b", 12.0, 20.0)
    assert low < 0.01 and high < 0.01
    assert after == pytest.approx(1.0, rel=0.05)
