"""The scheduling front (rsrv.gateway._scheduling) over a fleet of scripted workers: a
placement made while part of the fleet was still coming up is redone once it is up, a
malformed batch input is INVALID_ARGUMENT, each worker's discipline is checked the first
time it reports, the first placement can wait for the whole fleet, and what is kept per
model is dropped once the model has left every worker."""

from __future__ import annotations

import pytest
from support.gateway import fleet_of, packed, serve_models

from rsrv.config import SchedulingConfig
from rsrv.errors import InvalidArgument
from rsrv.gateway._fleet import Fleet
from rsrv.gateway._peek import peek_infer
from rsrv.gateway._scheduling import Scheduling


def lpt(fleet: Fleet, **settings) -> Scheduling:
    return Scheduling(SchedulingConfig(mode="lpt_packing", **settings), fleet)


def firsts(scheduling: Scheduling, fleet: Fleet, model: str, n: int = 20) -> set[str]:
    """The workers ``n`` requests, each answered before the next, go to first."""
    chosen = set()
    for _ in range(n):
        ticket = scheduling.route(model, None, fleet.routes[model])
        chosen.add(ticket.order[0])
        ticket.release()
    return chosen


def test_a_placement_made_while_a_worker_came_up_is_redone_once_it_is_up():
    fleet = fleet_of("w0", "w1")
    serve_models(fleet.workers[0], ["m"])
    fleet.rebuild_routes()
    scheduling = lpt(fleet, default_replicas="all")
    assert scheduling.tick().window.trigger == "startup"
    assert firsts(scheduling, fleet, "m") == {"w0"}
    serve_models(fleet.workers[1], ["m"])  # w1 finished starting
    fleet.rebuild_routes()
    assert scheduling.tick() is None  # a round to settle
    assert scheduling.tick().window.trigger == "fleet"
    assert firsts(scheduling, fleet, "m") == {"w0", "w1"}


def test_a_malformed_batch_input_is_invalid_argument():
    _, scheduling = packed("w0", "w1")
    head = peek_infer(b"\x0a\x01m" + b"\x2a\x01\x80")  # input 1: a truncated varint
    with pytest.raises(InvalidArgument, match="malformed ModelInferRequest"):
        scheduling.route("m", head, ("w0", "w1"))
    assert scheduling.ledger.model_outstanding("m") == 0


def test_each_workers_discipline_is_checked_when_it_first_reports():
    fleet = fleet_of("w0", "w1", "w2")
    serve_models(fleet.workers[0], ["m"], discipline="fair")  # w1 and w2 are not up (yet)
    fleet.rebuild_routes()
    scheduling = lpt(fleet)
    scheduling.tick()
    assert len(scheduling.warnings) == 1 and "worker w0 runs 'fair'" in scheduling.warnings[0]
    serve_models(fleet.workers[1], ["m"])
    serve_models(fleet.workers[2], ["m"], discipline="fair")
    fleet.rebuild_routes()
    scheduling.tick()
    scheduling.tick()  # each worker once
    assert len(scheduling.warnings) == 2 and "worker w2 runs 'fair'" in scheduling.warnings[1]
    scheduling.forget_worker("w0")  # it left the fleet (DNS)
    assert len(scheduling.warnings) == 1 and "worker w2" in scheduling.warnings[0]


def test_a_worker_restarted_with_another_discipline_is_checked_again():
    fleet, scheduling = packed("w0", "w1")
    assert scheduling.warnings == []
    serve_models(fleet.workers[1], ["m"], discipline="fair")  # restarted as fair
    scheduling.tick()
    assert len(scheduling.warnings) == 1 and "worker w1 runs 'fair'" in scheduling.warnings[0]
    serve_models(fleet.workers[1], ["m"], discipline="edf")  # and fixed
    scheduling.tick()
    assert scheduling.warnings == []


def test_the_first_placement_waits_for_every_configured_worker_when_asked():
    fleet = fleet_of("w0", "w1")
    serve_models(fleet.workers[0], ["m"])
    fleet.rebuild_routes()
    scheduling = Scheduling(SchedulingConfig(mode="lpt_packing"), fleet, startup_wait=60.0)
    assert scheduling.tick() is None  # w1 has not reported yet
    serve_models(fleet.workers[1], ["m"])
    fleet.rebuild_routes()
    assert scheduling.tick().window.trigger == "startup"


@pytest.mark.parametrize("mode", ["round_robin", "least_outstanding", "lpt_packing"])
def test_a_model_gone_from_every_worker_is_forgotten_once_nothing_is_in_flight(mode):
    fleet = fleet_of("w0")
    serve_models(fleet.workers[0], ["m", "gone"])
    fleet.rebuild_routes()
    scheduling = Scheduling(SchedulingConfig(mode=mode), fleet)
    scheduling.tick()
    scheduling.route("m", None, ("w0",)).release()
    held = scheduling.route("gone", None, ("w0",))
    serve_models(fleet.workers[0], ["m"])  # "gone" was unloaded
    fleet.rebuild_routes()
    scheduling.tick()
    assert set(scheduling.ledger.arrivals()) == {"m", "gone"}  # one still in flight
    held.release()
    scheduling.tick()
    assert set(scheduling.ledger.arrivals()) == {"m"}
    assert "gone" not in scheduling.meta.models
