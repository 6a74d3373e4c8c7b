"""An async client for a worker's control service (``rsrv.control.v1.ControlService``).

Use it from trio::

    async with ControlClient("127.0.0.1", 8001) as control:
        status = await control.status()
        await control.set_policy("classifier", weight=2.0)
"""

from __future__ import annotations

import purerpc

from rsrv.protocol.control import FROM_RESIDENCY, RESIDENCY
from rsrv.protocol.generated.rsrv.control.v1 import control_pb2 as pb
from rsrv.protocol.generated.rsrv.control.v1.control_grpc import ControlServiceStub


class ControlClient:
    """Failed calls raise purerpc's ``RpcFailedError`` subclasses (e.g. ``NotFoundError``)."""

    def __init__(self, host: str, port: int):
        self._channel = purerpc.insecure_channel(host, port)
        self._stub: ControlServiceStub | None = None

    async def __aenter__(self) -> ControlClient:
        await self._channel.__aenter__()
        self._stub = ControlServiceStub(self._channel)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._channel.__aexit__(*exc)

    async def status(self) -> pb.ModelControlStatusResponse:
        return await self._stub.ModelControlStatus(pb.ModelControlStatusRequest())

    async def set_residency(self, name: str, residency: str) -> str:
        """Set ``name``'s residency floor (explicit mode); returns the floor now in force."""
        response = await self._stub.SetModelResidency(
            pb.SetModelResidencyRequest(name=name, residency=RESIDENCY[residency])
        )
        return FROM_RESIDENCY[response.residency]

    async def set_policy(self, name: str, *, weight: float | None = None) -> float:
        """Change ``name``'s fair-share weight live; returns the weight now in force."""
        request = pb.SetModelPolicyRequest(name=name)
        if weight is not None:
            request.weight = weight
        return (await self._stub.SetModelPolicy(request)).weight

    async def compact_memory(self, reload: list[str] = ()) -> pb.CompactMemoryResponse:
        return await self._stub.CompactMemory(pb.CompactMemoryRequest(reload_models=reload))
