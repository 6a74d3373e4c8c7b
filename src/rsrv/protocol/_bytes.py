"""The BYTES tensor wire format (:mod:`rsrv.dtypes`) with the server's statuses: bad
client data is INVALID_ARGUMENT, an output the server cannot send INTERNAL. Decoded
BYTES tensors are numpy object arrays of ``bytes``."""

from __future__ import annotations

import numpy as np

from rsrv.dtypes import decode_bytes_tensor, encode_bytes_tensor
from rsrv.errors import Internal, InvalidArgument

__all__ = ["deserialize_bytes", "serialize_bytes"]


def deserialize_bytes(data: bytes, count: int, what: str) -> np.ndarray:
    """Length-prefixed BYTES elements; ``len(data) >= 4 * count`` was checked."""
    try:
        return decode_bytes_tensor(data, count)
    except ValueError as e:
        raise InvalidArgument(f"{what}: {e}") from None


def serialize_bytes(array: np.ndarray, what: str) -> bytes:
    try:
        return encode_bytes_tensor(array)
    except ValueError as e:
        raise Internal(f"{what}: {e}") from None
