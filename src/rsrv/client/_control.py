"""An async client for a worker's control service (``rsrv.control.v1.ControlService``).

Use it from trio::

    async with ControlClient("127.0.0.1", 8001) as control:
        status = await control.status()
        await control.set_policy("classifier", weight=2.0)
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping

import purerpc

from rsrv.protocol import FROM_RESIDENCY, RESIDENCY
from rsrv.protocol.generated.rsrv.control.v1 import control_pb2 as pb
from rsrv.protocol.generated.rsrv.control.v1.control_grpc import ControlServiceStub


class ControlClient:
    """Failed calls raise purerpc's ``RpcFailedError`` subclasses (e.g. ``NotFoundError``).

    ``headers`` are sent with every call (e.g. the header of a restricted ``control``
    protocol); ``ssl_context`` connects over TLS (``ssl.create_default_context()`` with
    the server's CA, plus ``load_cert_chain`` for mutual TLS).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        headers: Mapping[str, str] | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ):
        if ssl_context is None:
            self._channel = purerpc.insecure_channel(host, port)
        else:
            ssl_context.set_alpn_protocols(["h2"])
            self._channel = purerpc.secure_channel(host, port, ssl_context)
        self._metadata = tuple((headers or {}).items())
        self._stub: ControlServiceStub | None = None

    async def __aenter__(self) -> ControlClient:
        await self._channel.__aenter__()
        self._stub = ControlServiceStub(self._channel)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._channel.__aexit__(*exc)

    async def status(self) -> pb.ModelControlStatusResponse:
        return await self._stub.ModelControlStatus(
            pb.ModelControlStatusRequest(), metadata=self._metadata
        )

    async def set_residency(self, name: str, residency: str) -> str:
        """Set ``name``'s residency floor (explicit mode); returns the floor now in force."""
        response = await self._stub.SetModelResidency(
            pb.SetModelResidencyRequest(name=name, residency=RESIDENCY[residency]),
            metadata=self._metadata,
        )
        return FROM_RESIDENCY[response.residency]

    async def set_policy(self, name: str, *, weight: float | None = None) -> float:
        """Change ``name``'s fair-share weight live; returns the weight now in force."""
        request = pb.SetModelPolicyRequest(name=name)
        if weight is not None:
            request.weight = weight
        return (await self._stub.SetModelPolicy(request, metadata=self._metadata)).weight

    async def compact_memory(self, reload: list[str] = ()) -> pb.CompactMemoryResponse:
        return await self._stub.CompactMemory(
            pb.CompactMemoryRequest(reload_models=reload), metadata=self._metadata
        )
