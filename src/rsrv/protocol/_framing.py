"""Protobuf messages framed by hand, where protobuf would copy large bytes again.

A length-delimited field on the wire is its tag, its length as a varint, then its bytes,
and a message is its fields one after another; two serialized messages of one type
concatenated parse as one message with both sets of fields. So an answer's tensors can
be appended to its serialized head from their own buffers (one copy, where protobuf's
message and serializer take three, several times slower), and a stream answer can wrap a
serialized ModelInferResponse without parsing it again. The bytes are those protobuf
writes for the same message (fields in number order).
"""

from __future__ import annotations

__all__ = ["field_head", "stream_error", "stream_response"]


def field_head(number: int, length: int) -> bytes:
    """The tag and length of length-delimited field ``number`` carrying ``length`` bytes."""
    out = bytearray([(number << 3) | 2])
    while length >= 0x80:
        out.append((length & 0x7F) | 0x80)
        length >>= 7
    out.append(length)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return field_head(number, len(payload)) + payload


def stream_response(infer_response: bytes) -> bytes:
    """A ModelStreamInferResponse carrying serialized ModelInferResponse bytes as they are."""
    return _field(2, infer_response)


def stream_error(message: str, model: str, request_id: str) -> bytes:
    """A ModelStreamInferResponse with ``error_message``, naming the model and the id as a
    worker does (its infer_response carries model_name and id)."""
    head = _field(1, model.encode()) if model else b""
    if request_id:
        head += _field(3, request_id.encode())
    return _field(1, message.encode()) + _field(2, head)
