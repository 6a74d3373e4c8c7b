"""A trio-native client of the KServe V2 / Triton inference service, on rsrv's own
transport (``rsrv.transport.Channel``).

    async with InferenceClient("127.0.0.1", 8001) as client:
        result = await client.infer("classifier", {"x": np.ones((1, 256), np.float32)})
        logits = result["logits"]

Every failed call raises :class:`InferenceServerError` (code, message); calls that
failed UNAVAILABLE without reaching the server are retried per :class:`RetryPolicy`.
``timeout`` (seconds) bounds a call, retries included: it is sent as grpc-timeout, and
past it the call fails DEADLINE_EXCEEDED; a call being retried whose next wait would end
past it fails at once with its last attempt's status (UNAVAILABLE).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import trio
from purerpc.grpclib.status import StatusCode

from rsrv.client._errors import InferenceServerError
from rsrv.client._rpc import ChannelClient, open_stream
from rsrv.client._streaming import InferStream
from rsrv.client._tensors import InferResult, ShmInput, ShmOutput, build_request
from rsrv.errors import nursery_unwrapped
from rsrv.protocol.generated.inference import grpc_service_pb2 as pb
from rsrv.protocol.generated.inference import model_config_pb2

__all__ = ["InferenceClient"]

SERVICE = "/inference.GRPCInferenceService/"


class InferenceClient(ChannelClient):
    """Inference, health, metadata, repository, statistics and shared-memory calls.

    Its connection, headers and retries: see :class:`ChannelClient` (``host``, ``port``,
    ``tls``, ``server_hostname``, ``headers``, ``limits``, ``retry``, ``channel``).
    """

    service = SERVICE

    # -- health and metadata ------------------------------------------------------------

    async def server_live(self, *, timeout: float | None = None) -> bool:
        req = pb.ServerLiveRequest()
        return (await self._call("ServerLive", req, pb.ServerLiveResponse, timeout)).live

    async def server_ready(self, *, timeout: float | None = None) -> bool:
        req = pb.ServerReadyRequest()
        return (await self._call("ServerReady", req, pb.ServerReadyResponse, timeout)).ready

    async def server_metadata(self, *, timeout: float | None = None) -> Any:
        """``ServerMetadataResponse`` (name, version, extensions)."""
        req = pb.ServerMetadataRequest()
        return await self._call("ServerMetadata", req, pb.ServerMetadataResponse, timeout)

    async def model_ready(
        self, model: str, version: str = "", *, timeout: float | None = None
    ) -> bool:
        req = pb.ModelReadyRequest(name=model, version=version)
        return (await self._call("ModelReady", req, pb.ModelReadyResponse, timeout)).ready

    async def model_metadata(
        self, model: str, version: str = "", *, timeout: float | None = None
    ) -> Any:
        """``ModelMetadataResponse`` (versions, platform, inputs and outputs)."""
        req = pb.ModelMetadataRequest(name=model, version=version)
        return await self._call("ModelMetadata", req, pb.ModelMetadataResponse, timeout)

    async def model_config(
        self, model: str, version: str = "", *, timeout: float | None = None
    ) -> model_config_pb2.ModelConfig:
        """The model's Triton ``ModelConfig``."""
        req = pb.ModelConfigRequest(name=model, version=version)
        return (await self._call("ModelConfig", req, pb.ModelConfigResponse, timeout)).config

    async def model_statistics(
        self, model: str = "", version: str = "", *, timeout: float | None = None
    ) -> Any:
        """``ModelStatisticsResponse`` (every ready model when ``model`` is empty)."""
        req = pb.ModelStatisticsRequest(name=model, version=version)
        return await self._call("ModelStatistics", req, pb.ModelStatisticsResponse, timeout)

    # -- the repository -----------------------------------------------------------------

    async def repository_index(
        self, *, ready: bool = False, timeout: float | None = None
    ) -> list[Any]:
        """``RepositoryIndexResponse.ModelIndex`` entries (name, version, state, reason)."""
        req = pb.RepositoryIndexRequest(ready=ready)
        return list(
            (await self._call("RepositoryIndex", req, pb.RepositoryIndexResponse, timeout)).models
        )

    async def load_model(
        self,
        model: str,
        *,
        config: str | None = None,
        files: Mapping[str, bytes] | None = None,
        timeout: float | None = None,
    ) -> None:
        """RepositoryModelLoad (explicit mode): ``config`` a JSON ModelConfig override,
        ``files`` ``{"file:1/model.b1.mlir": bytes}`` overrides."""
        req = pb.RepositoryModelLoadRequest(model_name=model)
        if config is not None:
            req.parameters["config"].string_param = config
        for name, data in (files or {}).items():
            req.parameters[name].bytes_param = data
        await self._call("RepositoryModelLoad", req, pb.RepositoryModelLoadResponse, timeout)

    async def unload_model(
        self, model: str, *, unload_dependents: bool = False, timeout: float | None = None
    ) -> None:
        req = pb.RepositoryModelUnloadRequest(model_name=model)
        if unload_dependents:
            req.parameters["unload_dependents"].bool_param = True
        await self._call("RepositoryModelUnload", req, pb.RepositoryModelUnloadResponse, timeout)

    # -- inference ----------------------------------------------------------------------

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray | ShmInput],
        outputs: Sequence[str | ShmOutput] | None = None,
        *,
        version: str = "",
        request_id: str = "",
        parameters: Mapping[str, bool | int | float | str] | None = None,
        timeout: float | None = None,
    ) -> InferResult:
        """Run ``model`` on ``inputs`` (name -> array, or :class:`ShmInput` for data in
        a registered shared-memory region); ``outputs`` names the outputs to return (or
        :class:`ShmOutput` to have one written to a region), None for all. Raises
        ValueError / TypeError for an input with no KServe datatype. ``timeout`` covers
        encoding the request too."""
        start = trio.current_time()
        payload = build_request(
            model,
            inputs,
            outputs,
            version=version,
            request_id=request_id,
            parameters=parameters,
        ).SerializeToString()
        left = None if timeout is None else timeout - (trio.current_time() - start)
        response = await self.infer_serialized(payload, timeout=left)
        return InferResult(pb.ModelInferResponse.FromString(response))

    async def infer_serialized(self, payload: bytes, *, timeout: float | None = None) -> bytes:
        """ModelInfer of a serialized ModelInferRequest: the serialized response (what
        :meth:`infer` sends and parses; ``SyncInferenceClient`` encodes and parses in
        the caller's thread, not on the client's loop)."""
        return await self._call_serialized("ModelInfer", payload, timeout)

    @asynccontextmanager
    async def stream(self, *, timeout: float | None = None) -> AsyncIterator[InferStream]:
        """A ModelStreamInfer stream (see :class:`InferStream`); ``timeout`` bounds the
        whole stream. Opening it is retried (``retry``) while no connection to the
        server can be made. A stream the server turns away once open (REFUSED_STREAM,
        a GOAWAY below it: nothing on it was processed) is not opened again: its
        requests fail UNAVAILABLE with ``reached_server`` False, and the caller may open
        another. Leaving the block normally half-closes the stream and waits for the
        server to end it (answers not read are dropped); a stream that ended with an
        error status raises InferenceServerError then."""
        async with open_stream(
            self.channel,
            SERVICE + "ModelStreamInfer",
            metadata=self._metadata,
            timeout=timeout,
            retry=self.retry,
        ) as call:
            with nursery_unwrapped():  # (the block's own exception, not in a group)
                async with trio.open_nursery() as nursery:
                    stream = InferStream(call)
                    nursery.start_soon(stream._read)
                    try:
                        yield stream
                    except BaseException:
                        call.cancel()
                        raise
                    await call.end()
        if call.status is not StatusCode.OK:
            raise InferenceServerError(
                call.status, call.message, reached_server=call.reached_server
            )

    # -- system shared memory -----------------------------------------------------------

    async def register_system_shared_memory(
        self, name: str, key: str, byte_size: int, offset: int = 0, *, timeout=None
    ) -> None:
        """Register ``byte_size`` bytes at ``offset`` of POSIX shared-memory object
        ``key`` (see ``create_shared_memory_region``) as region ``name``."""
        req = pb.SystemSharedMemoryRegisterRequest(
            name=name, key=key, offset=offset, byte_size=byte_size
        )
        await self._call(
            "SystemSharedMemoryRegister", req, pb.SystemSharedMemoryRegisterResponse, timeout
        )

    async def unregister_system_shared_memory(self, name: str = "", *, timeout=None) -> None:
        """Unregister region ``name`` (every region when empty)."""
        req = pb.SystemSharedMemoryUnregisterRequest(name=name)
        await self._call(
            "SystemSharedMemoryUnregister", req, pb.SystemSharedMemoryUnregisterResponse, timeout
        )

    async def system_shared_memory_status(self, name: str = "", *, timeout=None) -> dict:
        """Registered regions by name (``RegionStatus``: name, key, offset, byte_size)."""
        req = pb.SystemSharedMemoryStatusRequest(name=name)
        response = await self._call(
            "SystemSharedMemoryStatus", req, pb.SystemSharedMemoryStatusResponse, timeout
        )
        return dict(response.regions)
