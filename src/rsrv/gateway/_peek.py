"""Reading the few fields the gateway needs straight from a message's wire bytes.

A ModelInfer body is forwarded as received: the gateway reads the model's name and
version, the request id and, when it routes by work, the shape of one input, and never
decodes or re-encodes the rest (tensor contents are skipped by length, not read).
Field numbers are those of proto/inference/grpc_service.proto.

The reading runs on the event loop, in Python, so it is bounded: a message with more
than :data:`MAX_FIELDS` fields (a request has a few per input), or one input shape with
more than :data:`MAX_DIMS` dimensions, is refused, as is field number 0 (protobuf's own
parser refuses it too). Without the bound, 16 MiB of two-byte fields held the gateway's
loop for 2.5 s.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["InferHead", "WireError", "peek_infer", "peek_name"]


class WireError(ValueError):
    """The bytes are not a well-formed protobuf message."""


_U64 = (1 << 64) - 1

#: Fields read of one message (and of the inputs one shape lookup scans).
MAX_FIELDS = 4096
#: Dimensions read of one input's shape.
MAX_DIMS = 64


class _Budget:
    """Fields a reading may still read."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = MAX_FIELDS

    def take(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise WireError(f"more than {MAX_FIELDS} fields")


def _varint(data: bytes, pos: int, end: int | None = None) -> tuple[int, int]:
    """The varint at ``pos`` (cut to 64 bits, as protobuf does) and the position after
    it; it must end before ``end`` (default: the end of ``data``)."""
    end = len(data) if end is None else end
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise WireError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & _U64, pos
        shift += 7


def _value(
    data: bytes, pos: int, end: int, tag: int, budget: _Budget, depth: int = 0
) -> tuple[object, int]:
    """The value of the field whose ``tag`` ends at ``pos``, and the position after it:
    an int (varint), (start, end) into ``data`` (length-delimited), or None (fixed
    width, or a group: deprecated, but a valid unknown field, skipped)."""
    wire = tag & 7
    if wire == 0:
        return _varint(data, pos, end)
    if wire == 2:
        length, pos = _varint(data, pos, end)
        return (pos, pos + length), pos + length
    if wire == 1:
        return None, pos + 8
    if wire == 5:
        return None, pos + 4
    if wire == 3 and depth < 100:  # (protobuf's own nesting limit)
        while pos < end:
            inner, pos = _varint(data, pos, end)
            budget.take()
            if inner & 7 == 4:
                if inner >> 3 != tag >> 3:
                    raise WireError("a group ends with another group's tag")
                return None, pos
            _, pos = _value(data, pos, end, inner, budget, depth + 1)
        raise WireError("a group without its end")
    raise WireError(f"unexpected wire type {wire}")


def _fields(data: bytes, budget: _Budget, start: int = 0, end: int | None = None):
    """(field number, wire type, value) of each field (see :func:`_value`), each taken
    from ``budget``."""
    pos, end = start, len(data) if end is None else end
    while pos < end:
        tag, pos = _varint(data, pos, end)
        budget.take()
        if tag >> 3 == 0:
            raise WireError("field number 0")
        value, pos = _value(data, pos, end, tag, budget)
        if pos > end:
            raise WireError("truncated field")
        yield tag >> 3, tag & 7, value


def _text(data: bytes, span: tuple[int, int]) -> str:
    try:
        return data[span[0] : span[1]].decode()
    except UnicodeDecodeError:
        raise WireError("a string field is not UTF-8") from None


@dataclass(frozen=True, slots=True)
class InferHead:
    """What the gateway reads of a ModelInferRequest."""

    model: str
    version: str
    id: str
    _body: bytes
    _inputs: tuple[tuple[int, int], ...]

    def input_shape(self, name: str) -> list[int] | None:
        """The shape of input ``name`` as sent, or None if there is no such input.
        Raises WireError (see the module docstring)."""
        budget = _Budget()
        for start, end in self._inputs:
            found, shape = None, []
            for number, wire, value in _fields(self._body, budget, start, end):
                if number == 1 and wire == 2:
                    found = _text(self._body, value)
                    if found != name:
                        break  # (encoders write the name first: one field per other input)
                elif number == 3 and wire == 2:  # packed int64
                    pos, stop = value
                    while pos < stop:
                        dim, pos = _varint(self._body, pos, stop)
                        shape.append(dim - (1 << 64) if dim >= 1 << 63 else dim)
                        if len(shape) > MAX_DIMS:
                            raise WireError(f"a shape of more than {MAX_DIMS} dimensions")
                elif number == 3 and wire == 0:  # unpacked
                    shape.append(value - (1 << 64) if value >= 1 << 63 else value)
                    if len(shape) > MAX_DIMS:
                        raise WireError(f"a shape of more than {MAX_DIMS} dimensions")
            if found == name:
                return shape
        return None


def peek_infer(body: bytes) -> InferHead:
    """The head of a ModelInferRequest. Raises WireError when it does not parse."""
    model = version = request_id = ""
    inputs = []
    for number, wire, value in _fields(body, _Budget()):
        if wire != 2:
            continue
        if number == 1:
            model = _text(body, value)
        elif number == 2:
            version = _text(body, value)
        elif number == 3:
            request_id = _text(body, value)
        elif number == 5:
            inputs.append(value)
    return InferHead(model, version, request_id, body, tuple(inputs))


def peek_name(body: bytes) -> tuple[str, str]:
    """(name, version) of a request whose field 1 is the model's name and field 2 its
    version (ModelReady, ModelMetadata, ModelConfig, ModelStatistics, ...)."""
    name = version = ""
    for number, wire, value in _fields(body, _Budget()):
        if wire == 2 and number == 1:
            name = _text(body, value)
        elif wire == 2 and number == 2:
            version = _text(body, value)
    return name, version
