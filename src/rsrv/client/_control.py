"""An async client for a worker's control service (``rsrv.control.v1.ControlService``),
on rsrv's own transport.

Use it from trio::

    async with ControlClient("127.0.0.1", 8001) as control:
        status = await control.status()
        await control.set_policy("classifier", weight=2.0)
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from typing import Any

from rsrv.client._errors import InferenceServerError
from rsrv.client._rpc import ChannelClient, RetryPolicy, unary_message
from rsrv.protocol import FROM_RESIDENCY, RESIDENCY
from rsrv.protocol.generated.rsrv.control.v1 import control_pb2 as pb
from rsrv.transport import Channel, ClientLimits, open_channel

SERVICE = "/rsrv.control.v1.ControlService/"


class ControlClient(ChannelClient):
    """Its connection is InferenceClient's: to ``host:port`` (``tls``: a client
    ``ssl.SSLContext``, e.g. ``ssl.create_default_context()`` with the server's CA, plus
    ``load_cert_chain`` for mutual TLS, verified against ``server_hostname`` or ``host``)
    when entered as ``async with``, or a running ``channel`` to share. ``headers`` go
    with every call (e.g. the header of a restricted ``control`` protocol); ``retry``:
    see :class:`RetryPolicy`. Each call takes a ``timeout`` (seconds); a failed call
    raises :class:`InferenceServerError`, as InferenceClient's do.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 8001,
        *,
        tls: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        headers: Mapping[str, str] | None = None,
        limits: ClientLimits = ClientLimits(),  # noqa: B008 (frozen)
        retry: RetryPolicy = RetryPolicy(),  # noqa: B008 (frozen)
        channel: Channel | None = None,
    ):
        super().__init__(
            channel,
            lambda: open_channel(
                host, port, tls=tls, server_hostname=server_hostname, limits=limits
            ),
        )
        self._metadata = tuple((headers or {}).items())
        self.retry = retry

    async def _call(self, method: str, request: Any, response_type: Any, timeout) -> Any:
        return await unary_message(
            self.channel,
            SERVICE + method,
            request,
            response_type,
            InferenceServerError.of,
            metadata=self._metadata,
            timeout=timeout,
            retry=self.retry,
        )

    async def status(self, *, timeout: float | None = None) -> pb.ModelControlStatusResponse:
        request = pb.ModelControlStatusRequest()
        return await self._call(
            "ModelControlStatus", request, pb.ModelControlStatusResponse, timeout
        )

    async def set_residency(
        self, name: str, residency: str, *, timeout: float | None = None
    ) -> str:
        """Set ``name``'s residency floor (explicit mode); returns the floor now in force."""
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
