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

from purerpc.grpclib.exceptions import RpcFailedError, raise_status
from purerpc.grpclib.status import Status

from rsrv.client._rpc import ChannelClient, unary_message
from rsrv.protocol import FROM_RESIDENCY, RESIDENCY
from rsrv.protocol.generated.rsrv.control.v1 import control_pb2 as pb
from rsrv.transport import Channel, UnaryResult, open_channel

SERVICE = "/rsrv.control.v1.ControlService/"


def _error(result: UnaryResult) -> RpcFailedError:
    try:
        raise_status(Status(result.status, result.message))
    except RpcFailedError as e:
        return e
    return RpcFailedError(Status(result.status, result.message))


class ControlClient(ChannelClient):
    """Failed calls raise purerpc's ``RpcFailedError`` subclasses (e.g. ``NotFoundError``;
    a server that cannot be reached: ``UnavailableError``).

    ``headers`` are sent with every call (e.g. the header of a restricted ``control``
    protocol); ``ssl_context`` connects over TLS (``ssl.create_default_context()`` with
    the server's CA, plus ``load_cert_chain`` for mutual TLS). Or give it a running
    ``channel`` (``rsrv.transport.Channel``) to share.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        headers: Mapping[str, str] | None = None,
        ssl_context: ssl.SSLContext | None = None,
        channel: Channel | None = None,
    ):
        super().__init__(channel, lambda: open_channel(host, port, tls=ssl_context))
        self._metadata = tuple((headers or {}).items())

    async def _call(self, method: str, request: Any, response_type: Any) -> Any:
        return await unary_message(
            self.channel, SERVICE + method, request, response_type, _error, metadata=self._metadata
        )

    async def status(self) -> pb.ModelControlStatusResponse:
        return await self._call(
            "ModelControlStatus", pb.ModelControlStatusRequest(), pb.ModelControlStatusResponse
        )

    async def set_residency(self, name: str, residency: str) -> str:
        """Set ``name``'s residency floor (explicit mode); returns the floor now in force."""
        response = await self._call(
            "SetModelResidency",
            pb.SetModelResidencyRequest(name=name, residency=RESIDENCY[residency]),
            pb.SetModelResidencyResponse,
        )
        return FROM_RESIDENCY[response.residency]

    async def set_policy(self, name: str, *, weight: float | None = None) -> float:
        """Change ``name``'s fair-share weight live; returns the weight now in force."""
        request = pb.SetModelPolicyRequest(name=name)
        if weight is not None:
            request.weight = weight
        return (await self._call("SetModelPolicy", request, pb.SetModelPolicyResponse)).weight

    async def compact_memory(self, reload: list[str] = ()) -> pb.CompactMemoryResponse:
        return await self._call(
            "CompactMemory", pb.CompactMemoryRequest(reload_models=reload), pb.CompactMemoryResponse
        )
