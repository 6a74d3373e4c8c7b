"""Scheduler: admission, coalescing at compiled sizes, errors, cancellation, lifecycle.

Ordering disciplines are in test_scheduler_order.py, fair sharing in
test_scheduler_fair.py. Time is trio's MockClock: deterministic and instant.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import trio
from support.scheduler import (
    FakeExecutor,
    config,
    queued,
    rows,
    spec,
)
from trio.testing import wait_all_tasks_blocked

from rsrv.errors import (
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from rsrv.scheduler import ModelSpec, Scheduler
from rsrv.scheduler._costs import CostTable, DecayedSum
from rsrv.scheduler._heap import KeyedHeap
from rsrv.scheduler._stats import StatsRecorder

# -- coalescing -----------------------------------------------------------------------

PLANS = [
    # compiled sizes, request rows in queue order, max_batch_size, expected dispatches
    ((1, 4, 8), [1], None, [(1, [1])]),
    ((1, 4, 8), [2], None, [(4, [2])]),
    ((1, 4, 8), [4, 4], None, [(8, [4, 4])]),
    ((1, 4, 8), [1, 2, 3, 7], None, [(8, [1, 2, 3]), (8, [7])]),
    ((1, 4, 8), [7, 1, 2], None, [(8, [7, 1]), (4, [2])]),
    ((1, 4, 8), [5, 5], None, [(8, [5]), (8, [5])]),
    ((1, 4, 8), [1] * 10, None, [(8, [1] * 8), (4, [1, 1])]),
    ((2, 4), [1, 1, 1], None, [(4, [1, 1, 1])]),
    ((1, 4, 8), [1] * 7, 5, [(8, [1] * 5), (4, [1, 1])]),
    ((1, 4, 8), [2, 2, 2], 4, [(4, [2, 2]), (4, [2])]),
    ((1, 4, 8), [0, 2], None, [(4, [0, 2])]),  # (a request of no rows counts none)
]


@pytest.mark.parametrize(("sizes", "request_rows", "cap", "expected"), PLANS)
async def test_coalescing_picks_sizes_and_splits_rows(
    autojump_clock, sizes, request_rows, cap, expected
):
    ex = FakeExecutor(cost=1.0)
    sched = Scheduler(config(), ex)
    sched.add_model(spec("m", sizes, max_batch_size=cap))
    async with trio.open_nursery() as nursery:
        # distinct values per row: request i holds 100*(i+1), 100*(i+1)+1, ...
        outs = [
            await queued(nursery, sched, "m", [rows(100 * (i + 1), n)])
            for i, n in enumerate(request_rows)
        ]
        await nursery.start(sched.run)
        await sched.drain()

    assert [c.size for c in ex.calls] == [size for size, _ in expected]
    i = 0  # next request, in queue order
    for call, (size, batch_rows) in zip(ex.calls, expected, strict=True):
        x = call.inputs[0]
        assert x.shape == (size, 3)
        assert not x[sum(batch_rows) :].any(), "padding must be zero rows"
        offset = 0
        for n in batch_rows:
            assert request_rows[i] == n
            mine = rows(100 * (i + 1), n)
            np.testing.assert_array_equal(x[offset : offset + n], mine)
            np.testing.assert_array_equal(outs[i].result.outputs[0], mine * 10)
            assert outs[i].result.batch_size == size
            offset += n
            i += 1
    stats = sched.stats("m")
    assert stats.dispatches == len(expected)
    assert stats.requests == len(request_rows) and stats.rows == sum(request_rows)
    assert sum(stats.batch_sizes.values()) == len(expected)
    counters = sched.counters("m")  # the same counters, taken without the rest
    assert {f: getattr(counters, f) for f in counters.__slots__} == {
        f: getattr(stats, f) for f in counters.__slots__
    }
    assert counters.requests == len(request_rows) and counters.rows == sum(request_rows)


async def test_padding_rows_never_reach_a_client(autojump_clock):
    def poison_padding(model, size, inputs):
        # an executable that writes garbage into padding rows (inputs there are 0)
        out = inputs[0] * 10
        out[~inputs[0].any(axis=1)] = -1.0
        return [out, np.full((size, 5), 7.0)]

    ex = FakeExecutor(cost=1.0, fn=poison_padding)
    sched = Scheduler(config(), ex)
    sched.add_model(spec("m", (4, 8), outputs=2))
    async with trio.open_nursery() as nursery:
        outs = [
            await queued(nursery, sched, "m", [rows(10 * (i + 1), n)])
            for i, n in enumerate((1, 2, 2))
        ]
        await nursery.start(sched.run)
        await sched.drain()
    assert [c.size for c in ex.calls] == [8]
    for out, n in zip(outs, (1, 2, 2), strict=True):
        y, z = out.result.outputs
        assert y.shape == (n, 3) and z.shape == (n, 5)
        assert (y > 0).all()


async def test_inputs_with_different_batch_axes(autojump_clock):
    # input 0 is "nc" (axis 0), input 1 is "cn" (axis 1); outputs the other way round
    def fn(model, size, inputs):
        a, b = inputs
        assert a.shape == (4, 3) and b.shape == (2, 4)
        return [b * 10, a * 10]

    ex = FakeExecutor(cost=1.0, fn=fn)
    sched = Scheduler(config(), ex)
    sched.add_model(ModelSpec("m", (4,), (0, 1), (1, 0)))
    reqs = [(rows(1, 1), rows(50, 1, width=2).T), (rows(10, 2), rows(60, 2, width=2).T)]
    async with trio.open_nursery() as nursery:
        outs = [await queued(nursery, sched, "m", [a, b]) for a, b in reqs]
        await nursery.start(sched.run)
        await sched.drain()
    assert len(ex.calls) == 1
    b_batch = ex.calls[0].inputs[1]
    np.testing.assert_array_equal(b_batch[:, :3], np.hstack([reqs[0][1], reqs[1][1]]))
    assert not b_batch[:, 3:].any()
    for (a, b), out in zip(reqs, outs, strict=True):
        y0, y1 = out.result.outputs
        np.testing.assert_array_equal(y0, b * 10)  # axis 1
        np.testing.assert_array_equal(y1, a * 10)  # axis 0


async def test_requests_with_different_shapes_are_not_coalesced(autojump_clock):
    ex = FakeExecutor(cost=1.0)
    sched = Scheduler(config(), ex)
    sched.add_model(spec("m", (8,)))
    async with trio.open_nursery() as nursery:
        a = await queued(nursery, sched, "m", [rows(1, 2, width=3)])
        b = await queued(nursery, sched, "m", [rows(1, 2, width=4)])
        c = await queued(nursery, sched, "m", [rows(9, 1, width=4)])
        await nursery.start(sched.run)
        await sched.drain()
    assert [c.inputs[0].shape for c in ex.calls] == [(8, 3), (8, 4)]
    assert a.result.outputs[0].shape == (2, 3) and b.result.outputs[0].shape == (2, 4)
    np.testing.assert_array_equal(c.result.outputs[0], rows(9, 1, width=4) * 10)


async def test_max_batch_size_caps_rows_per_dispatch(autojump_clock):
    ex = FakeExecutor(cost=1.0)
    sched = Scheduler(config(), ex)
    sched.add_model(spec("m", (1, 4, 8), max_batch_size=3))
    async with trio.open_nursery() as nursery:
        for i in range(7):
            await queued(nursery, sched, "m", [rows(i + 1, 1)])
        await nursery.start(sched.run)
        await sched.drain()
    real_rows = [int(c.inputs[0].any(axis=1).sum()) for c in ex.calls]
    assert real_rows == [3, 3, 1] and [c.size for c in ex.calls] == [4, 4, 1]
    assert sched.stats("m").max_batch_size == 3


async def test_unbatched_model_runs_each_request_alone_at_size_zero(autojump_clock):
    ex = FakeExecutor(cost=1.0, fn=lambda m, s, xs: [np.array([xs[0].sum()])])
    sched = Scheduler(config(), ex)
    sched.add_model(ModelSpec("u", (), (None,), (None,)))
    async with trio.open_nursery() as nursery:
        outs = [await queued(nursery, sched, "u", [np.full((2, 2), float(i))]) for i in range(3)]
        await nursery.start(sched.run)
        await sched.drain()
    assert [c.size for c in ex.calls] == [0, 0, 0]
    assert [float(o.result.outputs[0][0]) for o in outs] == [0.0, 4.0, 8.0]
    assert sched.stats("u").max_batch_size == 0

    # its outputs are counted as a batched model's are
    ex.fn = lambda m, s, xs: [xs[0], xs[0]]
    sched = Scheduler(config(), ex)
    sched.add_model(ModelSpec("u", (), (None,), (None,)))
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        with pytest.raises(Internal, match="'u': the executable returned 2 outputs, expected 1"):
            await sched.submit("u", [np.ones((2, 2))])
        await sched.drain()


# -- admission -------------------------------------------------------------------------


async def test_admission_errors(autojump_clock):
    sched = Scheduler(config(), FakeExecutor())
    sched.add_model(spec("m", (1, 4, 8), inputs=2))
    with pytest.raises(NotFound, match="'nope'"):
        await sched.submit("nope", [rows(0, 1)])
    with pytest.raises(InvalidArgument, match="takes 2 executable inputs, got 1"):
        await sched.submit("m", [rows(0, 1)])
    with pytest.raises(InvalidArgument, match="disagree on the batch size"):
        await sched.submit("m", [rows(0, 1), rows(0, 2)])
    with pytest.raises(InvalidArgument, match="rows=3 but the inputs have 2 rows"):
        await sched.submit("m", [rows(0, 2), rows(0, 2)], rows=3)
    with pytest.raises(
        InvalidArgument,
        match=r"9 rows exceeds the largest compiled batch size 8 "
        r"\(compiled sizes: \[1, 4, 8\]\)",
    ):
        await sched.submit("m", [rows(0, 9), rows(0, 9)])
    sched.add_model(spec("capped", (1, 4, 8), max_batch_size=5))
    with pytest.raises(InvalidArgument, match="6 rows exceeds max_batch_size 5"):
        await sched.submit("capped", [rows(0, 6)])
    with pytest.raises(NotFound):
        sched.set_weight("nope", 2.0)
    with pytest.raises(InvalidArgument):
        sched.set_weight("m", 0.0)
    with pytest.raises(InvalidArgument, match="compiled batch sizes"):
        ModelSpec("bad", (0, 4), (0,), (0,))
    with pytest.raises(InvalidArgument, match="batch axis"):
        ModelSpec("bad", (4,), (None,), (0,))
    assert sched.stats("m").failures == {"INVALID_ARGUMENT": 4}


async def test_queue_full_is_resource_exhausted_for_that_model_only(autojump_clock):
    ex = FakeExecutor(cost=1.0)
    sched = Scheduler(config(max_queue_depth=2), ex)
    sched.add_model(spec("a"))
    sched.add_model(spec("b"))
    async with trio.open_nursery() as nursery:
        a1 = await queued(nursery, sched, "a", [rows(1, 1)])
        a2 = await queued(nursery, sched, "a", [rows(2, 1)])
        with pytest.raises(ResourceExhausted, match=r"model 'a'.*max_queue_depth 2"):
            await sched.submit("a", [rows(3, 1)])
        b1 = await queued(nursery, sched, "b", [rows(4, 1)])
        b2 = await queued(nursery, sched, "b", [rows(5, 1)])
        await nursery.start(sched.run)
        await sched.drain()
    assert all(o.result is not None for o in (a1, a2, b1, b2))
    assert sched.stats("a").failures == {"RESOURCE_EXHAUSTED": 1}
    assert sched.stats("b").failures == {}


# -- errors, cancellation --------------------------------------------------------------


@pytest.mark.parametrize(
    ("raised", "expected", "message"),
    [
        (
            ValueError("device fell over"),
            Internal,
            "execution failed: ValueError: device fell over",
        ),
        (ResourceExhausted("out of device memory"), ResourceExhausted, "out of device memory"),
    ],
)
async def test_executor_error_reaches_every_request_of_the_batch(
    autojump_clock, raised, expected, message
):
    ex = FakeExecutor(cost=1.0)
    ex.errors["m"] = raised
    sched = Scheduler(config(), ex)
    sched.add_model(spec("m"))
    sched.add_model(spec("other"))
    async with trio.open_nursery() as nursery:
        outs = [await queued(nursery, sched, "m", [rows(i, i + 1)]) for i in range(3)]
        ok = await queued(nursery, sched, "other", [rows(1, 1)])
        await nursery.start(sched.run)
        await sched.drain()
    assert len([c for c in ex.calls if c.model == "m"]) == 1
    for out in outs:
        assert type(out.error) is expected and message in str(out.error)
    assert len({id(o.error) for o in outs}) == 3, "each waiter raises its own exception"
    assert ok.result is not None
    assert sched.stats("m").failures == {expected.code: 3}


async def test_cancelled_while_queued_is_withdrawn(autojump_clock):
    ex = FakeExecutor(cost=lambda model, size: 10.0 if model == "busy" else 1.0)
    sched = Scheduler(config(), ex)
    sched.add_model(spec("busy"))
    sched.add_model(spec("m"))
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        await queued(nursery, sched, "busy", [rows(1, 1)])
        with trio.move_on_after(1.0) as scope:
            await sched.submit("m", [rows(2, 1)])
        assert scope.cancelled_caught
        assert sched.stats("m").queue_depth == 0
        kept = await queued(nursery, sched, "m", [rows(3, 2)])
        await sched.drain()
    assert ex.order() == ["busy", "m"]
    np.testing.assert_array_equal(ex.calls[1].inputs[0][:2], rows(3, 2))
    assert kept.result is not None
    assert sched.stats("m").failures == {"CANCELLED": 1}


async def test_cancelled_while_executing_the_batch_finishes_for_the_others(autojump_clock):
    ex = FakeExecutor(cost=2.0)
    sched = Scheduler(config(), ex)
    sched.add_model(spec("m"))
    async with trio.open_nursery() as nursery:
        other = await queued(nursery, sched, "m", [rows(1, 1)])
        cancelled = trio.CancelScope()

        async def impatient():
            with cancelled:
                await sched.submit("m", [rows(5, 2)])

        nursery.start_soon(impatient)
        await wait_all_tasks_blocked()
        await nursery.start(sched.run)
        await trio.sleep(1.0)
        cancelled.cancel()
        await sched.drain()
    assert len(ex.calls) == 1 and ex.calls[0].size == 4
    np.testing.assert_array_equal(other.result.outputs[0], rows(1, 1) * 10)
    # its rows ran, but were answered to no one (they were counted as served)
    stats = sched.stats("m")
    assert (stats.requests, stats.rows, stats.failures) == (1, 1, {"CANCELLED": 1})


# -- lifecycle -------------------------------------------------------------------------


async def test_remove_model_fails_queued_requests_with_not_found(autojump_clock):
    ex = FakeExecutor(cost=5.0)
    retired = []
    ex.retire = retired.append
    sched = Scheduler(config(), ex)
    sched.add_model(spec("a"))
    sched.add_model(spec("b", (1,)))
    async with trio.open_nursery() as nursery:
        running = await queued(nursery, sched, "b", [rows(1, 1)])
        await nursery.start(sched.run)
        waiting = [await queued(nursery, sched, "b", [rows(i, 1)]) for i in range(2)]
        sched.remove_model("b")
        sched.remove_model("b")  # unknown names are ignored
        assert retired == []  # its executing batch still needs it
        with pytest.raises(NotFound):
            await sched.submit("b", [rows(1, 1)])
        a = await queued(nursery, sched, "a", [rows(1, 1)])
        await sched.drain()
    assert running.result is not None
    for out in waiting:
        assert isinstance(out.error, NotFound) and "model 'b' was unloaded" in str(out.error)
    assert ex.order() == ["b", "a"] and a.result is not None
    assert retired == ["b"]


async def test_replaced_model_serves_queued_requests_on_their_version(autojump_clock):
    ex = FakeExecutor(cost=1.0)
    retired = []
    ex.retire = retired.append
    sched = Scheduler(config(), ex)
    sched.add_model(spec("m", (1, 2), executable="m@1"))
    async with trio.open_nursery() as nursery:
        old = [await queued(nursery, sched, "m", [rows(i, 1)]) for i in range(3)]
        sched.add_model(spec("m", (4,), executable="m@2"))
        sched.warm_costs("m", {4: 0.5})
        new = [await queued(nursery, sched, "m", [rows(i, 1)]) for i in range(2)]
        await nursery.start(sched.run)
        await sched.drain()
    assert [(c.model, c.size) for c in ex.calls] == [("m@1", 2), ("m@1", 1), ("m@2", 4)]
    assert [o.result.batch_size for o in old + new] == [2, 2, 1, 4, 4]
    assert retired == ["m@1"]
    assert sched.stats("m").costs == {4: pytest.approx(0.2 * 1.0 + 0.8 * 0.5)}


async def test_a_key_is_retired_once_no_version_of_any_model_holds_it(autojump_clock):
    """Versions may share an executor key (a spec naming no executable runs under its
    model's name): the key goes once the last version holding it is done with it."""
    ex = FakeExecutor(cost=1.0)
    retired = []
    ex.retire = lambda key: retired.append((key, len(ex.calls)))
    sched = Scheduler(config(), ex)
    sched.add_model(spec("m"))  # key "m"
    sched.add_model(spec("a", executable="shared"))
    sched.add_model(spec("b", executable="shared"))
    async with trio.open_nursery() as nursery:
        old = await queued(nursery, sched, "m", [rows(1, 1)])  # on version 1
        sched.add_model(spec("m"))  # version 2: key "m" too
        sched.add_model(spec("m", executable="m@3"))  # version 2 is done, 1 is not
        sched.remove_model("a")  # b still uses "shared"
        assert retired == []
        await nursery.start(sched.run)
        await sched.drain()
    assert old.result is not None and ex.order() == ["m"]
    assert retired == [("m", 1)]  # once, after its last run
    sched.remove_model("b")
    assert retired == [("m", 1), ("shared", 1)]


async def test_versions_side_by_side_run_on_their_label(autojump_clock):
    """Two labels of one name: one queue, each request on the label it names (None: the
    label added last), batches never mixing them; per-label execution counters."""
    ex = FakeExecutor(cost=1.0)
    sched = Scheduler(config(), ex)
    sched.add_model(spec("m", (1, 2), executable="m@1", version="1"))
    sched.add_model(spec("m", (1, 4), executable="m@2", version="2"))
    async with trio.open_nursery() as nursery:
        outs = [
            await queued(nursery, sched, "m", [rows(i, 1)], version=label)
            for i, label in enumerate(["1", "1", "2", "2", None, "1"])
        ]
        with pytest.raises(NotFound, match="'m' version 3 is not found"):
            await sched.submit("m", [rows(1, 1)], version="3")
        await nursery.start(sched.run)
        await sched.drain()
    assert [(c.model, c.size) for c in ex.calls] == [("m@1", 2), ("m@2", 4), ("m@1", 1)]
    assert [o.result.batch_size for o in outs] == [2, 2, 4, 4, 4, 1]
    assert sched.spec("m", "1").batch_sizes == (1, 2)
    assert sched.spec("m").batch_sizes == (1, 4)  # the default: added last
    one, two = sched.version_stats("m", "1"), sched.version_stats("m", "2")
    assert (one.dispatches, one.batch_sizes) == (2, {1: 1, 2: 1})
    assert (two.dispatches, two.batch_sizes, two.max_batch_size) == (1, {4: 1}, 4)
    assert sched.stats("m").dispatches == 3  # the name: every label


async def test_removed_version_finishes_its_queued_requests(autojump_clock):
    """remove_version: no new request for the label; those queued for it still run on
    it, then its executable is retired. The other label serves on."""
    ex = FakeExecutor(cost=1.0)
    retired = []
    ex.retire = retired.append
    sched = Scheduler(config(), ex)
    sched.add_model(spec("m", (1,), executable="m@1", version="2"))
    sched.add_model(spec("m", (1,), executable="m@2", version="3"))
    async with trio.open_nursery() as nursery:
        old = [await queued(nursery, sched, "m", [rows(i, 1)], version="2") for i in range(2)]
        sched.remove_version("m", "2")
        sched.remove_version("m", "9")  # unknown labels are ignored
        with pytest.raises(NotFound, match="version 2 is not found"):
            await sched.submit("m", [rows(1, 1)], version="2")
        new = await queued(nursery, sched, "m", [rows(5, 1)])  # the remaining label
        await nursery.start(sched.run)
        await sched.drain()
    assert all(o.result is not None for o in [*old, new])
    assert ex.order() == ["m@1", "m@1", "m@2"]
    assert retired == ["m@1"]
    with pytest.raises(NotFound):
        sched.version_stats("m", "2")


async def test_a_pinned_version_runs_requests_after_it_is_replaced_or_removed(autojump_clock):
    """pinned: requests submitted with a version held before its label was replaced
    (m@1) or removed (m@2) still run on it, and each key is retired only once the pin
    is gone and its requests answered; after remove_model the pin admits nothing."""
    ex = FakeExecutor(cost=1.0)
    retired = []
    ex.retire = retired.append
    sched = Scheduler(config(), ex)
    sched.add_model(spec("m", (1,), executable="m@1", version="1"))
    sched.add_model(spec("m", (1,), executable="m@2", version="2"))
    async with trio.open_nursery() as nursery:
        with sched.pinned("m", "1") as one, sched.pinned("m") as two:
            assert (one.label, one.key, two.label, two.key) == ("1", "m@1", "2", "m@2")
            sched.add_model(spec("m", (1,), executable="m@3", version="1"))
            sched.remove_version("m", "2")
            assert retired == []  # held
            outs = [
                await queued(nursery, sched, "m", [rows(i, 1)], version=v)
                for i, v in enumerate([one, two, "1"])
            ]
            await nursery.start(sched.run)
            while not all(o.done for o in outs):
                await trio.sleep(0.5)
            assert retired == []  # answered, still pinned
        assert sorted(retired) == ["m@1", "m@2"]
        with sched.pinned("m") as three:
            sched.remove_model("m")
            with pytest.raises(NotFound, match="'m' was unloaded"):
                await sched.submit("m", [rows(1, 1)], version=three)
            sched.add_model(spec("m", (1,), executable="m@4"))
            with pytest.raises(NotFound, match="'m' was unloaded"):
                await sched.submit("m", [rows(1, 1)], version=three)
        await sched.drain()
    assert ex.order() == ["m@1", "m@2", "m@3"]
    assert all(o.result is not None for o in outs)
    assert sorted(retired) == ["m@1", "m@2", "m@3"]


async def test_drain_answers_everything_then_refuses_new_work(autojump_clock):
    ex = FakeExecutor(cost=1.0)
    sched = Scheduler(config(), ex)
    for name in "abc":
        sched.add_model(spec(name))
    async with trio.open_nursery() as nursery:
        outs = [
            await queued(nursery, sched, name, [rows(i, 1 + i % 3)])
            for i, name in enumerate("abcabcabc")
        ]
        await nursery.start(sched.run)
        await sched.drain()
        assert all(o.done and o.result is not None for o in outs)
        with pytest.raises(Unavailable, match="shutting down"):
            await sched.submit("a", [rows(1, 1)])
        assert sched.stats("a").failures == {"UNAVAILABLE": 1}  # (counted, as rejections are)
    # run() returned by itself, so the nursery closed


async def test_a_scheduler_drained_before_it_runs_returns_from_run_at_once():
    """A worker stopped during its start-up drains the scheduler before its run task
    starts: run raised RuntimeError, and the worker exited 1 with a traceback."""
    sched = Scheduler(config(), FakeExecutor(cost=1.0))
    await sched.drain()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(sched.run)
    with pytest.raises(Unavailable, match="shutting down"):
        await sched.submit("a", [rows(1, 1)])


async def test_cancelling_run_answers_queued_requests_unavailable(autojump_clock):
    ex = FakeExecutor(cost=5.0)
    sched = Scheduler(config(), ex)
    sched.add_model(spec("a", (1,)))
    async with trio.open_nursery() as nursery:
        outs = [await queued(nursery, sched, "a", [rows(i, 1)]) for i in range(3)]
        async with trio.open_nursery() as inner:
            await inner.start(sched.run)
            await trio.sleep(1.0)
            inner.cancel_scope.cancel()
    assert all(isinstance(o.error, Unavailable) for o in outs)
    with pytest.raises(Unavailable):
        await sched.submit("a", [rows(1, 1)])


async def test_prefetch_names_the_model_expected_next(autojump_clock):
    ex = FakeExecutor(cost=1.0)
    fetched = []

    async def prefetch(model):
        fetched.append((model, trio.current_time()))

    ex.prefetch = prefetch
    sched = Scheduler(config(discipline="fifo"), ex)
    sched.add_model(spec("a", (1,)))
    sched.add_model(spec("b", (1,)))
    async with trio.open_nursery() as nursery:
        for name in "aab":
            await queued(nursery, sched, name, [rows(1, 1)])
        await nursery.start(sched.run)
        await sched.drain()
    # while the second `a` runs (t=1), `b` is known to be next
    assert fetched == [("b", 1.0)]


# -- costs, usage, stats ---------------------------------------------------------------


def test_wait_percentiles_follow_each_dispatch():
    """(They are computed once per change: a scrape reads every model's.)"""
    recorder = StatsRecorder()
    assert recorder.percentiles() == {}
    recorder.dispatched(1, [1.0])
    assert recorder.percentiles() == {"p50": 1.0, "p90": 1.0, "p99": 1.0, "max": 1.0}
    recorder.percentiles()["p50"] = 7.0  # a copy: the caller's to change
    recorder.dispatched(4, [3.0, 3.0, 3.0])
    assert recorder.percentiles() == {"p50": 3.0, "p90": 3.0, "p99": 3.0, "max": 3.0}
    recorder.dispatched(1, [])
    assert recorder.percentiles()["p50"] == 3.0


async def test_costs_and_stats(autojump_clock):
    ex = FakeExecutor(cost=lambda model, size: {1: 1.0, 4: 2.0, 8: 3.0}[size])
    sched = Scheduler(config(cost_ema_alpha=0.5, ema_halflife_seconds=10.0), ex)
    sched.add_model(spec("m"))
    sched.warm_costs("m", {1: 3.0})
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        for n in (1, 3):  # one at a time: sizes 1 then 4
            await sched.submit("m", [rows(1, n)])
        outs = [await queued(nursery, sched, "m", [rows(1, 1)]) for _ in range(2)]
        await sched.drain()
    assert [o.result.queue_seconds for o in outs] == [0.0, 1.0]  # second waits for the first
    stats = sched.stats("m")
    # size 1: seeded 3, then three samples of 1.0: 3 -> 2 -> 1.5 -> 1.25; size 4: first sample
    assert stats.costs == {1: 1.25, 4: 2.0}
    assert stats.dispatches == 4 and stats.batch_sizes == {1: 3, 4: 1}
    assert stats.requests == 4 and stats.rows == 6
    assert stats.compute_seconds == pytest.approx(5.0)
    assert stats.wait_samples == (0.0, 0.0, 0.0, 1.0)
    assert stats.wait_percentiles["max"] == 1.0
    assert stats.queue_depth == 0 and stats.max_batch_size == 8
    # decayed usage: every compute second, halved per 10 s since it ran
    expected = sum(
        c * 2 ** (-(trio.current_time() - end) / 10.0)
        for c, end in [(call.end - call.start, call.end) for call in ex.calls]
    )
    assert stats.usage_ema == pytest.approx(expected)


def test_cost_table_first_sample_then_ema():
    table = CostTable(alpha=0.2)
    assert table.estimate(4) == 0.0
    table.observe(4, 2.0)
    assert table.estimate(4) == 2.0  # first sample adopted as is
    table.observe(4, 1.0)
    assert table.estimate(4) == pytest.approx(1.8)
    assert table.estimate(8) == pytest.approx(3.6)  # unmeasured: scaled from nearest
    table.seed({8: 5.0})
    assert table.estimate(8) == 5.0


def test_decayed_sum_halves_every_halflife():
    usage = DecayedSum(halflife=30.0)
    usage.add(8.0, now=100.0)
    assert usage.at(130.0) == pytest.approx(4.0)
    usage.add(1.0, now=160.0)
    assert usage.at(160.0) == pytest.approx(3.0)


def test_keyed_heap_updates_and_compaction():
    heap: KeyedHeap[str] = KeyedHeap()
    for i, item in enumerate("abcde"):
        heap.set(item, i)
    heap.set("a", 10)
    heap.discard("b")
    assert heap.peek() == (2, "c") and len(heap) == 4 and "b" not in heap
    for i in range(1000):  # stale entries do not pile up
        heap.set("d", -i)
    assert len(heap._heap) <= 2 * len(heap) + 65
    assert [heap.pop()[1] for _ in range(4)] == ["d", "c", "e", "a"]
    assert heap.pop() is None


async def test_deadline_in_the_past_and_while_queued(autojump_clock):
    ex = FakeExecutor(cost=5.0)
    sched = Scheduler(config(), ex)
    sched.add_model(spec("a"))
    sched.add_model(spec("b"))
    async with trio.open_nursery() as nursery:
        with pytest.raises(DeadlineExceeded, match="already passed"):
            await sched.submit("a", [rows(1, 1)], deadline=trio.current_time())
        await nursery.start(sched.run)
        await queued(nursery, sched, "a", [rows(1, 1)])
        late = await queued(nursery, sched, "b", [rows(1, 1)], deadline=2.0)
        await sched.drain()
    assert isinstance(late.error, DeadlineExceeded) and late.finished_at == 2.0
    assert "deadline exceeded after 2.000s" in str(late.error)
    assert ex.order() == ["a"]


def test_model_spec_with_policy_from_config():
    from rsrv.config._schema import ModelSchedConfig

    base = spec("m", (1, 4, 8), weight=1.0)
    assert base.with_policy(None) is base
    tuned = base.with_policy(
        ModelSchedConfig(weight=3.0, max_batch_size=6, latency_budget_seconds=0.1)
    )
    assert (tuned.weight, tuned.max_batch_size, tuned.latency_budget) == (3.0, 6, 0.1)
    assert tuned.max_rows == 6 and tuned.size_for(5) == 8 and tuned.size_for(0) == 1
    assert base.with_policy(ModelSchedConfig()).max_rows == 8
    assert ModelSpec("m", [8, 1, 4], (0,), (0,)).batch_sizes == (1, 4, 8)


@pytest.mark.parametrize("discipline", ["fair", "fifo", "edf"])
async def test_answered_and_withdrawn_requests_are_released(autojump_clock, discipline):
    """Nothing keeps a request once it is answered or withdrawn, whatever the order it
    leaves in: its input arrays can be freed (every answered request used to stay in
    the queue's arrival record, raw input bytes included)."""
    ex = FakeExecutor(cost=lambda model, size: 5.0 if model == "busy" else 0.001)
    sched = Scheduler(config(discipline=discipline), ex)
    sched.add_model(spec("busy"))
    sched.add_model(spec("m"))
    inputs: list[weakref.ref] = []

    def fresh(i: int) -> list[np.ndarray]:
        x = rows(i, 1 + i % 3)
        inputs.append(weakref.ref(x))
        return [x]

    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        for i in range(300):
            await sched.submit("m", fresh(i))
        # withdrawn out of arrival order while the device is busy
        await queued(nursery, sched, "busy", [rows(0, 1)])
        for i in range(300, 600):
            with trio.move_on_after(0.001 * (600 - i)):
                await sched.submit("m", fresh(i), deadline=None)
        await sched.drain()
    gc.collect()
    alive = [i for i, ref in enumerate(inputs) if ref() is not None]
    assert alive == [], alive[:10]
