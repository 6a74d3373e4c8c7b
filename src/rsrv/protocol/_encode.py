"""numpy -> ModelInferResponse: the output half of the KServe V2 / Triton tensor codec.

What ``tritonclient.grpc`` expects: a response lists every requested output in
``outputs`` and, at the same position, in ``raw_output_contents`` (its
``InferResult.as_numpy`` indexes ``raw_output_contents`` by output position). An output
written to shared memory gets an empty entry there, as in Triton, and its
``InferOutputTensor.parameters`` echo ``shared_memory_region``,
``shared_memory_byte_size`` (the bytes actually written) and ``shared_memory_offset``
(when non-zero); read it with ``InferResult.get_output`` and
``tritonclient.utils.shared_memory.get_contents_as_numpy``.

Statuses: an unknown or duplicate requested output, a ``classification`` output
parameter (not supported), an output larger than its ``shared_memory_byte_size``
(Triton says INTERNAL there; it is the caller's sizing mistake): INVALID_ARGUMENT. The
model not producing a requested output, or producing a dtype with no KServe datatype:
INTERNAL. Shared-memory statuses as ``_parameters`` says.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rsrv.bundle import Tensor
from rsrv.dtypes import DType
from rsrv.errors import Internal, InvalidArgument, RsrvError
from rsrv.protocol._bytes import serialize_bytes
from rsrv.protocol._parameters import (
    ShmTarget,
    check_region,
    registry,
    shm_target,
    with_context,
)
from rsrv.protocol._shm import SharedMemoryRegistry
from rsrv.protocol.generated.inference import grpc_service_pb2 as pb

__all__ = ["encode_response", "requested_outputs", "tensor_metadata"]


def tensor_metadata(spec: Tensor) -> Any:
    """``ModelMetadataResponse.TensorMetadata`` for a client-facing tensor (-1: any extent;
    ``Tensor.shape`` already holds -1 on the batch and variable axes)."""
    return pb.ModelMetadataResponse.TensorMetadata(
        name=spec.name, datatype=spec.dtype.kserve, shape=list(spec.shape)
    )


def requested_outputs(
    request: Any,
    produced: Sequence[str],
    shm: SharedMemoryRegistry | None = None,
) -> list[tuple[str, ShmTarget | None]]:
    """Which outputs to return, in which order, and where.

    The request's ``outputs`` in their order; all of ``produced`` (model order) when it has
    none. An unknown or repeated name is INVALID_ARGUMENT naming it and the available
    outputs. An output carrying shared-memory parameters gets a ``ShmTarget``. Pass the
    registry as ``shm`` to check such regions now, before any compute (disabled:
    FAILED_PRECONDITION; unregistered: NOT_FOUND; out of bounds: INVALID_ARGUMENT); with
    ``shm`` None the same checks happen in ``encode_response``.
    """
    if not request.outputs:
        return [(name, None) for name in produced]
    model = request.model_name
    available = set(produced)
    seen: set[str] = set()
    result: list[tuple[str, ShmTarget | None]] = []
    for output in request.outputs:
        name = output.name
        what = f"output tensor '{name}' for model '{model}'"
        if name not in available:
            raise InvalidArgument(
                f"unexpected inference {what}: the model's outputs are "
                f"[{', '.join(repr(p) for p in produced)}]"
            )
        if name in seen:
            raise InvalidArgument(f"{what} is requested more than once")
        seen.add(name)
        if "classification" in output.parameters:
            raise InvalidArgument(f"{what}: the classification extension is not supported")
        target = shm_target(output, what)
        if target is not None and shm is not None:
            check_region(shm, target, what)
        result.append((name, target))
    return result


def _output_dtype(array: np.ndarray, what: str) -> DType:
    kind = array.dtype.kind
    if kind in "OSU":
        return DType.BYTES
    try:
        return DType.from_numpy(array.dtype.newbyteorder("="))
    except ValueError:
        raise Internal(f"{what} has dtype {array.dtype}, which has no KServe datatype") from None


def _wire(array: np.ndarray, dtype: DType, what: str) -> bytes | memoryview:
    """The output's row-major little-endian bytes (a view where no conversion is needed)."""
    if dtype is DType.BYTES:
        return serialize_bytes(array, what)
    native = dtype.numpy
    if array.dtype != native:
        array = array.astype(native)
    array = np.ascontiguousarray(array)
    return memoryview(array.reshape(-1).view(np.uint8))


def encode_response(
    request: Any,
    model_name: str,
    model_version: str | int,
    outputs: Mapping[str, np.ndarray],
    order: Sequence[tuple[str, ShmTarget | None]],
    shm: SharedMemoryRegistry | None = None,
) -> Any:
    """Build the ModelInferResponse for ``order`` (from ``requested_outputs``).

    Every output appears in ``outputs`` and, at the same position, in
    ``raw_output_contents``; outputs with a ``ShmTarget`` are written into their region
    (after all sizes are checked) and get an empty raw entry and echoed shared-memory
    parameters. Echoes the request ``id``.
    """
    response = pb.ModelInferResponse(
        model_name=model_name, model_version=str(model_version), id=request.id
    )
    staged: list[tuple[str, DType, tuple[int, ...], bytes | memoryview, ShmTarget | None]] = []
    for name, target in order:
        what = f"output tensor '{name}' for model '{model_name}'"
        if name not in outputs:
            raise Internal(f"the model did not produce {what}")
        array = np.asarray(outputs[name])
        dtype = _output_dtype(array, what)
        data = _wire(array, dtype, what)
        if target is not None:
            nbytes = len(data) if isinstance(data, bytes) else data.nbytes
            if nbytes > target.byte_size:
                raise InvalidArgument(
                    f"{what} needs {nbytes} bytes but its shared_memory_byte_size in region "
                    f"'{target.region}' is {target.byte_size}"
                )
            registry(shm, target, what)
        staged.append((name, dtype, array.shape, data, target))
    for name, dtype, shape, data, target in staged:
        tensor = response.outputs.add(name=name, datatype=dtype.kserve, shape=shape)
        if target is None:
            response.raw_output_contents.append(bytes(data))
            continue
        what = f"output tensor '{name}' for model '{model_name}'"
        try:
            written = shm.write(target.region, target.offset, data)
        except RsrvError as e:
            raise with_context(e, what) from None
        response.raw_output_contents.append(b"")
        tensor.parameters["shared_memory_region"].string_param = target.region
        tensor.parameters["shared_memory_byte_size"].int64_param = written
        if target.offset:
            tensor.parameters["shared_memory_offset"].int64_param = target.offset
    return response
