"""``rsrv.control.v1.ControlService``: the control-plane RPCs.

Served on the same gRPC port as inference, over a :class:`~rsrv.protocol.ControlBackend`
(a worker). Unknown models are NOT_FOUND; a call that the worker's
``model_control_mode`` does not allow is FAILED_PRECONDITION.
"""

from __future__ import annotations

import dataclasses
import functools

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
        """The snapshot's fields carry the message's names: copied over one to one, the
        residency name mapped to the wire enum."""
        snapshot = self.backend.control_status()
        response = pb.ModelControlStatusResponse(**{**_fields(snapshot), "models": ()})
        add = response.models.add  # (in place: no message built, then copied in)
        for m in snapshot.models:
            fields = _fields(m)
            fields["residency"] = RESIDENCY.get(m.residency, pb.RESIDENCY_UNSPECIFIED)
            add(**fields)
        return response

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


def _fields(snapshot) -> dict:
    return {name: getattr(snapshot, name) for name in _names(type(snapshot))}


@functools.cache
def _names(kind: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(kind))
