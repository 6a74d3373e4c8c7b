"""KServe V2 / Triton tensor codec: ModelInferRequest -> numpy, numpy -> ModelInferResponse.

Wire contract (what ``tritonclient.grpc`` sends and expects):

* An input's data comes from exactly one place:

  - **system shared memory** when the tensor has the parameter ``shared_memory_region``
    (string) with ``shared_memory_byte_size`` (int64, required) and optionally
    ``shared_memory_offset`` (int64, default 0, relative to the registered region) —
    what ``InferInput.set_shared_memory`` sends. Typed ``contents`` may not be set too.
  - else **raw_input_contents**, when the request's ``raw_input_contents`` is non-empty:
    one entry per input *not* in shared memory, in input order (tritonclient appends no
    entry for a shared-memory input, and Triton reads them the same way). Fewer or more
    entries than that is INVALID_ARGUMENT, as is typed ``contents`` on such an input.
    Row-major, little-endian, unpadded; BOOL is one byte 0 or 1; BYTES is, per element, a
    4-byte little-endian length then the bytes.
  - else **typed contents**: ``bool_contents`` (BOOL), ``int_contents`` (INT8/16/32,
    values range-checked), ``int64_contents``, ``uint_contents`` (UINT8/16/32,
    range-checked), ``uint64_contents``, ``fp32_contents``, ``fp64_contents``,
    ``bytes_contents`` (BYTES). FP16 and BF16 have no typed field: raw or shm only.

* Decoded arrays are **read-only**: raw inputs are zero-copy ``np.frombuffer`` views of
  the request's bytes; shared-memory inputs are copied out of the region first (the
  client may reuse it as soon as the response arrives); typed contents are converted.
  Callers that need to write must copy. BYTES inputs are object arrays of ``bytes``.

* Every input is validated before anything sized by the request is allocated:
  names (undeclared, duplicate, missing), datatype, rank, fixed axes (batch and variable
  axes take any extent >= 0, the batch axis at least 1), negative dims, size (elements x
  itemsize, or 4 bytes per BYTES element, above ``max_tensor_bytes``), raw byte length,
  typed element count, shared-memory region, bounds and byte size.

* Responses list every requested output in ``outputs`` and, at the same position, in
  ``raw_output_contents`` (tritonclient's ``InferResult.as_numpy`` indexes
  ``raw_output_contents`` by output position). An output written to shared memory gets
  an empty entry there, as in Triton, and its ``InferOutputTensor.parameters`` echo
  ``shared_memory_region``, ``shared_memory_byte_size`` (the bytes actually written) and
  ``shared_memory_offset`` (when non-zero); read it with ``InferResult.get_output`` and
  ``tritonclient.utils.shared_memory.get_contents_as_numpy``.

Status decisions (all raised as ``rsrv.errors`` exceptions; ``rsrv.protocol._status``
maps them):

* INVALID_ARGUMENT: every malformed request above, an unknown or duplicate requested
  output, a ``classification`` output parameter (not supported), a bad parameter type
  (``timeout`` must be int64; ``priority`` uint64 or int64 >= 0, as Triton), a negative
  ``timeout``, shared-memory offset + size past the region, a shared-memory byte size
  that differs from the tensor's, an output larger than its ``shared_memory_byte_size``
  (Triton says INTERNAL there; it is the caller's sizing mistake).
* NOT_FOUND: an unregistered region, with Triton's message
  ``Unable to find shared memory region: '<name>'`` followed by the tensor. (Triton's
  inference path answers NOT_FOUND with this text; the "system shared memory region"
  wording is its SystemSharedMemoryStatus message, which ``shm.status`` uses.)
* FAILED_PRECONDITION: a tensor names a region while system shared memory is disabled
  (``shm`` is None or not enabled).
* INTERNAL: the model did not produce a requested output, or produced a dtype with no
  KServe datatype.

The codec assumes a little-endian host (as Triton and tritonclient do).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rsrv.bundle import Tensor
from rsrv.dtypes import DType
from rsrv.errors import FailedPrecondition, Internal, InvalidArgument, RsrvError
from rsrv.protocol._shm import DISABLED_MESSAGE, SharedMemoryRegistry
from rsrv.protocol.generated.inference import grpc_service_pb2 as pb

__all__ = [
    "DEFAULT_MAX_TENSOR_BYTES",
    "ShmTarget",
    "decode_request",
    "encode_response",
    "request_deadline",
    "request_priority",
    "requested_outputs",
    "tensor_metadata",
]

DEFAULT_MAX_TENSOR_BYTES = 2**31 - 1
"""Largest tensor (elements x itemsize; 4 bytes per BYTES element at least) accepted."""

_U32 = struct.Struct("<I")
_CONTENT_FIELDS = (
    "bool_contents",
    "int_contents",
    "int64_contents",
    "uint_contents",
    "uint64_contents",
    "fp32_contents",
    "fp64_contents",
    "bytes_contents",
)
_TYPED_FIELD = {
    DType.BOOL: "bool_contents",
    DType.I8: "int_contents",
    DType.I16: "int_contents",
    DType.I32: "int_contents",
    DType.I64: "int64_contents",
    DType.U8: "uint_contents",
    DType.U16: "uint_contents",
    DType.U32: "uint_contents",
    DType.U64: "uint64_contents",
    DType.F32: "fp32_contents",
    DType.F64: "fp64_contents",
    DType.BYTES: "bytes_contents",
}
_WIRE_DTYPE = {
    "bool_contents": np.dtype(np.bool_),
    "int_contents": np.dtype(np.int32),
    "int64_contents": np.dtype(np.int64),
    "uint_contents": np.dtype(np.uint32),
    "uint64_contents": np.dtype(np.uint64),
    "fp32_contents": np.dtype(np.float32),
    "fp64_contents": np.dtype(np.float64),
}


@dataclass(frozen=True, slots=True)
class ShmTarget:
    """A tensor's place in a registered system shared memory region."""

    region: str
    byte_size: int
    offset: int = 0


# --- parameters ---------------------------------------------------------------------------


def _param(params: Any, key: str, kind: str, what: str) -> Any:
    """The value of parameter ``key`` (None if absent), which must be of oneof ``kind``."""
    if key not in params:  # `params[key]` would insert a default entry
        return None
    value = params[key]
    if value.WhichOneof("parameter_choice") != kind:
        raise InvalidArgument(
            f"invalid value type for '{key}' parameter for {what}, expected {kind}"
        )
    return getattr(value, kind)


def _shm_params(tensor: Any, what: str) -> ShmTarget | None:
    params = tensor.parameters
    region = _param(params, "shared_memory_region", "string_param", what)
    byte_size = _param(params, "shared_memory_byte_size", "int64_param", what)
    offset = _param(params, "shared_memory_offset", "int64_param", what)
    if region is None:
        if byte_size is not None or offset is not None:
            raise InvalidArgument(
                f"'shared_memory_byte_size' and 'shared_memory_offset' can not be specified "
                f"without 'shared_memory_region' parameter for {what}"
            )
        return None
    if not region:
        raise InvalidArgument(f"empty 'shared_memory_region' parameter for {what}")
    if byte_size is None:
        raise InvalidArgument(
            f"'shared_memory_byte_size' parameter is required with 'shared_memory_region' "
            f"'{region}' for {what}"
        )
    offset = offset or 0
    if byte_size < 0 or offset < 0:
        raise InvalidArgument(
            f"negative shared memory byte size {byte_size} or offset {offset} in region "
            f"'{region}' for {what}"
        )
    return ShmTarget(region, byte_size, offset)


def _registry(shm: SharedMemoryRegistry | None, target: ShmTarget, what: str):
    if shm is None or not shm.enabled:
        raise FailedPrecondition(
            f"{what} uses shared memory region '{target.region}', but {DISABLED_MESSAGE}"
        )
    return shm


def _with_context(e: RsrvError, what: str) -> RsrvError:
    return type(e)(f"{e} ({what})")


def _check_region(shm: SharedMemoryRegistry | None, target: ShmTarget, what: str) -> None:
    registry = _registry(shm, target, what)
    try:
        registry.check(target.region, target.offset, target.byte_size)
    except RsrvError as e:
        raise _with_context(e, what) from None


def request_deadline(request: Any, now: float) -> float | None:
    """Absolute deadline (``now`` + the ``timeout`` parameter, in µs) or None.

    tritonclient's ``infer(..., timeout=µs)`` sends ``parameters["timeout"].int64_param``.
    Absent or 0 means no deadline; negative or a non-int64 value is INVALID_ARGUMENT.
    ``now`` and the result are in seconds on the caller's clock (e.g. ``trio.current_time``).
    """
    value = _param(request.parameters, "timeout", "int64_param", "the request")
    if not value:
        return None
    if value < 0:
        raise InvalidArgument(
            f"invalid value {value} for 'timeout' parameter: expected microseconds >= 0 "
            "(0 means no timeout)"
        )
    return now + value / 1e6


def request_priority(request: Any) -> int:
    """The ``priority`` parameter (0, the default, if absent).

    tritonclient sends ``uint64_param``; Triton also accepts ``int64_param`` >= 0.
    """
    params = request.parameters
    if "priority" not in params:
        return 0
    value = params["priority"]
    which = value.WhichOneof("parameter_choice")
    if which == "uint64_param":
        return value.uint64_param
    if which == "int64_param":
        if value.int64_param < 0:
            raise InvalidArgument("invalid value for 'priority', expected value >= 0")
        return value.int64_param
    raise InvalidArgument(
        "invalid value type for 'priority' parameter, expected uint64_param or int64_param"
    )


def tensor_metadata(spec: Tensor) -> Any:
    """``ModelMetadataResponse.TensorMetadata`` for a client-facing tensor (-1: any extent;
    ``Tensor.shape`` already holds -1 on the batch and variable axes)."""
    return pb.ModelMetadataResponse.TensorMetadata(
        name=spec.name, datatype=spec.dtype.kserve, shape=list(spec.shape)
    )


# --- decoding -----------------------------------------------------------------------------


@dataclass(slots=True)
class _Plan:
    spec: Tensor
    what: str
    shape: tuple[int, ...]
    count: int
    raw: bytes | None = None
    shm: ShmTarget | None = None
    tensor: Any = None
    field: str | None = None


def _names(specs: Sequence[Tensor]) -> str:
    return "[" + ", ".join(f"'{s.name}'" for s in specs) + "]"


def _check_shape(spec: Tensor, shape: tuple[int, ...], what: str) -> None:
    if len(shape) != spec.rank:
        raise InvalidArgument(
            f"{what}: rank {len(shape)} (shape {list(shape)}) does not match the model's "
            f"rank {spec.rank} ({spec.describe()})"
        )
    for axis, (got, want) in enumerate(zip(shape, spec.shape, strict=True)):
        if got < 0:
            raise InvalidArgument(
                f"{what}: negative dimension {got} on axis {axis} of shape {list(shape)}"
            )
        if axis == spec.batch_axis:
            if got == 0:
                raise InvalidArgument(
                    f"{what}: the batch axis (axis {axis}) has 0 rows in shape "
                    f"{list(shape)}; a request needs at least one"
                )
        elif want >= 0 and got != want:
            raise InvalidArgument(
                f"{what}: axis {axis} has extent {got} but the model expects {want} "
                f"(shape {list(shape)} vs {spec.describe()})"
            )


def _min_bytes(spec: Tensor, count: int) -> int:
    """Exact byte size, or for BYTES the least possible (a 4-byte prefix per element)."""
    return count * (spec.dtype.itemsize or 4)


def _check_typed(spec: Tensor, plan: _Plan, tensor: Any) -> str | None:
    contents = tensor.contents
    present = [f for f in _CONTENT_FIELDS if len(getattr(contents, f))]
    expected = _TYPED_FIELD.get(spec.dtype)
    kserve = spec.dtype.kserve
    if not present:
        if plan.count == 0:
            return None
        where = "raw_input_contents or shared memory"
        if expected is not None:
            where += f" or contents.{expected}"
        raise InvalidArgument(f"{plan.what}: no data for {plan.count} elements; send it in {where}")
    if expected is None:
        raise InvalidArgument(
            f"{plan.what}: {kserve} data can only be sent in raw_input_contents or shared "
            f"memory, not as typed contents ({', '.join(present)})"
        )
    if present != [expected]:
        raise InvalidArgument(
            f"{plan.what}: typed contents for datatype {kserve} belong in "
            f"contents.{expected}, got {', '.join(present)}"
        )
    n = len(getattr(contents, expected))
    if n != plan.count:
        raise InvalidArgument(
            f"{plan.what}: contents.{expected} has {n} elements but shape "
            f"{list(plan.shape)} needs {plan.count}"
        )
    return expected


def _check_data_size(spec: Tensor, plan: _Plan, nbytes: int, source: str, limit: int) -> None:
    if spec.dtype is DType.BYTES:
        if nbytes < 4 * plan.count:
            raise InvalidArgument(
                f"{plan.what}: {source} holds {nbytes} bytes, too few for {plan.count} "
                f"BYTES elements (each needs a 4-byte length prefix)"
            )
        if nbytes > limit:
            raise InvalidArgument(
                f"{plan.what}: {source} holds {nbytes} bytes, above the limit of {limit} "
                "bytes per tensor"
            )
        return
    expected = plan.count * spec.dtype.itemsize
    if nbytes != expected:
        raise InvalidArgument(
            f"{plan.what}: {source} holds {nbytes} bytes but shape {list(plan.shape)} of "
            f"{spec.dtype.kserve} needs {plan.count} x {spec.dtype.itemsize} = {expected}"
        )


def decode_request(
    request: Any,
    specs: Sequence[Tensor],
    shm: SharedMemoryRegistry | None = None,
    *,
    max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
) -> dict[str, np.ndarray]:
    """Decode every input of a ModelInferRequest against the model's client-facing specs.

    Returns ``{name: read-only array}`` in request order. ``shm`` None means system shared
    memory is unavailable (a tensor naming a region is FAILED_PRECONDITION). Raises
    InvalidArgument / NotFound / FailedPrecondition as the module docstring lists, each
    message naming the tensor (and region), before anything sized by the request is
    allocated.
    """
    model = request.model_name
    by_name = {s.name: s for s in specs}
    raw = request.raw_input_contents
    n_raw = len(raw)
    raw_used = 0
    seen: set[str] = set()
    plans: list[_Plan] = []
    for tensor in request.inputs:
        name = tensor.name
        what = f"input tensor '{name}' for model '{model}'"
        spec = by_name.get(name)
        if spec is None:
            raise InvalidArgument(f"unexpected {what}: the model's inputs are {_names(specs)}")
        if name in seen:
            raise InvalidArgument(f"{what} appears more than once in the request")
        seen.add(name)
        if tensor.datatype != spec.dtype.kserve:
            raise InvalidArgument(
                f"{what}: got datatype {tensor.datatype or '(empty)'}, expected {spec.dtype.kserve}"
            )
        shape = tuple(tensor.shape)
        _check_shape(spec, shape, what)
        count = math.prod(shape)
        least = _min_bytes(spec, count)
        if least > max_tensor_bytes:
            raise InvalidArgument(
                f"{what}: shape {list(shape)} has {count} elements ({least} bytes"
                f"{' at least' if spec.dtype is DType.BYTES else ''}), above the limit of "
                f"{max_tensor_bytes} bytes per tensor"
            )
        plan = _Plan(spec, what, shape, count)
        target = _shm_params(tensor, what)
        has_contents = tensor.HasField("contents")
        if target is not None:
            if has_contents:
                raise InvalidArgument(
                    f"{what}: typed 'contents' must not be set when the input is in shared "
                    f"memory region '{target.region}'"
                )
            _check_data_size(
                spec,
                plan,
                target.byte_size,
                f"shared_memory_byte_size of region '{target.region}'",
                max_tensor_bytes,
            )
            _check_region(shm, target, what)
            plan.shm = target
        elif n_raw:
            if has_contents:
                raise InvalidArgument(
                    f"{what}: typed 'contents' and 'raw_input_contents' are both set; "
                    "send each input one way"
                )
            if raw_used >= n_raw:
                raise InvalidArgument(
                    f"{what}: raw_input_contents has {n_raw} entries, none left for this "
                    "input (one entry per input not in shared memory, in input order)"
                )
            plan.raw = raw[raw_used]
            raw_used += 1
            _check_data_size(
                spec, plan, len(plan.raw), "its raw_input_contents entry", max_tensor_bytes
            )
        else:
            plan.tensor = tensor
            plan.field = _check_typed(spec, plan, tensor)
        plans.append(plan)
    if raw_used != n_raw:
        raise InvalidArgument(
            f"request for model '{model}' has {n_raw} raw_input_contents entries but "
            f"{raw_used} inputs not in shared memory; expected one entry per such input"
        )
    missing = [s.name for s in specs if s.name not in seen]
    if missing:
        raise InvalidArgument(
            f"model '{model}' expects input tensor(s) "
            f"{', '.join(repr(m) for m in missing)}, missing from the request"
        )
    return {plan.spec.name: _materialize(plan, shm) for plan in plans}


def _materialize(plan: _Plan, shm: SharedMemoryRegistry | None) -> np.ndarray:
    spec = plan.spec
    if plan.shm is not None:
        target = plan.shm
        registry = _registry(shm, target, plan.what)
        try:
            data = registry.read(target.region, target.offset, target.byte_size)
        except RsrvError as e:  # e.g. unregistered since validation
            raise _with_context(e, plan.what) from None
        array = _from_buffer(spec, plan, data)
    elif plan.raw is not None:
        array = _from_buffer(spec, plan, plan.raw)
    else:
        array = _from_typed(spec, plan)
    array = array.reshape(plan.shape)
    array.flags.writeable = False
    return array


def _from_buffer(spec: Tensor, plan: _Plan, data: bytes) -> np.ndarray:
    if spec.dtype is DType.BYTES:
        return _deserialize_bytes(data, plan.count, plan.what)
    if spec.dtype is DType.BOOL and plan.count:
        if np.frombuffer(data, dtype=np.uint8).max() > 1:
            raise InvalidArgument(f"{plan.what}: BOOL bytes must be 0 or 1")
    return np.frombuffer(data, dtype=spec.dtype.numpy)


def _from_typed(spec: Tensor, plan: _Plan) -> np.ndarray:
    if plan.field is None:  # no elements, no contents
        return np.empty(0, dtype=spec.dtype.numpy)
    values = getattr(plan.tensor.contents, plan.field)
    if spec.dtype is DType.BYTES:
        array = np.empty(plan.count, dtype=object)
        for i, value in enumerate(values):
            array[i] = value
        return array
    wire = _WIRE_DTYPE[plan.field]
    array = np.fromiter(values, dtype=wire, count=plan.count)
    target = spec.dtype.numpy
    if target != wire:
        info = np.iinfo(target)
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise InvalidArgument(
                f"{plan.what}: contents.{plan.field} holds values outside the "
                f"{spec.dtype.kserve} range [{info.min}, {info.max}]"
            )
        array = array.astype(target)
    return array


def _deserialize_bytes(data: bytes, count: int, what: str) -> np.ndarray:
    """Length-prefixed BYTES elements; ``len(data) >= 4 * count`` was checked."""
    out = np.empty(count, dtype=object)
    view = memoryview(data)
    size = len(data)
    pos = 0
    for i in range(count):
        if pos + 4 > size:
            raise InvalidArgument(
                f"{what}: BYTES data ends inside the length prefix of element {i} "
                f"(offset {pos} of {size})"
            )
        (length,) = _U32.unpack_from(data, pos)
        pos += 4
        end = pos + length
        if end > size:
            raise InvalidArgument(
                f"{what}: BYTES element {i} claims {length} bytes at offset {pos}, past the "
                f"end of the {size}-byte buffer"
            )
        out[i] = bytes(view[pos:end])
        pos = end
    if pos != size:
        raise InvalidArgument(
            f"{what}: BYTES data has {size - pos} trailing bytes after {count} elements "
            "(element count does not match the shape)"
        )
    return out


# --- outputs ------------------------------------------------------------------------------


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
        target = _shm_params(output, what)
        if target is not None and shm is not None:
            _check_region(shm, target, what)
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


def _serialize_bytes(array: np.ndarray, what: str) -> bytes:
    parts: list[bytes] = []
    for item in array.ravel(order="C"):
        if isinstance(item, bytes):
            data = item
        elif isinstance(item, str):
            data = item.encode("utf-8")
        elif isinstance(item, bytearray | memoryview):
            data = bytes(item)
        else:
            data = str(item).encode("utf-8")
        if len(data) > 0xFFFFFFFF:
            raise Internal(f"{what}: a BYTES element exceeds 4 GiB")
        parts.append(_U32.pack(len(data)))
        parts.append(data)
    return b"".join(parts)


def _wire(array: np.ndarray, dtype: DType, what: str) -> bytes | memoryview:
    """The output's row-major little-endian bytes (a view where no conversion is needed)."""
    if dtype is DType.BYTES:
        return _serialize_bytes(array, what)
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
            _registry(shm, target, what)
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
            raise _with_context(e, what) from None
        response.raw_output_contents.append(b"")
        tensor.parameters["shared_memory_region"].string_param = target.region
        tensor.parameters["shared_memory_byte_size"].int64_param = written
        if target.offset:
            tensor.parameters["shared_memory_offset"].int64_param = target.offset
    return response
