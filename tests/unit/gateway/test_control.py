"""The gateway's control service in process: a fill factor past its bound is refused
whole (nothing applied), by SetSchedulingPolicy and SetModelPlacement alike, and the
largest one allowed still routes; SetModelPlacement answers the replica counts the
status shows and counts as a change of the policy; a Repack's wait is clamped to its
cap."""

from __future__ import annotations

import math

import pytest
from support.gateway import FakeDiscovery, packed, serve_models

from rsrv.config import MAX_FILL_FACTOR
from rsrv.errors import InvalidArgument, NotFound
from rsrv.gateway._control import GatewayControl
from rsrv.protocol.generated.rsrv.gateway.v1 import gateway_pb2 as pb


@pytest.fixture
def control() -> GatewayControl:
    _, scheduling = packed("w0", "w1")  # "m", max batch 8
    return GatewayControl(scheduling, FakeDiscovery())


def routes(control: GatewayControl) -> None:
    s = control.scheduling
    s.route("m", None, s.fleet.routes["m"]).release()


def policy_factor(factor: float) -> pb.SetSchedulingPolicyRequest:
    return pb.SetSchedulingPolicyRequest(
        update_mask=["routing_fill_factor", "hysteresis"],
        policy=pb.SchedulingPolicy(routing_fill_factor=factor, hysteresis=0.5),
    )


@pytest.mark.parametrize("factor", [1e308, MAX_FILL_FACTOR * 1.01, float("inf")])
async def test_a_fill_factor_past_the_bound_is_refused_whole(control, factor):
    before = control.scheduling.config
    with pytest.raises(InvalidArgument, match="1000|must be a finite number, not inf"):
        await control.set_policy(policy_factor(factor), None)
    with pytest.raises(InvalidArgument, match="fill_factor must be > 0 and <= 1000"):
        await control.set_placement(pb.SetModelPlacementRequest(name="m", fill_factor=factor), None)
    assert control.scheduling.config is before and control.generation == 0
    routes(control)
    status = await control.status(pb.GetSchedulingStatusRequest(), None)
    assert [m.fill_quantum for m in status.models] == [8]


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
async def test_a_number_that_is_not_finite_is_refused_as_in_a_file(control, value):
    request = pb.SetSchedulingPolicyRequest(
        update_mask=["rebalance_compute_seconds"],
        policy=pb.SchedulingPolicy(rebalance_compute_seconds=value),
    )
    with pytest.raises(InvalidArgument, match="rebalance_compute_seconds must be a finite"):
        await control.set_policy(request, None)
    assert control.generation == 0


async def test_the_largest_fill_factor_routes(control):
    await control.set_policy(policy_factor(MAX_FILL_FACTOR), None)
    answer = await control.set_placement(
        pb.SetModelPlacementRequest(name="m", fill_factor=MAX_FILL_FACTOR), None
    )
    assert answer.fill_quantum == 8000
    routes(control)
    status = await control.status(pb.GetSchedulingStatusRequest(), None)
    assert [m.fill_quantum for m in status.models] == [8000]


@pytest.mark.parametrize(
    ("replicas", "configured", "effective"), [(None, 1, 1), (0, 1, 1), (-1, -1, 2), (5, 5, 2)]
)
async def test_set_placement_answers_the_counts_the_status_shows(
    control, replicas, configured, effective
):
    request = pb.SetModelPlacementRequest(name="m", fill_mode="spread")
    if replicas is not None:
        request.replicas = replicas
    answer = await control.set_placement(request, None)
    assert (answer.configured_replicas, answer.effective_replicas) == (configured, effective)
    clamped = f"{configured} replicas but 2 ready worker(s): clamped to 2"
    assert (clamped in answer.warnings) == (configured > 2)
    status = await control.status(pb.GetSchedulingStatusRequest(), None)
    (model,) = status.models
    # (the status gave the replicas placed, 1, until the next repack)
    assert (model.configured_replicas, model.effective_replicas) == (configured, effective)
    assert status.policy.generation == control.generation == 1


async def test_set_placement_waits_for_the_round_showing_a_model_just_loaded():
    """A load through the gateway, then set-replicas at once: it waits for the discovery
    round that shows the model (it answered NOT_FOUND), and is NOT_FOUND only when
    that round does not show it."""
    fleet, scheduling = packed("w0", "w1")

    def round_finds_n():
        for worker in fleet.workers:
            serve_models(worker, ["m", "n"])
        fleet.rebuild_routes()

    discovery = FakeDiscovery(on_refresh=round_finds_n)
    control = GatewayControl(scheduling, discovery)
    answer = await control.set_placement(pb.SetModelPlacementRequest(name="n", replicas=2), None)
    assert (answer.configured_replicas, answer.effective_replicas, discovery.refreshes) == (2, 2, 1)
    with pytest.raises(NotFound, match="model 'gone' is not served by any ready worker"):
        await control.set_placement(pb.SetModelPlacementRequest(name="gone", replicas=2), None)


@pytest.mark.parametrize("wait", [1e9, math.inf])
async def test_a_repack_wait_past_its_cap_is_clamped(autojump_clock, wait):
    """At most 120 s: an infinite wait too (it was refused "must be >= 0")."""
    _, scheduling = packed("w0", "w1")
    control = GatewayControl(scheduling, FakeDiscovery(on_wake=scheduling.tick))  # (a round ticks)
    answer = await control.repack(pb.RepackRequest(wait_seconds=wait), None)
    assert answer.completed and not answer.warnings


async def test_a_repack_wait_that_ends_first_says_so(autojump_clock):
    _, scheduling = packed("w0", "w1")
    control = GatewayControl(scheduling, FakeDiscovery())  # (no round runs)
    answer = await control.repack(pb.RepackRequest(wait_seconds=2), None)
    assert not answer.completed
    assert list(answer.warnings) == ["not completed within 2 s: it runs at a coming round"]


@pytest.mark.parametrize(("wait", "shown"), [(-1.0, "-1"), (math.nan, "nan")])
async def test_a_negative_or_nan_repack_wait_is_refused(control, wait, shown):
    with pytest.raises(InvalidArgument, match=f"wait_seconds must be a number >= 0, not {shown}$"):
        await control.repack(pb.RepackRequest(wait_seconds=wait), None)
