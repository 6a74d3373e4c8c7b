"""Clients of rsrv workers (and of any KServe V2 / Triton gRPC server), on rsrv's own
transport (``rsrv.transport.Channel``):

* :class:`InferenceClient`: trio-native inference, health, metadata, repository,
  statistics, system shared memory and streaming; :class:`SyncInferenceClient` the same
  unary calls from synchronous code (one daemon thread of its own);
* :class:`ControlClient`: rsrv's control service;
* both on :class:`ChannelClient` (the connection, headers, retries);
* POSIX shared-memory regions to put tensors in (:func:`create_shared_memory_region`).

Failures raise :class:`InferenceServerError` (``code``, ``message``).
"""

from rsrv.client._control import ControlClient
from rsrv.client._errors import InferenceServerError
from rsrv.client._inference import InferenceClient
from rsrv.client._rpc import ChannelClient, RetryPolicy
from rsrv.client._shm import SharedMemoryRegion, create_shared_memory_region
from rsrv.client._streaming import InferStream
from rsrv.client._sync import SyncInferenceClient
from rsrv.client._tensors import InferResult, OutputTensor, ShmInput, ShmOutput

__all__ = [
    "ChannelClient",
    "ControlClient",
    "InferResult",
    "InferStream",
    "InferenceClient",
    "InferenceServerError",
    "OutputTensor",
    "RetryPolicy",
    "SharedMemoryRegion",
    "ShmInput",
    "ShmOutput",
    "SyncInferenceClient",
    "create_shared_memory_region",
]
