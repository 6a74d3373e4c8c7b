"""The gateway's KServe V2 / Triton surface and rsrv's control service, over its workers.

Clients see one server:

* ServerLive answered here; ServerReady true while at least one worker is ready;
  ServerMetadata, trace and log settings from a ready worker (log settings go to all).
* ModelInfer forwarded as bytes to the replica the scheduler picks; ModelStreamInfer
  routes each request on its own (requests on a stream run concurrently, each answer
  sent when ready, a failed request answered in-band); ModelReady, ModelMetadata and
  ModelConfig forwarded to a worker serving the model.
* RepositoryIndex: the union, one row per model and version, READY when it is ready
  somewhere, its reason naming the workers. ModelStatistics: summed over workers.
  RepositoryModelLoad / Unload: every ready worker; the first failure is the answer
  (a worker without the model left out when another did it), what was done is kept.
* System shared memory: status, the regions every ready worker holds alike;
  register/unregister on every ready worker, all or nothing
  (a register that fails anywhere is undone wherever it may have taken effect, and a
  client that goes away meanwhile leaves it to catch-up). Refused with FAILED_PRECONDITION
  when a worker is not on this host (its memory is not this machine's).
* Loads, unloads, residency and policy settings and shared-memory changes are replayed
  on a worker that becomes ready later or restarted (``rsrv.gateway._catchup``).
* Control service: ModelControlStatus merged; SetModelResidency and SetModelPolicy on
  every worker holding the model; CompactMemory on every ready worker, counts summed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import trio
from google.protobuf.message import DecodeError, Message
from purerpc.grpclib.status import StatusCode

from rsrv.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from rsrv.gateway._catchup import CatchUp
from rsrv.gateway._fleet import CallResult, Fleet, WorkerLink, is_local_host
from rsrv.gateway._forward import CONTROL, INFERENCE, Forwarder, Relayed, first_failure, merge_each
from rsrv.gateway._merge import (
    common_regions,
    merge_control_status,
    merge_index,
    sum_statistics,
)
from rsrv.gateway._peek import InferHead, WireError, peek_infer, peek_name
from rsrv.protocol import Admission, grpc_status, stream_error, stream_response
from rsrv.protocol.generated.inference import grpc_service_pb2 as pb
from rsrv.protocol.generated.rsrv.control.v1 import control_pb2 as control_pb
from rsrv.threads import run_sync
from rsrv.transport import Method, ServerCall

__all__ = ["GatewayServices"]

log = logging.getLogger("rsrv.gateway")


def _method(path: str, handler, *, streaming: bool = False) -> Method:
    return Method(
        path=path,
        handler=handler,
        decode=bytes,
        encode=bytes,
        client_streaming=streaming,
        server_streaming=streaming,
    )


def _parse(kind: type[Message], body: bytes) -> Message:
    try:
        return kind.FromString(body)
    except Exception:  # protobuf's DecodeError, or a nested one
        raise InvalidArgument(f"malformed {kind.__name__}") from None


class GatewayServices:
    """Every RPC the gateway answers; :meth:`methods` is its table for the server."""

    def __init__(
        self,
        fleet: Fleet,
        forwarder: Forwarder,
        admission: Admission,
        max_requests_per_stream: int,
        max_message_bytes: int = 1 << 31,
    ):
        self.fleet = fleet
        self.admission = admission
        self.forward = forwarder
        self.max_requests_per_stream = max_requests_per_stream
        self.max_message_bytes = max_message_bytes  # grpc.max_message_bytes
        self.catchup = CatchUp(forwarder)

    def methods(self) -> list[Method]:
        unary: dict[str, Callable] = {
            "ServerLive": self.server_live,
            "ServerReady": self.server_ready,
            "ServerMetadata": self.any_worker,
            "ModelReady": self.model_call,
            "ModelMetadata": self.model_call,
            "ModelConfig": self.model_call,
            "ModelInfer": self.model_infer,
            "ModelStatistics": self.model_statistics,
            "RepositoryIndex": self.repository_index,
            "RepositoryModelLoad": self.model_load,
            "RepositoryModelUnload": self.model_unload,
            "SystemSharedMemoryStatus": self.shm_status,
            "SystemSharedMemoryRegister": self.shm_register,
            "SystemSharedMemoryUnregister": self.shm_unregister,
            "CudaSharedMemoryStatus": self.any_worker,
            "CudaSharedMemoryRegister": self.any_worker,
            "CudaSharedMemoryUnregister": self.any_worker,
            "TraceSetting": self.trace_setting,
            "LogSettings": self.log_settings,
        }
        control: dict[str, Callable] = {
            "ModelControlStatus": self.control_status,
            "SetModelResidency": self.model_holders,
            "SetModelPolicy": self.model_holders,
            "CompactMemory": self.compact_memory,
        }
        return [
            *(_method(INFERENCE + name, fn) for name, fn in unary.items()),
            _method(INFERENCE + "ModelStreamInfer", self.model_stream_infer, streaming=True),
            *(_method(CONTROL + name, fn) for name, fn in control.items()),
        ]

    # -- health and metadata --------------------------------------------------------------

    async def server_live(self, body: bytes, call: ServerCall) -> bytes:
        return pb.ServerLiveResponse(live=True).SerializeToString()

    async def server_ready(self, body: bytes, call: ServerCall) -> bytes:
        return pb.ServerReadyResponse(ready=bool(self.fleet.ready)).SerializeToString()

    async def any_worker(self, body: bytes, call: ServerCall) -> bytes:
        """Answered by one ready worker (failing over to the next)."""
        order = [w.name for w in self.forward.any_ready()]
        return await self.forward.try_in_order(call.path, body, call.metadata, call.deadline, order)

    async def log_settings(self, body: bytes, call: ServerCall) -> bytes:
        """Done on every ready worker, as :meth:`every_worker`; an update (settings
        given) is remembered for a worker that comes back (catch-up), so that reads
        agree whichever worker answers. A read changes nothing to remember."""
        if not _parse(pb.LogSettingsRequest, body).settings:
            return await self.every_worker(body, call)
        return await self._fleet_setting("LogSettings", body, call)

    async def trace_setting(self, body: bytes, call: ServerCall) -> bytes:
        """A read is one worker's answer; an update (settings given) is made on every
        ready worker, as LogSettings (remembered for catch-up too). A worker keeps one
        set for itself, whatever model an update names: the name is
        checked against the fleet (NOT_FOUND when no ready worker has the model,
        UNAVAILABLE when none has it ready, as a worker answers), then the update goes
        to every worker without it (one without the model would refuse it)."""
        try:
            request = pb.TraceSettingRequest.FromString(body)
        except DecodeError as e:
            raise InvalidArgument(f"cannot parse the request as TraceSettingRequest: {e}") from None
        if not request.settings:
            return await self.any_worker(body, call)
        if name := request.model_name:
            await self._holders(name)
            if not self.fleet.routes.get(name):
                raise Unavailable(f"model {name!r} is not ready on any worker")
            request.model_name = ""
            body = request.SerializeToString()
        return await self._fleet_setting("TraceSetting", body, call)

    async def _fleet_setting(self, method: str, body: bytes, call: ServerCall) -> bytes:
        """``method``'s ``body`` done on every ready worker, remembered for catch-up
        once one did it; the first failure is the answer, else the first response."""
        results = await self.forward.fan_out(call.path, body, call.metadata, call.deadline)
        if _any_ok(results):
            self.catchup.fleet_setting(method, body)
            self.catchup.missed(results)
        return _first_answer(results)

    async def every_worker(self, body: bytes, call: ServerCall) -> bytes:
        """Done on every ready worker; the first failure is the answer, else the first
        worker's response."""
        results = await self.forward.fan_out(call.path, body, call.metadata, call.deadline)
        return _first_answer(results)

    async def model_load(self, body: bytes, call: ServerCall) -> bytes:
        return await self._repository(body, call, pb.RepositoryModelLoadRequest, True)

    async def model_unload(self, body: bytes, call: ServerCall) -> bytes:
        return await self._repository(body, call, pb.RepositoryModelUnloadRequest, False)

    async def _repository(self, body: bytes, call: ServerCall, kind, load: bool) -> bytes:
        """A load or unload, as :meth:`every_worker`; remembered for a worker that comes
        back once a worker has accepted it."""
        name = _parse(kind, body).model_name
        results = await self.forward.fan_out(call.path, body, call.metadata, call.deadline)
        if _any_ok(results):
            (self.catchup.loaded if load else self.catchup.unloaded)(name, body)
            # A worker without the model (NOT_FOUND: not in its repository, or for an
            # unload not loaded there) is left out, of the answer and of catch-up.
            absent = {n for n, r in results.items() if r.status == StatusCode.NOT_FOUND}
            self.catchup.missed(results, exempt=absent)
            self.forward.discovery.changed()  # routes and holders see it at once
            results = {n: r for n, r in results.items() if n not in absent}
        return _first_answer(results)

    async def model_call(self, body: bytes, call: ServerCall) -> bytes:
        try:
            name, version = peek_name(body)
        except WireError as e:
            raise InvalidArgument(f"malformed request: {e}") from None
        answer = await self.forward.to_model(
            call.path, name, body, call.metadata, call.deadline, version
        )
        if version or not call.path.endswith("/ModelMetadata"):
            return answer
        return self._all_versions(name, answer)

    def _all_versions(self, name: str, answer: bytes) -> bytes:
        """ModelMetadata without a version: one worker's answer, listing the versions
        READY on any worker serving the model (workers may hold different ones), as
        their last indexes show."""
        metadata = pb.ModelMetadataResponse.FromString(answer)
        versions = set(metadata.versions).union(
            *(worker.ready_versions(name) for worker in self.fleet.ready)
        )
        if versions != set(metadata.versions):
            metadata.versions[:] = sorted(versions, key=lambda v: (len(v), v))
            return metadata.SerializeToString()
        return answer

    # -- inference --------------------------------------------------------------------------

    async def model_infer(self, body: bytes, call: ServerCall) -> bytes:
        head = _peeked(body)
        return await self.forward.infer(call.path, head, body, call.metadata, call.deadline)

    async def model_stream_infer(self, messages, call: ServerCall):
        """Each request routed on its own, at most ``max_requests_per_stream`` at once;
        answers sent as they complete. (The transport runs this generator in a task of
        its own: its nursery stays open across its yields.)"""
        send, receive = trio.open_memory_channel(0)
        slots = trio.Semaphore(self.max_requests_per_stream)
        path = INFERENCE + "ModelInfer"

        async def one(body: bytes) -> None:
            model = request_id = ""
            try:
                head = _peeked(body)
                model, request_id = head.model, head.id
                with self.admission:  # each request on a stream is one call in flight
                    answer = stream_response(
                        await self.forward.infer(path, head, body, call.metadata, call.deadline)
                    )
                if len(answer) > self.max_message_bytes:  # (its own failure, as a worker's)
                    raise ResourceExhausted(
                        f"response of {len(answer)} bytes exceeds the maximum "
                        f"{self.max_message_bytes} (grpc.max_message_bytes)"
                    )
            except Exception as e:
                answer = stream_error(grpc_status(e)[1], model, request_id)
            try:
                await send.send(answer)
            finally:
                slots.release()

        async def pump() -> None:
            async with send, trio.open_nursery() as requests:
                while True:
                    await slots.acquire()
                    body = await anext(messages, None)
                    if body is None:
                        break
                    requests.start_soon(one, body)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump)
            async with receive:
                async for answer in receive:
                    yield answer

    # -- repository and statistics ------------------------------------------------------------

    async def repository_index(self, body: bytes, call: ServerCall) -> bytes:
        results = await self.forward.fan_out(call.path, body, call.metadata, call.deadline)
        answers = merge_each(results, pb.RepositoryIndexResponse.FromString)
        if not answers and (failure := first_failure(results)) is not None:
            raise failure
        names = sorted(n for n, r in results.items() if r.status == StatusCode.OK)
        return merge_index(zip(names, answers, strict=True)).SerializeToString()

    async def model_statistics(self, body: bytes, call: ServerCall) -> bytes:
        try:
            name, _ = peek_name(body)
        except WireError as e:
            raise InvalidArgument(f"malformed request: {e}") from None
        # Of one model: the workers serving it (one still loading it, or whose load
        # failed, would answer UNAVAILABLE); of every model: every ready worker.
        routes = self.fleet.routes.get(name, ()) if name else ()
        serving = [w for w in self.fleet.ready if w.name in routes] or None
        results = await self.forward.fan_out(
            call.path, body, call.metadata, call.deadline, workers=serving
        )
        answers = merge_each(results, pb.ModelStatisticsResponse.FromString)
        # Any failure but NOT_FOUND fails the call: sums that left a worker out would go
        # down, and back up, between reads.
        found = {n: r for n, r in results.items() if r.status != StatusCode.NOT_FOUND}
        if (failure := first_failure(found)) is not None:
            raise failure
        if not answers:
            raise first_failure(results) or NotFound("no worker has statistics")
        return sum_statistics(answers).SerializeToString()

    # -- shared memory -------------------------------------------------------------------------

    async def _require_local(self) -> None:
        for w in self.fleet.workers:
            if w.local is None:  # its name did not resolve: it may now
                w.local = await run_sync(is_local_host, w.host)
        remote = [w for w in self.fleet.workers if not w.local]
        if remote:
            raise FailedPrecondition(
                "system shared memory needs every worker on the gateway's host; "
                + ", ".join(
                    f"{w.name} is at {w.address}"
                    + (" (its name does not resolve)" if w.local is None else "")
                    for w in remote
                )
            )

    async def shm_status(self, body: bytes, call: ServerCall) -> bytes:
        """The regions every ready worker holds alike: those a request may use whichever
        worker it is routed to. A worker failing the call fails it (a named region
        unknown there: NOT_FOUND naming the worker)."""
        name = _parse(pb.SystemSharedMemoryStatusRequest, body).name
        results = await self.forward.fan_out(call.path, body, call.metadata, call.deadline)
        if (failure := first_failure(results)) is not None:
            raise failure
        merged = common_regions(merge_each(results, pb.SystemSharedMemoryStatusResponse.FromString))
        if name and name not in merged.regions:
            raise NotFound(
                f"Unable to find system shared memory region: '{name}' "
                "(the workers hold it differently)"
            )
        return merged.SerializeToString()

    async def shm_register(self, body: bytes, call: ServerCall) -> bytes:
        await self._require_local()
        request = _parse(pb.SystemSharedMemoryRegisterRequest, body)
        targets = list(self.fleet.ready)
        try:
            results = await self.forward.fan_out(call.path, body, call.metadata, call.deadline)
        except* trio.Cancelled:  # (in a group: fan_out's nursery)
            # The client went away mid-way: where it took effect is unknown. Catch-up
            # brings every target in line (a region the gateway holds stays, another
            # one of this name goes).
            self.catchup.stray(request.name, targets)
            raise
        failure = first_failure(results)
        if failure is not None:
            # All or nothing, bounded: the worker client's request timeout.
            with trio.CancelScope(shield=True), trio.move_on_after(self.forward.request_timeout):
                await self._undo_register(request.name, results, call.metadata)
            raise failure
        self.catchup.registered(request.name, body)
        self.catchup.missed(results)
        return pb.SystemSharedMemoryRegisterResponse().SerializeToString()

    async def _undo_register(
        self, name: str, results: Mapping[str, CallResult], metadata: Mapping[str, str]
    ) -> None:
        """Unregister ``name`` where the failed register may have taken effect (OK, or
        an outcome that does not say: timed out, cut off); never where it was refused
        (ALREADY_EXISTS: that registration is not this one). Catch-up then brings those
        workers in line: it registers again a region of this name the gateway holds
        (the undo may have removed it), and removes it where the undo failed."""
        maybe = [
            worker
            for n, r in results.items()
            if _maybe_done(r) and (worker := self.fleet.by_name.get(n)) is not None
        ]
        if not maybe:
            return
        undo = pb.SystemSharedMemoryUnregisterRequest(name=name).SerializeToString()
        undone = await self.forward.fan_out(
            INFERENCE + "SystemSharedMemoryUnregister", undo, metadata, workers=maybe
        )
        left = [
            w for w in maybe if undone[w.name].status not in (StatusCode.OK, StatusCode.NOT_FOUND)
        ]
        if left:
            log.warning(
                "shared memory region %r: a failed registration could not be undone on %s; "
                "catch-up removes it there",
                name,
                ", ".join(w.name for w in left),
            )
        if name in self.catchup.regions:
            self.catchup.stray(name, maybe)
        elif left:
            self.catchup.stray(name, left)

    async def shm_unregister(self, body: bytes, call: ServerCall) -> bytes:
        await self._require_local()
        request = _parse(pb.SystemSharedMemoryUnregisterRequest, body)
        targets = list(self.fleet.ready)
        try:
            results = await self.forward.fan_out(call.path, body, call.metadata, call.deadline)
        except* trio.Cancelled:  # (in a group: fan_out's nursery)
            # The client went away mid-way: some workers may have dropped the region.
            # It is dropped: catch-up removes it wherever it is left.
            self.catchup.unregistered(request.name, {})
            self.catchup.start(targets)
            raise
        if _any_ok(results):
            self.catchup.unregistered(request.name, results)
            self.catchup.missed(results)
        if (failure := first_failure(results)) is not None:
            raise failure
        return pb.SystemSharedMemoryUnregisterResponse().SerializeToString()

    # -- control service ----------------------------------------------------------------------

    async def control_status(self, body: bytes, call: ServerCall) -> bytes:
        results = await self.forward.fan_out(call.path, body, call.metadata, call.deadline)
        answers = merge_each(results, control_pb.ModelControlStatusResponse.FromString)
        if not answers:
            raise first_failure(results) or NotFound("no worker answered")
        return merge_control_status(answers).SerializeToString()

    async def model_holders(self, body: bytes, call: ServerCall) -> bytes:
        try:
            name, _ = peek_name(body)
        except WireError as e:
            raise InvalidArgument(f"malformed request: {e}") from None
        holders = await self._holders(name)
        mark = self.catchup.unload_mark(name)
        results = await self.forward.fan_out(
            call.path, body, call.metadata, call.deadline, workers=holders
        )
        # remembered for a holder that restarts, or failed it (not when unloaded meanwhile)
        if _any_ok(results) and self.catchup.set(name, call.path.rsplit("/", 1)[1], body, mark):
            # (by what the workers hold now: one back while the fan-out ran missed it)
            self.catchup.missed(
                results, exempt={w.name for w in self.fleet.workers if not w.knows(name)}
            )
        return _first_answer(results)

    async def _holders(self, name: str) -> list[WorkerLink]:
        """The ready workers holding model ``name`` as of the last change made through
        the gateway (after one refresh when none is known); NotFound when none."""
        discovery = self.forward.discovery
        await discovery.changes_seen()  # a load a moment ago: where it is now
        holders = self.fleet.holders(name)
        if not holders:
            await discovery.refresh()
            holders = self.fleet.holders(name)
        if not holders:
            raise NotFound(f"model {name!r} is not on any ready worker")
        return holders

    async def compact_memory(self, body: bytes, call: ServerCall) -> bytes:
        results = await self.forward.fan_out(call.path, body, call.metadata, call.deadline)
        answers = merge_each(results, control_pb.CompactMemoryResponse.FromString)
        if not answers:
            raise first_failure(results) or Relayed(StatusCode.UNAVAILABLE, "no worker answered")
        merged = control_pb.CompactMemoryResponse()
        for answer in answers:
            merged.reloaded_models += answer.reloaded_models
            merged.resident_bytes_after += answer.resident_bytes_after
        return merged.SerializeToString()


#: Outcomes after which a call that reached the worker may have taken effect there
#: (UNAVAILABLE: it may have been processed before the connection ended).
_UNSURE = frozenset(
    {
        StatusCode.OK,
        StatusCode.DEADLINE_EXCEEDED,
        StatusCode.CANCELLED,
        StatusCode.UNKNOWN,
        StatusCode.UNAVAILABLE,
    }
)


def _peeked(body: bytes) -> InferHead:
    """What routing reads of a ModelInferRequest; InvalidArgument when malformed."""
    try:
        return peek_infer(body)
    except WireError as e:
        raise InvalidArgument(f"malformed ModelInferRequest: {e}") from None


def _maybe_done(result: CallResult) -> bool:
    return result.reached_server and result.status in _UNSURE


def _first_answer(results: Mapping[str, CallResult]) -> bytes:
    """The first failure (:func:`first_failure`) raised, else the first worker's answer."""
    if (failure := first_failure(results)) is not None:
        raise failure
    return results[min(results)].response or b""


def _any_ok(results: Mapping[str, CallResult]) -> bool:
    return any(r.status == StatusCode.OK for r in results.values())
