"""The repack clock, arrival rates, compaction (rsrv.gateway._repack) and the planner that
drives lpt_packing round by round (rsrv.gateway._planner)."""

from __future__ import annotations

import pytest

from rsrv.gateway._costs import ModelMeta, RoutingMeta
from rsrv.gateway._placement import ModelDemand, PlacementPolicy, WorkerBudget, compute_placement
from rsrv.gateway._planner import PackingSettings, RepackPlanner, model_demands
from rsrv.gateway._repack import (
    ArrivalRates,
    CompactionCounter,
    CompactionMode,
    RepackClock,
    RepackTrigger,
)

STARTUP, COMPUTE, OPERATOR = RepackTrigger.STARTUP, RepackTrigger.COMPUTE, RepackTrigger.OPERATOR
FLEET = RepackTrigger.FLEET

# -- the clock ---------------------------------------------------------------------------------


def test_first_threshold_then_the_steady_one():
    clock = RepackClock(first_threshold=60, threshold=300, now=0.0)
    assert clock.due() is STARTUP
    clock.complete(STARTUP, 1.0)
    assert clock.due() is None and clock.active_threshold == 60
    clock.advance(59.5, 2.0)
    assert clock.due() is None
    clock.advance(0.5, 3.0)
    assert clock.due() is COMPUTE
    window = clock.complete(COMPUTE, 11.0)
    assert (window.sequence, window.wall_elapsed_seconds, window.compute_seconds) == (2, 10.0, 60)
    assert clock.first_compute_repack_done and clock.active_threshold == 300
    assert clock.compute_accumulated == 0.0
    clock.advance(299.0, 12.0)
    assert clock.due() is None
    clock.advance(1.0, 13.0)
    assert clock.due() is COMPUTE


def test_startup_and_operator_repacks_do_not_consume_the_first_budget():
    clock = RepackClock(first_threshold=60, threshold=300)
    clock.complete(STARTUP, 0.0)
    clock.advance(40, 1.0)
    assert clock.request() == 1
    assert clock.due() is OPERATOR
    window = clock.complete(OPERATOR, 2.0)
    assert window.compute_seconds == 40 and clock.compute_accumulated == 0.0
    assert not clock.first_compute_repack_done and clock.active_threshold == 60


def test_operator_requests_coalesce_into_one_sequence():
    clock = RepackClock()
    clock.complete(STARTUP, 0.0)
    assert clock.request() == 1 and clock.request() == 1
    assert (clock.operator_requested, clock.operator_completed) == (1, 0)
    clock.complete(OPERATOR, 1.0)
    assert (clock.operator_requested, clock.operator_completed) == (1, 1)
    assert clock.due() is None
    assert clock.request() == 2


def test_operator_wins_over_compute_and_any_repack_serves_a_request():
    clock = RepackClock(first_threshold=1, threshold=1)
    assert clock.request() == 1
    assert clock.due() is STARTUP  # the startup placement serves it
    clock.complete(STARTUP, 0.0)
    assert clock.operator_completed == 1
    clock.advance(5, 1.0)
    clock.request()
    assert clock.due() is OPERATOR


def test_clock_status_and_validation():
    clock = RepackClock(first_threshold=60, threshold=300, now=100.0)
    status = clock.status()
    assert status.last_trigger is None and status.last_repack_at is None
    assert status.repack_count == 0 and status.active_threshold_seconds == 60
    clock.advance(5.0, 104.0)
    clock.complete(STARTUP, 105.0, models_placed=3, models_moved=0)
    status = clock.status()
    assert status.last_trigger is STARTUP and status.last_repack_at == 105.0
    assert status.last_repack_wall_elapsed_seconds == 5.0
    assert status.last_repack_compute_seconds == 5.0
    assert status.last_models_placed == 3 and status.last_tick_at == 104.0
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            clock.advance(bad, 0.0)
    with pytest.raises(ValueError):
        RepackClock(first_threshold=0)
    with pytest.raises(ValueError):
        clock.threshold = -5


# -- arrival rates -----------------------------------------------------------------------------


def test_arrival_rates_adopt_then_fold_over_compute_time():
    rates = ArrivalRates(halflife_compute_seconds=60.0)
    rates.rebase({"a": 100})
    rates.fold({"a": 120, "b": 0}, wall_elapsed=10.0, compute_elapsed=60.0)
    assert rates.rate("a") == 2.0  # first sample adopted
    assert "b" not in rates.rates()  # no arrival yet: still unknown
    rates.fold({"a": 120, "b": 30}, wall_elapsed=10.0, compute_elapsed=60.0)
    assert rates.rate("a") == pytest.approx(1.0)  # a 0 sample, alpha 0.5
    assert rates.rate("b") == 3.0
    rates.fold({"a": 120, "b": 30}, wall_elapsed=10.0, compute_elapsed=0.0)
    assert rates.rate("a") == pytest.approx(1.0)  # no compute elapsed, no ageing


def test_arrival_counts_that_go_back_rebaseline():
    rates = ArrivalRates(halflife_compute_seconds=1.0)
    rates.fold({"a": 10}, 10.0, 1.0)
    rates.fold({"a": 4}, 10.0, 1.0)
    assert rates.rate("a") == 1.0
    rates.fold({"a": 14}, 10.0, 1e6)
    assert rates.rate("a") == pytest.approx(1.0)
    rates.fold({"a": 20}, 0.0, 5.0)  # no wall time: only a new baseline
    assert rates.rate("a") == pytest.approx(1.0)
    with pytest.raises(ValueError):
        ArrivalRates(0)


# -- compaction --------------------------------------------------------------------------------


def test_compaction_counter_reference_sequence():
    counter = CompactionCounter(CompactionMode.EAGER, interval=2)
    seen = []
    for moved in (True, True, False, False, True):
        fired = counter.advance(moved)
        seen.append((fired, counter.count))
    assert seen == [(False, 1), (True, 0), (False, 1), (False, 2), (True, 0)]


def test_compaction_off_never_counts():
    counter = CompactionCounter("off", interval=1)
    assert [counter.advance(True) for _ in range(3)] == [False] * 3
    assert counter.count == 0
    with pytest.raises(ValueError):
        CompactionCounter("sometimes")
    with pytest.raises(ValueError):
        CompactionCounter("eager", interval=0)


def _moved_result():
    models = [ModelDemand("a", 0.5), ModelDemand("b", 0.4), ModelDemand("c", 0.1)]
    ws = [WorkerBudget("w0"), WorkerBudget("w1")]
    return compute_placement(models, ws, {"a": ["w1"], "b": ["w1"], "c": ["w0"]})


def test_eager_compaction_orders_the_changed_workers_with_no_reload():
    order = CompactionCounter("eager").on_repack(_moved_result())
    assert order.workers == ("w0", "w1")
    assert dict(order.reload) == {"w0": (), "w1": ()}


def test_scheduled_compaction_reloads_what_each_changed_worker_now_holds():
    result = _moved_result()
    order = CompactionCounter("scheduled").on_repack(result)
    assert dict(order.reload) == {"w0": ("b", "c"), "w1": ("a",)}
    models = [ModelDemand(m, p.utilization) for m, p in result.placements.items()]
    unmoved = compute_placement(models, result.workers, result.assignment())
    assert unmoved.moved == 0
    assert CompactionCounter("scheduled").on_repack(unmoved) is None


# -- the planner -------------------------------------------------------------------------------

WORKERS = [WorkerBudget("w0"), WorkerBudget("w1")]


def meta(**costs: float) -> RoutingMeta:
    return RoutingMeta(
        models={
            name: ModelMeta(name, cost_per_request=c, holders=frozenset({"w0", "w1"}))
            for name, c in costs.items()
        }
    )


def test_demand_is_arrival_rate_times_cost_per_request():
    rates = ArrivalRates(60.0)
    rates.fold({"a": 10, "b": 20}, wall_elapsed=10.0, compute_elapsed=1.0)
    demands = model_demands(meta(a=0.25, c=1.0), rates, {"a": ["w0"], "b": ["w0"], "c": ["w0"]})
    # b was never measured: the fleet mean cost (of a and c) stands in; c had no arrival
    assert [(d.name, d.utilization) for d in demands] == [("a", 0.25), ("b", 1.25), ("c", 0.0)]
    assert demands[0].holders == {"w0"}


def test_planner_runs_startup_then_compute_repacks():
    planner = RepackPlanner(
        PackingSettings(first_rebalance_compute_seconds=10, rebalance_compute_seconds=100),
        now=0.0,
    )
    costs = meta(a=0.1, b=0.1, c=0.1)
    first = planner.tick(now=1.0, compute_seconds=0.0, meta=costs, workers=WORKERS, arrivals={})
    assert first.window.trigger is STARTUP
    assert set(first.result.placements) == {"a", "b", "c"}
    assert first.compaction is None  # nothing moved
    assert "trigger=startup models=3 moved=0" in first.summary()

    arrivals = {"a": 50, "b": 40, "c": 10}
    assert (
        planner.tick(now=2.0, compute_seconds=5, meta=costs, workers=WORKERS, arrivals={}) is None
    )
    second = planner.tick(
        now=11.0, compute_seconds=5, meta=costs, workers=WORKERS, arrivals=arrivals
    )
    assert second.window.trigger is COMPUTE and second.window.wall_elapsed_seconds == 10.0
    assert planner.rates.rate("a") == 5.0
    # a: 0.5, b: 0.4, c: 0.1 -> the reference packing
    assert second.result.assignment() == {"a": ("w0",), "b": ("w1",), "c": ("w1",)}
    assert planner.clock.first_compute_repack_done
    assert planner.last is second.result


def test_planner_serves_operator_requests_and_waits_for_workers():
    planner = RepackPlanner()
    costs = meta(a=0.1)
    assert planner.tick(now=0.0, compute_seconds=0.0, meta=costs, workers=[], arrivals={}) is None
    assert planner.clock.due() is STARTUP  # still due
    planner.tick(now=1.0, compute_seconds=0.0, meta=costs, workers=WORKERS, arrivals={})
    assert planner.request_repack() == 1
    outcome = planner.tick(now=2.0, compute_seconds=0.0, meta=costs, workers=WORKERS, arrivals={})
    assert outcome.window.trigger is OPERATOR and planner.clock.operator_completed == 1


def test_planner_repacks_once_the_fleet_it_placed_on_has_changed_for_a_round():
    planner = RepackPlanner()
    costs = meta(a=0.1)

    def tick(now, workers, holders):
        return planner.tick(
            now=now, compute_seconds=0.0, meta=costs, workers=workers, arrivals={}, holders=holders
        )

    # placed while w1 was still loading: a on w0 only
    first = tick(0.0, WORKERS, {"a": ["w0"]})
    assert first.window.trigger is STARTUP and first.result.assignment() == {"a": ("w0",)}
    assert tick(1.0, WORKERS, {"a": ["w0"]}) is None  # nothing changed
    assert tick(2.0, WORKERS, {"a": ["w0", "w1"]}) is None  # w1 serves it now: wait a round
    again = tick(3.0, WORKERS, {"a": ["w0", "w1"]})  # still so: placed again
    assert again.window.trigger is FLEET and set(again.result.placements) == {"a"}
    assert tick(4.0, WORKERS, {"a": ["w0", "w1"]}) is None
    # a worker that flaps never repacks; one that stays away does, after a round
    assert tick(5.0, WORKERS[:1], {"a": ["w0"]}) is None
    assert tick(6.0, WORKERS, {"a": ["w0", "w1"]}) is None
    assert tick(7.0, WORKERS[:1], {"a": ["w0"]}) is None
    assert tick(8.0, WORKERS[:1], {"a": ["w0"]}).window.trigger is FLEET
    assert not planner.clock.first_compute_repack_done  # (the first budget is kept)


def test_planner_compacts_when_a_repack_moves_models():
    settings = PackingSettings(first_rebalance_compute_seconds=1, rebalance_compute_seconds=1)
    planner = RepackPlanner(settings)
    costs = meta(a=1.0, b=1.0)
    planner.tick(now=0.0, compute_seconds=0.0, meta=costs, workers=WORKERS, arrivals={})
    assert planner.last.assignment() == {"a": ("w0",), "b": ("w1",)}
    # b becomes hot and a cold: b stays alone, nothing moves
    out = planner.tick(now=1.0, compute_seconds=1, meta=costs, workers=WORKERS, arrivals={"b": 9})
    assert out.result.moved == 0 and out.compaction is None
    # w1 leaves: a and b share w0; b moved
    out = planner.tick(
        now=2.0, compute_seconds=1, meta=costs, workers=WORKERS[:1], arrivals={"b": 9}
    )
    assert out.result.moved == 1 and out.compaction.workers == ("w0",)


def test_planner_configure_applies_knobs_and_warns():
    planner = RepackPlanner(PackingSettings(first_rebalance_compute_seconds=60))
    planner.tick(now=0.0, compute_seconds=0.0, meta=meta(), workers=WORKERS, arrivals={})
    planner.tick(now=1.0, compute_seconds=50.0, meta=meta(), workers=WORKERS, arrivals={})
    warnings = planner.configure(
        PackingSettings(
            first_rebalance_compute_seconds=40,
            ema_halflife_compute_seconds=10,
            compaction_mode="scheduled",
            compaction_interval=3,
        )
    )
    assert len(warnings) == 2
    assert "half-life" in warnings[0] and "repack runs at the next round" in warnings[1]
    assert planner.clock.first_threshold == 40 and planner.rates.halflife_compute_seconds == 10
    assert planner.compaction.mode is CompactionMode.SCHEDULED
    assert planner.compaction.interval == 3
    assert planner.settings.halflife_compute_seconds == 10


def test_packing_settings_resolve_and_validate():
    assert PackingSettings().halflife_compute_seconds == 300.0
    assert PackingSettings(rebalance_compute_seconds=120).halflife_compute_seconds == 120
    assert PackingSettings().placement == PlacementPolicy()
    for bad in (
        {"rebalance_compute_seconds": 0},
        {"first_rebalance_compute_seconds": -1},
        {"ema_halflife_compute_seconds": -1},
        {"ema_halflife_compute_seconds": float("inf")},
        {"compaction_mode": "always"},
        {"compaction_interval": 0},
    ):
        with pytest.raises(ValueError):
            PackingSettings(**bad)
