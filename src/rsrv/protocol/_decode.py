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
  ``_parameters``. The checks that do not depend on protobuf are ``_tensors``'s, which
  the REST codec (``_rest_codec``) goes through too.

The codec assumes a little-endian host (as Triton and tritonclient do).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rsrv.bundle import Tensor
from rsrv.dtypes import DType
from rsrv.errors import InvalidArgument
from rsrv.protocol._parameters import shm_target
from rsrv.protocol._shm import SharedMemoryRegistry
from rsrv.protocol._tensors import (
    DEFAULT_MAX_TENSOR_BYTES,
    Decoding,
    InputPlan,
    check_data_size,
    check_inputs,
    check_shm_input,
    narrow,
    plan_input,
)

__all__ = ["DEFAULT_MAX_TENSOR_BYTES", "RAW_COPY_BYTE_SECONDS", "decode_request", "plan_request"]

#: Taking a raw entry out of a parsed request copies it (protobuf gives no view of it):
#: ~0.5 ms per MiB measured on a 2-core VM (64 MiB: 33 ms), fresh pages included. A
#: request's raw entries are about its size on the wire.
RAW_COPY_BYTE_SECONDS = 5e-10

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


def _check_typed(plan: InputPlan, tensor: Any) -> str | None:
    contents = tensor.contents
    present = [f for f in _CONTENT_FIELDS if len(getattr(contents, f))]
    expected = _TYPED_FIELD.get(plan.spec.dtype)
    kserve = plan.spec.dtype.kserve
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


def decode_request(
    request: Any,
    specs: Sequence[Tensor],
    shm: SharedMemoryRegistry | None = None,
    *,
    max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
    check_rows: Callable[[int], None] | None = None,
) -> dict[str, np.ndarray]:
    """:func:`plan_request`, then its inputs materialized."""
    return plan_request(
        request, specs, shm, max_tensor_bytes=max_tensor_bytes, check_rows=check_rows
    ).materialize()


def plan_request(
    request: Any,
    specs: Sequence[Tensor],
    shm: SharedMemoryRegistry | None = None,
    *,
    max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
    check_rows: Callable[[int], None] | None = None,
) -> Decoding:
    """Check every input of a ModelInferRequest against the model's client-facing specs
    (``check_rows``: the served model's check of the rows on a batch axis), allocating
    nothing sized by the request: the :class:`Decoding` materializes them.

    ``shm`` None means system shared memory is unavailable (a tensor naming a region is
    FAILED_PRECONDITION). Raises InvalidArgument / NotFound / FailedPrecondition as the
    module docstring lists, each message naming the tensor (and region).
    """
    model = request.model_name
    by_name = {s.name: s for s in specs}
    raw = request.raw_input_contents
    n_raw = len(raw)
    raw_used = 0
    seen: set[str] = set()
    plans: list[InputPlan] = []
    for tensor in request.inputs:
        name = tensor.name
        plan = plan_input(
            model,
            name,
            tensor.datatype,
            tensor.shape,
            by_name,
            seen,
            max_tensor_bytes,
            check_rows,
        )
        what = plan.what
        target = shm_target(tensor, what)
        has_contents = tensor.HasField("contents")
        if target is not None:
            check_shm_input(
                plan,
                target,
                shm,
                max_tensor_bytes,
                other_data="typed 'contents'" if has_contents else None,
            )
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
            check_data_size(plan, len(plan.raw), "its raw_input_contents entry", max_tensor_bytes)
        else:
            plan.values = tensor
            plan.field = _check_typed(plan, tensor)
        plans.append(plan)
    if raw_used != n_raw:
        raise InvalidArgument(
            f"request for model '{model}' has {n_raw} raw_input_contents entries but "
            f"{raw_used} inputs not in shared memory; expected one entry per such input"
        )
    check_inputs(model, specs, plans)
    return Decoding(plans, shm, _from_typed)


def _from_typed(plan: InputPlan) -> np.ndarray:
    values = getattr(plan.values.contents, plan.field)
    if plan.spec.dtype is DType.BYTES:
        array = np.empty(plan.count, dtype=object)
        for i, value in enumerate(values):
            array[i] = value
        return array
    array = np.fromiter(values, dtype=_WIRE_DTYPE[plan.field], count=plan.count)
    return narrow(array, plan, f"contents.{plan.field}")
