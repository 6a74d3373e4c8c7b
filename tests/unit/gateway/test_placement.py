"""lpt_packing placement (rsrv.gateway._placement): the reference vectors, then properties."""

from __future__ import annotations

import random

import pytest

from rsrv.gateway._placement import (
    ALL_REPLICAS,
    ModelDemand,
    PlacementPolicy,
    WorkerBudget,
    compute_placement,
    parse_replicas,
)

GB = 10**9


def workers(n: int = 2, budget: int | None = None) -> list[WorkerBudget]:
    return [WorkerBudget(f"w{i}", budget) for i in range(n)]


def demands(u: dict[str, float], mem: dict[str, int] | None = None) -> list[ModelDemand]:
    mem = mem or {}
    return [ModelDemand(name, load, mem.get(name, 0)) for name, load in u.items()]


def homes(result) -> dict[str, str | tuple[str, ...]]:
    """model -> its single worker, or the tuple of workers when several."""
    return {
        m: (p.workers[0] if len(p.workers) == 1 else p.workers)
        for m, p in result.placements.items()
    }


# -- reference vectors -----------------------------------------------------------------------


def test_largest_first_onto_the_least_loaded():
    result = compute_placement(demands({"a": 0.5, "b": 0.4, "c": 0.1}), workers())
    assert homes(result) == {"a": "w0", "b": "w1", "c": "w1"}
    assert result.compute_load == {"w0": 0.5, "w1": pytest.approx(0.5)}
    assert result.moved == 0 and result.held_by_hysteresis == 0


def test_memory_pressure_steers_placement():
    u = {"a": 0.6, "b": 0.5, "c": 0.1}
    mem = {"a": 1 * GB, "b": 9 * GB, "c": 9 * GB}
    result = compute_placement(demands(u, mem), workers(budget=10 * GB))
    assert homes(result) == {"a": "w0", "b": "w1", "c": "w0"}
    assert result.assigned_bytes == {"w0": 10 * GB, "w1": 9 * GB}
    assert result.oversubscribed == ()
    # without memory, compute alone decides
    assert homes(compute_placement(demands(u), workers()))["c"] == "w1"


def test_cold_models_spread_by_memory():
    result = compute_placement(
        demands({"x": 0.0, "y": 0.0}, {"x": 6 * GB, "y": 6 * GB}), workers(budget=10 * GB)
    )
    assert sorted(homes(result).values()) == ["w0", "w1"]


def test_cold_models_without_a_footprint_spread_by_count():
    """Equal pressure goes to the worker holding fewer models (then the smaller name)."""
    result = compute_placement(demands({"a": 0.0, "b": 0.0, "c": 0.0, "d": 0.0}), workers(3))
    assert homes(result) == {"a": "w0", "b": "w1", "c": "w2", "d": "w0"}


def test_hysteresis_keeps_a_lone_model_home():
    policy = PlacementPolicy(hysteresis=0.1)
    result = compute_placement(demands({"a": 0.5}), workers(), {"a": ["w1"]}, policy)
    assert homes(result) == {"a": "w1"}
    assert result.moved == 0
    # an equally good home needs no hysteresis: not counted as held
    assert result.held_by_hysteresis == 0


def test_hysteresis_keeps_the_hot_model_and_moves_the_small_one():
    policy = PlacementPolicy(hysteresis=0.1)
    prev = {"hot": ["w1"], "a": ["w1"]}
    result = compute_placement(demands({"hot": 0.7, "a": 0.3}), workers(), prev, policy)
    assert homes(result) == {"hot": "w1", "a": "w0"}
    assert result.moved == 1
    assert result.placements["a"].moved and not result.placements["hot"].moved
    assert result.changed_workers == ("w0", "w1")


def test_hysteresis_holds_within_the_margin_and_reports_the_improvement_given_up():
    u = {"x": 0.5, "y": 0.45, "z": 0.1}
    prev = {"x": ["w0"], "y": ["w1"], "z": ["w0"]}
    held = compute_placement(demands(u), workers(), prev, PlacementPolicy(hysteresis=0.1))
    assert homes(held) == {"x": "w0", "y": "w1", "z": "w0"}
    assert held.held_by_hysteresis == 1 and held.placements["z"].held_by_hysteresis
    assert held.max_improvement == pytest.approx(0.05)
    moved = compute_placement(demands(u), workers(), prev, PlacementPolicy(hysteresis=0.0))
    assert homes(moved)["z"] == "w1"
    assert moved.moved == 1 and moved.held_by_hysteresis == 0 and moved.max_improvement == 0


def test_default_hysteresis_is_zero():
    assert PlacementPolicy().hysteresis == 0.0


def _oversubscription_case(forbid: bool):
    u = {"busy": 1.2, "occ0": 0.5, "m": 0.1}
    mem = {"busy": 0, "occ0": 7 * GB, "m": int(3.5 * GB)}
    prev = {"busy": ["w1"], "occ0": ["w0"], "m": ["w0"]}
    policy = PlacementPolicy(forbid_memory_oversubscription=forbid)
    return compute_placement(demands(u, mem), workers(budget=10 * GB), prev, policy)


def test_soft_memory_mode_keeps_the_model_and_oversubscribes():
    result = _oversubscription_case(forbid=False)
    assert homes(result) == {"busy": "w1", "occ0": "w0", "m": "w0"}
    assert result.assigned_bytes["w0"] == int(10.5 * GB)
    assert result.oversubscribed == ("w0",)
    assert result.moved == 0


def test_hard_memory_mode_moves_the_model_where_it_fits():
    result = _oversubscription_case(forbid=True)
    assert homes(result)["m"] == "w1"
    assert result.oversubscribed == ()
    assert result.moved == 1 and result.changed_workers == ("w0", "w1")


def test_a_model_bigger_than_every_budget_is_still_placed():
    for forbid in (True, False):
        policy = PlacementPolicy(forbid_memory_oversubscription=forbid)
        result = compute_placement(
            demands({"huge": 0.2}, {"huge": 20 * GB}), workers(budget=10 * GB), None, policy
        )
        assert homes(result) == {"huge": "w0"}
        assert result.oversubscribed == ("w0",)


# -- replicas ----------------------------------------------------------------------------------


def test_replicas_charge_a_share_of_compute_and_the_full_bytes():
    policy = PlacementPolicy(replicas={"a": 2})
    result = compute_placement(
        demands({"a": 0.6, "b": 0.5}, {"a": 2 * GB, "b": GB}), workers(3), None, policy
    )
    a = result.placements["a"]
    assert a.workers == ("w0", "w1") and a.weights == (0.5, 0.5)
    assert a.weight_on("w1") == 0.5 and a.weight_on("w2") == 0.0
    assert homes(result)["b"] == "w2"
    assert result.compute_load == {"w0": 0.3, "w1": 0.3, "w2": 0.5}
    assert result.assigned_bytes == {"w0": 2 * GB, "w1": 2 * GB, "w2": GB}


def test_all_and_too_many_replicas_clamp_to_the_worker_count():
    policy = PlacementPolicy(default_replicas=ALL_REPLICAS, replicas={"b": 5})
    result = compute_placement(demands({"a": 0.2, "b": 0.1}), workers(3), None, policy)
    assert result.placements["a"].workers == ("w0", "w1", "w2")
    assert result.placements["b"].workers == ("w0", "w1", "w2")
    assert result.placements["a"].configured_replicas == ALL_REPLICAS
    assert result.placements["b"].configured_replicas == 5
    assert policy.effective("b", 2) == 2 and policy.effective("b", 0) == 0


def test_replicas_prefer_previous_members_on_equal_pressure():
    policy = PlacementPolicy(default_replicas=2)
    result = compute_placement(demands({"a": 0.4}), workers(4), {"a": ["w1", "w3"]}, policy)
    assert result.placements["a"].workers == ("w1", "w3")
    assert result.moved == 0


def test_replicas_rank_fitting_workers_first():
    policy = PlacementPolicy(default_replicas=2)
    ws = [WorkerBudget("w0", GB), WorkerBudget("w1", 10 * GB), WorkerBudget("w2", 10 * GB)]
    result = compute_placement(demands({"a": 0.4}, {"a": 2 * GB}), ws, None, policy)
    assert result.placements["a"].workers == ("w1", "w2")
    # soft mode: the small worker's memory ratio (2.0) is only pressure, still the worst
    soft = PlacementPolicy(default_replicas=2, forbid_memory_oversubscription=False)
    assert compute_placement(demands({"a": 0.4}, {"a": 2 * GB}), ws, None, soft).placements[
        "a"
    ].workers == ("w1", "w2")


def test_shrinking_to_one_replica_keeps_a_previous_member():
    prev = {"a": ["w1", "w2"]}
    result = compute_placement(demands({"a": 0.3}), workers(3), prev)
    assert homes(result) == {"a": "w1"}
    assert result.moved == 1  # the set changed
    assert result.changed_workers == ("w2",)


# -- drift, unplaced, bookkeeping ------------------------------------------------------------


def test_a_drifted_model_spreads_over_its_holders_and_its_load_counts():
    models = [
        ModelDemand("d", 0.5, GB, holders=frozenset({"w0"})),
        ModelDemand("a", 0.4, 0),
        ModelDemand("gone", 0.1, 0, holders=frozenset({"w9"})),
    ]
    result = compute_placement(models, workers(2, budget=10 * GB))
    d = result.placements["d"]
    assert d.drifted and d.workers == ("w0",) and d.weights == (1.0,)
    assert homes(result)["a"] == "w1"  # w0 already carries d's 0.5
    assert not result.placements["a"].drifted
    assert result.unplaced == ("gone",)
    assert result.assigned_bytes == {"w0": GB, "w1": 0}


def test_a_drifted_model_over_several_holders_gets_uniform_weights():
    models = [ModelDemand("d", 0.6, 0, holders=frozenset({"w0", "w2", "w7"}))]
    result = compute_placement(models, workers(3))
    assert result.placements["d"].workers == ("w0", "w2")
    assert result.placements["d"].weights == (0.5, 0.5)
    assert result.compute_load == {"w0": 0.3, "w1": 0.0, "w2": 0.3}


def test_no_worker_places_nothing():
    result = compute_placement(demands({"a": 0.1}), [])
    assert result.placements == {} and result.unplaced == ("a",)


def test_changed_workers_and_assignment():
    result = compute_placement(demands({"a": 0.5, "b": 0.4}), workers(), {"a": ["w0"]})
    assert result.assignment() == {"a": ("w0",), "b": ("w1",)}
    assert result.models_on("w1") == ("b",)
    assert result.changed_workers == ("w1",)  # b is new on w1; w0 still holds only a
    assert result.moved == 0


def test_previous_models_that_vanished_change_their_workers():
    result = compute_placement(demands({"a": 0.5}), workers(), {"a": ["w0"], "old": ["w1"]})
    assert result.changed_workers == ("w1",)


@pytest.mark.parametrize(
    ("value", "expected"), [(1, 1), (3, 3), ("all", -1), (" ALL ", -1), (-1, -1), ("2", 2)]
)
def test_parse_replicas(value, expected):
    assert parse_replicas(value) == expected


@pytest.mark.parametrize("value", [0, -2, "none", True, 1.5])
def test_parse_replicas_rejects(value):
    with pytest.raises(ValueError):
        parse_replicas(value)


def test_invalid_inputs_raise():
    with pytest.raises(ValueError):
        PlacementPolicy(hysteresis=1.0)
    with pytest.raises(ValueError):
        PlacementPolicy(replicas={"a": 0})
    with pytest.raises(ValueError):
        ModelDemand("a", -0.1)
    with pytest.raises(ValueError):
        ModelDemand("a", float("nan"))
    with pytest.raises(ValueError):
        WorkerBudget("w", -1)
    with pytest.raises(ValueError):
        compute_placement([], [WorkerBudget("w"), WorkerBudget("w")])
    with pytest.raises(ValueError):
        compute_placement(demands({"a": 0.1}) * 2, workers())


# -- properties --------------------------------------------------------------------------------


def _random_case(rng: random.Random):
    n = rng.randint(1, 5)
    ws = [WorkerBudget(f"w{i}", rng.choice([None, 0, 8 * GB, 16 * GB])) for i in range(n)]
    models = [
        ModelDemand(
            f"m{j}",
            rng.choice([0.0, round(rng.random(), 3), round(rng.random(), 1)]),
            rng.choice([0, GB, 3 * GB, 7 * GB]),
        )
        for j in range(rng.randint(0, 12))
    ]
    policy = PlacementPolicy(
        default_replicas=rng.choice([1, 1, 2, ALL_REPLICAS]),
        replicas={m.name: rng.choice([1, 2, 3]) for m in models if rng.random() < 0.3},
        hysteresis=rng.choice([0.0, 0.1, 0.5]),
        forbid_memory_oversubscription=rng.random() < 0.7,
    )
    return models, ws, policy


def test_property_invariants_hold_on_random_fleets():
    rng = random.Random(7)
    for _ in range(300):
        models, ws, policy = _random_case(rng)
        result = compute_placement(models, ws, None, policy)
        assert set(result.placements) == {m.name for m in models}
        for m in models:
            p = result.placements[m.name]
            assert len(p.workers) == policy.effective(m.name, len(ws))
            assert len(set(p.workers)) == len(p.workers) and list(p.workers) == sorted(p.workers)
            assert sum(p.weights) == pytest.approx(1.0)
        for w in ws:
            on = [m for m in models if w.name in result.placements[m.name].workers]
            assert result.assigned_bytes[w.name] == sum(m.weight_bytes for m in on)
            share = sum(m.utilization / len(result.placements[m.name].workers) for m in on)
            assert result.compute_load[w.name] == pytest.approx(share)
            over = bool(w.budget_bytes) and result.assigned_bytes[w.name] > w.budget_bytes
            assert over == (w.name in result.oversubscribed)


def test_property_repacking_its_own_result_moves_nothing():
    rng = random.Random(11)
    for _ in range(300):
        models, ws, policy = _random_case(rng)
        first = compute_placement(models, ws, None, policy)
        again = compute_placement(models, ws, first.assignment(), policy)
        assert again.assignment() == first.assignment()
        assert again.moved == 0 and again.changed_workers == ()


def test_property_input_order_does_not_matter():
    rng = random.Random(3)
    for _ in range(100):
        models, ws, policy = _random_case(rng)
        reference = compute_placement(models, ws, None, policy).assignment()
        for _ in range(3):
            rng.shuffle(models)
            rng.shuffle(ws)
            assert compute_placement(models, ws, None, policy).assignment() == reference


def test_property_single_replica_compute_is_within_one_model_of_the_mean():
    """List scheduling bound: without memory, max load <= mean + largest demand."""
    rng = random.Random(5)
    for _ in range(300):
        n = rng.randint(1, 6)
        u = {f"m{j}": rng.random() for j in range(rng.randint(1, 20))}
        result = compute_placement(demands(u), workers(n))
        bound = sum(u.values()) / n + max(u.values())
        assert max(result.compute_load.values()) <= bound + 1e-9
