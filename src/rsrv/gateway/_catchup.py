"""Bringing a worker that (re)joins the fleet in line with what was done through the gateway.

System shared-memory registrations and explicit-mode model loads made through the gateway
go to every ready worker; a worker away at the time (restarting, unreachable, or not yet
discovered) missed them. :class:`CatchUp` remembers them, in the gateway's memory (a
restarted gateway starts with nothing to replay; a load request is kept whole, file
overrides included), and :meth:`CatchUp.replay` brings a worker in line when discovery
finds it newly ready or restarted (its ModelControlStatus ``instance`` changed):

* a region registered through the gateway and missing there (or held otherwise) is
  registered; one unregistered through the gateway since is unregistered there;
* a model loaded through the gateway and neither READY nor LOADING there is loaded with
  the same request (config overrides included); one unloaded through the gateway since
  and READY or LOADING there (its own start-up loads included) is unloaded.

A change is remembered once at least one worker accepted it; a worker that became ready
while the change was being made (so neither reached by it nor caught up with it yet) is
brought in line once it is remembered. Replays are the gateway's
own calls, sent with ``worker_client.headers`` (where a restricted protocol's header
must then be). Otherwise, what was done on a worker directly is left alone. Workers are
brought in line concurrently; a replay that fails is logged, and the worker keeps
serving what it has.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import trio
from purerpc.grpclib.status import StatusCode

from rsrv.gateway._fleet import WorkerLink
from rsrv.gateway._forward import INFERENCE, Forwarder
from rsrv.protocol.generated.inference import grpc_service_pb2 as pb

__all__ = ["CatchUp"]

log = logging.getLogger("rsrv.gateway")


class CatchUp:
    """What a returning worker must be brought in line with; the gateway's services
    record each change at least one worker accepted."""

    def __init__(self, forward: Forwarder):
        self.forward = forward
        self.regions: dict[str, bytes] = {}  # name -> its register request
        self.dropped: set[str] = set()  # regions unregistered through the gateway since
        self.loads: dict[str, bytes] = {}  # model -> its load request
        self.unloads: dict[str, bytes] = {}  # model -> its unload request
        self.nursery: trio.Nursery | None = None  # where :meth:`start` runs replays
        self._replaying: dict[str, bool] = {}  # worker name -> replay again once done

    def __bool__(self) -> bool:
        return bool(self.regions or self.dropped or self.loads or self.unloads)

    def registered(self, name: str, body: bytes) -> None:
        self.regions[name] = body
        self.dropped.discard(name)

    def unregistered(self, name: str) -> None:
        """``name``; "" for every region."""
        if name:
            self.regions.pop(name, None)
            self.dropped.add(name)
        else:
            self.dropped.update(self.regions)
            self.regions.clear()

    def loaded(self, model: str, body: bytes) -> None:
        self.loads[model] = body
        self.unloads.pop(model, None)

    def unloaded(self, model: str, body: bytes) -> None:
        self.unloads[model] = body
        self.loads.pop(model, None)

    def start(self, workers: list[WorkerLink]) -> None:
        """:meth:`replay` on ``workers`` in the background (in ``nursery``), when there
        is anything to replay."""
        if workers and self and self.nursery is not None:
            self.nursery.start_soon(self.replay, workers)

    def missed(self, results: Mapping[str, object]) -> None:
        """A change was remembered after a fan-out whose results (by worker name) are
        ``results``: the workers ready now that it did not reach are brought in line."""
        self.start([w for w in self.forward.fleet.ready if w.name not in results])

    async def replay(self, workers: list[WorkerLink]) -> None:
        """Bring each of ``workers`` (newly ready or restarted, its index and control
        status fresh) in line, all at once. A worker being brought in line already is
        brought in line once more after that (one replay at a time per worker). Never
        raises but for cancellation."""
        async with trio.open_nursery() as nursery:
            for worker in workers:
                nursery.start_soon(self._replay_on, worker)

    async def _replay_on(self, worker: WorkerLink) -> None:
        if worker.name in self._replaying:
            self._replaying[worker.name] = True  # the running replay goes round again
            return
        self._replaying[worker.name] = False
        sent: dict[int, bytes] = {}  # the load / unload requests sent to it, by id
        try:
            again = True
            while again:
                try:
                    await self._regions_on(worker)
                    await self._models_on(worker, sent)
                except Exception:  # a gateway bug must not take the gateway down
                    log.exception("bringing %s in line failed", worker.name)
                again, self._replaying[worker.name] = self._replaying[worker.name], False
        finally:
            del self._replaying[worker.name]

    async def _regions_on(self, worker: WorkerLink) -> None:
        if not (self.regions or self.dropped):
            return
        answer = await self._call(worker, "SystemSharedMemoryStatus", b"")
        if answer is None:
            return
        held = pb.SystemSharedMemoryStatusResponse.FromString(answer).regions
        wanted = {
            name: pb.SystemSharedMemoryRegisterRequest.FromString(body)
            for name, body in self.regions.items()
        }
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
            await self._call(worker, "SystemSharedMemoryUnregister", undo)
        for name in wanted:
            body = self.regions.get(name)  # (unregistered meanwhile: nothing to do)
            if body is not None:
                await self._call(worker, "SystemSharedMemoryRegister", body)

    async def _models_on(self, worker: WorkerLink, sent: dict[int, bytes]) -> None:
        """Loads and unloads by the worker's last index and control status; a request
        already in ``sent`` (by an earlier pass of this replay, which that snapshot may
        not show yet) is not sent again."""
        present = worker.serving | {r.name for r in worker.index if r.state == "LOADING"}
        for model, body in list(self.loads.items()):  # (a load may come in meanwhile)
            done = sent.get(id(body)) is body
            if model in present or self.loads.get(model) is not body or done:
                continue
            log.info("loading %s on %s, as it was loaded through the gateway", model, worker.name)
            sent[id(body)] = body
            await self._call(worker, "RepositoryModelLoad", body)
        for model, body in list(self.unloads.items()):
            done = sent.get(id(body)) is body
            if model in present and self.unloads.get(model) is body and not done:
                log.info("unloading %s on %s, as it was through the gateway", model, worker.name)
                sent[id(body)] = body
                await self._call(worker, "RepositoryModelUnload", body)

    async def _call(self, worker: WorkerLink, method: str, body: bytes) -> bytes | None:
        results = await self.forward.fan_out(INFERENCE + method, body, workers=[worker])
        result = results[worker.name]
        if result.status != StatusCode.OK:
            log.warning("%s on %s failed: %s", method, worker.name, result.message)
            return None
        return result.response or b""
