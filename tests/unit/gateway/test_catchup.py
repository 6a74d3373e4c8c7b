"""Catch-up against fake workers that keep state (the models and regions each holds, and
what the gateway sent them): replays read each worker afresh, survive changes made while
they run, run one at a time per worker, reach a worker that restarted during a replay,
that was taken out of the routes by a call, that became ready while a change was being
made, or that shed a replay, see a meta's sub-models, and forget an unregistered region
once no worker can hold it (but not one dropped while a replay ran)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import trio
from purerpc.grpclib.status import StatusCode
from support.gateway import FakeDiscovery, client_call, fleet_of, ok, worker_link

from rsrv.gateway._catchup import CatchUp
from rsrv.gateway._fleet import IndexRow, WorkerLink
from rsrv.gateway._forward import CONTROL, Relayed
from rsrv.gateway._services import GatewayServices
from rsrv.protocol import Admission
from rsrv.protocol.generated.inference import grpc_service_pb2 as pb
from rsrv.protocol.generated.rsrv.control.v1 import control_pb2 as cpb
from rsrv.transport import UnaryResult


def load(model: str) -> bytes:
    return pb.RepositoryModelLoadRequest(model_name=model).SerializeToString()


def unload(model: str) -> bytes:
    return pb.RepositoryModelUnloadRequest(model_name=model).SerializeToString()


def region(name: str, key: str = "/k") -> bytes:
    request = pb.SystemSharedMemoryRegisterRequest(name=name, key=key, byte_size=64)
    return request.SerializeToString()


#: The models of every fake worker's repository (its RepositoryIndex lists those not
#: loaded UNAVAILABLE, "unloaded", as an explicit-mode worker does).
REPOSITORY = frozenset({"a", "b", "c", "d", "m", "x", "y", "L", "gone", "held", "own", "part"})


@dataclass
class Process:
    """What one worker process holds."""

    models: set[str] = field(default_factory=set)
    loading: set[str] = field(default_factory=set)  # listed LOADING (its start-up loads)
    regions: dict[str, str] = field(default_factory=dict)  # name -> key
    residency: dict[str, int] = field(default_factory=dict)  # model -> residency floor
    weight: dict[str, float] = field(default_factory=dict)  # model -> fair-share weight
    trace: dict[str, list[str]] = field(default_factory=dict)  # TraceSetting's settings


class FakeWorkers:
    """The Forwarder's fan_out over fake worker processes: each call takes ``delay``
    seconds (``client_delay`` for the clients' fan-outs, sent to every ready worker; plus
    ``slow[worker]`` on that worker),
    then acts on the process the worker has at that moment. ``fail[(method, worker)]``
    is the status that call fails with; ``during[(method, model or region)]`` runs the
    first time that change is made. A worker answers ModelControlStatus when it has
    ``subs`` (the sub-models of its metas, listed there only), else UNIMPLEMENTED.
    ``sent`` records (method, model or region, worker)."""

    def __init__(self, *names: str, delay: float = 0.0, client_delay: float = 0.0):
        self.fleet = fleet_of(*names)
        self.discovery = FakeDiscovery()
        self.processes = {n: Process() for n in names}
        self.delay, self.client_delay = delay, client_delay
        self.slow: dict[str, float] = {}  # worker -> seconds more it takes to answer
        self.request_timeout = 60.0
        self.fail: dict[tuple[str, str], StatusCode] = {}
        self.subs: dict[str, set[str]] = {}
        self.during: dict[tuple[str, str], object] = {}
        self.sent: list[tuple[str, str, str]] = []
        self.repository = {n: set(REPOSITORY) for n in names}  # worker -> its models

    def worker(self, name: str) -> WorkerLink:
        return self.fleet.by_name[name]

    def ready(self, *names: str) -> None:
        for n in names:
            self.worker(n).ready = True

    def restart(self, name: str, models: set[str] = frozenset()) -> None:
        """A new process, with ``models`` (its start-up loads)."""
        self.processes[name] = Process(set(models))

    def changes(self, worker: str | None = None) -> list[tuple[str, str, str]]:
        """What changed state (loads, unloads, registrations), to ``worker`` or all."""
        reads = {"RepositoryIndex", "ModelControlStatus", "SystemSharedMemoryStatus"}
        return [s for s in self.sent if s[0] not in reads and worker in (None, s[2])]

    async def fan_out(self, path, body, metadata=None, deadline=None, workers=None):
        targets = list(self.fleet.ready if workers is None else workers)
        base = self.client_delay if workers is None else self.delay
        results, elapsed = {}, 0.0
        for w in sorted(targets, key=lambda w: self.slow.get(w.name, 0.0)):  # (stable)
            wait = base + self.slow.get(w.name, 0.0) - elapsed
            if wait > 0 or not elapsed:
                await trio.sleep(wait)
                elapsed += wait
            results[w.name] = self._act(path.rsplit("/", 1)[1], body, w.name)
        return results

    def _act(self, method: str, body: bytes, name: str) -> UnaryResult:
        process = self.processes[name]
        failure = self.fail.get((method, name))
        if failure is not None:
            self.sent.append((method, "", name))
            return UnaryResult(failure, "scripted failure")
        if method == "ModelControlStatus":
            if name not in self.subs:
                return UnaryResult(StatusCode.UNIMPLEMENTED, "no control service")
            models = [*process.models, *self.subs[name]]
            status = cpb.ModelControlStatusResponse(
                models=[cpb.ModelStatus(name=m, state="READY") for m in models]
            )
            return ok(status)
        if method == "RepositoryIndex":
            row = pb.RepositoryIndexResponse.ModelIndex
            rows = [row(name=m, state="READY") for m in process.models]
            rows += [row(name=m, state="LOADING") for m in process.loading]
            rows += [
                row(name=m, state="UNAVAILABLE", reason="unloaded")
                for m in self.repository[name] - process.models - process.loading
            ]
            index = pb.RepositoryIndexResponse(models=rows)
            self.sent.append((method, "", name))
            return ok(index)
        if method == "SystemSharedMemoryStatus":
            status = pb.SystemSharedMemoryStatusResponse()
            for n, key in process.regions.items():
                status.regions[n].CopyFrom(
                    pb.SystemSharedMemoryStatusResponse.RegionStatus(name=n, key=key, byte_size=64)
                )
            self.sent.append((method, "", name))
            return ok(status)
        if method == "RepositoryModelLoad":
            what = pb.RepositoryModelLoadRequest.FromString(body).model_name
            process.models.add(what)
        elif method == "RepositoryModelUnload":
            what = pb.RepositoryModelUnloadRequest.FromString(body).model_name
            process.models.discard(what)
        elif method == "SystemSharedMemoryRegister":
            request = pb.SystemSharedMemoryRegisterRequest.FromString(body)
            what = request.name
            process.regions[what] = request.key
        elif method == "SystemSharedMemoryUnregister":
            what = pb.SystemSharedMemoryUnregisterRequest.FromString(body).name
            process.regions.pop(what, None)
        elif method == "SetModelResidency":
            request = cpb.SetModelResidencyRequest.FromString(body)
            what = request.name
            process.residency[what] = request.residency
        elif method == "SetModelPolicy":
            request = cpb.SetModelPolicyRequest.FromString(body)
            what = request.name
            if what in process.loading:  # (as a worker refuses it)
                self.sent.append((method, what, name))
                return UnaryResult(StatusCode.UNAVAILABLE, f"model '{what}' is loading")
            if request.HasField("weight"):
                process.weight[what] = request.weight
        elif method == "TraceSetting":
            request = pb.TraceSettingRequest.FromString(body)
            for key, value in request.settings.items():
                process.trace[key] = list(value.value)
            what = ""
        elif method == "LogSettings":
            what = ""
        else:
            raise AssertionError(f"unexpected {method}")
        self.sent.append((method, what, name))
        self.during.pop((method, what), lambda: None)()
        return ok(b"")


def residency(model: str, floor: int) -> bytes:
    return cpb.SetModelResidencyRequest(name=model, residency=floor).SerializeToString()


def policy(model: str, weight: float | None = None) -> bytes:
    request = cpb.SetModelPolicyRequest(name=model)
    if weight is not None:
        request.weight = weight
    return request.SerializeToString()


def services_of(fake: FakeWorkers) -> GatewayServices:
    return GatewayServices(fake.fleet, fake, Admission(0), 4)


def one_worker(*models: str, delay: float = 0.0) -> tuple[FakeWorkers, CatchUp, WorkerLink]:
    """A ready worker "w0", and a catch-up that remembers loads of ``models``."""
    fake = FakeWorkers("w0", delay=delay)
    fake.ready("w0")
    catchup = CatchUp(fake)
    for model in models:
        catchup.loaded(model, load(model))
    return fake, catchup, fake.worker("w0")


async def test_a_replay_reads_the_worker_and_survives_changes_made_while_it_runs():
    fake, catchup, worker = one_worker("a", "b", "held")
    catchup.unloaded("gone", unload("gone"))
    fake.restart("w0", models={"held", "gone", "own"})

    def meanwhile():
        catchup.loaded("c", load("c"))
        catchup.unloaded("b", unload("b"))

    fake.during[("RepositoryModelLoad", "a")] = meanwhile
    await catchup.replay([worker])
    # "a" loaded; "b", unloaded meanwhile, is not; "held" is there already; "gone" is
    # unloaded; "own" (a start-up load) is left alone; "c", recorded meanwhile, waits
    # for the next catch-up.
    assert fake.changes() == [
        ("RepositoryModelLoad", "a", "w0"),
        ("RepositoryModelUnload", "gone", "w0"),
    ]
    assert fake.processes["w0"].models == {"a", "held", "own"}
    assert set(catchup.loads) == {"a", "held", "c"} and set(catchup.unloads) == {"b", "gone"}


async def test_one_replay_at_a_time_and_the_next_reads_what_the_first_did(autojump_clock):
    fake, catchup, worker = one_worker("a", delay=0.1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(catchup.replay, [worker])
        await trio.sleep(0.15)  # the first pass has read the index; its load is under way
        assert fake.changes() == []
        for _ in range(3):  # asked again while the first runs: once more, after it
            nursery.start_soon(catchup.replay, [worker])
        catchup.loaded("b", load("b"))  # recorded meanwhile
    # "a" once: the second pass reads the index again and finds it; then "b".
    assert fake.changes() == [
        ("RepositoryModelLoad", "a", "w0"),
        ("RepositoryModelLoad", "b", "w0"),
    ]
    assert not catchup._replaying
    await catchup.replay([worker])  # later, after it ended: nothing to do
    assert len(fake.changes()) == 2


async def test_a_worker_that_restarts_during_a_replay_gets_its_loads_again(autojump_clock):
    fake, catchup, worker = one_worker("a", "b", delay=1.0)
    async with trio.open_nursery() as nursery:

        def dies():  # "a" reached the process, which dies and comes back, and
            fake.restart("w0")  # discovery sees the new instance while the replay runs
            nursery.start_soon(catchup.replay, [worker])

        fake.during[("RepositoryModelLoad", "a")] = dies
        await catchup.replay([worker])
    assert [c[1] for c in fake.changes()] == ["a", "b", "a"]
    assert fake.processes["w0"].models == {"a", "b"}


async def test_a_replay_stops_when_its_worker_goes_away_or_leaves_the_fleet(autojump_clock):
    fake, catchup, old = one_worker("a", delay=1.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(catchup.replay, [old])
        await trio.sleep(0.5)
        fake.fleet.remove("w0")  # DNS dropped it, then lists it again: a new link
        new = worker_link("w0", 9, ready=True)
        fake.fleet.add(new)
        nursery.start_soon(catchup.replay, [new])  # not folded into the old link's replay
    # the old link's pass stops before its load (it read the index before the worker
    # left); the new link's loads it
    assert fake.changes() == [("RepositoryModelLoad", "a", "w0")]
    assert not catchup._replaying


async def test_a_worker_back_from_a_moment_away_that_missed_nothing_is_left_alone():
    """What was done on it directly stays (a pass undid it: loads and unloads made through
    the gateway were done again); one that restarted, or missed a change, is brought in
    line."""
    fake, catchup, worker = one_worker()
    worker.instance = "first"
    async with trio.open_nursery() as nursery:
        catchup.nursery = nursery
        catchup.start([worker])  # found: nothing recorded yet, so in line
        catchup.loaded("a", load("a"))  # through the gateway, done on w0
        fake.processes["w0"].models.add("a")
        catchup.missed({"w0": ok(b"")})
        catchup.unloaded("b", unload("b"))
        catchup.missed({"w0": ok(b"")})
        fake.processes["w0"].models = {"b"}  # an operator's change, on w0 directly
        catchup.start([worker])  # back from a moment away
        await trio.testing.wait_all_tasks_blocked()
        assert fake.changes() == [] and fake.processes["w0"].models == {"b"}

        worker.instance = "second"  # restarted: brought in line
        catchup.start([worker])
        await trio.testing.wait_all_tasks_blocked()
        assert fake.processes["w0"].models == {"a"}

        catchup.loaded("c", load("c"))  # missed: brought in line at once
        catchup.missed({})
        await trio.testing.wait_all_tasks_blocked()
        assert fake.processes["w0"].models == {"a", "c"}

        worker.ready = False  # away: not among the ready workers a load is sent to
        catchup.loaded("d", load("d"))
        catchup.missed({})
        worker.ready = True
        catchup.start([worker])  # back: it missed "d"
        await trio.testing.wait_all_tasks_blocked()
        assert fake.processes["w0"].models == {"a", "c", "d"}


async def test_a_holder_back_while_a_setting_is_made_gets_it(autojump_clock):
    """Away when the holders were chosen, back before the setting was recorded (no
    pass then: it had missed nothing yet): it is brought in line, not counted as done."""
    fake = FakeWorkers("w0", "w1", delay=1.0)
    fake.ready("w0", "w1")
    services = services_of(fake)
    catchup = services.catchup
    for i, worker in enumerate(fake.fleet.workers):
        worker.instance, worker.away = f"process {i}", False
        fake.processes[worker.name].models.add("a")
        worker.index = (IndexRow("a", "1", "READY", ""),)
    w1 = fake.worker("w1")
    async with trio.open_nursery() as nursery:
        catchup.nursery = nursery
        catchup.start(fake.fleet.workers)  # nothing recorded: both in line
        catchup.loaded("a", load("a"))
        catchup.missed({"w0": ok(b""), "w1": ok(b"")})
        fake.fleet.mark_unreachable(w1)  # a moment away (the same process)

        async def back():
            await trio.sleep(0.5)  # during the fan-out to the holders (w0)
            w1.ready = True
            catchup.start(fake.fleet.returned())  # (discovery's round)

        nursery.start_soon(back)
        call = client_call("SetModelResidency", CONTROL)
        await services.model_holders(residency("a", cpb.RESIDENCY_SYSTEM), call)
    assert fake.processes["w1"].residency == {"a": cpb.RESIDENCY_SYSTEM}


async def test_a_setting_right_after_a_replayed_load_reaches_that_worker():
    """A replay loads a model on a worker; a setting made before the next discovery round
    waits for it (the index read before the replay has no such model there: the worker
    was left out, and counted as having nothing to do)."""
    fake = FakeWorkers("w0", "w1")
    fake.ready("w0", "w1")
    services = services_of(fake)
    catchup = services.catchup
    w0, w1 = fake.fleet.workers

    def index_of(worker):
        models = fake.processes[worker.name].models
        return tuple(IndexRow(m, "1", "READY", "") for m in sorted(models))

    async def round_if_changed():  # (a discovery round: the indexes as they are now)
        if fake.discovery.changes:
            fake.discovery.changes = 0
            for worker in fake.fleet.workers:
                worker.index = index_of(worker)

    fake.discovery.changes_seen = round_if_changed
    for i, worker in enumerate(fake.fleet.workers):
        worker.instance, worker.away = f"process {i}", False
    async with trio.open_nursery() as nursery:
        catchup.nursery = nursery
        catchup.start([w0, w1])  # nothing recorded: both in line
        w1.ready = False  # away while "a" is loaded through the gateway
        fake.processes["w0"].models.add("a")
        catchup.loaded("a", load("a"))
        catchup.missed({"w0": ok(b"")})
        w0.index = index_of(w0)
        w1.ready = True  # back: its replay loads "a"
        catchup.start([w1])
        await trio.testing.wait_all_tasks_blocked()
        assert "a" in fake.processes["w1"].models and not w1.index
        call = client_call("SetModelResidency", CONTROL)
        await services.model_holders(residency("a", cpb.RESIDENCY_SYSTEM), call)
    assert fake.processes["w1"].residency == {"a": cpb.RESIDENCY_SYSTEM}


def trace(**settings: str) -> bytes:
    request = pb.TraceSettingRequest()
    for key, value in settings.items():
        request.settings[key].value.append(value)
    return request.SerializeToString()


async def test_trace_settings_made_through_the_gateway_reach_a_restarted_worker():
    """(reads, answered by one worker, disagreed: a restarted one had the defaults)"""
    fake, catchup, worker = one_worker()
    catchup.fleet_setting("TraceSetting", trace(trace_rate="7", trace_level="TIMESTAMPS"))
    catchup.fleet_setting("TraceSetting", trace(trace_rate="9"))
    fake.restart("w0")
    await catchup.replay([worker])
    assert fake.processes["w0"].trace == {"trace_rate": ["9"], "trace_level": ["TIMESTAMPS"]}


async def test_a_log_settings_read_is_not_a_change_to_catch_up():
    """A read (no settings) was recorded as an update: every later pass replayed it,
    and a worker back that had missed nothing looked out of line for good."""
    fake = FakeWorkers("w0")
    fake.ready("w0")
    services = services_of(fake)
    read = pb.LogSettingsRequest().SerializeToString()
    await services.log_settings(read, client_call("LogSettings"))
    assert not services.catchup and "LogSettings" not in services.catchup.fleet_settings
    update = pb.LogSettingsRequest()
    update.settings["log_verbose_level"].uint32_param = 1
    await services.log_settings(update.SerializeToString(), client_call("LogSettings"))
    assert services.catchup.fleet_settings["LogSettings"] == update.SerializeToString()


async def test_a_setting_not_kept_marks_no_worker_in_line():
    """A residency set while its model was unloaded is not kept (no change recorded);
    the workers that did it were still moved in line past the last recorded change,
    which w0 had missed (the unload), so a catch-up pass skipped it."""
    fake = FakeWorkers("w0")
    fake.ready("w0")
    services = services_of(fake)
    catchup, (w0,) = services.catchup, fake.fleet.workers
    w0.instance, w0.index = "process 0", (IndexRow("a", "1", "READY", ""),)
    assert catchup._known_in_line(w0)  # (nothing recorded yet)
    catchup.loaded("a", load("a"))
    catchup.missed({"w0": ok(b"")})  # w0 holds every change: the load
    fake.during[("SetModelResidency", "a")] = lambda: catchup.unloaded("a", unload("a"))
    call = client_call("SetModelResidency", CONTROL)
    await services.model_holders(residency("a", cpb.RESIDENCY_SYSTEM), call)
    assert "a" not in catchup.settings  # (the unload came between)
    assert not catchup._known_in_line(w0)  # it missed the unload


async def test_a_pass_stops_calling_a_worker_found_not_ready(autojump_clock):
    """(it went on, each load waiting out the request timeout)"""
    fake, catchup, worker = one_worker("a", "b", "c", delay=1.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(catchup.replay, [worker])
        await trio.sleep(3.5)  # the index and control status read, "a" loaded, "b" sent
        worker.ready = False
    assert [c[1] for c in fake.changes()] == ["a", "b"]


async def test_a_worker_a_call_found_unreachable_is_caught_up_when_it_is_back():
    fake = FakeWorkers("w0", "w1")
    fake.ready("w0", "w1")
    for w in fake.fleet.workers:
        w.away = False  # both caught up already
    services = services_of(fake)
    fake.fleet.mark_unreachable(fake.worker("w1"))  # a call failed to reach it
    async with trio.open_nursery() as nursery:
        services.catchup.nursery = nursery
        await services.model_load(load("x"), client_call("RepositoryModelLoad"))
        assert fake.changes() == [("RepositoryModelLoad", "x", "w0")]
        fake.ready("w1")  # the next discovery round finds it ready
        back = fake.fleet.returned()
        assert back == [fake.worker("w1")] and fake.fleet.returned() == []
        services.catchup.start(back)
    assert fake.changes("w1") == [("RepositoryModelLoad", "x", "w1")]


async def test_a_worker_ready_while_a_load_runs_is_brought_in_line_once_it_is_recorded(
    autojump_clock,
):
    fake = FakeWorkers("w0", "w1", client_delay=1.0)
    fake.ready("w0")
    services = services_of(fake)
    services.catchup.loaded("L", load("L"))
    async with trio.open_nursery() as nursery:
        services.catchup.nursery = nursery
        nursery.start_soon(services.model_load, load("x"), client_call("RepositoryModelLoad"))
        await trio.sleep(0.5)
        fake.ready("w1")  # a discovery round: newly ready, caught up with "L" at once
        services.catchup.start([fake.worker("w1")])
    # Its catch-up ran before "x" was recorded; brought in line once it was. "L" is
    # not loaded twice: the second replay reads the worker again.
    assert fake.changes("w1") == [
        ("RepositoryModelLoad", "L", "w1"),
        ("RepositoryModelLoad", "x", "w1"),
    ]


async def test_a_worker_that_failed_a_load_is_brought_in_line_once_it_is_recorded():
    fake = FakeWorkers("w0", "w1")
    fake.ready("w0", "w1")
    services = services_of(fake)
    real = fake._act

    def restarting(method, body, name):  # w1 dies during the load
        if name == "w1" and method == "RepositoryModelLoad" and not fake.changes("w1"):
            fake.restart("w1")
            fake.sent.append((method, "", name))
            return UnaryResult(StatusCode.UNAVAILABLE, "going away")
        return real(method, body, name)

    fake._act = restarting
    async with trio.open_nursery() as nursery:
        services.catchup.nursery = nursery
        with pytest.raises(Relayed, match="going away"):  # what the client sees
            await services.model_load(load("x"), client_call("RepositoryModelLoad"))
    assert fake.processes["w1"].models == {"x"}  # and the restarted worker has it


async def test_an_unregistered_region_is_forgotten_once_no_worker_can_hold_it():
    fake = FakeWorkers("w0", "w1")
    fake.ready("w0", "w1")
    services = services_of(fake)
    catchup = services.catchup
    register, unregister = (
        client_call("SystemSharedMemoryRegister"),
        client_call("SystemSharedMemoryUnregister"),
    )
    for name in ("r1", "r2"):
        await services.shm_register(region(name), register)
    await services.shm_unregister(
        pb.SystemSharedMemoryUnregisterRequest(name="r1").SerializeToString(), unregister
    )
    assert catchup.dropped == {}  # every worker got it: nothing to remember
    fake.worker("w1").ready = False  # away: it keeps "r2"
    await services.shm_unregister(
        pb.SystemSharedMemoryUnregisterRequest(name="r2").SerializeToString(), unregister
    )
    assert catchup.dropped == {"r2": {"w1"}}
    catchup.forget_worker("w2")  # another worker leaving the fleet changes nothing here
    assert catchup.dropped == {"r2": {"w1"}}
    fake.ready("w1")
    await catchup.replay([fake.worker("w1")])
    assert fake.processes["w1"].regions == {} and catchup.dropped == {}


async def test_a_region_unregistered_during_a_replay_is_not_forgotten(autojump_clock):
    fake = FakeWorkers("w0", "w1", delay=1.0)
    fake.ready("w0", "w1")
    services = services_of(fake)
    catchup = services.catchup
    register = client_call("SystemSharedMemoryRegister")
    await services.shm_register(region("R"), register)
    fake.worker("w1").ready = False
    await services.shm_register(region("R2"), register)  # w1 misses it
    fake.ready("w1")
    drop = pb.SystemSharedMemoryUnregisterRequest(name="R").SerializeToString()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(catchup.replay, [fake.worker("w1")])
        await trio.sleep(1.5)  # its region status is read; "R2" is being registered
        fake.fail[("SystemSharedMemoryUnregister", "w1")] = StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(Relayed):
            await services.shm_unregister(drop, client_call("SystemSharedMemoryUnregister"))
        del fake.fail[("SystemSharedMemoryUnregister", "w1")]
    # the pass that read the status before "R" was dropped does not forget it ...
    assert catchup.dropped == {"R": {"w1"}}
    await catchup.replay([fake.worker("w1")])  # ... so the next one removes it there
    assert set(fake.processes["w1"].regions) == {"R2"} and catchup.dropped == {}


async def test_a_catch_up_the_worker_shed_is_tried_again_at_the_next_round():
    fake, catchup, worker = one_worker("a")
    assert fake.fleet.returned() == [worker]
    fake.fail[("RepositoryIndex", "w0")] = StatusCode.RESOURCE_EXHAUSTED
    await catchup.replay([worker])
    assert fake.changes() == []
    del fake.fail[("RepositoryIndex", "w0")]
    assert fake.fleet.returned() == [worker]  # away again
    await catchup.replay([worker])
    assert fake.changes() == [("RepositoryModelLoad", "a", "w0")]
    assert fake.fleet.returned() == []


async def test_a_metas_sub_model_is_present_and_an_unread_control_status_loads_nothing():
    fake, catchup, worker = one_worker("part")  # loaded through the gateway; a meta calls it
    fake.subs["w0"] = {"part"}  # so only ModelControlStatus lists it
    await catchup.replay([worker])
    assert fake.changes() == []
    fake.subs["w0"] = set()
    fake.fail[("ModelControlStatus", "w0")] = StatusCode.PERMISSION_DENIED
    await catchup.replay([worker])
    assert fake.changes() == []  # it cannot tell: nothing is loaded
    del fake.fail[("ModelControlStatus", "w0")]
    await catchup.replay([worker])
    assert fake.changes() == [("RepositoryModelLoad", "part", "w0")]


async def test_a_failed_registration_is_undone_wherever_it_may_have_taken_effect():
    fake = FakeWorkers("w0", "w1", "w2")
    fake.ready("w0", "w1", "w2")
    services = services_of(fake)
    fake.processes["w2"].regions["r"] = "/theirs"  # registered there otherwise
    fake.fail[("SystemSharedMemoryRegister", "w1")] = StatusCode.DEADLINE_EXCEEDED
    fake.fail[("SystemSharedMemoryRegister", "w2")] = StatusCode.ALREADY_EXISTS
    with pytest.raises(Relayed):
        await services.shm_register(region("r"), client_call("SystemSharedMemoryRegister"))
    # undone on w0 (OK) and w1 (timed out: it may have registered), not on w2 (refused)
    undone = [c[2] for c in fake.changes() if c[0] == "SystemSharedMemoryUnregister"]
    assert sorted(undone) == ["w0", "w1"]
    assert fake.processes["w2"].regions == {"r": "/theirs"}
    assert "r" not in services.catchup.regions


async def test_an_undo_that_fails_is_left_to_catch_up():
    fake = FakeWorkers("w0", "w1")
    fake.ready("w0", "w1")
    services = services_of(fake)
    fake.fail[("SystemSharedMemoryRegister", "w1")] = StatusCode.INVALID_ARGUMENT
    fake.fail[("SystemSharedMemoryUnregister", "w0")] = StatusCode.INTERNAL
    async with trio.open_nursery() as nursery:
        services.catchup.nursery = nursery
        with pytest.raises(Relayed):
            await services.shm_register(region("r"), client_call("SystemSharedMemoryRegister"))
        assert services.catchup.dropped == {"r": {"w0"}}
        del fake.fail[("SystemSharedMemoryUnregister", "w0")]  # the replay it started
    assert fake.processes["w0"].regions == {} and services.catchup.dropped == {}


async def test_a_client_gone_mid_registration_leaves_no_stray_region(autojump_clock):
    fake = FakeWorkers("w0", "w1")
    fake.slow["w1"] = 1.0
    fake.ready("w0", "w1")
    services = services_of(fake)
    async with trio.open_nursery() as nursery:
        services.catchup.nursery = nursery
        with trio.move_on_after(0.5):  # the client's deadline, or its reset
            await services.shm_register(region("r"), client_call("SystemSharedMemoryRegister"))
        assert fake.processes["w0"].regions == {"r": "/k"}  # registered there, not on w1
    # catch-up brought both in line: the registration the client gave up on is gone
    assert all(p.regions == {} for p in fake.processes.values())
    assert "r" not in services.catchup.regions and services.catchup.dropped == {}


def test_a_worker_that_left_the_fleet_is_no_longer_waited_for():
    catchup = CatchUp(FakeWorkers("w0"))
    catchup.dropped = {"a": {"w0", "w1"}, "b": {"w1"}}
    catchup.forget_worker("w1")
    assert catchup.dropped == {"a": {"w0"}}


async def test_residency_and_policy_set_through_the_gateway_reach_a_restarted_worker():
    fake, catchup, worker = one_worker("a")
    catchup.set("a", "SetModelResidency", residency("a", cpb.RESIDENCY_DEVICE), 0)
    catchup.set("a", "SetModelResidency", residency("a", cpb.RESIDENCY_SYSTEM), 0)  # the last
    catchup.set("a", "SetModelPolicy", policy("a", weight=4.0), 0)
    catchup.set("a", "SetModelPolicy", policy("a"), 0)  # leaves the weight as it was
    catchup.set("b", "SetModelResidency", residency("b", cpb.RESIDENCY_SYSTEM), 0)  # not there
    await catchup.replay([worker])  # a restarted (explicit) worker: "a" loaded, then set
    assert fake.changes() == [
        ("RepositoryModelLoad", "a", "w0"),
        ("SetModelResidency", "a", "w0"),
        ("SetModelPolicy", "a", "w0"),
    ]
    process = fake.processes["w0"]
    assert process.residency == {"a": cpb.RESIDENCY_SYSTEM} and process.weight == {"a": 4.0}
    catchup.unloaded("a", unload("a"))  # unloaded: a later load starts with the defaults
    assert set(catchup.settings) == {"b"}
    # A setting sent before that unload, answered after it: not kept.
    catchup.set("a", "SetModelResidency", residency("a", cpb.RESIDENCY_SYSTEM), 0)
    assert set(catchup.settings) == {"b"}
    catchup.set("a", "SetModelResidency", residency("a", cpb.RESIDENCY_SYSTEM), 1)
    assert set(catchup.settings) == {"a", "b"}
    # No worker lists "b" (unloaded on the workers themselves): forgotten; "a" stays
    # while a worker lists it, and "c" while a load through the gateway brings it back.
    catchup.loaded("c", load("c"))
    catchup.set("c", "SetModelPolicy", policy("c", weight=2.0), 0)
    catchup.forget_absent({"a"}, every_worker_seen=True)
    assert set(catchup.settings) == {"a", "c"}


def test_unloads_of_models_no_worker_lists_are_forgotten_once_every_worker_is_seen():
    """Unloaded through the gateway, then deleted from the repositories: the unload is
    kept while a worker away might still hold the model, then forgotten (30k such
    models grew the gateway by 15 MB)."""
    catchup = CatchUp(FakeWorkers("w0"))
    for model in ("gone", "listed"):
        catchup.unloaded(model, unload(model))
    catchup.forget_absent({"listed"}, every_worker_seen=False)
    assert set(catchup.unloads) == {"gone", "listed"}
    catchup.forget_absent({"listed"}, every_worker_seen=True)
    assert set(catchup.unloads) == {"listed"}


def test_a_setting_sent_before_an_unload_whose_record_was_forgotten_is_not_kept():
    """A policy fan-out starts; meanwhile m is unloaded, deleted (its unload forgotten),
    created and loaded again: the policy, answered last, is not kept for the new load
    (with a per-model count forgotten back to 0, it was)."""
    catchup = CatchUp(FakeWorkers("w0"))
    mark = catchup.unload_mark("m")
    catchup.unloaded("m", unload("m"))
    catchup.forget_absent(set(), every_worker_seen=True)
    catchup.loaded("m", load("m"))
    catchup.set("m", "SetModelPolicy", policy("m", weight=2.0), mark)
    assert "m" not in catchup.settings
    catchup.set("m", "SetModelPolicy", policy("m", weight=2.0), catchup.unload_mark("m"))
    assert "m" in catchup.settings


async def test_a_holder_that_failed_a_setting_is_brought_in_line():
    fake = FakeWorkers("w0", "w1", "w2")
    fake.ready("w0", "w1", "w2")
    for name in ("w0", "w1"):  # w2 does not hold it: not asked
        fake.processes[name].models.add("a")
        fake.worker(name).index = (IndexRow("a", "1", "READY", ""),)
    for worker in fake.fleet.workers:
        worker.away = False
    services = services_of(fake)
    fake.fail[("SetModelResidency", "w1")] = StatusCode.UNAVAILABLE  # restarting
    async with trio.open_nursery() as nursery:
        services.catchup.nursery = nursery
        with pytest.raises(Relayed, match="w1"):
            call = client_call("SetModelResidency", CONTROL)
            await services.model_holders(residency("a", cpb.RESIDENCY_SYSTEM), call)
        del fake.fail[("SetModelResidency", "w1")]  # back: its catch-up sets it
    system = {"a": cpb.RESIDENCY_SYSTEM}
    assert [p.residency for p in fake.processes.values()] == [system, system, {}]


async def test_a_load_a_worker_has_no_such_model_for_is_done_where_it_can_be():
    """Workers whose repositories differ: the load is OK where the model is; a worker
    without it (NOT_FOUND) is left out of the answer and of catch-up."""
    fake = FakeWorkers("w0", "w1")
    fake.ready("w0", "w1")
    for worker in fake.fleet.workers:
        worker.away = False
    services = services_of(fake)
    fake.fail[("RepositoryModelLoad", "w1")] = StatusCode.NOT_FOUND
    async with trio.open_nursery() as nursery:
        services.catchup.nursery = nursery
        await services.model_load(load("x"), client_call("RepositoryModelLoad"))
    assert fake.changes() == [("RepositoryModelLoad", "x", "w0"), ("RepositoryModelLoad", "", "w1")]
    assert services.forward.discovery.changes == 1  # a round to route it at once
    fake.fail[("RepositoryModelLoad", "w0")] = StatusCode.NOT_FOUND
    with pytest.raises(Relayed) as info:  # nowhere: NOT_FOUND
        await services.model_load(load("y"), client_call("RepositoryModelLoad"))
    assert info.value.code == "NOT_FOUND"


async def test_a_client_gone_mid_unregistration_leaves_the_region_nowhere(autojump_clock):
    fake = FakeWorkers("w0", "w1")
    fake.ready("w0", "w1")
    services = services_of(fake)
    await services.shm_register(region("r"), client_call("SystemSharedMemoryRegister"))
    fake.slow["w1"] = 1.0
    drop = pb.SystemSharedMemoryUnregisterRequest(name="r").SerializeToString()
    async with trio.open_nursery() as nursery:
        services.catchup.nursery = nursery
        with trio.move_on_after(0.5):  # the client's deadline, or its reset
            await services.shm_unregister(drop, client_call("SystemSharedMemoryUnregister"))
        assert fake.processes["w1"].regions == {"r": "/k"}  # dropped on w0 only
    assert all(p.regions == {} for p in fake.processes.values())
    assert "r" not in services.catchup.regions and services.catchup.dropped == {}


async def test_a_region_unregistered_while_a_replay_registers_it_is_removed_there():
    """The client's unregister reaches the worker just before the replay's register of
    the same region: the replay sees the region dropped and removes it there."""
    fake, catchup, worker = one_worker()
    catchup.registered("r", region("r"))

    def client_unregisters() -> None:  # (its call found nothing there yet: OK)
        catchup.unregistered("r", {"w0": ok(b"")})

    fake.during[("SystemSharedMemoryRegister", "r")] = client_unregisters
    async with trio.open_nursery() as nursery:
        catchup.nursery = nursery
        await catchup.replay([worker])
    assert fake.processes["w0"].regions == {} and catchup.dropped == {}


async def test_a_model_unloaded_while_a_replay_loads_it_is_unloaded_there():
    fake, catchup, worker = one_worker("a")
    fake.during[("RepositoryModelLoad", "a")] = lambda: catchup.unloaded("a", unload("a"))
    await catchup.replay([worker])
    assert fake.processes["w0"].models == set()


# -- a change through the gateway while a replay on the same worker is under way ----------


async def replay(catchup: CatchUp, worker) -> None:
    async with trio.open_nursery() as nursery:
        catchup.nursery = nursery
        await catchup.replay([worker])


async def test_a_load_that_lands_before_the_replayed_unload_is_loaded_again():
    """The replay read the model present and unloads it (an unload through the gateway
    it missed); a client's load reaches the worker first: the next pass loads it."""
    fake, catchup, worker = one_worker()
    catchup.unloaded("a", unload("a"))
    fake.processes["w0"].models.add("a")  # (its own start-up load)
    fake.during[("RepositoryModelUnload", "a")] = lambda: catchup.loaded("a", load("a"))
    await replay(catchup, worker)
    assert fake.processes["w0"].models == {"a"}, fake.changes()


async def test_a_register_that_lands_before_the_replayed_unregister_is_registered_again():
    fake, catchup, worker = one_worker()
    fake.processes["w0"].regions["r"] = "/k"
    catchup.registered("r", region("r"))
    catchup.unregistered("r", {})  # w0 missed it
    fake.during[("SystemSharedMemoryUnregister", "r")] = lambda: catchup.registered(
        "r", region("r")
    )
    await replay(catchup, worker)
    assert fake.processes["w0"].regions == {"r": "/k"}, fake.changes()


async def test_settings_forgotten_by_an_unload_meanwhile_are_not_replayed():
    """Unloaded and loaded again through the gateway while the replay sends a model's
    settings: the new instance starts with the defaults (the rest are not sent)."""
    fake, catchup, worker = one_worker()
    fake.processes["w0"].models.add("a")
    catchup.loaded("a", load("a"))
    catchup.set("a", "SetModelResidency", residency("a", cpb.RESIDENCY_SYSTEM), 0)
    catchup.set("a", "SetModelPolicy", policy("a", weight=4.0), 0)

    def client_unloads_then_loads():
        worker0 = fake.processes["w0"]
        worker0.models.discard("a")
        worker0.residency.clear()
        worker0.weight.clear()
        catchup.unloaded("a", unload("a"))
        worker0.models.add("a")
        catchup.loaded("a", load("a"))

    fake.during[("SetModelResidency", "a")] = client_unloads_then_loads
    await replay(catchup, worker)
    assert catchup.settings == {} and fake.processes["w0"].weight == {}, fake.changes()


async def test_a_policy_for_a_model_still_loading_after_a_restart_is_set_once_it_is_ready():
    """A restarted static worker is ready while its own start-up loads run: the policy
    replayed then was refused ("is loading"), not tried again, and lost."""
    fake, catchup, worker = one_worker()
    assert fake.fleet.returned() == [worker]
    catchup.set("a", "SetModelPolicy", policy("a", weight=3.0), 0)
    fake.processes["w0"] = Process(loading={"a"})
    await catchup.replay([worker])
    assert fake.processes["w0"].weight == {} and fake.changes() == []
    assert fake.fleet.returned() == [worker]  # brought in line again at the next round
    fake.processes["w0"].loading.clear()
    fake.processes["w0"].models.add("a")
    await catchup.replay([worker])
    assert fake.processes["w0"].weight == {"a": 3.0}
    assert fake.fleet.returned() == []


async def test_a_load_is_not_replayed_on_a_worker_whose_repository_lacks_the_model():
    """Left out of catch-up, as of the load's answer: replayed at every pass it failed
    NOT_FOUND, and the worker was never in line."""
    fake, catchup, worker = one_worker("a", "x")
    assert fake.fleet.returned() == [worker]
    fake.repository["w0"].discard("x")
    await catchup.replay([worker])
    assert fake.changes() == [("RepositoryModelLoad", "a", "w0")]
    assert fake.fleet.returned() == []
    # one whose load writes the model's files is replayed: they create it there
    written = pb.RepositoryModelLoadRequest(model_name="x")
    written.parameters["file:1/model.mlir"].bytes_param = b"module {}"
    catchup.loaded("x", written.SerializeToString())
    await catchup.replay([worker])
    assert fake.changes()[-1] == ("RepositoryModelLoad", "x", "w0")
