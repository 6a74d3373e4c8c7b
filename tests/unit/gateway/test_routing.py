"""Request routing (rsrv.gateway._routing, rsrv.gateway._fill): round robin, least
outstanding, and lpt_packing's fill router with its reference vectors and closed loops."""

from __future__ import annotations

import random
from collections import Counter, deque

import pytest

from rsrv.gateway._costs import ModelMeta, RoutingMeta
from rsrv.gateway._fill import (
    INFLIGHT_WARNING,
    FillMode,
    FillPlan,
    FillRouter,
    FillSettings,
    ModelFill,
    fill_mode_warning,
    fill_quantum,
)
from rsrv.gateway._routing import (
    InflightLedger,
    LeastOutstandingRouter,
    RoundRobinRouter,
    WorkBasis,
)

W2 = ["w0", "w1"]


def fill_router(
    n: int = 2,
    *,
    max_batch: int = 8,
    mode: str = "run",
    policy: str = "fill_least",
    basis: str = "items",
    factor: float = 1.0,
    models: tuple[str, ...] = ("m",),
) -> tuple[FillRouter, list[str]]:
    ws = [f"w{i}" for i in range(n)]
    meta = RoutingMeta(models={m: ModelMeta(m, max_batch=max_batch) for m in models})
    router = FillRouter(FillSettings(mode=mode, factor=factor), policy, basis, meta)
    router.set_placement({m: ws for m in models})
    return router, ws


def closed_loop(router: FillRouter, ws: list[str], clients: int, steps: int) -> list[int]:
    """``clients`` requests always in flight: each step the oldest finishes, one is routed."""
    live: deque = deque()
    routed: Counter = Counter()
    for _ in range(steps):
        if len(live) == clients:
            live.popleft().release()
        ticket = router.route("m", ws)
        routed[ticket.worker] += 1
        live.append(ticket)
    return [routed[w] for w in ws]


# -- round robin -------------------------------------------------------------------------------


def test_round_robin_rotates_per_model_with_the_rest_as_failover():
    router = RoundRobinRouter()
    orders = [router.route("a", ["w2", "w0", "w1"]).order for _ in range(4)]
    assert orders == [
        ["w0", "w1", "w2"],
        ["w1", "w2", "w0"],
        ["w2", "w0", "w1"],
        ["w0", "w1", "w2"],
    ]
    assert router.route("b", ["w0", "w1"]).order == ["w0", "w1"]  # its own cursor
    assert router.ledger.arrivals() == {"a": 4, "b": 1}


def test_round_robin_rejects_no_replica_and_bad_units():
    with pytest.raises(ValueError):
        RoundRobinRouter().route("a", [])
    with pytest.raises(ValueError):
        RoundRobinRouter().route("a", W2, 0)


# -- least outstanding -------------------------------------------------------------------------


def test_least_outstanding_picks_the_least_loaded_ties_to_the_smaller_name():
    router = LeastOutstandingRouter("requests")
    first = router.route("m", ["w1", "w0"])
    assert first.order == ["w0", "w1"]
    second = router.route("m", W2)
    assert second.order == ["w1", "w0"]
    first.release()
    assert router.route("m", W2).worker == "w0"


def test_least_outstanding_compares_in_nanoseconds():
    meta = RoutingMeta(
        models={
            "a": ModelMeta("a", cost_per_item=0.1),
            "b": ModelMeta("b", cost_per_item=0.2),
            "c": ModelMeta("c", cost_per_item=0.3),
        }
    )
    router = LeastOutstandingRouter("compute", meta)
    assert router.route("c", ["w0"]).charge == 0.3  # w0: 0.3
    router.route("a", ["w1"])
    router.route("b", ["w1"])  # w1: 0.1 + 0.2 = 0.30000000000000004
    assert router.ledger.load("w1") != router.ledger.load("w0")
    assert router.route("a", W2).worker == "w0"  # equal after quantizing: smaller name


@pytest.mark.parametrize(
    ("basis", "expected"), [("requests", 1.0), ("items", 4.0), ("compute", 4 * 0.25)]
)
def test_least_outstanding_charges_by_work_basis(basis, expected):
    meta = RoutingMeta(models={"m": ModelMeta("m", cost_per_item=0.25)})
    router = LeastOutstandingRouter(basis, meta)
    ticket = router.route("m", W2, units=4)
    assert ticket.charge == expected and router.ledger.load("w0") == expected
    assert router.ledger.outstanding("m", "w0") == 4
    assert router.needs_units == (basis != "requests")
    assert router.needs_control == (basis != "requests")
    with pytest.raises(ValueError):
        router.work_basis = "bytes"


# -- ledger and tickets ------------------------------------------------------------------------


def test_tickets_release_once_and_drained_counters_snap_to_zero():
    meta = RoutingMeta(models={"m": ModelMeta("m", cost_per_item=0.1)})
    router = LeastOutstandingRouter("compute", meta)
    tickets = [router.route("m", ["w0"]) for _ in range(3)]
    assert router.ledger.load("w0") == pytest.approx(0.3)
    tickets[0].release()
    tickets[1].release()
    assert router.ledger.load("w0") == pytest.approx(0.1)
    assert tickets[2].release() is True
    assert tickets[2].release() is False  # a second release does nothing
    assert router.ledger.load("w0") == 0.0 and router.ledger.loads() == {}
    assert router.ledger.outstanding("m", "w0") == 0
    assert router.ledger.model_outstanding("m") == 0
    assert router.ledger.routed("m", "w0") == 3


def test_a_ticket_is_a_context_manager():
    router = RoundRobinRouter()
    with router.route("m", W2, units=5) as ticket:
        assert ticket.live and router.ledger.outstanding("m", "w0") == 5
        assert repr(ticket) == "Ticket('m' -> 'w0', units=5, live)"
    assert not ticket.live and router.ledger.outstanding("m", "w0") == 0


def test_redirect_moves_the_charge_to_the_failover_worker():
    ledger = InflightLedger()
    router = LeastOutstandingRouter("items", ledger=ledger)
    ticket = router.route("m", W2, units=3)
    assert ticket.order == ["w0", "w1"]
    ticket.redirect("w1")
    assert (ledger.load("w0"), ledger.load("w1")) == (0.0, 3.0)
    assert (ledger.outstanding("m", "w0"), ledger.outstanding("m", "w1")) == (0, 3)
    assert (ledger.routed("m", "w0"), ledger.routed("m", "w1")) == (1, 1)
    assert ledger.arrivals() == {"m": 1}
    ticket.release()
    ticket.redirect("w0")  # released: nothing to move
    assert ledger.loads() == {} and ledger.inflight("w0") == 0


# -- fill router: reference vectors -------------------------------------------------------------


def test_a_quantum_held_in_flight_fills_one_replica_then_moves():
    router, ws = fill_router(max_batch=8)
    held = [router.route("m", ws) for _ in range(8)]
    assert {t.worker for t in held} == {"w0"}
    assert router.route("m", ws).worker == "w1"
    assert router.plan("m") == FillPlan(FillMode.RUN, 8)


def test_fill_factor_scales_the_run():
    router, ws = fill_router(max_batch=8, factor=1.5)
    assert router.plan("m").quantum == 12
    workers = [router.route("m", ws).worker for _ in range(13)]
    assert workers == ["w0"] * 12 + ["w1"]


def test_a_request_that_does_not_fit_what_is_left_of_the_run_opens_the_next():
    """7 rows then 4 of Q = 8 could never share a batch: the 4 go to the other replica
    (they made an 11-row run before, two batches on one worker beside an idle one); a
    request of Q or more goes alone, as a run of its own."""
    router, ws = fill_router(max_batch=8)
    first, second = router.route("m", ws, 7), router.route("m", ws, 4)
    assert (first.worker, second.worker) == ("w0", "w1")
    assert second.run.opened and second.run.units == 4
    assert router.route("m", ws, 4).worker == "w1"  # 8: fits exactly
    big = router.route("m", ws, 9)
    assert big.run.opened and big.run.units == 9
    assert router.route("m", ws, 1).run.opened  # nothing fits a full run


def test_fill_rr_alternates_when_each_request_finishes_first():
    router, ws = fill_router(policy="fill_rr")
    seen = []
    for _ in range(4):
        ticket = router.route("m", ws)
        seen.append(ticket.worker)
        ticket.release()
    assert seen == ["w0", "w1", "w0", "w1"]


def test_closed_loop_of_two_clients_run_shares_and_inflight_parks():
    assert closed_loop(*fill_router(mode="run"), clients=2, steps=400) == [200, 200]
    assert closed_loop(*fill_router(mode="inflight"), clients=2, steps=400) == [400, 0]


@pytest.mark.parametrize("mode", ["run", "spread"])
@pytest.mark.parametrize("policy", ["fill_least", "fill_rr"])
@pytest.mark.parametrize("basis", ["items", "compute", "requests"])
def test_closed_loops_share_evenly_within_a_quantum(mode, policy, basis):
    for clients in (1, 2, 4, 7, 8, 9, 16, 24):
        for n in (2, 3, 4):
            router, ws = fill_router(n, mode=mode, policy=policy, basis=basis)
            shares = closed_loop(router, ws, clients, 400)
            assert all(s > 0 for s in shares), (clients, n, shares)
            assert all(abs(s - 400 / n) <= 8 for s in shares), (clients, n, shares)


def test_quantum_32_runs_count_items():
    router, ws = fill_router(max_batch=32)
    assert router.route("m", ws, units=32).worker == "w0"
    assert router.route("m", ws).worker == "w1"  # the 32-item request closed the run

    router, ws = fill_router(max_batch=32)
    assert {router.route("m", ws).worker for _ in range(32)} == {"w0"}
    assert router.route("m", ws).worker == "w1"

    router, ws = fill_router(max_batch=32)
    assert [router.route("m", ws, units=u).worker for u in (16, 8, 8)] == ["w0"] * 3
    assert router.route("m", ws).worker == "w1"


@pytest.mark.parametrize("policy", ["fill_least", "fill_rr"])
def test_spread_weighs_items_not_requests(policy):
    router, ws = fill_router(max_batch=32, mode="spread", policy=policy)
    assert router.route("m", ws, units=32).worker == "w0"
    assert router.route("m", ws).worker == "w1"
    assert router.route("m", ws).worker == "w1"
    assert router.route("m", ws).worker == "w1"  # 32 items on w0 outweigh 2 on w1


def test_compute_basis_charges_cost_per_item():
    meta = RoutingMeta(
        models={
            "dear": ModelMeta("dear", cost_per_item=1.0, max_batch=32),
            "m": ModelMeta("m", cost_per_item=0.01, max_batch=32),
        }
    )
    placement = {"dear": W2, "m": W2, "cold": W2}
    router = FillRouter(work_basis="compute", meta=meta)
    router.set_placement(placement)
    assert router.route("dear", W2, units=8).worker == "w0"
    assert router.route("m", W2, units=32).worker == "w1"
    assert router.ledger.load("w0") == 8.0
    assert router.ledger.load("w1") == pytest.approx(0.32)
    assert router.route("cold", W2).charge == pytest.approx(0.505)  # the fleet mean

    router = FillRouter(work_basis="items", meta=meta)
    router.set_placement(placement)
    router.route("dear", W2, units=8)
    assert router.route("m", W2, units=32).worker == "w1"
    assert (router.ledger.load("w0"), router.ledger.load("w1")) == (8.0, 32.0)


def test_requests_basis_charges_cost_per_request_not_per_item():
    meta = RoutingMeta(models={"m": ModelMeta("m", cost_per_request=0.5, cost_per_item=0.1)})
    router = FillRouter(work_basis="requests", meta=meta)
    router.set_placement({"m": W2})
    assert router.route("m", W2, units=8).charge == 0.5


# -- fill router: replica sets, failover, state --------------------------------------------


def test_a_single_replica_still_reserves_counters():
    router, _ = fill_router(1)
    ticket = router.route("m", ["w0", "w5"], units=3)
    assert ticket.order == ["w0", "w5"]  # the placed replica, then the discovered rest
    assert router.ledger.outstanding("m", "w0") == 3 and router.ledger.load("w0") == 3.0


def test_failover_order_is_chosen_then_fullness_then_outside_the_placement():
    router, _ = fill_router(3, max_batch=2, mode="spread")
    discovered = ["w0", "w1", "w2", "x9", "x1"]
    router.route("m", discovered, units=3)  # w0: 3 items (bucket 1)
    router.route("m", discovered, units=1)  # w1: 1 item (bucket 0)
    ticket = router.route("m", discovered)  # w2 chosen (0 items)
    assert ticket.order == ["w2", "w1", "w0", "x1", "x9"]


def test_placed_workers_not_discovered_are_skipped():
    router, _ = fill_router(3)
    assert router.route("m", ["w2", "x"]).order == ["w2", "x"]


def test_unplaced_models_go_round_robin_over_discovered_routes():
    router, _ = fill_router()
    orders = [router.route("new", ["a", "b"]).order for _ in range(3)]
    assert orders == [["a", "b"], ["b", "a"], ["a", "b"]]
    assert router.ledger.outstanding("new", "a") == 2  # still charged


def test_inflight_counts_survive_a_new_placement():
    router, ws = fill_router(3)
    held = [router.route("m", ws) for _ in range(3)]  # a run on w0
    router.set_placement({"m": ["w0", "w2"]})
    assert router.route("m", ["w0", "w1", "w2"]).order == ["w0", "w2", "w1"]  # run continues
    router.set_placement({"m": ["w1", "w2"]})
    ticket = router.route("m", ["w0", "w1", "w2"])
    assert ticket.worker == "w1" and ticket.order[-1] == "w0"  # target gone: a new run
    for t in held:
        t.release()
    assert router.ledger.outstanding("m", "w0") == 1


def test_run_reopens_when_the_model_drains():
    router, ws = fill_router(max_batch=8)
    first = router.route("m", ws)
    first.release()
    assert router.route("m", ws).worker == "w1"  # nothing in flight: a new run, rotated


def test_a_behind_target_gives_up_its_run():
    router, ws = fill_router(max_batch=4)
    assert router.route("m", ws, units=4).worker == "w0"  # w0: 4 items, run full
    assert router.route("m", ws).worker == "w1"  # a new run on w1
    big = router.route("m", ws, units=4)
    assert big.worker == "w1"  # the run goes on: w1 holds 5 items
    assert router.route("m", ws).worker == "w0"  # run full: w0 (4 items) is less loaded
    big.release()  # w1 drops to 1 item: w0 (5 items, bucket 1) is now behind
    assert router.route("m", ws).worker == "w1"  # the run on w0 (1 of 4 items) gives up


def test_fill_least_prefers_the_worker_other_models_leave_idle():
    router, ws = fill_router(models=("m", "busy"))
    router.route("busy", ["w0"], units=5)
    assert router.route("m", ws).worker == "w1"
    router_rr, ws = fill_router(policy="fill_rr", models=("m", "busy"))
    router_rr.route("busy", ["w0"], units=5)
    assert router_rr.route("m", ws).worker == "w0"  # load-blind


def test_inflight_cursor_moves_only_on_ties():
    router, ws = fill_router(3, mode="inflight", policy="fill_rr")
    first = router.route("m", ws)
    second = router.route("m", ws)
    assert (first.worker, second.worker) == ("w0", "w0")  # the fuller wins: no tie
    first.release()
    second.release()
    third = router.route("m", ws)
    assert third.worker == "w1"  # a genuine tie: rotates on from w0
    third.release()
    assert router.route("m", ws).worker == "w2"


# -- plans and settings -------------------------------------------------------------------------


def test_quantum_rounding_and_unknown_max_batch():
    assert fill_quantum(1.0, 8) == 8
    assert fill_quantum(1.5, 8) == 12
    assert fill_quantum(0.25, 2) == 1  # round(0.5) is 0: at least 1
    assert fill_quantum(1.25, 2) == 2  # round(2.5) is 2: ties to even
    assert fill_quantum(3.0, 0) == 1 and fill_quantum(3.0, -1) == 1
    with pytest.raises(ValueError):
        fill_quantum(0.0, 8)


def test_per_model_overrides_and_warnings():
    settings = FillSettings(
        mode="run",
        factor=1.0,
        models={"s": ModelFill(mode="spread"), "f": ModelFill(factor=0.5), "i": ModelFill()},
    )
    assert settings.plan("s", 8) == FillPlan(FillMode.SPREAD, 8)
    assert settings.plan("f", 8) == FillPlan(FillMode.RUN, 4)
    assert settings.plan("i", 8) == FillPlan(FillMode.RUN, 8)
    assert fill_mode_warning("inflight") == INFLIGHT_WARNING
    assert fill_mode_warning(FillMode.RUN) is None
    with pytest.raises(ValueError):
        FillSettings(mode="sideways")
    with pytest.raises(ValueError):
        ModelFill(factor=-1)
    with pytest.raises(ValueError):
        FillRouter(policy="fill_most")


def test_fill_router_validates_requests():
    router, ws = fill_router()
    with pytest.raises(ValueError):
        router.route("m", [])
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            router.route("m", ws, bad)
    assert WorkBasis("compute") is WorkBasis.COMPUTE


# -- properties ---------------------------------------------------------------------------------


def test_property_ledger_balances_under_random_traffic():
    rng = random.Random(9)
    meta = RoutingMeta(
        models={
            "a": ModelMeta("a", cost_per_item=0.013, max_batch=8),
            "b": ModelMeta("b", cost_per_item=0.7, max_batch=3),
        }
    )
    ws = ["w0", "w1", "w2"]
    router = FillRouter(FillSettings(mode="run"), "fill_least", "compute", meta)
    router.set_placement({"a": ws, "b": ws[:2]})
    live = []
    for step in range(3000):
        if live and rng.random() < 0.5:
            live.pop(rng.randrange(len(live))).release()
        else:
            model = rng.choice(["a", "b", "c"])
            ticket = router.route(model, rng.sample(ws, rng.randint(1, 3)), rng.randint(1, 9))
            assert len(ticket.order) == len(set(ticket.order)) and ticket.order[0] == ticket.worker
            if rng.random() < 0.1:
                ticket.redirect(rng.choice(ticket.order))
            live.append(ticket)
        if step % 500 == 0:
            router.settings = FillSettings(mode=rng.choice(list(FillMode)))
            router.work_basis = rng.choice(list(WorkBasis))
        for w in ws:
            mine = [t for t in live if t.worker == w]
            assert router.ledger.inflight(w) == len(mine)
            assert router.ledger.load(w) == pytest.approx(sum(t.charge for t in mine))
            for m in ("a", "b", "c"):
                items = sum(t.units for t in mine if t.model == m)
                assert router.ledger.outstanding(m, w) == items
    for t in live:
        t.release()
    assert router.ledger.loads() == {}
    assert all(router.ledger.model_outstanding(m) == 0 for m in ("a", "b", "c"))


def test_property_run_mode_shares_items_evenly_with_mixed_request_sizes():
    rng = random.Random(4)
    for _ in range(20):
        n, clients = rng.randint(2, 4), rng.randint(1, 24)
        router, ws = fill_router(n, max_batch=8)
        live: deque = deque()
        items: Counter = Counter()
        for _ in range(1000):
            if len(live) == clients:
                live.popleft().release()
            ticket = router.route("m", ws, units=rng.randint(1, 4))
            items[ticket.worker] += ticket.units
            live.append(ticket)
        total = sum(items.values())
        assert all(abs(items[w] - total / n) <= 4 * 8 for w in ws), (n, clients, items)
