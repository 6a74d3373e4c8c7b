"""``rsrv.control.v1.ControlService``: the control-plane RPCs of a worker.

Served on the same gRPC port as inference. Unknown models are NOT_FOUND; a call that
the worker's ``model_control_mode`` does not allow is FAILED_PRECONDITION.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rsrv.errors import FailedPrecondition, InvalidArgument
from rsrv.protocol.generated.rsrv.control.v1 import control_pb2 as pb
from rsrv.protocol.generated.rsrv.control.v1.control_grpc import ControlServiceServicer

if TYPE_CHECKING:
    from rsrv.worker.app import Worker

#: Residency floor names <-> the wire enum, least to most resident (the client uses them).
RESIDENCY = {
    "unpinned": pb.RESIDENCY_UNPINNED,
    "system": pb.RESIDENCY_SYSTEM,
    "device": pb.RESIDENCY_DEVICE,
}
FROM_RESIDENCY = {v: k for k, v in RESIDENCY.items()}


class ControlService(ControlServiceServicer):
    def __init__(self, worker: Worker):
        self.worker = worker

    async def ModelControlStatus(self, message, request):
        w = self.worker
        cache = w.weights.cache
        return pb.ModelControlStatusResponse(
            discipline=w.config.scheduler.discipline,
            control_mode=w.config.model_control_mode,
            weight_cache_budget_bytes=cache.budget or 0,
            weight_cache_resident_bytes=cache.resident_bytes,
            weight_cache_loads=cache.counters.loads,
            weight_cache_evictions=cache.counters.evictions,
            models=[self._status(name) for name in sorted(w.models.entries)],
        )

    def _status(self, name: str) -> pb.ModelStatus:
        w = self.worker
        entry = w.models.entries[name]
        status = pb.ModelStatus(name=name, state=entry.state, batch_axis=-1)
        served = entry.model
        if served is None:
            return status
        status.kind = served.bundle.kind
        if served.bundle.kind == "meta":
            return self._meta_status(status, served)
        sched = w.scheduler.stats(name)
        status.residency = RESIDENCY[served.residency]
        status.device_resident = w.weights.cache.is_resident(served.key)
        status.host_resident = w.weights.host_resident(served.key)
        status.weight_bytes = served.bundle.weight_bytes
        status.weight = sched.weight
        status.queue_depth = sched.queue_depth
        status.compute_seconds = sched.compute_seconds
        status.requests_served = sched.requests
        status.rows_served = sched.rows
        status.dispatches = sched.dispatches
        status.max_batch_size = sched.max_batch_size
        for t in served.bundle.signature.client_inputs:
            if t.batch_axis is not None:
                status.batch_input_name, status.batch_axis = t.name, t.batch_axis
                break
        return status

    def _meta_status(self, status: pb.ModelStatus, served) -> pb.ModelStatus:
        """A meta reports its sub-models' footprint, its least-resident floor, and the
        device time of its own sub-calls."""
        w = self.worker
        subs = [
            w.models.entries[c].model
            for c in served.bundle.signature.calls
            if c in w.models.entries and w.models.entries[c].model is not None
        ]
        meta = w.pipeline.meta.stats.get(served.name)
        if meta is not None:
            status.requests_served = status.rows_served = status.dispatches = meta.requests
            status.compute_seconds = meta.compute_seconds
        status.weight_bytes = sum(s.bundle.weight_bytes for s in subs)
        if subs:
            order = list(RESIDENCY)  # least resident first
            status.residency = RESIDENCY[min((s.residency for s in subs), key=order.index)]
            status.device_resident = all(w.weights.cache.is_resident(s.key) for s in subs)
            status.host_resident = all(w.weights.host_resident(s.key) for s in subs)
        return status

    async def SetModelResidency(self, message, request):
        w = self.worker
        served = w.models.get(message.name)
        if w.config.model_control_mode != "explicit":
            raise FailedPrecondition(
                "SetModelResidency is only accepted when model_control_mode is 'explicit' "
                f"(this worker runs '{w.config.model_control_mode}'; residency then comes "
                "from scheduler.models.<name>.residency)"
            )
        residency = FROM_RESIDENCY.get(message.residency)
        if residency is None:
            raise InvalidArgument(
                "residency must be RESIDENCY_UNPINNED, RESIDENCY_SYSTEM or RESIDENCY_DEVICE"
            )
        await w.set_residency(served, residency)
        return pb.SetModelResidencyResponse(residency=RESIDENCY[served.residency])

    async def SetModelPolicy(self, message, request):
        w = self.worker
        if w.models.get(message.name).bundle.kind == "meta":
            raise FailedPrecondition(
                f"{message.name!r} is a meta model: it has no scheduling policy of its own "
                "(its calls are scheduled as requests of the models it calls; set theirs)"
            )
        if message.HasField("weight"):
            w.scheduler.set_weight(message.name, message.weight)
        return pb.SetModelPolicyResponse(weight=w.scheduler.stats(message.name).weight)

    async def CompactMemory(self, message, request):
        w = self.worker
        for name in message.reload_models:
            w.models.get(name)  # NOT_FOUND before freeing anything
        reloaded = await w.compact_memory(list(message.reload_models))
        return pb.CompactMemoryResponse(
            reloaded_models=reloaded, resident_bytes_after=w.weights.cache.resident_bytes
        )
