"""The queue delay (Triton's max_queue_delay_microseconds): a batch smaller than the
largest one it can run waits a bounded time for more requests. Time is trio's MockClock:
every instant below is exact."""

from __future__ import annotations

import msgspec
import pytest
import trio
from support.scheduler import FakeExecutor, client_loop, config, queued, rows, scheduler_of, spec
from trio.testing import wait_all_tasks_blocked

from rsrv.config._schema import ModelSchedConfig, SchedulerConfig
from rsrv.errors import InvalidArgument
from rsrv.scheduler import ModelSpec, Scheduler

DISCIPLINES = ["fair", "fifo", "edf"]


def starts(ex: FakeExecutor) -> list[tuple[str, float, int]]:
    """(model, start, rows of real data) of every execution."""
    return [(c.model, c.start, int(c.inputs[0].any(axis=1).sum())) for c in ex.calls]


@pytest.mark.parametrize("discipline", DISCIPLINES)
async def test_waits_up_to_the_delay_then_dispatches_what_is_there(autojump_clock, discipline):
    ex, sched = scheduler_of(spec("m", max_queue_delay=0.1), cost=0.01, discipline=discipline)
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        first = await queued(nursery, sched, "m", [rows(1, 1)])
        await trio.sleep(0.03)
        second = await queued(nursery, sched, "m", [rows(2, 2)])
        await trio.sleep(0.5)
        assert starts(ex) == [("m", 0.1, 3)]  # at the oldest's arrival + delay, size 4
        late = await queued(nursery, sched, "m", [rows(9, 1)])  # a fresh wait of its own
        await trio.sleep(0.5)
        await sched.drain()
    assert [c.size for c in ex.calls] == [4, 1]
    assert ex.calls[1].start == pytest.approx(0.53 + 0.1)
    assert first.result.queue_seconds == pytest.approx(0.1)
    assert second.result.queue_seconds == pytest.approx(0.07)
    assert late.result.queue_seconds == pytest.approx(0.1)
    assert sched.stats("m").wait_samples == pytest.approx((0.1, 0.07, 0.1))


async def test_a_full_batch_goes_at_once(autojump_clock):
    ex, sched = scheduler_of(spec("m", max_queue_delay=0.5), cost=0.01)
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        for i in range(7):
            await queued(nursery, sched, "m", [rows(i + 1, 1)])
        await trio.sleep(0.1)
        assert ex.calls == []  # 7 of 8 rows: still waiting
        await queued(nursery, sched, "m", [rows(7, 1)])  # the 8th row fills it
        assert starts(ex) == [("m", 0.1, 8)]
        # rows beyond what one batch holds also go at once: 5 + 5 > 8
        await queued(nursery, sched, "m", [rows(1, 5)])
        await queued(nursery, sched, "m", [rows(1, 5)])
        await trio.sleep(1.0)
        await sched.drain()
    # queued at 0.1 while the first batch ran (until 0.11), then 5 + 5 > 8: at once
    assert starts(ex)[1] == ("m", pytest.approx(0.11), 5)
    # the second 5 rows, left alone, wait out their own delay: arrival 0.1 + 0.5
    assert starts(ex)[2] == ("m", pytest.approx(0.6), 5)


async def test_max_batch_size_is_what_fills_a_batch(autojump_clock):
    ex, sched = scheduler_of(spec("m", max_batch_size=3, max_queue_delay=0.5), cost=0.01)
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        for i in range(3):
            await queued(nursery, sched, "m", [rows(i + 1, 1)])
        await sched.drain()
    assert [(c.start, c.size) for c in ex.calls] == [(0.0, 4)]


@pytest.mark.parametrize("discipline", DISCIPLINES)
async def test_another_model_is_served_while_one_waits(autojump_clock, discipline):
    ex, sched = scheduler_of(
        spec("slow", max_queue_delay=0.2), spec("eager"), cost=0.01, discipline=discipline
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        held = await queued(nursery, sched, "slow", [rows(1, 1)])  # selected first, waits
        eager = await queued(nursery, sched, "eager", [rows(2, 1)])
        await trio.sleep(0.05)
        again = await queued(nursery, sched, "eager", [rows(3, 1)])
        await sched.drain()
    assert starts(ex) == [
        ("eager", 0.0, 1),
        ("eager", 0.05, 1),
        ("slow", pytest.approx(0.05 + 0.01), 1),  # drained: waits no more
    ]
    assert held.result and eager.result.queue_seconds == 0.0 and again.result.queue_seconds == 0


async def test_a_waiting_model_runs_when_due_beside_a_saturated_one(autojump_clock):
    ex, sched = scheduler_of(spec("held", max_queue_delay=0.3), spec("busy"), cost=0.05)
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        for _ in range(8):
            nursery.start_soon(client_loop, sched, "busy")
        await trio.sleep(1.0)
        out = await queued(nursery, sched, "held", [rows(1, 1)])
        await trio.sleep(0.28)
        assert not out.done
        await trio.sleep(0.1)  # due at 1.3, then at most the batch in flight (0.05)
        assert out.done and 0.3 <= out.result.queue_seconds <= 0.35
        nursery.cancel_scope.cancel()


async def test_a_model_that_waits_banks_no_credit(autojump_clock):
    """12 closed-loop clients per model, max 8 rows: after a batch, a model holds (4
    rows queued) while the other runs, so each runs every other batch, whatever the
    weights: the device is shared 1:1, not 1:2. When more clients come, shares follow
    the weights at once: b, which waited rather than run short batches, did not bank
    the device time it left to a (it would then take the device alone for seconds)."""
    ex, sched = scheduler_of(
        spec("a", max_queue_delay=0.05, weight=1.0),
        spec("b", max_queue_delay=0.05, weight=2.0),
        cost=lambda model, size: 0.002 + 0.0005 * size,
    )
    with trio.move_on_after(12.0):
        async with trio.open_nursery() as nursery:
            await nursery.start(sched.run)
            for model in "ab":
                for i in range(12):
                    nursery.start_soon(client_loop, sched, model, 1, 0.0002 * i)
            await trio.sleep(10.0)
            for model in "ab":
                for _ in range(24):
                    nursery.start_soon(client_loop, sched, model)

    def share_of_a(since: float, until: float) -> float:
        a, b = ex.device_time("a", since, until), ex.device_time("b", since, until)
        return a / (a + b)

    assert share_of_a(2.0, 10.0) == pytest.approx(0.5, abs=0.02)
    assert share_of_a(10.0, 10.5) == pytest.approx(1 / 3, abs=0.03)
    assert share_of_a(10.5, 12.0) == pytest.approx(1 / 3, abs=0.03)


@pytest.mark.parametrize("discipline", DISCIPLINES)
async def test_a_deadline_that_waiting_would_miss_forces_dispatch(autojump_clock, discipline):
    ex, sched = scheduler_of(spec("m", max_queue_delay=0.5), cost=0.1, discipline=discipline)
    sched.warm_costs("m", {1: 0.1, 4: 0.1, 8: 0.1})
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        # waiting until 0.5 would finish at 0.6: past 0.55, so at once
        tight = await queued(nursery, sched, "m", [rows(1, 1)], deadline=0.55)
        await trio.sleep(0.2)
        # 0.7 + 0.1 <= 0.8: may wait
        await queued(nursery, sched, "m", [rows(2, 1)], deadline=0.8)
        await trio.sleep(0.1)
        # joins it; now 0.7 + 0.1 > 0.75: both go at once
        await queued(nursery, sched, "m", [rows(3, 1)], deadline=0.75)
        await sched.drain()
    assert starts(ex) == [("m", 0.0, 1), ("m", pytest.approx(0.3), 2)]
    assert tight.result is not None


@pytest.mark.parametrize("discipline", DISCIPLINES)
async def test_a_latency_budget_that_waiting_would_miss_forces_dispatch(autojump_clock, discipline):
    ex, sched = scheduler_of(
        spec("m", latency_budget=0.3, max_queue_delay=0.5), cost=0.05, discipline=discipline
    )
    sched.warm_costs("m", {1: 0.05})
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        out = await queued(nursery, sched, "m", [rows(1, 1)])
        await sched.drain()
    assert starts(ex) == [("m", 0.0, 1)]
    assert out.result is not None


async def test_the_dispatch_timeout_is_never_waited_out(autojump_clock):
    ex, sched = scheduler_of(
        spec("m", max_queue_delay=0.5), cost=0.01, dispatch_timeout_seconds=0.5
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        out = await queued(nursery, sched, "m", [rows(1, 1)])
        await sched.drain()
    assert starts(ex) == [("m", 0.0, 1)] and out.result is not None


async def test_drain_and_hurry_do_not_wait(autojump_clock):
    ex, sched = scheduler_of(spec("m", max_queue_delay=1.0), cost=0.01)
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        await queued(nursery, sched, "m", [rows(1, 1)])
        await trio.sleep(0.1)
        sched.hurry()  # a graceful stop began; admission goes on
        await wait_all_tasks_blocked()
        assert starts(ex) == [("m", 0.1, 1)]
        await trio.sleep(0.2)
        await queued(nursery, sched, "m", [rows(2, 1)])
        assert starts(ex)[1] == ("m", pytest.approx(0.3), 1)
        nursery.cancel_scope.cancel()
    ex, sched = scheduler_of(spec("m", max_queue_delay=1.0), cost=0.01)
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        t0 = trio.current_time()
        await queued(nursery, sched, "m", [rows(1, 1)])
        await trio.sleep(0.1)
        await sched.drain()
    assert starts(ex) == [("m", pytest.approx(t0 + 0.1), 1)]


@pytest.mark.parametrize("delay", [None, 0.0])
async def test_no_delay_dispatches_at_once(autojump_clock, delay):
    ex, sched = scheduler_of(spec("m", max_queue_delay=delay), cost=1.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        await queued(nursery, sched, "m", [rows(1, 1)])
        await trio.sleep(0.5)
        for i in range(3):
            await queued(nursery, sched, "m", [rows(i + 1, 1)])
        await sched.drain()
    # the lone first request at once, the three that queued meanwhile together at 1.0
    assert starts(ex) == [("m", 0.0, 1), ("m", 1.0, 3)]
    assert sched._delayed == 0  # nothing to check per decision


async def test_an_unbatched_model_never_waits(autojump_clock):
    ex = FakeExecutor(cost=0.01)
    sched = Scheduler(config(max_queue_delay_seconds=0.5), ex)
    sched.add_model(ModelSpec("u", (), (None,), (None,)))
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        await queued(nursery, sched, "u", [rows(1, 1)])
        await sched.drain()
    assert [c.start for c in ex.calls] == [0.0]


async def test_the_scheduler_default_and_the_model_setting(autojump_clock):
    ex = FakeExecutor(cost=0.01)
    sched = Scheduler(config(max_queue_delay_seconds=0.2), ex)
    sched.add_model(spec("default"))
    sched.add_model(spec("own", max_queue_delay=0.05))
    sched.add_model(spec("none").with_policy(ModelSchedConfig(max_queue_delay_seconds=0)))
    assert [sched.queue_delay(m) for m in ("default", "own", "none")] == [0.2, 0.05, 0.0]
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        for name in ("default", "own", "none"):
            await queued(nursery, sched, name, [rows(1, 1)])
        await trio.sleep(1.0)
        nursery.cancel_scope.cancel()
    assert starts(ex) == [("none", 0.0, 1), ("own", 0.05, 1), ("default", 0.2, 1)]
    # a replacement without a delay, then removal: nothing is held any more
    sched.add_model(spec("own"))
    assert sched.queue_delay("own") == 0.2
    sched.remove_model("default")
    sched.remove_model("own")
    assert sched._delayed == 0


async def test_a_queue_delay_raises_rows_per_execution(autojump_clock):
    """8 closed-loop clients per model whose think times spread their arrivals: without
    a delay a batch is whatever arrived during the last execution; with one, batches
    fill up (one execution at a time throughout: FakeExecutor asserts it)."""

    async def rows_per_execution(delay: float) -> float:
        ex, sched = scheduler_of(
            spec("a", max_queue_delay=delay),
            spec("b", max_queue_delay=delay, weight=2.0),
            cost=lambda model, size: 0.001 + 0.0001 * size,
        )
        with trio.move_on_after(4.0):
            async with trio.open_nursery() as nursery:
                await nursery.start(sched.run)
                for model in "ab":
                    for i in range(8):
                        nursery.start_soon(client_loop, sched, model, 1, 0.005 + 0.001 * i)
        stats = [sched.stats(m) for m in "ab"]
        assert sum(s.requests for s in stats) == sum(s.rows for s in stats)
        return sum(s.rows for s in stats) / sum(s.dispatches for s in stats)

    eager, patient = await rows_per_execution(0.0), await rows_per_execution(0.01)
    assert patient > 2 * eager, (eager, patient)


def test_queue_delay_settings_are_bounded():
    with pytest.raises(InvalidArgument, match="max_queue_delay must be a finite number"):
        spec("m", max_queue_delay=-0.1)
    with pytest.raises(InvalidArgument, match="max_queue_delay"):
        spec("m", max_queue_delay=float("nan"))
    for value in (-0.001, 1.001):
        with pytest.raises(msgspec.ValidationError, match="max_queue_delay_seconds"):
            msgspec.convert({"max_queue_delay_seconds": value}, ModelSchedConfig)
        with pytest.raises(msgspec.ValidationError, match="max_queue_delay_seconds"):
            msgspec.convert({"max_queue_delay_seconds": value}, SchedulerConfig)
    assert SchedulerConfig().max_queue_delay_seconds == 0.0
    assert ModelSchedConfig().max_queue_delay_seconds is None
    assert spec("m").with_policy(ModelSchedConfig()).max_queue_delay is None


async def test_replacing_a_held_version_by_one_without_a_delay_dispatches_at_once(
    autojump_clock,
):
    """A registry change wakes the loop sleeping on a hold: it dispatched at the old
    hold's end (0.5) before."""
    ex, sched = scheduler_of(spec("m", max_queue_delay=0.5), cost=0.01)
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        await queued(nursery, sched, "m", [rows(1, 1)])
        await trio.sleep(0.1)
        sched.add_model(spec("m", max_queue_delay=0.0))
        await trio.sleep(1.0)
        await sched.drain()
    assert ex.calls[0].start == pytest.approx(0.1)


async def test_costs_learned_while_held_end_a_wait_that_would_miss_the_deadline(
    autojump_clock,
):
    """Seeded costs of 0.3 s make waiting until 0.5 finish at 0.8, past the 0.7
    deadline: the request goes at once (it waited, and finished at 0.8, before)."""
    ex, sched = scheduler_of(spec("m", max_queue_delay=0.5), cost=0.3)
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        held = await queued(nursery, sched, "m", [rows(1, 1)], deadline=0.7)
        await trio.sleep(0.1)
        sched.warm_costs("m", {1: 0.3})
        await trio.sleep(1.0)
        await sched.drain()
    assert held.finished_at <= 0.7
