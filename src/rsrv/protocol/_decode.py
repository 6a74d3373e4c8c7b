"""ModelInferRequest -> numpy: the input half of the KServe V2 / Triton tensor codec.

What ``tritonclient.grpc`` sends:

* An input's data comes from exactly one place:

  - **system shared memory** when the tensor names a region (``_parameters``) —
    what ``InferInput.set_shared_memory`` sends. Typed ``contents`` may not be set too.
  - else **raw_input_contents**, when the request's ``raw_input_contents`` is non-empty:
    one entry per input *not* in shared memory, in input order (tritonclient appends no
    entry for a shared-memory input, and Triton reads them the same way). Fewer or more
    entries than that is INVALID_ARGUMENT, as is typed ``contents`` on such an input.
    Row-major, little-endian, unpadded; BOOL is one byte 0 or 1; BYTES as ``_bytes``
    says.
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
  typed element count, shared-memory region, bounds and byte size. Every failure is
  INVALID_ARGUMENT naming the tensor, except the shared-memory statuses of
  ``_parameters``.

The codec assumes a little-endian host (as Triton and tritonclient do).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rsrv.bundle import Tensor
from rsrv.dtypes import DType
from rsrv.errors import InvalidArgument, RsrvError
from rsrv.protocol._bytes import deserialize_bytes
from rsrv.protocol._parameters import (
    ShmTarget,
    check_region,
    registry,
    shm_target,
    with_context,
)
from rsrv.protocol._shm import SharedMemoryRegistry

__all__ = ["DEFAULT_MAX_TENSOR_BYTES", "decode_request"]

DEFAULT_MAX_TENSOR_BYTES = 2**31 - 1
"""Largest tensor (elements x itemsize; 4 bytes per BYTES element at least) accepted."""

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
        target = shm_target(tensor, what)
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
            check_region(shm, target, what)
            plan.shm = target
        elif n_raw:
            if has_contents:  # Triton's words first: its clients match on them
                raise InvalidArgument(
                    "contents field must not be specified when using raw_input_contents "
                    f"for '{name}' for model '{model}' (typed 'contents' and "
                    "'raw_input_contents' are both set; send each input one way)"
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
        found = registry(shm, target, plan.what)
        try:
            data = found.read(target.region, target.offset, target.byte_size)
        except RsrvError as e:  # e.g. unregistered since validation
            raise with_context(e, plan.what) from None
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
        return deserialize_bytes(data, plan.count, plan.what)
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
