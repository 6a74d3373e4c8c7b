"""``rsrv.control.v1.ControlService``: the control-plane RPCs.

Served on the same gRPC port as inference, over a :class:`~rsrv.protocol.ControlBackend`
(a worker). Unknown models are NOT_FOUND; a call that the worker's
``model_control_mode`` does not allow is FAILED_PRECONDITION.
"""

from __future__ import annotations

from rsrv.errors import InvalidArgument
from rsrv.protocol._backend import ControlBackend
from rsrv.protocol.generated.rsrv.control.v1 import control_pb2 as pb
from rsrv.protocol.generated.rsrv.control.v1.control_grpc import ControlServiceServicer

#: Residency floor names <-> the wire enum, least to most resident (the client uses them).
RESIDENCY = {
    "unpinned": pb.RESIDENCY_UNPINNED,
    "system": pb.RESIDENCY_SYSTEM,
    "device": pb.RESIDENCY_DEVICE,
}
FROM_RESIDENCY = {v: k for k, v in RESIDENCY.items()}


class ControlService(ControlServiceServicer):
    def __init__(self, backend: ControlBackend):
        self.backend = backend

    async def ModelControlStatus(self, message, request):
        snapshot = self.backend.control_status()
        return pb.ModelControlStatusResponse(
            discipline=snapshot.discipline,
            control_mode=snapshot.control_mode,
            weight_cache_budget_bytes=snapshot.weight_cache_budget_bytes,
            weight_cache_resident_bytes=snapshot.weight_cache_resident_bytes,
            weight_cache_loads=snapshot.weight_cache_loads,
            weight_cache_evictions=snapshot.weight_cache_evictions,
            models=[
                pb.ModelStatus(
                    name=m.name,
                    state=m.state,
                    kind=m.kind,
                    residency=RESIDENCY.get(m.residency, pb.RESIDENCY_UNSPECIFIED),
                    device_resident=m.device_resident,
                    host_resident=m.host_resident,
                    weight_bytes=m.weight_bytes,
                    weight=m.weight,
                    queue_depth=m.queue_depth,
                    compute_seconds=m.compute_seconds,
                    requests_served=m.requests_served,
                    rows_served=m.rows_served,
                    dispatches=m.dispatches,
                    max_batch_size=m.max_batch_size,
                    batch_input_name=m.batch_input_name,
                    batch_axis=m.batch_axis,
                )
                for m in snapshot.models
            ],
        )

    async def SetModelResidency(self, message, request):
        residency = FROM_RESIDENCY.get(message.residency)
        if residency is None:
            raise InvalidArgument(
                "residency must be RESIDENCY_UNPINNED, RESIDENCY_SYSTEM or RESIDENCY_DEVICE"
            )
        floor = await self.backend.set_residency(message.name, residency)
        return pb.SetModelResidencyResponse(residency=RESIDENCY[floor])

    async def SetModelPolicy(self, message, request):
        if message.HasField("weight"):
            weight = self.backend.set_weight(message.name, message.weight)
        else:
            weight = self.backend.weight_of(message.name)
        return pb.SetModelPolicyResponse(weight=weight)

    async def CompactMemory(self, message, request):
        reloaded, resident = await self.backend.compact_memory(list(message.reload_models))
        return pb.CompactMemoryResponse(reloaded_models=reloaded, resident_bytes_after=resident)
