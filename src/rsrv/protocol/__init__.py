"""The KServe V2 / Triton protocol: services, tensor codec, shared memory, statuses.

The services translate protobuf (gRPC) and JSON (REST: :class:`RestService`, an ASGI
app) to and from a backend (:class:`InferenceBackend`,
:class:`ControlBackend`) that the serving process implements; the standard gRPC health
service (:class:`HealthService`) over one question, is the server ready. The generated
message and service modules live in ``rsrv.protocol.generated``.
"""

from rsrv.protocol._backend import (
    DURATIONS,
    ControlBackend,
    ControlSnapshot,
    Duration,
    IndexEntry,
    InferenceBackend,
    LoadOverride,
    ModelControl,
    ModelStatisticsSnapshot,
    ServedModelView,
)
from rsrv.protocol._calls import (
    PROTOCOLS,
    RESTRICTED_MESSAGE,
    Admission,
    Restriction,
    call_deadline,
    deadline_cut_off,
    guard,
)
from rsrv.protocol._control import FROM_RESIDENCY, RESIDENCY, ControlService
from rsrv.protocol._decode import DEFAULT_MAX_TENSOR_BYTES, decode_request
from rsrv.protocol._encode import encode_response, requested_outputs, tensor_metadata
from rsrv.protocol._framing import stream_error, stream_response
from rsrv.protocol._health import HEALTH_SERVICES, HealthService
from rsrv.protocol._inference import InferenceService
from rsrv.protocol._logs import LogSettings
from rsrv.protocol._model_config import load_parameters, model_config
from rsrv.protocol._parameters import ShmTarget, request_deadline, request_priority
from rsrv.protocol._rest import RestService
from rsrv.protocol._restrictions import restrictions_of
from rsrv.protocol._shm import DISABLED_MESSAGE, AlreadyExists, RegionInfo, SharedMemoryRegistry
from rsrv.protocol._status import (
    HTTP_STATUS,
    MAX_MESSAGE_CHARS,
    PUSHBACK,
    grpc_status,
    grpc_trailers,
    http_status,
    pushback_of,
)

__all__ = [
    "DEFAULT_MAX_TENSOR_BYTES",
    "DURATIONS",
    "DISABLED_MESSAGE",
    "HTTP_STATUS",
    "FROM_RESIDENCY",
    "HEALTH_SERVICES",
    "MAX_MESSAGE_CHARS",
    "PUSHBACK",
    "RESTRICTED_MESSAGE",
    "PROTOCOLS",
    "RESIDENCY",
    "Admission",
    "AlreadyExists",
    "ControlBackend",
    "ControlService",
    "ControlSnapshot",
    "Duration",
    "HealthService",
    "IndexEntry",
    "InferenceBackend",
    "InferenceService",
    "LoadOverride",
    "LogSettings",
    "ModelControl",
    "ModelStatisticsSnapshot",
    "RegionInfo",
    "RestService",
    "Restriction",
    "ServedModelView",
    "SharedMemoryRegistry",
    "ShmTarget",
    "call_deadline",
    "deadline_cut_off",
    "decode_request",
    "encode_response",
    "grpc_status",
    "grpc_trailers",
    "guard",
    "restrictions_of",
    "http_status",
    "pushback_of",
    "load_parameters",
    "model_config",
    "request_deadline",
    "request_priority",
    "requested_outputs",
    "stream_error",
    "stream_response",
    "tensor_metadata",
]
