"""The KServe V2 / Triton gRPC protocol: tensor codec, shared memory, status mapping.

The generated message and service modules live in ``rsrv.protocol.generated``.
"""

from rsrv.protocol.codec import (
    DEFAULT_MAX_TENSOR_BYTES,
    ShmTarget,
    decode_request,
    encode_response,
    request_deadline,
    request_priority,
    requested_outputs,
    tensor_metadata,
)
from rsrv.protocol.shm import DISABLED_MESSAGE, AlreadyExists, RegionInfo, SharedMemoryRegistry
from rsrv.protocol.status import MAX_MESSAGE_CHARS, grpc_status

__all__ = [
    "DEFAULT_MAX_TENSOR_BYTES",
    "DISABLED_MESSAGE",
    "MAX_MESSAGE_CHARS",
    "AlreadyExists",
    "RegionInfo",
    "SharedMemoryRegistry",
    "ShmTarget",
    "decode_request",
    "encode_response",
    "grpc_status",
    "request_deadline",
    "request_priority",
    "requested_outputs",
    "tensor_metadata",
]
