"""Tensor element types: manifest tokens, numpy dtypes, KServe datatype names, MLIR types;
and the BYTES tensor wire format the server and the client share.

One table is the single source of truth; every conversion in rsrv goes through it.
"""

from __future__ import annotations

import enum
import struct

import ml_dtypes
import numpy as np


class DType(enum.Enum):
    """A tensor element type. ``value`` is the manifest token."""

    F16 = "f16"
    F32 = "f32"
    F64 = "f64"
    BF16 = "bf16"
    I8 = "i8"
    I16 = "i16"
    I32 = "i32"
    I64 = "i64"
    U8 = "u8"
    U16 = "u16"
    U32 = "u32"
    U64 = "u64"
    BOOL = "bool"
    BYTES = "bytes"  # client-facing only: model.py consumes or produces it

    @property
    def numpy(self) -> np.dtype:
        return _NUMPY[self]

    @property
    def kserve(self) -> str:
        return _KSERVE[self]

    @property
    def itemsize(self) -> int:
        """Bytes per element on the wire; 0 for BYTES (variable length)."""
        return 0 if self is DType.BYTES else self.numpy.itemsize

    @classmethod
    def from_token(cls, token: str) -> DType:
        try:
            return cls(token)
        except ValueError:
            raise ValueError(f"unknown dtype {token!r} (expected one of {TOKENS})") from None

    @classmethod
    def from_kserve(cls, name: str) -> DType:
        try:
            return _FROM_KSERVE[name]
        except KeyError:
            raise ValueError(f"unsupported datatype {name!r}") from None

    @classmethod
    def from_numpy(cls, dtype: np.dtype) -> DType:
        try:
            return _FROM_NUMPY[np.dtype(dtype)]
        except KeyError:
            raise ValueError(f"unsupported numpy dtype {dtype}") from None

    @classmethod
    def from_mlir(cls, name: str) -> DType:
        try:
            return _FROM_MLIR[name]
        except KeyError:
            raise ValueError(f"unsupported MLIR element type {name!r}") from None


_NUMPY = {
    DType.F16: np.dtype(np.float16),
    DType.F32: np.dtype(np.float32),
    DType.F64: np.dtype(np.float64),
    DType.BF16: np.dtype(ml_dtypes.bfloat16),
    DType.I8: np.dtype(np.int8),
    DType.I16: np.dtype(np.int16),
    DType.I32: np.dtype(np.int32),
    DType.I64: np.dtype(np.int64),
    DType.U8: np.dtype(np.uint8),
    DType.U16: np.dtype(np.uint16),
    DType.U32: np.dtype(np.uint32),
    DType.U64: np.dtype(np.uint64),
    DType.BOOL: np.dtype(np.bool_),
    DType.BYTES: np.dtype(object),
}
_KSERVE = {
    DType.F16: "FP16",
    DType.F32: "FP32",
    DType.F64: "FP64",
    DType.BF16: "BF16",
    DType.I8: "INT8",
    DType.I16: "INT16",
    DType.I32: "INT32",
    DType.I64: "INT64",
    DType.U8: "UINT8",
    DType.U16: "UINT16",
    DType.U32: "UINT32",
    DType.U64: "UINT64",
    DType.BOOL: "BOOL",
    DType.BYTES: "BYTES",
}
_MLIR = {
    DType.F16: "f16",
    DType.F32: "f32",
    DType.F64: "f64",
    DType.BF16: "bf16",
    DType.I8: "i8",
    DType.I16: "i16",
    DType.I32: "i32",
    DType.I64: "i64",
    DType.U8: "ui8",
    DType.U16: "ui16",
    DType.U32: "ui32",
    DType.U64: "ui64",
    DType.BOOL: "i1",
}
_FROM_KSERVE = {v: k for k, v in _KSERVE.items()}
_FROM_NUMPY = {v: k for k, v in _NUMPY.items() if k is not DType.BYTES}
_FROM_MLIR = {v: k for k, v in _MLIR.items()}
TOKENS = tuple(d.value for d in DType)


# -- BYTES tensors on the wire: per element, a 4-byte little-endian length, then the bytes --

_U32 = struct.Struct("<I")


def encode_bytes_tensor(array) -> bytes:
    """BYTES elements in row-major order: bytes as they are, str as UTF-8, anything else
    as its ``str()``. Raises ValueError for an element of 4 GiB or more."""
    parts: list[bytes] = []
    for item in np.asarray(array, dtype=object).ravel(order="C"):
        if isinstance(item, bytes):
            data = item
        elif isinstance(item, str):
            data = item.encode("utf-8")
        elif isinstance(item, bytearray | memoryview):
            data = bytes(item)
        else:
            data = str(item).encode("utf-8")
        if len(data) > 0xFFFFFFFF:
            raise ValueError("a BYTES element exceeds 4 GiB")
        parts.append(_U32.pack(len(data)))
        parts.append(data)
    return b"".join(parts)


def decode_bytes_tensor(data, count: int, *, exact: bool = True) -> np.ndarray:
    """``count`` BYTES elements as a 1-D object array of ``bytes``. Raises ValueError
    when ``data`` ends inside an element or (``exact``) has bytes left after the last."""
    out = np.empty(count, dtype=object)
    view = memoryview(data)
    size = len(view)
    pos = 0
    for i in range(count):
        if pos + 4 > size:
            raise ValueError(
                f"BYTES data ends inside the length prefix of element {i} (offset {pos} of {size})"
            )
        (length,) = _U32.unpack_from(view, pos)
        pos += 4
        end = pos + length
        if end > size:
            raise ValueError(
                f"BYTES element {i} claims {length} bytes at offset {pos}, past the "
                f"end of the {size}-byte buffer"
            )
        out[i] = bytes(view[pos:end])
        pos = end
    if exact and pos != size:
        raise ValueError(
            f"BYTES data has {size - pos} trailing bytes after {count} elements "
            "(element count does not match the shape)"
        )
    return out
