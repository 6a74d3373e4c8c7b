"""Bringing a worker that (re)joins the fleet in line with what was done through the gateway.

System shared-memory registrations and explicit-mode model loads made through the gateway
go to every ready worker, residency and policy settings to every worker holding the
model; a worker away at the time (restarting, unreachable, or not yet discovered), or
that restarted since, missed them. :class:`CatchUp` remembers them, in the gateway's memory (a
restarted gateway starts with nothing to replay; a load request is kept whole, file
overrides included), and :meth:`CatchUp.replay` brings a worker in line when discovery
finds it ready again after being away, or restarted (its ModelControlStatus ``instance``
changed). Each pass reads the worker's state afresh (SystemSharedMemoryStatus,
RepositoryIndex, ModelControlStatus), then:

* a region registered through the gateway and missing there (or held otherwise) is
  registered; one unregistered through the gateway while it was away is unregistered
  there;
* a model loaded through the gateway and neither READY nor LOADING there is loaded with
  the same request (config overrides included); one unloaded through the gateway since
  and READY or LOADING there (its own start-up loads included) is unloaded;
* a model whose residency or policy was set through the gateway (SetModelResidency,
  SetModelPolicy: the last residency, the policy fields last set) and READY or LOADING
  there, after those loads, gets them again, over what a restarted worker is configured
  with; they are forgotten when the model is unloaded through the gateway, or when no
  worker lists it any more and no load through the gateway brings it back;
* the LogSettings and TraceSetting updates made through the gateway, merged, are sent.

A change is remembered once at least one worker accepted it; a ready worker it did not
reach, or that failed it, is brought in line once it is remembered (it may have become
ready, or restarted, while the change was being made). A worker back from a moment away
that missed nothing (the same ``instance``, known to hold every change recorded) gets no
pass, so that what was done on it directly meanwhile stays. Replays are the gateway's own
calls, sent with ``worker_client.headers`` (where a restricted protocol's header must then
be). Otherwise, what was done on a worker directly is left alone. Workers are brought in
line concurrently, one replay at a time per worker; a replay that fails is logged, and the
worker keeps serving what it has.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Collection, Mapping

import trio
from purerpc.grpclib.status import StatusCode

from rsrv.gateway._discovery import CONTROL_STATUS, REPOSITORY_INDEX
from rsrv.gateway._fleet import CallResult, WorkerLink
from rsrv.gateway._forward import CONTROL, INFERENCE, Forwarder
from rsrv.protocol.generated.inference import grpc_service_pb2 as pb
from rsrv.protocol.generated.rsrv.control.v1 import control_pb2 as control_pb
from rsrv.transport import UnaryResult

__all__ = ["CatchUp"]

log = logging.getLogger("rsrv.gateway")

_PRESENT = frozenset({"READY", "LOADING"})
_SETTING_REQUESTS = {"LogSettings": pb.LogSettingsRequest, "TraceSetting": pb.TraceSettingRequest}
#: Failures after which the worker is brought in line again at the next discovery round.
_TRANSIENT = frozenset({StatusCode.RESOURCE_EXHAUSTED, StatusCode.DEADLINE_EXCEEDED})


def _ok(result: CallResult | None) -> bool:
    return result is not None and result.status == StatusCode.OK


class CatchUp:
    """What a returning worker must be brought in line with; the gateway's services
    record each change at least one worker accepted."""

    def __init__(self, forward: Forwarder):
        self.forward = forward
        self.regions: dict[str, bytes] = {}  # name -> its register request
        # name -> the workers (by name) an unregister through the gateway did not reach:
        # they may still hold the region; forgotten once each was brought in line
        self.dropped: dict[str, set[str]] = {}
        self.loads: dict[str, bytes] = {}  # model -> its load request
        self.unloads: dict[str, bytes] = {}  # model -> its unload request
        # model -> control method (SetModelResidency, SetModelPolicy) -> its request
        self.settings: dict[str, dict[str, bytes]] = {}
        # LogSettings, TraceSetting -> the updates made through the gateway, merged
        self.fleet_settings: dict[str, bytes] = {}
        # model -> the mark of its last unload through the gateway (see unload_mark)
        self._unloaded: dict[str, int] = {}
        self._marks = itertools.count(1)
        self._forgotten = 0  # the last mark of a forgotten unload: the mark of the rest
        self.nursery: trio.Nursery | None = None  # where :meth:`start` runs replays
        self._replaying: dict[int, bool] = {}  # id(worker link) -> replay again once done
        self._unfinished: set[int] = set()  # id(worker link): a call was shed or timed out
        self._changes = 0  # changes recorded so far (loads, unloads, regions, settings)
        # worker name -> (its instance, the changes it held all of) when last known in
        # line: a worker away for a moment that missed nothing is left alone
        self._in_line: dict[str, tuple[str, int]] = {}
        self._failed: set[int] = set()  # id(worker link): a call of its pass failed

    def __bool__(self) -> bool:
        return bool(
            self.regions
            or self.dropped
            or self.loads
            or self.unloads
            or self.settings
            or self.fleet_settings
        )

    def registered(self, name: str, body: bytes) -> None:
        self.regions[name] = body
        self.dropped.pop(name, None)
        self._changes += 1

    def unregistered(self, name: str, results: Mapping[str, CallResult]) -> None:
        """``name`` ("" for every region the gateway registered) was unregistered; by
        worker name, ``results`` of doing so."""
        names = [name] if name else list(self.regions)
        missed = {w.name for w in self.forward.fleet.workers if not _ok(results.get(w.name))}
        self._changes += 1
        for n in names:
            self.regions.pop(n, None)
            if missed:
                self.dropped[n] = set(missed)
            else:
                self.dropped.pop(n, None)

    def stray(self, name: str, workers: list[WorkerLink]) -> None:
        """Region ``name`` on ``workers`` may not be what the gateway holds (a failed
        registration, its undo failed or unknown): bring them in line now. A region of
        that name the gateway holds is registered there as it holds it; any other is
        removed (now, or at their next catch-up until it is gone)."""
        if name not in self.regions:  # (a new set: a running pass holds the old one)
            self.dropped[name] = self.dropped.get(name, set()) | {w.name for w in workers}
        for worker in workers:
            self._in_line.pop(worker.name, None)
        self.start(workers)

    def forget_absent(self, known: set[str], every_worker_seen: bool) -> None:
        """Drop the settings of the models no worker lists any more (unloaded on the
        workers directly, gone from their repositories), unless a load through the
        gateway will bring them back; and, when ``every_worker_seen`` (each answered
        the last round: none away may still hold one), their unloads through the
        gateway (a gateway in front of explicit workers loading and unloading models of
        new names, later deleted, kept every one)."""
        for model in [m for m in self.settings if m not in known and m not in self.loads]:
            del self.settings[model]
        if every_worker_seen:
            for model in [m for m in self.unloads if m not in known]:
                del self.unloads[model]
                self._forgotten = max(self._forgotten, self._unloaded.pop(model, 0))

    def forget_worker(self, worker: str) -> None:
        """``worker`` left the fleet (DNS; a pod that returns comes as a new process):
        no region is waiting to be removed from it any more, nor is it known in line."""
        self._in_line.pop(worker, None)
        for name, away in list(self.dropped.items()):
            if worker in away:
                if len(away) == 1:
                    del self.dropped[name]
                else:  # (a new set: a running pass holds the old one)
                    self.dropped[name] = away - {worker}

    def loaded(self, model: str, body: bytes) -> None:
        self.loads[model] = body
        self.unloads.pop(model, None)
        self._changes += 1

    def unloaded(self, model: str, body: bytes) -> None:
        self.unloads[model] = body
        self.loads.pop(model, None)
        self.settings.pop(model, None)  # a model loaded again starts with the defaults
        self._unloaded[model] = next(self._marks)
        self._changes += 1

    def unload_mark(self, model: str) -> int:
        """A mark of ``model``'s last unload through the gateway, read before a setting's
        fan-out and given to :meth:`set` after it: another mark then means an unload
        came between (or the record of one was forgotten meanwhile: then the setting is
        not kept either, to be safe)."""
        return self._unloaded.get(model, self._forgotten)

    def set(self, model: str, method: str, body: bytes, mark: int) -> bool:
        """``method`` (SetModelResidency or SetModelPolicy) was done on ``model``, whose
        :meth:`unload_mark` was ``mark`` when it was sent (another now: it is not kept;
        returns whether it was). A policy keeps the fields an earlier request set and
        this one leaves unset."""
        if self.unload_mark(model) != mark:
            return False
        held = self.settings.setdefault(model, {})
        if method == "SetModelPolicy":
            body = _merged(control_pb.SetModelPolicyRequest, held.get(method), body)
        held[method] = body
        self._changes += 1
        return True

    def fleet_setting(self, method: str, body: bytes) -> None:
        """A LogSettings or TraceSetting update was done: merged over the earlier ones
        (a setting given again replaces its value; one left out keeps it)."""
        held = self.fleet_settings.get(method)
        self.fleet_settings[method] = _merged(_SETTING_REQUESTS[method], held, body)
        self._changes += 1

    def start(self, workers: list[WorkerLink]) -> None:
        """:meth:`replay` on ``workers`` in the background (in ``nursery``), when there
        is anything to replay, but for those known in line: the same process (by its
        ModelControlStatus ``instance``) that held every change recorded so far."""
        workers = [w for w in workers if not self._known_in_line(w)]
        if workers and self and self.nursery is not None:
            self.nursery.start_soon(self.replay, workers)

    def _known_in_line(self, worker: WorkerLink) -> bool:
        if not self:  # nothing to bring it in line with: it is, from now on
            self._in_line[worker.name] = (worker.instance, self._changes)
        return bool(worker.instance) and self._in_line.get(worker.name) == (
            worker.instance,
            self._changes,
        )

    def missed(self, results: Mapping[str, CallResult], exempt: Collection[str] = ()) -> None:
        """A change was remembered after a fan-out whose results (by worker name) are
        ``results``: the ready workers it concerns (all but those named in ``exempt``,
        found now not to be concerned: without the model, say) that it did not reach,
        or that failed it, are brought in line. Those that did it, or are exempt, and
        held every change before it, hold every one now."""
        fleet = self.forward.fleet
        for worker in fleet.workers:
            done = worker.name in exempt or _ok(results.get(worker.name))
            if done and self._in_line.get(worker.name) == (worker.instance, self._changes - 1):
                self._in_line[worker.name] = (worker.instance, self._changes)
        self.start(
            [w for w in fleet.ready if w.name not in exempt and not _ok(results.get(w.name))]
        )

    async def replay(self, workers: list[WorkerLink]) -> None:
        """Bring each of ``workers`` in line, all at once. A worker being brought in
        line already is brought in line once more after that (one replay at a time per
        worker); a worker that is no longer ready, or has left the fleet, is left for
        its return. Never raises but for cancellation."""
        async with trio.open_nursery() as nursery:
            for worker in workers:
                nursery.start_soon(self._replay_on, worker)

    async def _replay_on(self, worker: WorkerLink) -> None:
        key = id(worker)
        if key in self._replaying:
            self._replaying[key] = True  # the running replay goes round again
            return
        self._replaying[key] = False
        fleet = self.forward.fleet
        try:
            again = True
            while again and worker.ready and fleet.by_name.get(worker.name) is worker:
                self._failed.discard(key)
                held = (worker.instance, self._changes)  # (what this pass brings it to)
                try:
                    await self._regions_on(worker)
                    await self._models_on(worker)
                    for method, body in list(self.fleet_settings.items()):
                        await self._call(worker, INFERENCE + method, body)
                except Exception:  # a gateway bug must not take the gateway down
                    log.exception("bringing %s in line failed", worker.name)
                    self._failed.add(key)
                if key not in self._failed and worker.instance == held[0]:
                    self._in_line[worker.name] = held
                again, self._replaying[key] = self._replaying[key], False
        finally:
            del self._replaying[key]
            self._failed.discard(key)
            if key in self._unfinished:  # shed or timed out: again at the next round
                self._unfinished.discard(key)
                worker.away = True

    async def _regions_on(self, worker: WorkerLink) -> None:
        if not (self.regions or self.dropped):
            return
        answer = await self._call(worker, INFERENCE + "SystemSharedMemoryStatus", b"")
        if answer is None:
            return
        held = pb.SystemSharedMemoryStatusResponse.FromString(answer).regions
        wanted = {
            name: pb.SystemSharedMemoryRegisterRequest.FromString(body)
            for name, body in self.regions.items()
        }
        dropped = dict(self.dropped)  # as when the status was read (later ones stay)
        in_line = True
        for name, region in held.items():
            want = wanted.get(name)
            if want is not None and (want.key, want.offset, want.byte_size) == (
                region.key,
                region.offset,
                region.byte_size,
            ):
                del wanted[name]  # already as the gateway holds it
                continue
            if want is None and name not in self.dropped:
                continue  # not the gateway's
            undo = pb.SystemSharedMemoryUnregisterRequest(name=name).SerializeToString()
            in_line &= (
                await self._call(worker, INFERENCE + "SystemSharedMemoryUnregister", undo)
                is not None
            )
            if name in self.regions and want is None:  # registered meanwhile: look again
                self.start([worker])
        for name in wanted:
            body = self.regions.get(name)  # (unregistered meanwhile: nothing to do)
            if body is not None:
                await self._call(worker, INFERENCE + "SystemSharedMemoryRegister", body)
                if self.regions.get(name) is not body:  # unregistered (or changed) meanwhile
                    self.stray(name, [worker])
        if in_line:  # it holds none of the regions dropped before the read
            for name, away in dropped.items():
                if self.dropped.get(name) is away:
                    away.discard(worker.name)
                    if not away:
                        del self.dropped[name]

    async def _present(self, worker: WorkerLink) -> tuple[dict[str, str], set[str]] | None:
        """The models READY or LOADING on ``worker`` now, with their states (its
        RepositoryIndex's, and the sub-models of its metas, which only its
        ModelControlStatus lists), and every name its index lists (what its repository
        holds). None when the index cannot be read."""
        answer = await self._call(worker, REPOSITORY_INDEX, b"")
        if answer is None:
            return None
        index = pb.RepositoryIndexResponse.FromString(answer).models
        listed = {m.name for m in index}
        present = {m.name: m.state for m in index if m.state in _PRESENT}
        result = await self._result(worker, CONTROL_STATUS, b"")
        if result.status == StatusCode.UNIMPLEMENTED:  # no control service: no metas
            return present, listed
        if result.status != StatusCode.OK:  # a meta's sub-models would look absent
            return None
        control = control_pb.ModelControlStatusResponse.FromString(result.response or b"")
        for m in control.models:
            if m.state in _PRESENT:
                present.setdefault(m.name, m.state)
                listed.add(m.name)
        return present, listed

    async def _models_on(self, worker: WorkerLink) -> None:
        """Loads and unloads by what the worker holds now (each awaited to its end, so
        the next pass reads their outcome), then the settings of what it holds: of a
        model still LOADING there (a restarted worker's own start-up), at the next round
        (a worker refuses them while it loads)."""
        if not (self.loads or self.unloads or self.settings):
            return
        read = await self._present(worker)
        if read is None:
            return
        present, listed = read
        for model, body in list(self.loads.items()):  # (a load may come in meanwhile)
            if model in present or self.loads.get(model) is not body:
                continue
            if model not in listed and not _writes_files(body):
                continue  # not in its repository (NOT_FOUND when it was done there)
            log.info("loading %s on %s, as it was loaded through the gateway", model, worker.name)
            if await self._call(worker, INFERENCE + "RepositoryModelLoad", body) is not None:
                present[model] = "READY"
                self.forward.discovery.changed()  # (who holds it: a setting must see it)
            if self.loads.get(model) is not body:  # unloaded meanwhile: look again
                self.start([worker])
        for model, body in list(self.unloads.items()):
            if model in present and self.unloads.get(model) is body:
                log.info("unloading %s on %s, as it was through the gateway", model, worker.name)
                if await self._call(worker, INFERENCE + "RepositoryModelUnload", body) is not None:
                    del present[model]
                    self.forward.discovery.changed()
                if self.unloads.get(model) is not body:  # loaded meanwhile: look again
                    self.start([worker])
        for model, held in list(self.settings.items()):
            if present.get(model) == "LOADING":  # not in line yet: again at the next round
                self._failed.add(id(worker))
                self._unfinished.add(id(worker))
                continue
            if model in present:
                for method, body in list(held.items()):
                    if self.settings.get(model) is not held or held.get(method) is not body:
                        continue  # unloaded (or set again) meanwhile
                    await self._call(worker, CONTROL + method, body)

    async def _call(self, worker: WorkerLink, path: str, body: bytes) -> bytes | None:
        """The worker's answer; None when it failed."""
        result = await self._result(worker, path, body)
        return (result.response or b"") if result.status == StatusCode.OK else None

    async def _result(self, worker: WorkerLink, path: str, body: bytes) -> CallResult:
        """The call's result; a failure is logged (UNIMPLEMENTED of ModelControlStatus
        excepted: a worker without the control service), and one the worker shed or
        timed out brings it in line again at the next round."""
        if not worker.ready or self.forward.fleet.by_name.get(worker.name) is not worker:
            # found not ready (or gone) during the pass: the rest waits for its return
            self._failed.add(id(worker))
            return UnaryResult(StatusCode.UNAVAILABLE, "not ready", reached_server=False)
        result = (await self.forward.fan_out(path, body, workers=[worker]))[worker.name]
        if result.status in _TRANSIENT:
            self._unfinished.add(id(worker))
        if result.status != StatusCode.OK and not (
            result.status == StatusCode.UNIMPLEMENTED and path == CONTROL_STATUS
        ):
            self._failed.add(id(worker))
            method = path.rsplit("/", 1)[1]
            log.warning("%s on %s failed: %s", method, worker.name, result.message)
        return result


def _writes_files(load: bytes) -> bool:
    """Whether a RepositoryModelLoad request carries file overrides (which may create
    the model's directory in a repository without it)."""
    request = pb.RepositoryModelLoadRequest.FromString(load)
    return any(key.startswith("file:") for key in request.parameters)


def _merged(kind, held: bytes | None, body: bytes) -> bytes:
    """``body`` (a ``kind`` message) merged over ``held``: a field set again replaces
    its value, one left out keeps it."""
    if held is None:
        return body
    merged = kind.FromString(held)
    merged.MergeFromString(body)
    return merged.SerializeToString()
