"""Scheduling status views (rsrv.gateway._status)."""

from __future__ import annotations

import pytest

from rsrv.gateway._costs import ModelMeta, RoutingMeta
from rsrv.gateway._fill import FillRouter, FillSettings, ModelFill
from rsrv.gateway._placement import (
    ALL_REPLICAS,
    ModelDemand,
    PlacementPolicy,
    WorkerBudget,
    compute_placement,
)
from rsrv.gateway._repack import ArrivalRates
from rsrv.gateway._routing import RoundRobinRouter
from rsrv.gateway._status import ReplicaView, model_views, worker_views

GB = 10**9


def test_lpt_views_report_placement_load_and_memory():
    meta = RoutingMeta(
        models={
            "a": ModelMeta("a", cost_per_request=0.05, max_batch=8, weight_bytes=6 * GB),
            "b": ModelMeta("b", cost_per_request=0.02, max_batch=4, weight_bytes=6 * GB),
            "d": ModelMeta("d", weight_bytes=GB),
        },
        budgets={"w0": 10 * GB, "w1": 10 * GB},
    )
    rates = ArrivalRates(60.0)
    rates.fold({"a": 100, "b": 50}, wall_elapsed=10.0, compute_elapsed=1.0)
    policy = PlacementPolicy(replicas={"a": 2})
    result = compute_placement(
        [
            ModelDemand("a", 0.5, 6 * GB),
            ModelDemand("b", 0.1, 6 * GB),
            ModelDemand("d", 0.0, GB, holders=frozenset({"w1"})),
        ],
        [WorkerBudget("w0", 10 * GB), WorkerBudget("w1", 10 * GB)],
        None,
        policy,
    )
    fill = FillSettings(models={"b": ModelFill(mode="spread", factor=2.0)})
    router = FillRouter(fill, meta=meta)
    router.set_placement(result.assignment())
    ticket = router.route("a", ["w0", "w1"], units=3)
    router.route("a", ["w0", "w1"]).release()
    routes = {"a": ["w0", "w1"], "b": ["w0", "w1"], "d": ["w1"], "new": ["w0"]}

    views = {
        v.name: v
        for v in model_views(
            ledger=router.ledger,
            meta=meta,
            routes=routes,
            result=result,
            rates=rates,
            fill=fill,
            policy=policy,
            ready_workers=1,
        )
    }
    assert list(views) == ["a", "b", "d", "new"]
    a = views["a"]
    # effective: the configured 2 clamped to the one ready worker (placed on two before)
    assert (a.configured_replicas, a.effective_replicas, a.placed, a.drifted) == (2, 1, True, False)
    assert a.replicas == (ReplicaView("w0", 0.5, 3, 2), ReplicaView("w1", 0.5, 0, 0))
    assert (a.utilization, a.arrival_rate, a.cost_seconds) == (0.5, 10.0, 0.05)
    assert (a.max_batch, a.fill_mode, a.fill_quantum, a.weight_bytes) == (8, "run", 8, 6 * GB)
    assert (views["b"].fill_mode, views["b"].fill_quantum) == ("spread", 8)
    assert views["d"].drifted and views["d"].replicas == (ReplicaView("w1", 1.0, 0, 0),)
    new = views["new"]
    assert not new.placed and new.replicas == (ReplicaView("w0", 1.0, 0, 0),)
    assert new.utilization == 0.0 and new.cost_seconds == 0.0

    workers = worker_views(
        ledger=router.ledger,
        workers=["w0", "w1", "w2"],
        ready=["w0", "w1"],
        budgets=meta.budgets,
        result=result,
    )
    assert [w.worker for w in workers] == ["w0", "w1", "w2"]
    w0, w1, w2 = workers
    assert w0.ready and not w2.ready
    # b (6 GB) fits nowhere (w1 also holds the drifted d): it goes to the lesser pressure
    assert (w0.models_placed, w1.models_placed, w2.models_placed) == (2, 2, 0)
    assert w0.inflight_compute == pytest.approx(3.0)  # compute basis, no cost per item: 1.0
    assert (w0.assigned_weight_bytes, w1.assigned_weight_bytes) == (12 * GB, 7 * GB)
    assert w0.oversubscribed and not w1.oversubscribed
    assert w0.weight_budget_bytes == 10 * GB and w2.weight_budget_bytes == 0
    ticket.release()


def test_views_without_a_placement_use_the_discovered_routes():
    router = RoundRobinRouter()
    router.route("m", ["w0", "w1"], units=2)
    views = model_views(ledger=router.ledger, meta=RoutingMeta(), routes={"m": ["w1", "w0"]})
    (m,) = views
    assert m.configured_replicas == ALL_REPLICAS and m.effective_replicas == 2
    assert m.replicas == (ReplicaView("w0", 0.5, 2, 1), ReplicaView("w1", 0.5, 0, 0))
    assert (m.fill_mode, m.fill_quantum, m.placed) == ("", 0, False)
    (w0, w1) = worker_views(ledger=router.ledger, workers=["w0", "w1"], ready=["w0"])
    assert w0.inflight_compute == 1.0 and w0.ready and not w1.ready
    assert w0.assigned_weight_bytes == 0 and not w0.oversubscribed
