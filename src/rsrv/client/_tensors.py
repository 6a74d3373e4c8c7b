"""numpy <-> KServe V2 tensors for the client: a ModelInferRequest from arrays, and
an :class:`InferResult` from a ModelInferResponse.

Inputs travel in ``raw_input_contents`` (row-major, little-endian; BOOL one byte;
BYTES length-prefixed), one entry per input not in shared memory, in input order, as
tritonclient sends them. Outputs are read from ``raw_output_contents`` at their
position (zero-copy, read-only arrays, as tritonclient's ``as_numpy``); BYTES outputs
are object arrays of ``bytes``. An input may come from a registered system
shared-memory region (:class:`ShmInput`), an output may be written into one
(:class:`ShmOutput`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rsrv.dtypes import DType, decode_bytes_tensor, encode_bytes_tensor
from rsrv.protocol.generated.inference import grpc_service_pb2 as pb

__all__ = [
    "InferResult",
    "OutputTensor",
    "ShmInput",
    "ShmOutput",
    "build_request",
    "datatype_of",
    "deserialize_bytes",
    "numpy_dtype",
    "serialize_bytes",
]

_TYPED = {  # typed contents field of each datatype (servers that answer without raw)
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


@dataclass(frozen=True, slots=True)
class ShmInput:
    """An input whose data is in registered region ``region`` (``byte_size`` bytes at
    ``offset``): its ``shape`` and KServe ``datatype`` say what the bytes hold."""

    region: str
    byte_size: int
    shape: Sequence[int]
    datatype: str
    offset: int = 0


@dataclass(frozen=True, slots=True)
class ShmOutput:
    """Output ``name`` written by the server into region ``region`` (at most
    ``byte_size`` bytes at ``offset``) instead of the response."""

    name: str
    region: str
    byte_size: int
    offset: int = 0


@dataclass(frozen=True, slots=True)
class OutputTensor:
    """What the response says of one output; ``region`` etc. are set for an output
    written to shared memory (``byte_size``: the bytes written)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    region: str | None = None
    byte_size: int = 0
    offset: int = 0


def numpy_dtype(datatype: str | np.dtype) -> np.dtype:
    """The numpy dtype of a KServe datatype name (BYTES: object); numpy dtypes pass."""
    if isinstance(datatype, str):
        return DType.from_kserve(datatype).numpy
    return np.dtype(datatype)


def datatype_of(array: np.ndarray) -> str:
    """The KServe datatype of an array (object, bytes and str arrays: BYTES). Raises
    ValueError for a dtype with none."""
    if array.dtype.kind in "OSU":
        return "BYTES"
    return DType.from_numpy(array.dtype.newbyteorder("=")).kserve


serialize_bytes = encode_bytes_tensor
deserialize_bytes = decode_bytes_tensor


def _set_parameter(params: Any, key: str, value: bool | int | float | str) -> None:
    if isinstance(value, np.generic):  # (np.int64(3), np.bool_(True): their Python value)
        value = value.item()
    if isinstance(value, bool):
        params[key].bool_param = value
    elif isinstance(value, int):
        params[key].int64_param = value
    elif isinstance(value, float):
        params[key].double_param = value
    elif isinstance(value, str):
        params[key].string_param = value
    else:
        raise TypeError(f"parameter {key!r}: {type(value).__name__} is not bool/int/float/str")


def _shm_parameters(params: Any, region: str, byte_size: int, offset: int) -> None:
    params["shared_memory_region"].string_param = region
    params["shared_memory_byte_size"].int64_param = byte_size
    if offset:
        params["shared_memory_offset"].int64_param = offset


def build_request(
    model: str,
    inputs: Mapping[str, np.ndarray | ShmInput],
    outputs: Sequence[str | ShmOutput] | None = None,
    *,
    version: str = "",
    request_id: str = "",
    parameters: Mapping[str, bool | int | float | str] | None = None,
) -> pb.ModelInferRequest:
    """The ModelInferRequest of ``inputs`` (name -> array or :class:`ShmInput`),
    asking for ``outputs`` (names or :class:`ShmOutput`, or one of them; None: every
    output). Raises
    ValueError / TypeError for an array or parameter that has no KServe form."""
    if isinstance(outputs, (str, ShmOutput)):  # (one output: not a sequence of letters)
        outputs = [outputs]
    request = pb.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    for key, value in (parameters or {}).items():
        _set_parameter(request.parameters, key, value)
    raw = request.raw_input_contents
    for name, value in inputs.items():
        if isinstance(value, ShmInput):
            tensor = request.inputs.add(name=name, datatype=value.datatype, shape=list(value.shape))
            _shm_parameters(tensor.parameters, value.region, value.byte_size, value.offset)
            continue
        array = _as_array(value)
        try:
            datatype = datatype_of(array)
        except ValueError as e:
            raise ValueError(f"input {name!r}: {e}") from None
        request.inputs.add(name=name, datatype=datatype, shape=array.shape)
        if datatype == "BYTES":
            raw.append(serialize_bytes(array))
        else:
            raw.append(np.ascontiguousarray(array, array.dtype.newbyteorder("<")).tobytes())
    for output in outputs or ():
        if isinstance(output, ShmOutput):
            tensor = request.outputs.add(name=output.name)
            _shm_parameters(tensor.parameters, output.region, output.byte_size, output.offset)
        else:
            request.outputs.add(name=output)
    return request


class InferResult:
    """A ModelInferResponse with its outputs as numpy arrays.

    ``outputs``: name -> array for the outputs carried in the response (read-only views
    of its bytes; BYTES as object arrays); ``tensors``: name -> :class:`OutputTensor`
    for every output, those in shared memory included (read them with
    ``SharedMemoryRegion.read``, at the tensor's ``offset`` plus the offset the region
    was registered at: the server's offsets count from the registered window).
    ``model_name``, ``model_version``, ``id``, ``parameters`` (name -> value) and
    ``response`` (the protobuf message) as received.
    """

    def __init__(self, response: Any):
        self.response = response
        self.model_name: str = response.model_name
        self.model_version: str = response.model_version
        self.id: str = response.id
        self.parameters = {k: _value(v) for k, v in response.parameters.items()}
        self.outputs: dict[str, np.ndarray] = {}
        self.tensors: dict[str, OutputTensor] = {}
        raw = response.raw_output_contents
        for i, tensor in enumerate(response.outputs):
            params = tensor.parameters
            shape = tuple(tensor.shape)
            if "shared_memory_region" in params:
                self.tensors[tensor.name] = OutputTensor(
                    tensor.name,
                    tensor.datatype,
                    shape,
                    params["shared_memory_region"].string_param,
                    params["shared_memory_byte_size"].int64_param,
                    params["shared_memory_offset"].int64_param
                    if "shared_memory_offset" in params
                    else 0,
                )
                continue
            self.tensors[tensor.name] = OutputTensor(tensor.name, tensor.datatype, shape)
            data = raw[i] if i < len(raw) else None
            self.outputs[tensor.name] = _array(tensor, shape, data)

    def as_numpy(self, name: str) -> np.ndarray | None:
        """Output ``name`` as an array; None if the response has no such output (or it
        was written to shared memory), as tritonclient's ``InferResult.as_numpy``."""
        return self.outputs.get(name)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.outputs[name]

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {t.datatype}{list(t.shape)}" for k, t in self.tensors.items())
        return f"InferResult({self.model_name} v{self.model_version}, {shapes})"


def _array(tensor: Any, shape: tuple[int, ...], data: bytes | None) -> np.ndarray:
    """Output ``tensor``'s values; ValueError naming it when they do not fill ``shape``."""
    count = int(np.prod(shape, dtype=np.int64))
    if data is None:  # typed contents (a server that does not answer raw)
        values = list(getattr(tensor.contents, _TYPED.get(tensor.datatype, "bytes_contents")))
        if len(values) != count:
            raise _malformed(tensor, shape, f"{len(values)} values")
        dtype = object if tensor.datatype == "BYTES" else numpy_dtype(tensor.datatype)
        return np.array(values, dtype=dtype).reshape(shape)
    if tensor.datatype == "BYTES":
        return deserialize_bytes(data, count).reshape(shape)
    dtype = numpy_dtype(tensor.datatype).newbyteorder("<")
    if len(data) != count * dtype.itemsize:
        raise _malformed(tensor, shape, f"{len(data)} bytes")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def _malformed(tensor: Any, shape: tuple[int, ...], got: str) -> ValueError:
    return ValueError(
        f"output {tensor.name!r} of the response is malformed: "
        f"{tensor.datatype}{list(shape)} but {got}"
    )


def _value(parameter: Any) -> Any:
    which = parameter.WhichOneof("parameter_choice")
    return getattr(parameter, which) if which else None


def _as_array(value: Any) -> np.ndarray:
    """``value`` as an array; a sequence of bytes or str becomes an object array (numpy
    would make it a fixed-width one, which drops each element's trailing NUL bytes)."""
    if isinstance(value, np.ndarray):
        return value
    array = np.asarray(value)
    return np.asarray(value, dtype=object) if array.dtype.kind in "SU" else array
