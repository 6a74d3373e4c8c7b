"""``inference.GRPCInferenceService``: the KServe V2 / Triton RPCs.

Handlers translate between protobuf and an :class:`~rsrv.protocol.InferenceBackend`
(a worker): decode -> backend -> encode. They raise :mod:`rsrv.errors` exceptions; the
transport maps them to statuses.
"""

from __future__ import annotations

import logging
import time

import trio

import rsrv
from rsrv.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
)
from rsrv.protocol._backend import InferenceBackend, ModelStatisticsSnapshot
from rsrv.protocol._calls import call_deadline
from rsrv.protocol._decode import RAW_COPY_BYTE_SECONDS, plan_request
from rsrv.protocol._encode import encode_response, requested_outputs, tensor_metadata
from rsrv.protocol._framing import stream_error
from rsrv.protocol._infer_flow import infer_counted
from rsrv.protocol._model_config import load_parameters, model_config
from rsrv.protocol._parameters import request_deadline, request_priority
from rsrv.protocol._status import grpc_status
from rsrv.protocol.generated.inference import grpc_service_pb2 as pb
from rsrv.protocol.generated.inference.grpc_service_grpc import GRPCInferenceServiceServicer
from rsrv.transport import Unparsed
from rsrv.versions import parse_version

log = logging.getLogger(__name__)
SERVER_NAME = "rsrv"
#: The trace settings TraceSetting reports (Triton's defaults, tracing off).
TRACE_DEFAULTS = {
    "trace_level": ["OFF"],
    "trace_rate": ["1000"],
    "trace_count": ["-1"],
    "log_frequency": ["0"],
    "trace_mode": ["triton"],
}


class InferenceService(GRPCInferenceServiceServicer):
    def __init__(self, backend: InferenceBackend):
        self.backend = backend
        self._trace = dict(TRACE_DEFAULTS)

    # -- health and metadata ----------------------------------------------------------

    async def ServerLive(self, message, request):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, message, request):
        return pb.ServerReadyResponse(ready=self.backend.ready)

    async def ModelReady(self, message, request):
        version = parse_version(message.version)
        return pb.ModelReadyResponse(ready=self.backend.model_ready(message.name, version))

    async def ServerMetadata(self, message, request):
        return pb.ServerMetadataResponse(
            name=SERVER_NAME, version=rsrv.__version__, extensions=self.backend.extensions
        )

    async def ModelMetadata(self, message, request):
        version = parse_version(message.version)
        served = self.backend.model(message.name, version)
        sig = served.bundle.signature
        return pb.ModelMetadataResponse(
            name=served.name,
            # Triton: the version asked for, else every ready version
            versions=[served.version]
            if version is not None
            else self.backend.ready_versions(served.name),
            platform=self.backend.platform,
            inputs=[tensor_metadata(t) for t in sig.client_inputs],
            outputs=[tensor_metadata(t) for t in sig.client_outputs],
        )

    async def ModelConfig(self, message, request):
        served = self.backend.model(message.name, parse_version(message.version))
        return pb.ModelConfigResponse(
            config=model_config(
                served.bundle,
                self.backend.platform,
                served.max_batch_size,
                served.version_policy,
                served.max_queue_delay,
            )
        )

    # -- inference ------------------------------------------------------------------------

    async def ModelInfer(self, message, request):
        return await self._infer(message, request.received_bytes)

    async def ModelStreamInfer(self, messages, request):
        """Requests on one stream run concurrently, at most
        ``endpoints.max_requests_per_stream`` at once (the stream is not read further
        until one finishes); each answer (or its error_message) is sent as it completes,
        and a failed request never ends the stream. The stream's grpc-timeout bounds the
        whole stream (DEADLINE_EXCEEDED when it expires) and every request on it."""
        send, receive = trio.open_memory_channel(0)
        slots = trio.Semaphore(self.backend.max_requests_per_stream)

        async def one(message, size: int):
            if isinstance(message, Unparsed):  # (its model and id: unknown)
                response = stream_error(grpc_status(message.error)[1], "", "")
            else:
                try:
                    with self.backend.admission:  # each request on a stream: one in flight
                        response = await self._infer(message, size, stream=True)
                except Exception as e:  # (in-band: a stream outlives a failed request)
                    response = stream_error(grpc_status(e)[1], message.model_name, message.id)
            try:
                await send.send(response)
            finally:
                slots.release()

        async def pump():
            async with send:
                async with trio.open_nursery() as requests:
                    while True:
                        await slots.acquire()
                        message = await anext(messages, None)
                        if message is None:
                            break
                        requests.start_soon(one, message, request.received_bytes)

        # The transport runs this generator in a task of its own (a nursery may stay
        # open across its yields) and enforces the deadline.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump)
            async with receive:
                async for response in receive:
                    yield response

    async def _infer(self, message, size: int, *, stream: bool = False) -> bytes:
        """The serialized answer to ``message`` (``size`` bytes on the wire; ``stream``:
        as a ModelStreamInferResponse), decoded and encoded off the loop when large."""
        if not message.model_name:
            raise InvalidArgument("model_name is empty")
        backend = self.backend
        start = time.perf_counter()
        served = backend.model(message.model_name, parse_version(message.model_version))
        sig = served.bundle.signature
        order = None

        def prepare(now: float):
            nonlocal order
            inputs = plan_request(
                message, sig.client_inputs, backend.shm, check_rows=served.check_rows
            )
            order = requested_outputs(message, [t.name for t in sig.client_outputs], backend.shm)
            deadline = min(call_deadline.get(), request_deadline(message, now) or float("inf"))
            request_priority(message)  # validated; the scheduler has no priorities
            return inputs, None if deadline == float("inf") else deadline

        def finish(outputs):
            response = encode_response(
                message, served.name, served.version, outputs, order, backend.shm, stream=stream
            )
            limit = backend.max_message_bytes
            if len(response) > limit:  # (here, not in the transport: counted as failed)
                raise ResourceExhausted(
                    f"response of {len(response)} bytes exceeds the maximum {limit} "
                    "(endpoints.max_message_bytes)"
                )
            return response

        # (taking raw entries out of the parsed message copies them: about the wire size)
        return await infer_counted(
            backend, served, start, prepare, finish, size * RAW_COPY_BYTE_SECONDS
        )

    async def ModelStatistics(self, message, request):
        """Every ready version of every model (no name), of the model named, or the
        one version named."""
        version = parse_version(message.version) if message.name else None
        snapshots = self.backend.statistics(message.name, version)
        return pb.ModelStatisticsResponse(model_stats=[model_statistics(s) for s in snapshots])

    # -- repository -----------------------------------------------------------------------

    async def RepositoryIndex(self, message, request):
        return pb.RepositoryIndexResponse(
            models=[
                pb.RepositoryIndexResponse.ModelIndex(
                    name=e.name, version=e.version, state=e.state, reason=e.reason
                )
                for e in await self.backend.index()
                if not message.ready or e.state == "READY"
            ]
        )

    async def RepositoryModelLoad(self, message, request):
        """Loads (or reloads) a model; ``parameters`` may carry Triton's ``config``
        override (the subset that maps to rsrv settings) and ``file:`` contents."""
        override, files = load_parameters(
            message.model_name, message.parameters, self.backend.platform
        )
        await self.backend.load_model(message.model_name, override, files)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, message, request):
        await self.backend.unload_model(message.model_name)
        return pb.RepositoryModelUnloadResponse()

    # -- shared memory ------------------------------------------------------------------

    async def SystemSharedMemoryStatus(self, message, request):
        regions = {
            r.name: pb.SystemSharedMemoryStatusResponse.RegionStatus(
                name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size
            )
            for r in self.backend.shm.status(message.name or None)
        }
        return pb.SystemSharedMemoryStatusResponse(regions=regions)

    async def SystemSharedMemoryRegister(self, message, request):
        await trio.to_thread.run_sync(
            self.backend.shm.register, message.name, message.key, message.offset, message.byte_size
        )
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, message, request):
        self.backend.shm.unregister(message.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(self, message, request):
        return pb.CudaSharedMemoryStatusResponse()

    async def CudaSharedMemoryRegister(self, message, request):
        raise FailedPrecondition(
            f"CUDA shared memory is not supported by this {self.backend.platform} worker; "
            "use system shared memory (SystemSharedMemoryRegister)"
        )

    async def CudaSharedMemoryUnregister(self, message, request):
        return pb.CudaSharedMemoryUnregisterResponse()  # nothing can be registered

    # -- trace and log settings ---------------------------------------------------------

    async def TraceSetting(self, message, request):
        """Tracing is not implemented: settings are validated, kept and reported, and
        trace_level can only be OFF. One set for the server; a model_name must exist."""
        if message.model_name:
            self.backend.model(message.model_name)  # NotFound for an unknown model
        updated = dict(self._trace)
        for key, setting in message.settings.items():
            if key not in TRACE_DEFAULTS:
                raise InvalidArgument(
                    f"unknown trace setting {key!r} (known: {', '.join(TRACE_DEFAULTS)})"
                )
            value = list(setting.value) or TRACE_DEFAULTS[key]  # no value: back to default
            if key == "trace_level" and value != ["OFF"]:
                raise InvalidArgument(
                    f"tracing is not supported: trace_level can only be OFF, got {value}"
                )
            if key in ("trace_rate", "trace_count", "log_frequency") and not (
                len(value) == 1 and value[0].lstrip("-").isdigit()
            ):
                raise InvalidArgument(f"trace setting {key!r} takes one integer, got {value}")
            if key == "trace_mode" and value not in (["triton"], ["opentelemetry"]):
                raise InvalidArgument(f"trace_mode must be triton or opentelemetry, got {value}")
            updated[key] = value
        self._trace = updated
        return pb.TraceSettingResponse(
            settings={k: pb.TraceSettingResponse.SettingValue(value=v) for k, v in updated.items()}
        )

    async def LogSettings(self, message, request):
        logs = self.backend.log_settings
        for key, value in message.settings.items():
            logs.update(key, value)
        return pb.LogSettingsResponse(settings=logs.to_proto())


def model_statistics(snapshot: ModelStatisticsSnapshot) -> pb.ModelStatistics:
    """Triton's ModelStatistics message of one model."""

    return pb.ModelStatistics(
        name=snapshot.name,
        version=snapshot.version,
        last_inference=snapshot.last_inference_ms,
        inference_count=snapshot.inference_count,
        execution_count=snapshot.execution_count,
        inference_stats=pb.InferStatistics(
            **{
                name: pb.StatisticDuration(count=d.count, ns=d.ns)
                for name, d in snapshot.durations.items()
            }
        ),
        batch_stats=[
            pb.InferBatchStatistics(
                batch_size=size, compute_infer=pb.StatisticDuration(count=count)
            )
            for size, count in sorted(snapshot.batch_executions.items())
        ],
    )
