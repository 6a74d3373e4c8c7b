"""Reading a request's routing fields from its wire bytes, against protobuf's encoder."""

from __future__ import annotations

import pytest

from rsrv.gateway._peek import MAX_DIMS, MAX_FIELDS, WireError, peek_infer, peek_name
from rsrv.protocol.generated.inference import grpc_service_pb2 as pb


def request(**fields) -> bytes:
    return pb.ModelInferRequest(**fields).SerializeToString()


def test_the_head_of_an_infer_request():
    body = request(
        model_name="classifier",
        model_version="2",
        id="req-7",
        inputs=[
            pb.ModelInferRequest.InferInputTensor(name="mask", datatype="BOOL", shape=[3, 5]),
            pb.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=[8, 256]),
        ],
        raw_input_contents=[b"\x01" * 15, b"\x00" * (8 * 256 * 4)],
    )
    head = peek_infer(body)
    assert (head.model, head.version, head.id) == ("classifier", "2", "req-7")
    assert head.input_shape("x") == [8, 256]
    assert head.input_shape("mask") == [3, 5]
    assert head.input_shape("y") is None


def test_negative_and_unpacked_dims():
    tensor = pb.ModelInferRequest.InferInputTensor(name="x", shape=[-1, 4])
    assert peek_infer(request(model_name="m", inputs=[tensor])).input_shape("x") == [-1, 4]
    # An encoder may write repeated int64 unpacked: field 3 as varints, one per dim.
    unpacked = b"\x0a\x01x" + b"\x18\x02" + b"\x18\x07"
    body = b"\x0a\x01m" + b"\x2a" + bytes([len(unpacked)]) + unpacked
    assert peek_infer(body).input_shape("x") == [2, 7]


def test_empty_and_malformed_bodies():
    assert peek_infer(b"").model == ""
    for broken in (b"\x0a\x05ab", b"\x0a", b"\x0b\x01", b"\x0a\x02\xff\xfe"):
        with pytest.raises(WireError):
            peek_infer(broken)


def test_what_protobuf_accepts_the_gateway_reads_alike():
    # A group (deprecated, still a valid unknown field), nested, is skipped.
    group = b"\x53" + b"\x08\x01" + b"\x63\x10\x02\x64" + b"\x54"  # 10 { 12 {} }
    body = b"\x0a\x01a" + group + b"\x1a\x01r"
    parsed = pb.ModelInferRequest.FromString(body)
    head = peek_infer(body)
    assert (head.model, head.id) == (parsed.model_name, parsed.id) == ("a", "r")
    with pytest.raises(WireError):
        peek_infer(b"\x0a\x01a\x53\x08\x01")  # a group without its end
    # A varint of ten bytes is cut to 64 bits, as protobuf cuts it.
    dims = b"\x80\x80\x80\x80\x80\x80\x80\x80\x80\x7f"
    tensor = b"\x0a\x01x\x1a" + bytes([len(dims)]) + dims
    body = b"\x2a" + bytes([len(tensor)]) + tensor
    assert peek_infer(body).input_shape("x") == list(
        pb.ModelInferRequest.FromString(body).inputs[0].shape
    )
    # A packed shape's last dim may not borrow bytes from the next field.
    tensor = b"\x1a\x02\x04\x80" + b"\x0a\x01x"
    body = b"\x2a" + bytes([len(tensor)]) + tensor
    with pytest.raises(WireError):
        peek_infer(body).input_shape("x")


def test_name_and_version_of_model_requests():
    body = pb.ModelMetadataRequest(name="grader", version="3").SerializeToString()
    assert peek_name(body) == ("grader", "3")
    assert peek_name(pb.ModelReadyRequest(name="a").SerializeToString()) == ("a", "")


def test_the_reading_is_bounded():
    """The gateway reads a request on its event loop: 16 MiB of two-byte fields held it
    2.5 s. More than MAX_FIELDS fields, field number 0, or a shape of more than MAX_DIMS
    dimensions is malformed; a request with many inputs (in shared memory: six fields
    each) and parameters is not."""
    shm = {  # (how tritonclient sends an input in shared memory: six fields)
        "shared_memory_region": pb.InferParameter(string_param="r"),
        "shared_memory_byte_size": pb.InferParameter(int64_param=16),
        "shared_memory_offset": pb.InferParameter(int64_param=0),
    }
    inputs = [
        pb.ModelInferRequest.InferInputTensor(
            name=f"in{i}", datatype="FP32", shape=[1, 4], parameters=shm
        )
        for i in range(1000)
    ]
    parameters = {f"p{i}": pb.InferParameter(int64_param=i) for i in range(500)}
    body = request(model_name="m", inputs=inputs, parameters=parameters)
    head = peek_infer(body)
    assert head.model == "m" and head.input_shape("in999") == [1, 4]
    padding = b"\x78\x00" * (MAX_FIELDS + 1)  # field 15, varint 0: unknown, valid
    with pytest.raises(WireError, match=f"more than {MAX_FIELDS} fields"):
        peek_infer(request(model_name="m") + padding)
    with pytest.raises(WireError, match=f"more than {MAX_FIELDS} fields"):
        peek_name(padding)
    with pytest.raises(WireError, match="field number 0"):
        peek_infer(bytes(64 << 10))  # what a gzip bomb of zeros inflates to
    deep = pb.ModelInferRequest.InferInputTensor(name="x", shape=[1] * (MAX_DIMS + 1))
    with pytest.raises(WireError, match=f"more than {MAX_DIMS} dimensions"):
        peek_infer(request(model_name="m", inputs=[deep])).input_shape("x")
    with pytest.raises(WireError, match=f"more than {MAX_FIELDS} fields"):
        crowded = pb.ModelInferRequest.InferInputTensor(name="y", shape=[1])
        tail = crowded.SerializeToString() + b"\x78\x00" * MAX_FIELDS
        body = request(model_name="m") + b"\x2a" + _varint_bytes(len(tail)) + tail
        peek_infer(body).input_shape("y")  # (the input asked for is read whole)


def _varint_bytes(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)
