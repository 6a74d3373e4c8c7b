"""An async client for a worker's control service (``rsrv.control.v1.ControlService``),
on rsrv's own transport.

Use it from trio::

    async with ControlClient("127.0.0.1", 8001) as control:
        status = await control.status()
        await control.set_policy("classifier", weight=2.0)
"""

from __future__ import annotations

from rsrv.client._rpc import ChannelClient
from rsrv.protocol import FROM_RESIDENCY, RESIDENCY
from rsrv.protocol.generated.rsrv.control.v1 import control_pb2 as pb

SERVICE = "/rsrv.control.v1.ControlService/"


class ControlClient(ChannelClient):
    """rsrv's control service. Its connection, headers (e.g. the header of a restricted
    ``control`` protocol) and retries: see :class:`ChannelClient`, as InferenceClient's
    (``tls``: e.g. ``ssl.create_default_context()`` with the server's CA, plus
    ``load_cert_chain`` for mutual TLS). Each call takes a ``timeout`` (seconds); a
    failed call raises :class:`InferenceServerError`.
    """

    service = SERVICE

    async def status(self, *, timeout: float | None = None) -> pb.ModelControlStatusResponse:
        request = pb.ModelControlStatusRequest()
        return await self._call(
            "ModelControlStatus", request, pb.ModelControlStatusResponse, timeout
        )

    async def set_residency(
        self, name: str, residency: str, *, timeout: float | None = None
    ) -> str:
        """Set ``name``'s residency floor (explicit mode); returns the floor now in force.
        Raises ValueError, sending nothing, for a residency that is none of
        :data:`rsrv.protocol.RESIDENCY`'s names."""
        if residency not in RESIDENCY:
            raise ValueError(f"residency {residency!r}: expected one of {', '.join(RESIDENCY)}")
        request = pb.SetModelResidencyRequest(name=name, residency=RESIDENCY[residency])
        response = await self._call(
            "SetModelResidency", request, pb.SetModelResidencyResponse, timeout
        )
        return FROM_RESIDENCY[response.residency]

    async def set_policy(
        self, name: str, *, weight: float | None = None, timeout: float | None = None
    ) -> float:
        """Change ``name``'s fair-share weight live; returns the weight now in force."""
        request = pb.SetModelPolicyRequest(name=name)
        if weight is not None:
            request.weight = weight
        return (
            await self._call("SetModelPolicy", request, pb.SetModelPolicyResponse, timeout)
        ).weight

    async def compact_memory(
        self, reload: list[str] = (), *, timeout: float | None = None
    ) -> pb.CompactMemoryResponse:
        request = pb.CompactMemoryRequest(reload_models=reload)
        return await self._call("CompactMemory", request, pb.CompactMemoryResponse, timeout)
