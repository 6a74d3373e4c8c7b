"""The BYTES tensor wire format: per element, a 4-byte little-endian length, then the
bytes. Decoded BYTES tensors are numpy object arrays of ``bytes``."""

from __future__ import annotations

import struct

import numpy as np

from rsrv.errors import Internal, InvalidArgument

__all__ = ["deserialize_bytes", "serialize_bytes"]

_U32 = struct.Struct("<I")


def deserialize_bytes(data: bytes, count: int, what: str) -> np.ndarray:
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


def serialize_bytes(array: np.ndarray, what: str) -> bytes:
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
