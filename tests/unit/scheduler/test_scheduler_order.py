"""Scheduler ordering: fifo and edf across models, deadlines, dispatch timeout, shedding."""

from __future__ import annotations

import pytest
import trio
from support.scheduler import FakeExecutor, config, queued, rows, spec

from rsrv.errors import DeadlineExceeded
from rsrv.scheduler import Scheduler


async def test_fifo_serves_the_oldest_front_request_first(autojump_clock):
    ex = FakeExecutor(cost=1.0)
    sched = Scheduler(config(discipline="fifo"), ex)
    for name in "xyz":
        sched.add_model(spec(name, (1,)))
    async with trio.open_nursery() as nursery:
        for name in "xyxzyx":
            await queued(nursery, sched, name, [rows(1, 1)])
        await nursery.start(sched.run)
        await sched.drain()
    assert ex.order() == list("xyxzyx")


async def test_front_requests_go_ahead_of_fresh_work(autojump_clock):
    ex = FakeExecutor(cost=1.0)
    sched = Scheduler(config(discipline="fifo"), ex)
    sched.add_model(spec("x", (1,)))
    sched.add_model(spec("y", (1,)))
    async with trio.open_nursery() as nursery:
        fresh = [await queued(nursery, sched, "x", [rows(i + 1, 1)]) for i in range(2)]
        sub = await queued(nursery, sched, "y", [rows(9, 1)], front=True)
        await nursery.start(sched.run)
        await sched.drain()
    assert ex.order() == ["y", "x", "x"]
    assert sub.result.queue_seconds == 0.0 and fresh[1].result.queue_seconds == 2.0


async def test_edf_serves_the_earliest_deadline_first(autojump_clock):
    ex = FakeExecutor(cost=1.0)
    sched = Scheduler(config(discipline="edf", dispatch_timeout_seconds=100.0), ex)
    for name in "wxyz":
        sched.add_model(spec(name, (1,)))
    async with trio.open_nursery() as nursery:
        await queued(nursery, sched, "x", [rows(1, 1)], deadline=50.0)
        await queued(nursery, sched, "y", [rows(1, 1)], deadline=10.0)
        await queued(nursery, sched, "w", [rows(1, 1)])  # no deadline: ordered by its timeout, 100
        await queued(nursery, sched, "z", [rows(1, 1)], deadline=20.0)
        await queued(nursery, sched, "y", [rows(1, 1)], deadline=40.0)
        await nursery.start(sched.run)
        await sched.drain()
    assert ex.order() == ["y", "z", "y", "x", "w"]


async def test_edf_sheds_what_cannot_finish_before_its_deadline(autojump_clock):
    ex = FakeExecutor(cost=2.0)
    sched = Scheduler(config(discipline="edf"), ex)
    sched.add_model(spec("m", (1, 2)))
    sched.warm_costs("m", {1: 2.0, 2: 2.0})
    async with trio.open_nursery() as nursery:
        doomed = await queued(nursery, sched, "m", [rows(1, 1)], deadline=1.5)
        fine = await queued(nursery, sched, "m", [rows(2, 1)], deadline=2.5)
        await nursery.start(sched.run)
        await sched.drain()
    assert isinstance(doomed.error, DeadlineExceeded)
    assert "cannot finish before its deadline" in str(doomed.error)
    assert doomed.finished_at == 0.0, "shed before any device work"
    assert len(ex.calls) == 1 and ex.calls[0].size == 1  # re-planned without it
    assert fine.result is not None and fine.finished_at == 2.0


async def test_edf_treats_the_latency_budget_as_a_deadline(autojump_clock):
    ex = FakeExecutor(cost=2.0)
    sched = Scheduler(config(discipline="edf"), ex)
    sched.add_model(spec("m", (1,), latency_budget=1.0))
    sched.add_model(spec("other", (1,)))
    sched.warm_costs("m", {1: 2.0})
    async with trio.open_nursery() as nursery:
        out = await queued(nursery, sched, "m", [rows(1, 1)])
        await queued(nursery, sched, "other", [rows(2, 1)])
        await nursery.start(sched.run)
        await sched.drain()
    assert isinstance(out.error, DeadlineExceeded) and ex.order() == ["other"]


async def test_edf_runs_a_doomed_request_when_nothing_else_waits(autojump_clock):
    """Shedding it would save nobody time; its run refreshes the estimate. One slow run
    (2 s against 10 ms) shed every later request of a 200 ms deadline for good before:
    a request shed never runs, so the estimate never came down."""
    slow = iter([2.0])
    ex = FakeExecutor(cost=lambda m, s: next(slow, 0.01))
    sched = Scheduler(config(discipline="edf", cost_ema_alpha=0.5), ex)
    sched.add_model(spec("m", (1, 4)))
    sched.warm_costs("m", {1: 0.01, 4: 0.02})
    shed = 0
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        await sched.submit("m", [rows(1, 1)])  # 2 s: the estimate is 1 s now
        for _ in range(10):  # one client, one request at a time
            await trio.sleep(1.0)
            try:
                await sched.submit("m", [rows(1, 1)], deadline=trio.current_time() + 0.2)
            except DeadlineExceeded:
                shed += 1
        await sched.drain()
    assert shed == 0 and len(ex.calls) == 11
    assert sched.stats("m").costs[1] < 0.02


async def test_edf_runs_the_earliest_when_every_queued_request_is_doomed(autojump_clock):
    """Two requests of another model, due at 0.5 s, with a stale estimate of 1 s (runs
    take 0.01 s): shedding the first would save nobody, so it runs, the estimate comes
    down, and the second is in time too. A request without a deadline elsewhere would
    be saved time: then the doomed are shed."""
    for elsewhere in (False, True):
        ex = FakeExecutor(cost=0.01)
        sched = Scheduler(config(discipline="edf", cost_ema_alpha=1.0), ex)
        sched.add_model(spec("m", (1,)))
        sched.add_model(spec("other", (1,)))
        sched.warm_costs("m", {1: 1.0})
        async with trio.open_nursery() as nursery:
            outs = [await queued(nursery, sched, "m", [rows(i, 1)], deadline=0.5) for i in (1, 2)]
            if elsewhere:
                outs.append(await queued(nursery, sched, "other", [rows(3, 1)]))
            await nursery.start(sched.run)
            await sched.drain()
        errors = [type(o.error).__name__ if o.error else None for o in outs]
        if elsewhere:
            assert errors == ["DeadlineExceeded", "DeadlineExceeded", None]
        else:
            assert errors == [None, None] and sched.stats("m").costs == {1: 0.01}


async def test_edf_learns_the_executors_measured_time_not_its_waits(autojump_clock):
    """An executor that measures its device time apart from waits (for weights to be
    copied: seconds once evicted) has its measure learned, not the wall time."""

    class Measuring(FakeExecutor):
        def measured_seconds(self, model: str, size: int) -> float:
            return 0.01

    ex = Measuring(cost=2.0)
    sched = Scheduler(config(discipline="edf"), ex)
    sched.add_model(spec("m", (1,)))
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        await sched.submit("m", [rows(1, 1)])
        await sched.drain()
    assert sched.stats("m").costs == {1: 0.01}
    assert sched.stats("m").compute_seconds == 2.0  # (device usage is the wall time)


async def test_a_failing_measure_is_logged_and_the_batch_answered(autojump_clock, caplog):
    class Failing(FakeExecutor):
        def measured_seconds(self, model: str, size: int) -> float:
            raise KeyError(model)

    sched = Scheduler(config(discipline="edf"), Failing(cost=2.0))
    sched.add_model(spec("m", (1,)))
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        assert (await sched.submit("m", [rows(1, 1)])).batch_size == 1
        await sched.drain()
    assert sched.stats("m").costs == {1: 2.0}  # (the wall time, learned instead)
    assert "measured_seconds of m failed" in caplog.text

    # and should accounting itself fail, the batch is answered all the same
    sched = Scheduler(config(discipline="edf"), FakeExecutor(cost=2.0))
    sched.add_model(spec("m", (1,)))
    sched._policy.completed = lambda *args: 1 / 0
    with pytest.raises(BaseExceptionGroup) as info:
        async with trio.open_nursery() as nursery:
            out = await queued(nursery, sched, "m", [rows(1, 1)])
            await nursery.start(sched.run)
    assert info.group_contains(ZeroDivisionError)
    assert out.result is not None


async def test_edf_serves_the_longest_prefix_that_finishes_in_time(autojump_clock):
    """Eight 1-row requests due at 0.5, 0.1 s per row: all were shed, at size 8 (0.8 s);
    a batch of 4 (0.4 s) finishes in time, then one more at size 1."""
    ex = FakeExecutor(cost=lambda m, size: 0.1 * size)
    sched = Scheduler(config(discipline="edf"), ex)
    sched.add_model(spec("m", (1, 4, 8)))
    sched.warm_costs("m", {1: 0.1, 4: 0.4, 8: 0.8})
    async with trio.open_nursery() as nursery:
        outs = [await queued(nursery, sched, "m", [rows(i, 1)], deadline=0.5) for i in range(8)]
        await nursery.start(sched.run)
        await sched.drain()
    assert [c.size for c in ex.calls] == [4, 1]
    assert [o.error is None for o in outs] == [True] * 5 + [False] * 3
    assert all(o.finished_at <= 0.5 for o in outs)


async def test_edf_sheds_only_what_cannot_finish_alone(autojump_clock):
    """Two 4-row requests due at 0.5 and 0.6: together (size 8, 0.8 s) both are late,
    but the first finishes alone (size 4, 0.4 s); it was shed with the other."""
    ex = FakeExecutor(cost=lambda m, size: 0.1 * size)
    sched = Scheduler(config(discipline="edf"), ex)
    sched.add_model(spec("m", (1, 4, 8)))
    sched.warm_costs("m", {1: 0.1, 4: 0.4, 8: 0.8})
    async with trio.open_nursery() as nursery:
        first = await queued(nursery, sched, "m", [rows(1, 4)], deadline=0.5)
        await queued(nursery, sched, "m", [rows(2, 4)], deadline=0.6)
        await nursery.start(sched.run)
        await sched.drain()
    assert first.error is None and first.finished_at == pytest.approx(0.4)
    assert ex.calls[0].size == 4


@pytest.mark.parametrize("discipline", ["fair", "fifo", "edf"])
async def test_deadline_passing_in_the_queue_fails_without_device_work(autojump_clock, discipline):
    ex = FakeExecutor(cost=5.0)
    sched = Scheduler(config(discipline=discipline), ex)
    sched.add_model(spec("a"))
    sched.add_model(spec("b"))
    async with trio.open_nursery() as nursery:
        with pytest.raises(DeadlineExceeded, match="already passed"):
            await sched.submit("a", [rows(1, 1)], deadline=0.0)
        busy = await queued(nursery, sched, "a", [rows(1, 1)], deadline=100.0)
        await nursery.start(sched.run)
        late = await queued(nursery, sched, "b", [rows(1, 1)], deadline=3.0)
        await sched.drain()
    assert busy.result is not None
    assert isinstance(late.error, DeadlineExceeded) and late.finished_at == 3.0
    assert ex.order() == ["a"]
    assert sched.stats("b").failures == {"DEADLINE_EXCEEDED": 1}


@pytest.mark.parametrize("discipline", ["fair", "fifo", "edf"])
async def test_dispatch_timeout_is_enforced(autojump_clock, discipline):
    ex = FakeExecutor(cost=5.0)
    sched = Scheduler(config(discipline=discipline, dispatch_timeout_seconds=1.0), ex)
    sched.add_model(spec("a"))
    sched.add_model(spec("b"))
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        busy = await queued(nursery, sched, "a", [rows(1, 1)])
        late = await queued(nursery, sched, "b", [rows(1, 1)])
        await sched.drain()
    assert busy.result is not None
    assert isinstance(late.error, DeadlineExceeded) and late.finished_at == 1.0
    assert "longer than dispatch_timeout_seconds (1s)" in str(late.error)
    assert ex.order() == ["a"]


async def test_expired_requests_are_dropped_at_dispatch_too(autojump_clock):
    # a non-trio clock: the waiters' timers and the dispatcher must agree
    now = [0.0]
    ex = FakeExecutor(cost=0.0)
    sched = Scheduler(config(dispatch_timeout_seconds=1.0), ex, clock=lambda: now[0])
    sched.add_model(spec("a"))
    async with trio.open_nursery() as nursery:
        stale = await queued(nursery, sched, "a", [rows(1, 1)])
        now[0] = 5.0  # time passes for the scheduler only
        fresh = await queued(nursery, sched, "a", [rows(2, 1)])
        await nursery.start(sched.run)
        await sched.drain()
    assert isinstance(stale.error, DeadlineExceeded)
    assert fresh.result is not None and len(ex.calls) == 1 and ex.calls[0].size == 1


async def test_edf_counts_a_model_held_for_company_as_one_that_shedding_saves(autojump_clock):
    """The request that shedding would save time may be one of a model withheld in
    this decision (selected first, by its earlier deadline, then left to wait out its
    queue delay): the doomed request is shed still."""
    ex = FakeExecutor(cost=0.01)
    sched = Scheduler(config(discipline="edf", cost_ema_alpha=1.0), ex)
    sched.add_model(spec("m", (1,)))
    sched.add_model(spec("held", (1, 8), max_queue_delay=0.2))
    sched.warm_costs("m", {1: 1.0})
    async with trio.open_nursery() as nursery:
        waiting = await queued(nursery, sched, "held", [rows(3, 1)], deadline=0.4)
        doomed = await queued(nursery, sched, "m", [rows(1, 1)], deadline=0.5)
        await nursery.start(sched.run)
        await trio.sleep(1.0)  # (a drain would hurry: no queue delay, nothing held)
        await sched.drain()
    assert isinstance(doomed.error, DeadlineExceeded) and doomed.finished_at == 0.0
    assert waiting.result is not None


async def test_an_edf_decision_looks_only_at_backlogged_models(autojump_clock):
    """Deciding whether to shed looks at the queues of backlogged models, never at every
    registered one (specs/scheduler.md, Complexity): idle models' queues go untouched."""

    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"an idle model's queue was read ({name})")

    sched = Scheduler(config(discipline="edf"), FakeExecutor(cost=0.01))
    for i in range(3):
        sched.add_model(spec(f"idle{i}", (1,)))
        sched._models[f"idle{i}"].queue = Untouchable()
    sched.add_model(spec("m", (1,)))
    sched.warm_costs("m", {1: 1.0})
    async with trio.open_nursery() as nursery:
        doomed = await queued(nursery, sched, "m", [rows(1, 1)], deadline=0.5)
        fine = await queued(nursery, sched, "m", [rows(2, 1)])
        await nursery.start(sched.run)
        await sched.drain()
    assert isinstance(doomed.error, DeadlineExceeded) and fine.result is not None
