"""Holding fill runs at the gateway (rsrv.gateway._hold), on trio's mock clock: a run
whose model has a run's worth in flight waits until it is full, or until its hold time
after it opened; a new run releases the one before; a lone client is never held; the
outcomes are counted."""

from __future__ import annotations

import trio
from support.gateway import fleet_of

from rsrv.config import SchedulingConfig
from rsrv.gateway._fleet import IndexRow
from rsrv.gateway._hold import RunHolds
from rsrv.gateway._scheduling import Scheduling
from rsrv.protocol.generated.rsrv.control.v1 import control_pb2 as cpb


def packing(hold: float) -> Scheduling:
    """lpt_packing over w0 and w1, both serving "m" (compiled up to a batch of 8: runs of
    8), both its replicas."""
    fleet = fleet_of("w0", "w1")
    for worker in fleet.workers:
        worker.ready = True
        worker.index = (IndexRow("m", "1", "READY", ""),)
        worker.control = cpb.ModelControlStatusResponse(
            discipline="fifo",
            models=[cpb.ModelStatus(name="m", state="READY", max_batch_size=8)],
        )
    fleet.rebuild_routes()
    scheduling = Scheduling(
        SchedulingConfig(
            mode="lpt_packing", default_replicas="all", routing_fill_hold_seconds=hold
        ),
        fleet,
    )
    scheduling.tick()  # the first placement
    return scheduling


def route(scheduling: Scheduling):
    return scheduling.route("m", None, ("w0", "w1"))


async def test_a_run_is_held_until_it_is_full(autojump_clock):
    scheduling = packing(hold=0.01)
    first = [route(scheduling) for _ in range(8)]  # a run of 8 in flight: never held
    assert {t.order[0] for t in first} == {"w0"} and all(t.hold is None for t in first)
    released: list[float] = []

    async def request() -> None:
        ticket = route(scheduling)
        assert ticket.order[0] == "w1" and ticket.hold is not None
        await ticket.hold.wait()
        released.append(trio.current_time())

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(7):
            nursery.start_soon(request)
            await trio.sleep(0.001)  # clients' answers come back apart
        assert released == []
        last = route(scheduling)  # the 8th: full, and the 7 go with it
        assert last.hold is None
    assert released == [start + 0.007] * 7
    holds = scheduling.holds
    assert holds.held == 7 and holds.outcomes == {"full": 1, "timeout": 0, "replaced": 0}


async def test_a_run_that_does_not_fill_goes_at_its_hold_time(autojump_clock):
    scheduling = packing(hold=0.01)
    first = [route(scheduling) for _ in range(8)]
    start = trio.current_time()
    held = [route(scheduling) for _ in range(3)]
    assert {t.hold for t in held} == {held[0].hold} and held[0].hold is not None
    for ticket in held:
        await ticket.hold.wait()
    assert trio.current_time() == start + 0.01
    assert scheduling.holds.outcomes == {"full": 0, "timeout": 1, "replaced": 0}
    late = route(scheduling)  # a late joiner of the same run goes at once
    assert late.hold is None
    for ticket in [*first, *held, late]:
        ticket.release()
    route(scheduling)  # nothing in flight: a new run, which retires the held one
    assert scheduling.holds.outcomes == {"full": 0, "timeout": 1, "replaced": 0}


async def test_a_request_waits_at_most_until_its_own_limit(autojump_clock):
    """A held request whose deadline leaves it less than the hold goes at the limit it is
    given (the forwarder gives half its time left); the others stay held, and the hold
    ends at its hold time."""
    scheduling = packing(hold=1.0)
    for _ in range(8):
        route(scheduling)
    start = trio.current_time()
    hurried, patient = route(scheduling), route(scheduling)
    await hurried.hold.wait(start + 0.15)
    assert trio.current_time() == start + 0.15 and not hurried.hold.opened
    assert scheduling.holds.outcomes == {"full": 0, "timeout": 0, "replaced": 0}
    await patient.hold.wait()
    assert trio.current_time() == start + 1.0
    assert scheduling.holds.outcomes == {"full": 0, "timeout": 1, "replaced": 0}


async def test_a_run_opened_unheld_is_never_held(autojump_clock):
    """Whether a run is held is decided when it opens: joiners that bring the model's
    units in flight up to a quantum later do not wait (the run may have opened long
    ago)."""
    scheduling = packing(hold=0.01)
    opener = route(scheduling)  # alone: not held
    await trio.sleep(1)
    joiners = [route(scheduling) for _ in range(7)]
    assert opener.hold is None and all(t.hold is None for t in joiners)
    assert scheduling.holds.held == 0


async def test_a_lone_client_is_never_held(autojump_clock):
    scheduling = packing(hold=0.01)
    for _ in range(20):  # one request in flight at a time: no run can fill
        ticket = route(scheduling)
        assert ticket.hold is None
        ticket.release()
    assert scheduling.holds.held == 0


async def test_a_new_run_or_a_new_hold_time_releases_what_is_held(autojump_clock):
    holds = RunHolds(seconds=0.01)
    gate = holds.gate("m", run=2, units=1, quantum=8, outstanding=11, opened=True)
    assert gate is not None and not gate.opened
    assert holds.gate("m", run=2, units=2, quantum=8, outstanding=12, opened=False) is gate
    assert holds.gate("m", run=3, units=1, quantum=8, outstanding=12, opened=True) is not None
    assert gate.opened and holds.outcomes["replaced"] == 1
    holds.configure(0.02)  # changed live: what is held goes now
    assert holds.outcomes["replaced"] == 2 and holds.held == 3
    late = holds.gate("m", run=4, units=1, quantum=8, outstanding=12, opened=True)
    await trio.sleep(0.05)
    holds.forget("m")  # the model left every worker, after the hold time: a timeout
    assert late.opened and holds.outcomes == {"full": 0, "timeout": 1, "replaced": 2}
    holds.configure(0)
    assert holds.gate("m", run=5, units=1, quantum=8, outstanding=99, opened=True) is None
