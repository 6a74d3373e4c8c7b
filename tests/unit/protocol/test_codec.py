"""Tensor codec: requests built by tritonclient, responses read back by tritonclient.

Requests are assembled from tritonclient's own ``InferInput`` / ``InferRequestedOutput``
objects into tritonclient's ``ModelInferRequest``, serialized, and parsed with rsrv's
generated message: the tests prove the wire contract, not just our own round trip.
"""

from __future__ import annotations

import struct
import uuid

import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.utils.shared_memory as tshm
from purerpc.grpclib import exceptions as rpc_exc
from purerpc.grpclib.status import StatusCode
from support.assertions import raises
from support.clients import infer_input
from tritonclient.grpc import service_pb2 as t_svc
from tritonclient.utils import serialize_byte_tensor

from rsrv.bundle._manifest import Tensor
from rsrv.dtypes import DType
from rsrv.errors import (
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from rsrv.protocol import (
    MAX_MESSAGE_CHARS,
    Admission,
    AlreadyExists,
    SharedMemoryRegistry,
    ShmTarget,
    _tensors,
    decode_request,
    encode_response,
    grpc_status,
    grpc_trailers,
    pushback_of,
    request_deadline,
    request_priority,
    requested_outputs,
    stream_error,
    stream_response,
    tensor_metadata,
)
from rsrv.protocol.generated.inference import grpc_service_pb2 as pb

MODEL = "m"
ALL_FIXED = [d for d in DType if d is not DType.BYTES]


# --- helpers ------------------------------------------------------------------------------


def spec(name="x", dtype=DType.F32, shape=(-1, 3), batch_axis=0, letters=None) -> Tensor:
    letters = letters or "nabcdefg"[: len(shape)]
    return Tensor(name, dtype, letters, tuple(shape), batch_axis)


def to_ours(t_request: t_svc.ModelInferRequest) -> pb.ModelInferRequest:
    """tritonclient's message on the wire, parsed by rsrv."""
    return pb.ModelInferRequest.FromString(t_request.SerializeToString())


def build(inputs, outputs=None, *, raw=True, request_id="", **params) -> pb.ModelInferRequest:
    """Assemble a request exactly as tritonclient does (``_get_inference_request``)."""
    t_request = t_svc.ModelInferRequest(model_name=MODEL, id=request_id)
    for tensor in inputs:
        t_request.inputs.extend([tensor._get_tensor()])
        if raw and tensor._get_content() is not None:
            t_request.raw_input_contents.extend([tensor._get_content()])
    for infer_output in outputs or []:
        t_request.outputs.extend([infer_output._get_tensor()])
    for key, value in params.items():
        t_request.parameters[key].CopyFrom(value)
    return to_ours(t_request)


def sample(dtype: DType, shape=(2, 3), seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if dtype is DType.BOOL:
        return rng.integers(0, 2, n).astype(bool).reshape(shape)
    if dtype is DType.BYTES:
        items = [b"", b"a", b"\x00\xff", "é".encode(), b"x" * 300, b"zz"]
        return np.array((items * n)[:n], dtype=object).reshape(shape)
    np_dtype = dtype.numpy
    if np_dtype.kind in "iu":
        info = np.iinfo(np_dtype)
        return rng.integers(info.min, info.max, n, dtype=np_dtype, endpoint=True).reshape(shape)
    return rng.standard_normal(n).astype(np_dtype).reshape(shape)


def typed_input(name, dtype: DType, shape, **contents) -> t_svc.ModelInferRequest:
    tensor = t_svc.ModelInferRequest.InferInputTensor(
        name=name, datatype=dtype.kserve, shape=list(shape)
    )
    for field, values in contents.items():
        getattr(tensor.contents, field).extend(values)
    return tensor


def typed_request(*tensors, raw=()) -> pb.ModelInferRequest:
    t_request = t_svc.ModelInferRequest(model_name=MODEL)
    t_request.inputs.extend(tensors)
    t_request.raw_input_contents.extend(raw)
    return to_ours(t_request)


def as_triton_result(response: pb.ModelInferResponse) -> tgrpc.InferResult:
    parsed = t_svc.ModelInferResponse.FromString(response.SerializeToString())
    return tgrpc.InferResult(parsed)


def serialize_bytes(items) -> bytes:
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


@pytest.fixture
def regions():
    """Real POSIX shared memory created through tritonclient's own utilities."""
    registry = SharedMemoryRegistry()
    handles = []

    def make(name: str, byte_size: int):
        key = f"/rsrv_test_{uuid.uuid4().hex[:12]}"
        handle = tshm.create_shared_memory_region(name, key, byte_size)
        handles.append(handle)
        registry.register(name, key, 0, byte_size)
        return handle

    yield registry, make
    registry.close()
    for handle in handles:
        tshm.destroy_shared_memory_region(handle)


# --- decode: round trips ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.kserve)
def test_raw_round_trip_every_dtype(dtype):
    array = sample(dtype)
    request = build([infer_input("x", array)])
    out = decode_request(request, [spec(dtype=dtype)])
    got = out["x"]
    assert got.shape == (2, 3)
    assert got.dtype == dtype.numpy
    assert not got.flags.writeable
    if dtype is DType.BYTES:
        assert got.tolist() == array.tolist()
        assert all(type(v) is bytes for v in got.ravel())
    else:
        np.testing.assert_array_equal(got, array)


def test_raw_is_zero_copy_view():
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = decode_request(build([infer_input("x", array)]), [spec()])
    assert out["x"].base is not None  # a view over the request's bytes, not a fresh buffer
    with pytest.raises(ValueError):
        out["x"][0, 0] = 1.0


TYPED_VALUES = {
    DType.BOOL: ("bool_contents", [True, False, True, True, False, False]),
    DType.I8: ("int_contents", [-128, 127, 0, 1, -1, 5]),
    DType.I16: ("int_contents", [-32768, 32767, 0, 1, -1, 5]),
    DType.I32: ("int_contents", [-(2**31), 2**31 - 1, 0, 1, -1, 5]),
    DType.I64: ("int64_contents", [-(2**63), 2**63 - 1, 0, 1, -1, 5]),
    DType.U8: ("uint_contents", [0, 255, 1, 2, 3, 4]),
    DType.U16: ("uint_contents", [0, 65535, 1, 2, 3, 4]),
    DType.U32: ("uint_contents", [0, 2**32 - 1, 1, 2, 3, 4]),
    DType.U64: ("uint64_contents", [0, 2**64 - 1, 1, 2, 3, 4]),
    DType.F32: ("fp32_contents", [0.5, -1.25, 3.0, 1e30, -0.0, 7.75]),
    DType.F64: ("fp64_contents", [0.1, -1e300, 3.0, 2.5, -0.0, 7.75]),
    DType.BYTES: ("bytes_contents", [b"", b"a", b"\x00\xff", b"xyz", b"q" * 40, b"!"]),
}


@pytest.mark.parametrize("dtype", list(TYPED_VALUES), ids=lambda d: d.kserve)
def test_typed_round_trip(dtype):
    field, values = TYPED_VALUES[dtype]
    request = typed_request(typed_input("x", dtype, [2, 3], **{field: values}))
    got = decode_request(request, [spec(dtype=dtype)])["x"]
    assert got.shape == (2, 3) and got.dtype == dtype.numpy
    assert not got.flags.writeable
    expected = np.array(values, dtype=dtype.numpy).reshape(2, 3)
    if dtype is DType.BYTES:
        assert got.tolist() == expected.tolist()
    else:
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("dtype", [DType.F16, DType.BF16], ids=lambda d: d.kserve)
def test_fp16_bf16_typed_contents_rejected(dtype):
    request = typed_request(typed_input("x", dtype, [1, 3], fp32_contents=[1.0, 2.0, 3.0]))
    with raises(InvalidArgument, "'x'", dtype.kserve, "raw_input_contents or shared memory"):
        decode_request(request, [spec(dtype=dtype)])


def test_bytes_round_trip_with_empty_and_binary_elements():
    array = np.array([[b"", b"\x00\x00\x00\x00", "snowman ☃".encode()]], dtype=object)
    out = decode_request(build([infer_input("s", array)]), [spec("s", DType.BYTES)])
    assert out["s"].tolist() == array.tolist()


def test_scalar_and_variable_axes():
    specs = [
        spec("scalar", DType.I64, (), None),
        spec("var", DType.F32, (-1, -1, 2), 0),  # batch, variable, fixed
    ]
    scalar = np.array(7, dtype=np.int64)
    var = np.zeros((1, 0, 2), dtype=np.float32)  # variable axis may be empty
    out = decode_request(build([infer_input("scalar", scalar), infer_input("var", var)]), specs)
    assert out["scalar"].shape == () and out["scalar"] == 7
    assert out["var"].shape == (1, 0, 2)


def test_typed_zero_elements_without_contents_is_fine():
    request = typed_request(typed_input("v", DType.F32, [1, 0]))
    out = decode_request(request, [spec("v", DType.F32, (-1, -1))])
    assert out["v"].shape == (1, 0)


def test_multiple_inputs_in_request_order_with_mixed_shm_and_raw(regions):
    registry, make = regions
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    b = np.linspace(0, 1, 6, dtype=np.float32).reshape(2, 3)
    handle = make("in_a", a.nbytes + 16)
    tshm.set_shared_memory_region(handle, [a], offset=16)
    in_a = tgrpc.InferInput("a", [2, 3], "INT32")
    in_a.set_shared_memory("in_a", a.nbytes, offset=16)
    in_b = infer_input("b", b)
    request = build([in_a, in_b])
    assert len(request.raw_input_contents) == 1  # tritonclient sends none for shm inputs
    specs = [spec("b", DType.F32), spec("a", DType.I32)]
    out = decode_request(request, specs, registry)
    assert list(out) == ["a", "b"]
    np.testing.assert_array_equal(out["a"], a)
    np.testing.assert_array_equal(out["b"], b)
    assert not out["a"].flags.writeable


def test_shm_input_is_copied_out_of_the_region(regions):
    registry, make = regions
    a = np.arange(6, dtype=np.float64).reshape(2, 3)
    handle = make("r", a.nbytes)
    tshm.set_shared_memory_region(handle, [a])
    in_a = tgrpc.InferInput("x", [2, 3], "FP64")
    in_a.set_shared_memory("r", a.nbytes)
    out = decode_request(build([in_a]), [spec(dtype=DType.F64)], registry)
    tshm.set_shared_memory_region(handle, [np.zeros_like(a)])  # client reuses the region
    np.testing.assert_array_equal(out["x"], a)


def test_shm_bytes_input(regions):
    registry, make = regions
    array = np.array([[b"ab", b"", b"cde"]], dtype=object)
    payload = serialize_bytes(array.ravel())
    handle = make("s", 64)
    tshm.set_shared_memory_region(handle, [serialize_byte_tensor(array)])  # as Triton's example
    in_s = tgrpc.InferInput("s", [1, 3], "BYTES")
    in_s.set_shared_memory("s", len(payload))
    out = decode_request(build([in_s]), [spec("s", DType.BYTES)], registry)
    assert out["s"].tolist() == array.tolist()


# --- decode: bad input --------------------------------------------------------------------


def test_undeclared_input():
    request = build([infer_input("x", sample(DType.F32)), infer_input("bogus", sample(DType.F32))])
    with raises(InvalidArgument, "'bogus'", "'x'"):
        decode_request(request, [spec()])


def test_missing_input():
    request = build([infer_input("x", sample(DType.F32))])
    with raises(InvalidArgument, "'y'", "missing"):
        decode_request(request, [spec(), spec("y")])


def test_duplicate_input():
    array = sample(DType.F32)
    request = build([infer_input("x", array), infer_input("x", array)])
    with raises(InvalidArgument, "'x'", "more than once"):
        decode_request(request, [spec()])


def test_dtype_mismatch_names_tensor_got_and_expected():
    request = build([infer_input("x", sample(DType.I32))])
    with raises(InvalidArgument, "'x'", "INT32", "FP32"):
        decode_request(request, [spec()])


def test_rank_mismatch():
    request = build([infer_input("x", np.zeros((2, 3, 1), dtype=np.float32))])
    with raises(InvalidArgument, "'x'", "rank 3", "rank 2"):
        decode_request(request, [spec()])


def test_a_rank_of_millions_is_refused_before_the_shape_is_walked():
    """A shape of 2M dimensions (8 MB on the wire) is refused on its length: the
    message showed all of them (and a 20M-dimension request stalled the loop 1.5 s)."""
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype="FP32", shape=[1] * 2_000_000)
    with pytest.raises(InvalidArgument) as raised:
        decode_request(request, [spec()])
    assert "rank 2000000 (shape [1, 1, 1, 1, 1, 1, 1, 1, ...])" in str(raised.value)
    assert len(str(raised.value)) < 300


def test_fixed_axis_mismatch():
    request = build([infer_input("x", np.zeros((2, 4), dtype=np.float32))])
    with raises(InvalidArgument, "'x'", "axis 1", "extent 4", "expects 3"):
        decode_request(request, [spec()])


def test_negative_dims():
    tensor = tgrpc.InferInput("x", [-2, 3], "FP32")
    tensor._raw_content = b""
    with raises(InvalidArgument, "'x'", "negative dimension -2"):
        decode_request(build([tensor]), [spec()])


def test_zero_rows_on_batch_axis():
    request = build([infer_input("x", np.zeros((0, 3), dtype=np.float32))])
    with raises(InvalidArgument, "'x'", "batch axis", "0 rows"):
        decode_request(request, [spec()])


def test_element_count_overflow_is_rejected_before_allocating():
    tensor = tgrpc.InferInput("x", [2**40, 2**40, 3], "FP32")
    tensor._raw_content = b"\x00" * 12
    specs = [spec(shape=(-1, -1, 3))]
    with raises(InvalidArgument, "'x'", "above the limit of 2147483647 bytes"):
        decode_request(build([tensor]), specs)


def test_configurable_byte_limit():
    request = build([infer_input("x", np.zeros((4, 3), dtype=np.float32))])
    with raises(InvalidArgument, "'x'", "48 bytes", "limit of 40"):
        decode_request(request, [spec()], max_tensor_bytes=40)
    assert decode_request(request, [spec()], max_tensor_bytes=48)["x"].shape == (4, 3)


def test_bytes_element_count_overflow():
    tensor = tgrpc.InferInput("s", [2**31, 1], "BYTES")
    tensor._raw_content = b""
    with raises(InvalidArgument, "'s'", "at least", "limit"):
        decode_request(build([tensor]), [spec("s", DType.BYTES, (-1, 1))])


@pytest.mark.parametrize("source", ["raw", "none"])
def test_a_zero_size_tensor_whose_other_dimensions_overflow_is_refused(source):
    """0 x 2**62: no data, but numpy cannot shape it (it was INTERNAL "array is too big")."""
    tensor = tgrpc.InferInput("x", [0, 2**62], "FP32")
    if source == "raw":
        tensor._raw_content = b""
    with raises(InvalidArgument, "'x'", "0 elements, but its other dimensions span", "limit"):
        decode_request(build([tensor]), [spec(shape=(-1, -1), batch_axis=None)])


def test_rows_are_checked_before_any_data_is_decoded(monkeypatch):
    """The served model's check of the rows on the batch axis runs with the header's
    checks, before anything is materialized (shared memory copied, BYTES split)."""
    calls, rows = [], []
    monkeypatch.setattr(_tensors, "materialize", lambda *a: calls.append(a))

    def check_rows(n):
        rows.append(n)
        raise InvalidArgument(f"model 'm': a request of {n} rows exceeds ...")

    request = build([infer_input("x", np.zeros((9, 3), dtype=np.float32))])
    with raises(InvalidArgument, "a request of 9 rows exceeds"):
        decode_request(request, [spec()], check_rows=check_rows)
    assert rows == [9] and calls == []


def test_raw_byte_length_mismatch():
    tensor = tgrpc.InferInput("x", [2, 3], "FP32")
    tensor._raw_content = b"\x00" * 20
    with raises(InvalidArgument, "'x'", "20 bytes", "24"):
        decode_request(build([tensor]), [spec()])


def test_raw_and_typed_contents_both_set():
    tensor = typed_input("x", DType.F32, [1, 3], fp32_contents=[1, 2, 3])
    request = typed_request(tensor, raw=[b"\x00" * 12])
    with raises(InvalidArgument, "'x'", "both set"):
        decode_request(request, [spec()])


def test_typed_count_mismatch():
    request = typed_request(typed_input("x", DType.F32, [2, 3], fp32_contents=[1, 2, 3]))
    with raises(InvalidArgument, "'x'", "3 elements", "needs 6"):
        decode_request(request, [spec()])


def test_typed_wrong_field():
    request = typed_request(typed_input("x", DType.F32, [1, 3], int64_contents=[1, 2, 3]))
    with raises(InvalidArgument, "'x'", "fp32_contents", "int64_contents"):
        decode_request(request, [spec()])


def test_typed_value_out_of_range():
    request = typed_request(typed_input("x", DType.I8, [1, 3], int_contents=[1, 200, 3]))
    with raises(InvalidArgument, "'x'", "INT8 range"):
        decode_request(request, [spec(dtype=DType.I8)])


def test_no_data():
    request = typed_request(typed_input("x", DType.F32, [1, 3]))
    with raises(InvalidArgument, "'x'", "no data"):
        decode_request(request, [spec()])


def test_raw_entries_fewer_than_inputs():
    a, b = infer_input("a", sample(DType.F32)), infer_input("b", sample(DType.F32))
    request = typed_request(a._get_tensor(), b._get_tensor(), raw=[a._get_content()])
    with raises(InvalidArgument, "'b'", "none left"):
        decode_request(request, [spec("a"), spec("b")])


def test_raw_entries_more_than_inputs():
    a = infer_input("a", sample(DType.F32))
    request = typed_request(a._get_tensor(), raw=[a._get_content(), b"extra"])
    with raises(InvalidArgument, "2 raw_input_contents entries", "1 inputs"):
        decode_request(request, [spec("a")])


def test_bool_raw_values_must_be_0_or_1():
    tensor = tgrpc.InferInput("x", [1, 3], "BOOL")
    tensor._raw_content = b"\x00\x01\x02"
    with raises(InvalidArgument, "'x'", "0 or 1"):
        decode_request(build([tensor]), [spec(dtype=DType.BOOL)])


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        (serialize_bytes([b"ab", b"c"]) + b"\x05\x00\x00\x00ab", "past the end"),
        (serialize_bytes([b"ab", b"c"]) + b"\x00\x00", "ends inside the length prefix"),
        (serialize_bytes([b"ab", b"c", b"d", b"e"]), "trailing bytes"),
        (b"\x00" * 8, "too few"),
    ],
    ids=["prefix-past-end", "truncated-prefix", "extra-element", "too-short"],
)
def test_malformed_bytes(payload, needle):
    tensor = tgrpc.InferInput("s", [1, 3], "BYTES")
    tensor._raw_content = payload
    with raises(InvalidArgument, "'s'", needle):
        decode_request(build([tensor]), [spec("s", DType.BYTES)])


def test_validation_precedes_materialization(monkeypatch):
    """A bad second input fails the request before the first input is decoded."""
    calls = []
    monkeypatch.setattr(_tensors, "materialize", lambda *a: calls.append(a))
    good = infer_input("a", sample(DType.F32))
    bad = infer_input("b", sample(DType.I32))
    with raises(InvalidArgument, "'b'"):
        decode_request(build([good, bad]), [spec("a"), spec("b")])
    assert calls == []


def test_shm_unknown_region_uses_triton_status_and_text(regions):
    registry, _ = regions
    tensor = tgrpc.InferInput("x", [2, 3], "FP32")
    tensor.set_shared_memory("nope", 24)
    with raises(NotFound, "Unable to find shared memory region: 'nope'", "'x'"):
        decode_request(build([tensor]), [spec()], registry)


def test_shm_offset_plus_size_beyond_region(regions):
    registry, make = regions
    make("small", 32)
    tensor = tgrpc.InferInput("x", [2, 3], "FP32")
    tensor.set_shared_memory("small", 24, offset=16)
    with raises(InvalidArgument, "'small'", "'x'", "exceeds"):
        decode_request(build([tensor]), [spec()], registry)


def test_shm_byte_size_differs_from_tensor(regions):
    registry, make = regions
    make("r", 64)
    tensor = tgrpc.InferInput("x", [2, 3], "FP32")
    tensor.set_shared_memory("r", 32)
    with raises(InvalidArgument, "'x'", "'r'", "32 bytes", "24"):
        decode_request(build([tensor]), [spec()], registry)


def test_shm_with_typed_contents(regions):
    registry, make = regions
    make("r", 64)
    tensor = typed_input("x", DType.F32, [1, 3], fp32_contents=[1, 2, 3])
    tensor.parameters["shared_memory_region"].string_param = "r"
    tensor.parameters["shared_memory_byte_size"].int64_param = 12
    with raises(InvalidArgument, "'x'", "'r'", "contents"):
        decode_request(typed_request(tensor), [spec()], registry)


def test_shm_parameter_types_and_requirements(regions):
    registry, make = regions
    make("r", 64)
    tensor = typed_input("x", DType.F32, [1, 3])
    tensor.parameters["shared_memory_region"].string_param = "r"
    tensor.parameters["shared_memory_byte_size"].uint64_param = 12
    with raises(InvalidArgument, "'x'", "shared_memory_byte_size", "int64_param"):
        decode_request(typed_request(tensor), [spec()], registry)
    tensor.parameters.pop("shared_memory_byte_size")
    with raises(InvalidArgument, "'x'", "shared_memory_byte_size", "required"):
        decode_request(typed_request(tensor), [spec()], registry)
    orphan = typed_input("x", DType.F32, [1, 3])
    orphan.parameters["shared_memory_offset"].int64_param = 4
    with raises(InvalidArgument, "'x'", "without 'shared_memory_region'"):
        decode_request(typed_request(orphan), [spec()], registry)


@pytest.mark.parametrize("disabled", ["none", "disabled"])
def test_shm_when_unavailable(disabled):
    registry = None if disabled == "none" else SharedMemoryRegistry(enabled=False)
    tensor = tgrpc.InferInput("x", [2, 3], "FP32")
    tensor.set_shared_memory("r", 24)
    with raises(FailedPrecondition, "'x'", "'r'", "endpoints.system_shared_memory"):
        decode_request(build([tensor]), [spec()], registry)


# --- requested outputs --------------------------------------------------------------------


PRODUCED = ["y0", "y1", "y2"]


def test_requested_outputs_default_is_all_in_model_order():
    request = build([])
    assert requested_outputs(request, PRODUCED) == [(n, None) for n in PRODUCED]


def test_requested_outputs_filter_and_order():
    request = build([], [tgrpc.InferRequestedOutput("y2"), tgrpc.InferRequestedOutput("y0")])
    assert requested_outputs(request, PRODUCED) == [("y2", None), ("y0", None)]


def test_requested_output_unknown():
    request = build([], [tgrpc.InferRequestedOutput("nope")])
    with raises(InvalidArgument, "'nope'", "'y0'", "'y1'", "'y2'"):
        requested_outputs(request, PRODUCED)


def test_requested_output_duplicate():
    request = build([], [tgrpc.InferRequestedOutput("y1"), tgrpc.InferRequestedOutput("y1")])
    with raises(InvalidArgument, "'y1'", "more than once"):
        requested_outputs(request, PRODUCED)


def test_requested_output_classification_rejected():
    request = build([], [tgrpc.InferRequestedOutput("y1", class_count=3)])
    with raises(InvalidArgument, "'y1'", "classification"):
        requested_outputs(request, PRODUCED)


def test_requested_output_shm_target(regions):
    registry, make = regions
    make("out", 128)
    output = tgrpc.InferRequestedOutput("y1")
    output.set_shared_memory("out", 64, offset=8)
    request = build([], [output, tgrpc.InferRequestedOutput("y0")])
    expected = [("y1", ShmTarget("out", 64, 8)), ("y0", None)]
    assert requested_outputs(request, PRODUCED) == expected
    (name, target), rest = requested_outputs(request, PRODUCED, registry)
    assert (name, target.registration, rest) == ("y1", registry.check("out", 8, 64), expected[1])


def test_requested_output_shm_checked_early(regions):
    registry, make = regions
    make("out", 32)
    output = tgrpc.InferRequestedOutput("y1")
    output.set_shared_memory("gone", 16)
    with raises(NotFound, "Unable to find shared memory region: 'gone'", "'y1'"):
        requested_outputs(build([], [output]), PRODUCED, registry)
    output.set_shared_memory("out", 64)
    with raises(InvalidArgument, "'out'", "'y1'"):
        requested_outputs(build([], [output]), PRODUCED, registry)
    with raises(FailedPrecondition, "'y1'", "endpoints.system_shared_memory"):
        requested_outputs(build([], [output]), PRODUCED, SharedMemoryRegistry(enabled=False))


# --- encode: read back by tritonclient ----------------------------------------------------


def encoded(*args, **kwargs) -> pb.ModelInferResponse:
    """encode_response's bytes, parsed by protobuf."""
    return pb.ModelInferResponse.FromString(encode_response(*args, **kwargs))


def test_the_answer_is_framed_as_protobuf_serializes_it():
    """Built by hand (the tensors appended from their buffers), byte for byte what
    protobuf writes for the same message, on its own and wrapped for a stream."""
    outputs = {f"o_{d.value}": sample(d, (2, 3), seed=i) for i, d in enumerate(DType)}
    outputs["big"] = np.arange(1 << 18, dtype=np.float32)  # (a length of 3 varint bytes)
    request = build([], request_id="r")
    order = requested_outputs(request, list(outputs))
    wire = encode_response(request, MODEL, "1", outputs, order)
    assert wire == pb.ModelInferResponse.FromString(wire).SerializeToString()
    streamed = encode_response(request, MODEL, "1", outputs, order, stream=True)
    parsed = pb.ModelStreamInferResponse.FromString(streamed)
    assert streamed == parsed.SerializeToString() and parsed.infer_response.id == "r"
    assert parsed.infer_response.SerializeToString() == wire


def test_stream_answers_are_what_protobuf_decodes():
    inner = pb.ModelInferResponse(model_name="m", id="7", raw_output_contents=[b"x" * 300])
    wrapped = pb.ModelStreamInferResponse.FromString(stream_response(inner.SerializeToString()))
    assert wrapped.infer_response == inner and wrapped.error_message == ""
    error = pb.ModelStreamInferResponse.FromString(stream_error("bad shape", "m", "7"))
    assert error.error_message == "bad shape"
    assert (error.infer_response.model_name, error.infer_response.id) == ("m", "7")


def test_response_every_dtype_through_tritonclient_as_numpy():
    outputs = {f"o_{d.value}": sample(d, (2, 3), seed=i) for i, d in enumerate(DType)}
    outputs["scalar"] = np.array(3.5, dtype=np.float64)
    request = build([], request_id="req-42")
    order = requested_outputs(request, list(outputs))
    response = encoded(request, MODEL, "1", outputs, order)
    assert response.id == "req-42" and response.model_name == MODEL
    assert response.model_version == "1"
    assert len(response.raw_output_contents) == len(response.outputs) == len(outputs)
    result = as_triton_result(response)
    for name, array in outputs.items():
        got = result.as_numpy(name)
        if array.dtype == object:
            assert got.tolist() == array.tolist()
        else:
            assert got.dtype == array.dtype
            np.testing.assert_array_equal(got, array)
        t_out = result.get_output(name)
        assert list(t_out.shape) == list(array.shape)


def test_response_follows_requested_order():
    outputs = {n: np.full((1,), i, dtype=np.int32) for i, n in enumerate(PRODUCED)}
    request = build([], [tgrpc.InferRequestedOutput("y2"), tgrpc.InferRequestedOutput("y0")])
    response = encoded(request, MODEL, 1, outputs, requested_outputs(request, PRODUCED))
    assert [o.name for o in response.outputs] == ["y2", "y0"]
    result = as_triton_result(response)
    assert result.as_numpy("y2").tolist() == [2]
    assert result.as_numpy("y0").tolist() == [0]
    assert result.as_numpy("y1") is None


def test_response_non_contiguous_and_str_outputs():
    base = np.arange(12, dtype=np.int64).reshape(3, 4)
    outputs = {"t": base.T, "u": np.array(["a", "é"])}
    request = build([])
    response = encoded(request, MODEL, "1", outputs, requested_outputs(request, ["t", "u"]))
    result = as_triton_result(response)
    np.testing.assert_array_equal(result.as_numpy("t"), base.T)
    assert result.as_numpy("u").tolist() == [b"a", "é".encode()]


def test_response_output_in_shm(regions):
    registry, make = regions
    y0 = np.arange(6, dtype=np.float32).reshape(2, 3)
    y1 = np.array([[1, 2]], dtype=np.int64)
    handle = make("out", 64)
    o0 = tgrpc.InferRequestedOutput("y0")
    o0.set_shared_memory("out", 32, offset=8)
    o1 = tgrpc.InferRequestedOutput("y1")
    request = build([], [o0, o1])
    order = requested_outputs(request, ["y0", "y1"], registry)
    response = encoded(request, MODEL, "1", {"y0": y0, "y1": y1}, order, registry)
    assert list(response.raw_output_contents) == [b"", y1.tobytes()]
    result = as_triton_result(response)
    np.testing.assert_array_equal(result.as_numpy("y1"), y1)  # indexed past the empty entry
    t_out = result.get_output("y0")
    assert t_out.datatype == "FP32" and list(t_out.shape) == [2, 3]
    params = t_out.parameters
    assert params["shared_memory_region"].string_param == "out"
    assert params["shared_memory_byte_size"].int64_param == y0.nbytes
    assert params["shared_memory_offset"].int64_param == 8
    got = tshm.get_contents_as_numpy(handle, np.float32, [2, 3], offset=8)
    np.testing.assert_array_equal(got, y0)


def test_response_bytes_output_in_shm(regions):
    registry, make = regions
    handle = make("sout", 64)
    s = np.array([b"hello", b"", b"w"], dtype=object)
    out = tgrpc.InferRequestedOutput("s")
    out.set_shared_memory("sout", 64)
    request = build([], [out])
    order = requested_outputs(request, ["s"], registry)
    response = encoded(request, MODEL, "1", {"s": s}, order, registry)
    size = response.outputs[0].parameters["shared_memory_byte_size"].int64_param
    assert size == len(serialize_bytes(s))
    got = tshm.get_contents_as_numpy(handle, np.object_, [3])
    assert got.tolist() == s.tolist()


def test_response_output_larger_than_its_shm_slot(regions):
    registry, make = regions
    handle = make("out", 64)
    tshm.set_shared_memory_region(handle, [np.zeros(16, dtype=np.float32)])
    out = tgrpc.InferRequestedOutput("y0")
    out.set_shared_memory("out", 16)
    request = build([], [out, tgrpc.InferRequestedOutput("y1")])
    order = requested_outputs(request, ["y0", "y1"], registry)
    outputs = {"y0": np.ones(6, dtype=np.float32), "y1": np.ones(1, dtype=np.float32)}
    with raises(InvalidArgument, "'y0'", "'out'", "24 bytes", "16"):
        encode_response(request, MODEL, "1", outputs, order, registry)
    assert not tshm.get_contents_as_numpy(handle, np.float32, [16]).any()  # nothing written


def test_response_output_goes_to_the_region_checked_whatever_becomes_of_its_name(regions):
    """As Triton, which defers an unregister until the requests using the region are
    done: an output looked up by name at the end went to whatever object held the name
    then (another client's, answered OK), or failed NOT_FOUND once unregistered."""
    registry, make = regions
    mine, other = make("out", 64), make("other", 64)
    out = tgrpc.InferRequestedOutput("y0")
    out.set_shared_memory("out", 64)
    request = build([], [out])
    order = requested_outputs(request, ["y0"], registry)
    registry.unregister("out")
    encode_response(request, MODEL, "1", {"y0": np.full(2, 1.0)}, order, registry)
    registry.register("out", registry.status("other")[0].key, 0, 64)  # (another object)
    encode_response(request, MODEL, "1", {"y0": np.full(2, 2.0)}, order, registry)
    assert tshm.get_contents_as_numpy(mine, np.float64, [2]).tolist() == [2.0, 2.0]
    assert tshm.get_contents_as_numpy(other, np.float64, [2]).tolist() == [0.0, 0.0]
    with raises(FailedPrecondition, "'y0'"):  # (no registry: shared memory disabled)
        encode_response(request, MODEL, "1", {"y0": np.ones(2)}, order, None)


def test_response_missing_output_is_internal():
    request = build([])
    with raises(Internal, "'y1'"):
        encode_response(request, MODEL, "1", {"y0": np.ones(1)}, [("y1", None)])


def test_response_unsupported_dtype_is_internal():
    request = build([])
    with raises(Internal, "'c'", "complex"):
        encode_response(request, MODEL, "1", {"c": np.ones(1, np.complex64)}, [("c", None)])


# --- request parameters -------------------------------------------------------------------


def triton_request(**kw) -> pb.ModelInferRequest:
    from tritonclient.grpc._utils import _get_inference_request

    args = dict(
        model_name=MODEL,
        inputs=[],
        model_version="",
        request_id="",
        outputs=None,
        sequence_id=0,
        sequence_start=False,
        sequence_end=False,
        priority=0,
        timeout=None,
    )
    args.update(kw)
    return to_ours(_get_inference_request(parameters=None, **args))


def test_timeout_and_priority_as_tritonclient_sends_them():
    request = triton_request(priority=7, timeout=1500)
    assert request.parameters["timeout"].WhichOneof("parameter_choice") == "int64_param"
    assert request.parameters["priority"].WhichOneof("parameter_choice") == "uint64_param"
    assert request_deadline(request, 100.0) == pytest.approx(100.0015)
    assert request_priority(request) == 7


def test_timeout_and_priority_absent_or_zero():
    assert request_deadline(triton_request(), 5.0) is None
    assert request_deadline(triton_request(timeout=0), 5.0) is None
    assert request_priority(triton_request()) == 0
    assert request_priority(triton_request(priority=2**64 - 1)) == 2**64 - 1


def test_timeout_and_priority_bad_values():
    request = pb.ModelInferRequest()
    request.parameters["timeout"].int64_param = -1
    with raises(InvalidArgument, "'timeout'"):
        request_deadline(request, 0.0)
    request.parameters["timeout"].string_param = "5"
    with raises(InvalidArgument, "'timeout'", "int64_param"):
        request_deadline(request, 0.0)
    request.parameters["priority"].int64_param = 3
    assert request_priority(request) == 3
    request.parameters["priority"].int64_param = -3
    with raises(InvalidArgument, "'priority'"):
        request_priority(request)
    request.parameters["priority"].double_param = 1.0
    with raises(InvalidArgument, "'priority'"):
        request_priority(request)


def test_tensor_metadata():
    meta = tensor_metadata(spec("x", DType.BF16, (-1, -1, 4), 0))
    assert (meta.name, meta.datatype, list(meta.shape)) == ("x", "BF16", [-1, -1, 4])
    theirs = t_svc.ModelMetadataResponse.TensorMetadata.FromString(meta.SerializeToString())
    assert (theirs.name, theirs.datatype, list(theirs.shape)) == ("x", "BF16", [-1, -1, 4])
    scalar = tensor_metadata(spec("s", DType.BYTES, (), None))
    assert (scalar.datatype, list(scalar.shape)) == ("BYTES", [])


# --- status mapping -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (InvalidArgument("bad 'x'"), StatusCode.INVALID_ARGUMENT),
        (NotFound("no 'm'"), StatusCode.NOT_FOUND),
        (FailedPrecondition("off"), StatusCode.FAILED_PRECONDITION),
        (ResourceExhausted("full"), StatusCode.RESOURCE_EXHAUSTED),
        (AlreadyExists("dup"), StatusCode.ALREADY_EXISTS),
        (Internal("boom"), StatusCode.INTERNAL),
        (TimeoutError(), StatusCode.DEADLINE_EXCEEDED),
        (MemoryError(), StatusCode.RESOURCE_EXHAUSTED),
        (NotImplementedError("x"), StatusCode.UNIMPLEMENTED),
        (rpc_exc.MessageTooLargeError("big"), StatusCode.RESOURCE_EXHAUSTED),
        (ExceptionGroup("one", [NotFound("inner")]), StatusCode.NOT_FOUND),
    ],
)
def test_grpc_status_mapping(exc, code):
    got_code, message = grpc_status(exc)
    assert got_code is code
    assert "Traceback" not in message


def test_unexpected_exception_is_internal_without_traceback():
    try:
        {}["k"]
    except KeyError as e:
        code, message = grpc_status(e)
    assert code is StatusCode.INTERNAL
    assert message == "KeyError: 'k'"
    assert "Traceback" not in message
    assert grpc_status(ValueError()) == (StatusCode.INTERNAL, "ValueError")


def test_rpc_failed_error_passes_through_and_long_messages_are_capped():
    error = rpc_exc.UnavailableError("later")
    assert grpc_status(error) == (StatusCode.UNAVAILABLE, "later")
    code, message = grpc_status(InvalidArgument("x" * 10_000))
    assert code is StatusCode.INVALID_ARGUMENT
    assert len(message) == MAX_MESSAGE_CHARS and message.endswith("(truncated)")


def test_a_retry_pushback_travels_as_a_trailer():
    assert grpc_trailers(Unavailable("no worker", retry_after=0.5)) == (
        ("grpc-retry-pushback-ms", "500"),
    )
    assert grpc_trailers(ExceptionGroup("one", [Unavailable("x", retry_after=0)])) == (
        ("grpc-retry-pushback-ms", "0"),
    )
    assert grpc_trailers(Unavailable("maybe processed")) == ()
    assert grpc_trailers(NotFound("no")) == ()
    closed = Admission(0)
    closed.close()  # shutting down: refused before any processing
    with pytest.raises(Unavailable) as info:
        closed.check_open()
    assert grpc_trailers(info.value) == (("grpc-retry-pushback-ms", "0"),)
    assert pushback_of([("x", "1"), ("grpc-retry-pushback-ms", "500")]) == 0.5
    assert pushback_of([("grpc-retry-pushback-ms", "-1")]) is None  # do not retry
    assert pushback_of([("grpc-retry-pushback-ms", "soon")]) is None
    assert pushback_of([("other", "1")]) is None


def test_bf16_sample_uses_ml_dtypes():
    # tritonclient requires ml_dtypes.bfloat16 arrays for BF16 (see its set_data_from_numpy)
    assert sample(DType.BF16).dtype == np.dtype(ml_dtypes.bfloat16)
