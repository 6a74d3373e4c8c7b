"""Routing metadata (rsrv.gateway._costs): cost EWMAs over polled counters, batch facts."""

from __future__ import annotations

import math
import random

import pytest

from rsrv.gateway._costs import (
    MAX_UNITS,
    CostTracker,
    ModelCounters,
    ModelMeta,
    RoutingMeta,
    WorkerReport,
    batch_units,
    ewma,
    resolve_halflife,
)
from rsrv.protocol.generated.rsrv.control.v1 import control_pb2


def report(worker: str, *models: ModelCounters, budget: int = 0) -> WorkerReport:
    return WorkerReport(worker, tuple(models), budget)


def counters(name="m", compute=0.0, requests=0, rows=0, **kw) -> ModelCounters:
    return ModelCounters(name, compute, requests, rows, **kw)


def test_first_poll_adopts_the_lifetime_average():
    tracker = CostTracker()
    delta = tracker.observe([report("w0", counters(compute=10.0, requests=5, rows=40))])
    meta = tracker.snapshot().get("m")
    assert meta.cost_per_request == 2.0
    assert meta.cost_per_item == 0.25
    # a pair's first sighting is not "consumed since the last poll"
    assert delta.compute_seconds == 0.0 and delta.requests == {}


def test_later_polls_fold_with_alpha_from_fleet_compute():
    tracker = CostTracker(halflife_compute_seconds=30.0)
    tracker.observe([report("w0", counters(compute=10.0, requests=5, rows=40))])
    # 30 more compute seconds over 5 requests: sample 6.0, alpha = 1 - 2^-1 = 0.5
    delta = tracker.observe([report("w0", counters(compute=40.0, requests=10, rows=80))])
    assert delta.compute_seconds == 30.0 and delta.requests == {"m": 5}
    meta = tracker.snapshot().get("m")
    assert meta.cost_per_request == pytest.approx(4.0)
    assert meta.cost_per_item == pytest.approx(0.25 + 0.5 * (0.75 - 0.25))


def test_fleet_compute_of_other_models_ages_a_model_between_its_samples():
    tracker = CostTracker(halflife_compute_seconds=10.0)
    tracker.observe([report("w0", counters("a", 1.0, 1, 1), counters("b", 0.0, 0, 0))])
    # b is idle while a burns 10 s, then 10 s more; b's next sample sees dt = 20 + its own
    tracker.observe([report("w0", counters("a", 11.0, 2, 2), counters("b", 0.0, 0, 0))])
    tracker.observe([report("w0", counters("a", 21.0, 3, 3), counters("b", 0.0, 0, 0))])
    tracker.observe([report("w0", counters("a", 21.0, 3, 3), counters("b", 4.0, 1, 1))])
    tracker.observe([report("w0", counters("a", 21.0, 3, 3), counters("b", 5.0, 2, 2))])
    # b: first sample 4.0 adopted; second after dt = 1 s: alpha = 1 - 2^-0.1
    alpha = 1 - 2**-0.1
    assert tracker.snapshot().get("b").cost_per_request == pytest.approx(4 + alpha * (1 - 4))
    # a: sampled at dt 10 then 10: 1 -> 10 (alpha .5 -> 5.5) -> 10 (alpha .5 -> 7.75)
    assert tracker.snapshot().get("a").cost_per_request == pytest.approx(7.75)


def test_costs_sum_over_workers():
    tracker = CostTracker()
    tracker.observe([report("w0", counters(compute=3.0, requests=1, rows=1))])
    tracker.observe([report("w1", counters(compute=1.0, requests=1, rows=4))])
    meta = tracker.snapshot().get("m")
    assert meta.cost_per_request == 3.0  # the first sample (w0) is adopted ...
    tracker = CostTracker()
    tracker.observe(
        [
            report("w0", counters(compute=3.0, requests=1, rows=1)),
            report("w1", counters(compute=1.0, requests=1, rows=3)),
        ]
    )
    meta = tracker.snapshot().get("m")
    assert meta.cost_per_request == 2.0 and meta.cost_per_item == 1.0  # ... or both at once


def test_a_worker_restart_rebaselines_and_skips_the_sample():
    tracker = CostTracker(halflife_compute_seconds=1.0)
    tracker.observe([report("w0", counters(compute=10.0, requests=5, rows=40))])
    delta = tracker.observe([report("w0", counters(compute=1.0, requests=1, rows=1))])
    assert delta.rebaselined == (("w0", "m"),)
    assert delta.compute_seconds == 0.0
    assert tracker.snapshot().get("m").cost_per_request == 2.0
    # the next sample is differenced against the restarted counters
    delta = tracker.observe([report("w0", counters(compute=4.0, requests=2, rows=2))])
    assert delta.compute_seconds == 3.0 and delta.rebaselined == ()
    # sample 3.0 after dt = 3 s with h = 1 s: alpha = 1 - 2^-3
    assert tracker.snapshot().get("m").cost_per_request == pytest.approx(2.0 + 0.875 * 1.0)


@pytest.mark.parametrize("backwards", ["compute", "requests", "rows"])
def test_any_counter_going_back_is_a_restart(backwards):
    tracker = CostTracker()
    tracker.observe([report("w0", counters(compute=10.0, requests=5, rows=5))])
    after = {"compute": 20.0, "requests": 9, "rows": 9}
    after[backwards] = {"compute": 9.0, "requests": 4, "rows": 4}[backwards]
    delta = tracker.observe([report("w0", counters(**after))])
    assert delta.rebaselined == (("w0", "m"),)


def test_a_new_instance_rebaselines_even_when_its_counters_grew():
    tracker = CostTracker()
    tracker.observe([WorkerReport("w0", (counters(compute=10.0, requests=5),), instance="a")])
    # a new process that already served more than the old one had: not one sample
    delta = tracker.observe(
        [WorkerReport("w0", (counters(compute=30.0, requests=9),), instance="b")]
    )
    assert delta.compute_seconds == 0.0 and delta.requests == {}
    delta = tracker.observe(
        [WorkerReport("w0", (counters(compute=31.0, requests=10),), instance="b")]
    )
    assert delta.compute_seconds == 1.0


def test_a_metas_compute_is_its_sub_models_and_counts_once():
    tracker = CostTracker()
    meta, sub = counters("meta", kind="meta"), counters("sub")
    tracker.observe([report("w0", meta, sub)])
    later = counters("meta", 10.0, 5, 5, weight_bytes=64, kind="meta")
    delta = tracker.observe([report("w0", later, counters("sub", 10.0, 5, 5, weight_bytes=64))])
    assert delta.compute_seconds == 10.0  # the sub-model's device time, once
    snap = tracker.snapshot()
    assert snap.get("meta").cost_per_request == 2.0  # (it still has a cost of its own)


def test_workers_that_left_the_fleet_are_forgotten():
    tracker = CostTracker()
    tracker.observe([report("w0", counters(compute=1.0), budget=8), report("w1", budget=9)])
    tracker.forget_worker("w0")
    assert tracker.snapshot().budgets == {"w1": 9}
    delta = tracker.observe([report("w0", counters(compute=5.0))])  # back: a new baseline
    assert delta.compute_seconds == 0.0


def test_an_absent_worker_keeps_its_baseline():
    tracker = CostTracker()
    tracker.observe([report("w0", counters(compute=10.0, requests=5, rows=5))])
    tracker.observe([])
    delta = tracker.observe([report("w0", counters(compute=14.0, requests=6, rows=6))])
    assert delta.compute_seconds == 4.0 and delta.requests == {"m": 1}


def test_max_batch_is_the_largest_report_and_batch_axis_the_first_non_empty():
    tracker = CostTracker()
    tracker.observe(
        [
            report("w1", counters(max_batch_size=16, batch_input_name="y", batch_axis=1)),
            report("w0", counters(max_batch_size=8)),
            report("w2", counters(max_batch_size=4, batch_input_name="z", batch_axis=0)),
        ]
    )
    meta = tracker.snapshot().get("m")
    assert meta.max_batch == 16
    assert (meta.batch_input, meta.batch_axis) == ("y", 1)  # w0 is empty; w1 before w2
    assert meta.holders == {"w0", "w1", "w2"}
    # a round without a batch axis keeps the last known one; max_batch follows the round
    tracker.observe([report("w0", counters(max_batch_size=8))])
    meta = tracker.snapshot().get("m")
    assert (meta.batch_input, meta.batch_axis, meta.max_batch) == ("y", 1, 8)
    assert meta.holders == {"w0"}
    # a model absent from a round keeps its facts but has no holder
    tracker.observe([report("w0")])
    meta = tracker.snapshot().get("m")
    assert meta.max_batch == 8 and meta.holders == frozenset()


def test_item_cost_falls_back_to_the_fleet_mean_then_one():
    assert RoutingMeta().item_cost("cold") == 1.0
    assert RoutingMeta().request_cost("cold") == 1.0
    meta = RoutingMeta(
        models={
            "dear": ModelMeta("dear", cost_per_request=4.0, cost_per_item=1.0),
            "cheap": ModelMeta("cheap", cost_per_request=0.5, cost_per_item=0.01),
            "free": ModelMeta("free", cost_per_request=0.0, cost_per_item=0.0),
        }
    )
    assert meta.item_cost("dear") == 1.0
    assert meta.item_cost("cold") == pytest.approx(0.505)
    assert meta.item_cost("free") == pytest.approx(0.505)  # never 0
    assert meta.request_cost("cold") == pytest.approx(2.25)
    assert meta.mean_cost_per_item == pytest.approx(0.505)


def test_costs_are_never_zero_or_nan():
    rng = random.Random(1)
    tracker = CostTracker(halflife_compute_seconds=5.0)
    totals = {w: [0.0, 0, 0] for w in ("w0", "w1")}
    for _ in range(200):
        reports = []
        for w, t in totals.items():
            if rng.random() < 0.1:
                t[:] = [0.0, 0, 0]  # restart
            t[1] += rng.randint(0, 3)
            t[2] += t[1] and rng.randint(0, 5)
            t[0] += rng.choice([0.0, rng.random()])
            reports.append(report(w, counters(compute=t[0], requests=t[1], rows=t[2])))
        delta = tracker.observe(reports)
        assert delta.compute_seconds >= 0
        meta = tracker.snapshot()
        for cost in (meta.item_cost("m"), meta.request_cost("m"), meta.item_cost("x")):
            assert math.isfinite(cost) and cost > 0


def test_units_read_the_wire_shape_at_the_row_major_axis():
    meta = ModelMeta("m", batch_input="x", batch_axis=1)
    assert meta.units({"x": [3, 7, 2]}.get) == 7
    assert meta.units({"y": [3, 7]}.get) == 1  # no such input
    assert meta.units({"x": [3]}.get) == 1  # no such axis
    assert meta.units({"x": [3, 0]}.get) == 1  # an empty batch still counts one
    calls = []
    assert ModelMeta("u").units(lambda name: calls.append(name)) == 1
    assert calls == []  # nothing read without a batch input
    assert batch_units(None, 0) == 1 and batch_units([5], -1) == 1 and batch_units([5], 0) == 5
    # A shape no worker accepts is charged no more than MAX_UNITS: the loads, floats,
    # keep counting the other requests exactly.
    assert batch_units([2**62, 4], 0) == MAX_UNITS


def test_reports_convert_from_the_control_messages():
    response = control_pb2.ModelControlStatusResponse(
        discipline="fifo",
        weight_cache_budget_bytes=1024,
        models=[
            control_pb2.ModelStatus(
                name="m",
                weight_bytes=64,
                compute_seconds=10.0,
                requests_served=5,
                rows_served=40,
                max_batch_size=8,
                batch_input_name="x",
                batch_axis=0,
            )
        ],
    )
    converted = WorkerReport.from_response("w0", response)
    assert converted == WorkerReport(
        "w0",
        (ModelCounters("m", 10.0, 5, 40, 64, 8, "x", 0),),
        weight_cache_budget_bytes=1024,
        discipline="fifo",
    )
    tracker = CostTracker()
    tracker.observe([converted])
    snap = tracker.snapshot()
    assert snap.get("m").cost_per_request == 2.0 and snap.get("m").weight_bytes == 64
    assert snap.budgets == {"w0": 1024}


def test_forget_model_and_invalid_inputs():
    tracker = CostTracker()
    tracker.observe([report("w0", counters(compute=1.0, requests=1, rows=1))])
    tracker.forget_model("m")
    assert tracker.snapshot().get("m") is None
    with pytest.raises(ValueError):
        tracker.observe([report("w0"), report("w0")])
    with pytest.raises(ValueError):
        CostTracker(halflife_compute_seconds=0)


def test_ewma_and_halflife_resolution():
    assert ewma(None, 3.0, 0.0, 10.0) == 3.0
    assert ewma(1.0, 3.0, 0.0, 10.0) == 1.0
    assert ewma(1.0, 3.0, 10.0, 10.0) == 2.0
    assert ewma(1.0, 3.0, 1e9, 10.0) == pytest.approx(3.0)
    assert resolve_halflife(20.0, 300.0) == 20.0
    assert resolve_halflife(0.0, 300.0) == 300.0
    assert resolve_halflife(None, None) == 30.0
