"""The KServe V2 REST tensor codec: a JSON inference request (with Triton's binary tensor
data extension) -> numpy, and numpy -> a JSON response with binary data after it.

Request (``POST .../infer``): a JSON object, optionally followed by binary data when the
``Inference-Header-Content-Length`` header gives the JSON's length. An input's data comes
from exactly one place:

* **system shared memory** when its ``parameters`` name a region (what
  ``tritonclient.http.InferInput.set_shared_memory`` sends); ``data`` and
  ``binary_data_size`` may not be set too;
* else **binary data** when its ``parameters.binary_data_size`` is set: that many bytes,
  taken from the binary part in input order (what ``set_data_from_numpy(binary_data=
  True)`` sends). The sizes must add up to the binary part exactly; ``data`` may not be
  set too;
* else **``data``**: a JSON array, flat or nested (row-major), of exactly
  ``prod(shape)`` values of the datatype's JSON type: booleans (BOOL), integers
  (INT*/UINT*, range-checked), numbers (FP32/FP64), strings (BYTES, UTF-8). FP16 and
  BF16 have no JSON form: binary data or shared memory only (as on gRPC, where they have
  no typed field).

Every check that does not depend on the wire is the gRPC codec's own (``_tensors``,
``_parameters``, ``_encode``), with the same messages; only the wording of where the
data was (``its binary data`` rather than ``its raw_input_contents entry``) differs. A
request that is not such a JSON object is InvalidArgument naming the field at fault.

Response: ``model_name``, ``model_version``, ``id`` (echoed), ``outputs``. An output is
sent as binary data when its ``parameters.binary_data`` is true, or, without that
parameter, when the request's ``parameters.binary_data_output`` is true (tritonclient
sets it when it asks for no outputs by name); it then has ``parameters.binary_data_size``
and its bytes follow the JSON in output order. Other outputs carry ``data`` (flat, as
Triton sends it); an output in shared memory carries neither and echoes
``shared_memory_region`` / ``shared_memory_byte_size`` (bytes written) /
``shared_memory_offset`` (when non-zero).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from rsrv.bundle import Tensor
from rsrv.dtypes import DType
from rsrv.errors import InvalidArgument
from rsrv.protocol._encode import check_output, stage_outputs, write_output
from rsrv.protocol._infer_flow import encode_seconds
from rsrv.protocol._parameters import (
    ShmTarget,
    check_region,
    deadline_of,
    json_param,
    priority_of,
    shm_target_of,
)
from rsrv.protocol._shm import SharedMemoryRegistry
from rsrv.protocol._tensors import (
    BYTES_ELEMENT_SECONDS,
    COPY_BYTE_SECONDS,
    DEFAULT_MAX_TENSOR_BYTES,
    TYPED_VALUE_SECONDS,
    Decoding,
    InputPlan,
    check_data_size,
    check_inputs,
    check_shm_input,
    narrow,
    plan_input,
)

__all__ = [
    "JSON_PARSE_BYTE_SECONDS",
    "RestRequest",
    "decode_rest_inputs",
    "rest_decode_seconds",
    "encode_rest_response",
    "json_error_text",
    "parse_rest_request",
    "rest_deadline",
    "rest_encode_seconds",
    "rest_outputs",
    "rest_priority",
]

#: JSON parsed into Python objects, at worst (an object of many small members: 0.64 s
#: for 26 MB here); a body expected to take longer than OFFLOAD_SECONDS is parsed in a
#: worker thread (12M parameters, 157 MB, held the loop 7 s).
JSON_PARSE_BYTE_SECONDS = 2.5e-8
#: A numeric output value written as JSON (``tolist`` then the encoder: 75-90 ns a
#: float here, 17 an int): 10,000 values take about 1 ms, so more leave the loop.
JSON_VALUE_ENCODE_SECONDS = 1e-7

Param = bool | int | float | str


class RestInput(msgspec.Struct):
    name: str
    datatype: str
    shape: list[int]
    parameters: dict[str, Param] = {}
    data: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)


class RestOutput(msgspec.Struct):
    name: str
    parameters: dict[str, Param] = {}


class RestRequest(msgspec.Struct):
    """An inference request's JSON (unknown fields are ignored, as KServe allows)."""

    inputs: list[RestInput]
    id: str = ""
    parameters: dict[str, Param] = {}
    outputs: list[RestOutput] = []


_REQUEST = msgspec.json.Decoder(RestRequest)
_ANY = msgspec.json.Decoder()
_DTYPE_JSON: dict[DType, tuple[Any, str]] = {}
for _d in DType:
    if _d is DType.BOOL:
        _DTYPE_JSON[_d] = (msgspec.json.Decoder(list[bool]), "booleans")
    elif _d is DType.BYTES:
        _DTYPE_JSON[_d] = (msgspec.json.Decoder(list[str]), "strings")
    elif _d.numpy.kind in "iu":
        _DTYPE_JSON[_d] = (msgspec.json.Decoder(list[int]), "integers")
    elif _d in (DType.F32, DType.F64):
        _DTYPE_JSON[_d] = (msgspec.json.Decoder(list[float]), "numbers")


def parse_rest_request(body) -> RestRequest:
    """The JSON part of an inference request; InvalidArgument naming what is wrong."""
    try:
        return _REQUEST.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
        # (a string not UTF-8; JSON nested past the decoder's depth)
        raise InvalidArgument(
            f"cannot parse the request as a KServe V2 inference request (JSON): "
            f"{json_error_text(e)}"
        ) from None


def _getter(params: Mapping[str, Param], what: str):
    return lambda key, kind: json_param(params, key, kind, what)


def _has_data(raw: msgspec.Raw) -> bool:
    return len(raw) > 0 and bytes(raw) != b"null"


def rest_decode_seconds(request: RestRequest) -> float:
    """Roughly how long :func:`decode_rest_inputs` takes on ``request``, from its inputs'
    headers and the length of their JSON values (BYTES elements parsed, shared memory
    copied, JSON values converted: ~30 ns each, at most one per 2 bytes of JSON)."""
    total = 0.0
    for tensor in request.inputs:
        params = tensor.parameters
        if "shared_memory_region" in params or "binary_data_size" in params:
            if tensor.datatype == "BYTES" and len(tensor.shape) <= 64:  # (more: refused)
                count = min(math.prod(max(d, 0) for d in tensor.shape), 1 << 40)
                total += count * BYTES_ELEMENT_SECONDS
            nbytes = params.get("shared_memory_byte_size")
            total += (nbytes if type(nbytes) is int else 0) * COPY_BYTE_SECONDS
        else:  # (JSON: at most one value per 2 bytes)
            total += len(tensor.data) * TYPED_VALUE_SECONDS / 2
    return total


def decode_rest_inputs(
    request: RestRequest,
    model: str,
    specs: Sequence[Tensor],
    binary: memoryview,
    shm: SharedMemoryRegistry | None = None,
    *,
    max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
    check_rows: Callable[[int], None] | None = None,
) -> dict[str, np.ndarray]:
    """Decode every input of ``request`` (``binary``: the bytes after its JSON) against
    the model's client-facing specs: ``{name: read-only array}`` in request order.
    Raises as the gRPC codec does, every input checked before any is materialized."""
    by_name = {s.name: s for s in specs}
    seen: set[str] = set()
    plans: list[InputPlan] = []
    offset = 0
    for tensor in request.inputs:
        plan = plan_input(
            model,
            tensor.name,
            tensor.datatype,
            tensor.shape,
            by_name,
            seen,
            max_tensor_bytes,
            check_rows,
        )
        what = plan.what
        params = tensor.parameters
        target = size = None
        if params:
            target = shm_target_of(_getter(params, what), what)
            size = json_param(params, "binary_data_size", "int64_param", what)
        has_data = _has_data(tensor.data)
        if target is not None:
            other = "'data'" if has_data else None
            if size is not None:
                other = "binary data (binary_data_size)"
            check_shm_input(plan, target, shm, max_tensor_bytes, other_data=other)
        elif size is not None:
            if has_data:
                raise InvalidArgument(
                    f"{what}: 'data' must not be set when the input is sent as binary data "
                    f"(binary_data_size {size}); send each input one way"
                )
            if size < 0:
                raise InvalidArgument(f"{what}: negative binary_data_size {size}")
            if offset + size > len(binary):
                raise InvalidArgument(
                    f"{what}: binary_data_size {size} at offset {offset} runs past the "
                    f"{len(binary)} bytes of binary data after the JSON header "
                    "(Inference-Header-Content-Length)"
                )
            plan.raw = binary[offset : offset + size]
            offset += size
            check_data_size(plan, size, "its binary data", max_tensor_bytes)
        elif has_data:
            plan.values = _values(plan, tensor.data)
            plan.field = "data"
        elif plan.count:
            where = "binary data (binary_data_size) or shared memory"
            if plan.spec.dtype in _DTYPE_JSON:
                where = "'data', " + where
            raise InvalidArgument(f"{what}: no data for {plan.count} elements; send it in {where}")
        plans.append(plan)
    if offset != len(binary):
        raise InvalidArgument(
            f"request for model '{model}' has {len(binary)} bytes of binary data after "
            f"the JSON header but its inputs' binary_data_size add up to {offset}; "
            "expected one binary part per input sent as binary data, in input order"
        )
    check_inputs(model, specs, plans)
    return Decoding(plans, shm, _from_values).materialize()


def _flatten(value: Any, out: list) -> None:
    """The leaves of nested lists, in row-major order (iteratively: any depth)."""
    stack = [iter((value,))]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()


def json_error_text(e: Exception) -> str:
    """What a JSON decoder's error says (RecursionError: that it is nested too deep)."""
    return "nested too deeply" if isinstance(e, RecursionError) else str(e)


def _values(plan: InputPlan, raw: msgspec.Raw) -> list:
    """The JSON ``data`` of one input as a flat list of its datatype's JSON type, with
    exactly ``prod(shape)`` values."""
    dtype = plan.spec.dtype
    found = _DTYPE_JSON.get(dtype)
    if found is None:
        raise InvalidArgument(
            f"{plan.what}: {dtype.kserve} data can only be sent as binary data "
            "(binary_data_size) or in shared memory, not as JSON 'data'"
        )
    decoder, words = found
    _check_size(plan, raw)
    try:
        values = decoder.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        values = None
    if values is None:  # nested arrays (row-major), or values of the wrong type
        try:
            nested = _ANY.decode(raw)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
            raise InvalidArgument(
                f"{plan.what}: 'data' is not valid JSON: {json_error_text(e)}"
            ) from None
        flat: list = []
        _flatten(nested, flat)
        try:
            values = msgspec.convert(flat, decoder.type)
        except msgspec.ValidationError as e:
            raise InvalidArgument(
                f"{plan.what}: 'data' of datatype {dtype.kserve} must hold {words}: {e}"
            ) from None
    if len(values) != plan.count:
        raise InvalidArgument(
            f"{plan.what}: 'data' has {len(values)} elements but shape "
            f"{list(plan.shape)} needs {plan.count}"
        )
    return values


def _check_size(plan: InputPlan, raw: msgspec.Raw) -> None:
    """InvalidArgument when the JSON ``raw`` holds more values than ``plan``'s shape,
    told before any of it becomes Python objects (60M values for a shape of 16 took
    5 GB, and held the loop, before the count was checked): numbers by their commas
    (``leaves - 1 + empty arrays``), strings (BYTES) by their quotes (two a string,
    escaped ones aside; a string ending in an escaped backslash, ``"a\\"``, counts as
    one quote: at most half of them are missed). Counted only when ``raw`` is long
    enough to hold that many."""
    shape = plan.shape
    if plan.spec.dtype is DType.BYTES:
        if len(raw) <= max(3 * (plan.count + 1), 1 << 16):  # (small: the exact count says)
            return
        data = bytes(memoryview(raw))
        found = (data.count(b'"') - data.count(b'\\"')) // 2
    else:
        arrays = sum(math.prod(shape[:i]) for i in range(1, len(shape)))  # (nested)
        if len(raw) <= 32 * (plan.count + arrays + 1):
            return
        found = bytes(memoryview(raw)).count(b",") - arrays
    if found > plan.count:
        raise InvalidArgument(
            f"{plan.what}: 'data' has more values than shape {list(shape)} holds ({plan.count})"
        )


def _from_values(plan: InputPlan) -> np.ndarray:
    dtype = plan.spec.dtype
    values = plan.values
    if dtype is DType.BYTES:
        array = np.empty(plan.count, dtype=object)
        for i, value in enumerate(values):
            array[i] = value.encode("utf-8")
        return array
    if dtype.numpy.kind not in "iu":
        return np.array(values, dtype=dtype.numpy)
    wide = np.uint64 if dtype is DType.U64 else np.int64
    try:
        array = np.array(values, dtype=wide)
    except OverflowError:
        info = np.iinfo(dtype.numpy)
        raise InvalidArgument(
            f"{plan.what}: 'data' holds values outside the {dtype.kserve} range "
            f"[{info.min}, {info.max}]"
        ) from None
    return narrow(array, plan, "'data'")


def rest_deadline(request: RestRequest, now: float) -> float | None:
    """The request's ``timeout`` parameter (µs) as an absolute deadline, or None."""
    return deadline_of(json_param(request.parameters, "timeout", "int64_param", "the request"), now)


def rest_priority(request: RestRequest) -> int:
    """The ``priority`` parameter (0 if absent): an integer >= 0."""
    value = request.parameters.get("priority")
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(
            "invalid value type for 'priority' parameter, expected an integer >= 0"
        )
    return priority_of(value)


def rest_outputs(
    request: RestRequest,
    model: str,
    produced: Sequence[str],
    shm: SharedMemoryRegistry | None = None,
) -> tuple[list[tuple[str, ShmTarget | None]], frozenset[str]]:
    """Which outputs to return, in which order and where (as ``requested_outputs``),
    and the names of those sent as JSON ``data`` rather than binary data."""
    default = json_param(request.parameters, "binary_data_output", "bool_param", "the request")
    binary_default = bool(default)
    if not request.outputs:
        order = [(name, None) for name in produced]
        return order, frozenset() if binary_default else frozenset(produced)
    seen: set[str] = set()
    order: list[tuple[str, ShmTarget | None]] = []
    as_values = set()
    for output in request.outputs:
        params = output.parameters
        what = check_output(model, output.name, produced, seen, "classification" in params)
        target = None
        binary = binary_default
        if params:
            target = shm_target_of(_getter(params, what), what)
            flag = json_param(params, "binary_data", "bool_param", what)
            binary = binary_default if flag is None else flag
        if target is not None and shm is not None:
            target = check_region(shm, target, what)
        if target is None and not binary:
            as_values.add(output.name)
        order.append((output.name, target))
    return order, frozenset(as_values)


def encode_rest_response(
    request: RestRequest,
    model_name: str,
    model_version: str,
    outputs: Mapping[str, np.ndarray],
    order: Sequence[tuple[str, ShmTarget | None]],
    as_values: frozenset[str],
    shm: SharedMemoryRegistry | None = None,
) -> tuple[bytes, list]:
    """The response's JSON and the binary parts that follow it (in output order; empty
    when every output went as JSON or into shared memory). Outputs in shared memory are
    written after every output has been checked."""
    entries = []
    parts: list = []
    for out in stage_outputs(model_name, outputs, order, shm, as_values):
        entry: dict[str, Any] = {
            "name": out.name,
            "datatype": out.dtype.kserve,
            "shape": list(out.array.shape),
        }
        if out.target is not None:
            params = {
                "shared_memory_region": out.target.region,
                "shared_memory_byte_size": write_output(shm, out),
            }
            if out.target.offset:
                params["shared_memory_offset"] = out.target.offset
            entry["parameters"] = params
        elif out.data is None:
            entry["data"] = _json_values(out.array, out.dtype, out.what)
        else:
            size = len(out.data) if isinstance(out.data, bytes) else out.data.nbytes
            entry["parameters"] = {"binary_data_size": size}
            parts.append(out.data)
        entries.append(entry)
    body: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request.id:
        body["id"] = request.id
    body["outputs"] = entries
    return msgspec.json.encode(body), parts


def rest_encode_seconds(outputs: Mapping[str, np.ndarray], as_values: frozenset[str]) -> float:
    """Roughly how long encoding a REST answer takes: ``encode_seconds``'s copies, and
    each value of the outputs written as JSON values (``as_values``)."""
    values = sum(outputs[name].size for name in as_values if name in outputs)
    return encode_seconds(outputs) + values * JSON_VALUE_ENCODE_SECONDS


#: Values written as JSON in one call of the encoder (about 5 ms of floats): the encoder
#: holds the GIL while it runs, so an answer encoded in a worker thread lets the event
#: loop run between two such pieces, not only once the whole array is written.
JSON_VALUES_AT_ONCE = 65536


def _json_values(array: np.ndarray, dtype: DType, what: str) -> list | msgspec.Raw:
    """An output's values as a flat JSON list (BYTES as UTF-8 strings); numbers
    already encoded, :data:`JSON_VALUES_AT_ONCE` at a time."""
    flat = array.reshape(-1)
    if dtype is DType.BYTES:
        values = []
        for item in flat:
            if isinstance(item, bytes | bytearray | memoryview):
                try:
                    item = bytes(item).decode("utf-8")
                except UnicodeDecodeError:
                    raise InvalidArgument(
                        f"{what} holds bytes that are not UTF-8 text; ask for it as binary "
                        "data (parameters.binary_data: true)"
                    ) from None
            values.append(item if isinstance(item, str) else str(item))
        return values
    if dtype in (DType.F16, DType.BF16):
        flat = flat.astype(np.float32)
    encode = msgspec.json.encode
    pieces = [
        encode(flat[i : i + JSON_VALUES_AT_ONCE].tolist())[1:-1]  # (without its brackets)
        for i in range(0, flat.size, JSON_VALUES_AT_ONCE)
    ]
    return msgspec.Raw(b"[" + b",".join(pieces) + b"]")
