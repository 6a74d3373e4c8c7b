"""Weights files: the safetensors header, argument order, and host materialisation.

rsrv reads safetensors itself (the format is an 8-byte length, a JSON header, then one
data region) for two reasons: every dtype rsrv serves, bf16 included, maps straight to
numpy; and a model's whole data region is read with one ``readinto`` into one contiguous
buffer, so a device load later copies one staging buffer instead of many small arrays.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rsrv.dtypes import DType

ORDER_KEY = "argument_order"
_ALIGN = 64

_SAFETENSORS_DTYPES = {
    "F16": DType.F16, "F32": DType.F32, "F64": DType.F64, "BF16": DType.BF16,
    "I8": DType.I8, "I16": DType.I16, "I32": DType.I32, "I64": DType.I64,
    "U8": DType.U8, "U16": DType.U16, "U32": DType.U32, "U64": DType.U64, "BOOL": DType.BOOL,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class WeightInfo:
    name: str
    dtype: DType
    shape: tuple[int, ...]
    start: int  # byte offset within the data region
    end: int


@dataclass(frozen=True, slots=True)
class WeightsFile:
    """The header of a weights file: the executable's weight arguments, in order."""

    path: Path
    data_offset: int  # where the data region starts in the file
    weights: tuple[WeightInfo, ...]  # in argument order

    @property
    def nbytes(self) -> int:
        return sum(w.end - w.start for w in self.weights)


def read_weights_header(path: Path) -> WeightsFile:
    """Read and check the header; raise ``ValueError`` naming what is wrong."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > 100 * 2**20:
            raise ValueError(f"not a safetensors file (header length {n} is implausible)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"not a safetensors file (header is not JSON: {e})") from None
    size = path.stat().st_size - 8 - n
    metadata = header.pop("__metadata__", None) or {}
    if ORDER_KEY not in metadata:
        if header:
            raise ValueError(
                f"has tensors but no {ORDER_KEY!r} metadata (a JSON list of "
                "tensor names giving the executable's weight argument order)"
            )
        order: list[str] = []
    else:
        try:
            order = json.loads(metadata[ORDER_KEY])
        except json.JSONDecodeError:
            order = None
        if not isinstance(order, list) or not all(isinstance(x, str) for x in order):
            raise ValueError(f"metadata {ORDER_KEY!r} must be a JSON list of tensor names")
    infos = []
    for name in order:
        if name not in header:
            raise ValueError(f"{ORDER_KEY} names tensor {name!r}, which the file does not contain")
        entry = header[name]
        dtype = _SAFETENSORS_DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise ValueError(f"tensor {name!r} has unsupported dtype {entry.get('dtype')!r}")
        shape = tuple(int(d) for d in entry["shape"])
        start, end = (int(x) for x in entry["data_offsets"])
        if not 0 <= start <= end <= size or end - start != dtype.itemsize * _prod(shape):
            raise ValueError(f"tensor {name!r} has inconsistent data_offsets {[start, end]}")
        infos.append(WeightInfo(name, dtype, shape, start, end))
    return WeightsFile(path, 8 + n, tuple(infos))


def load_host(wf: WeightsFile) -> list[np.ndarray]:
    """Read the weights into one aligned host buffer; return per-tensor views, in order.

    Only the span covering the listed tensors is read, with a single ``readinto``.
    """
    if not wf.weights:
        return []
    lo = min(w.start for w in wf.weights)
    hi = max(w.end for w in wf.weights)
    buf = _aligned_empty(hi - lo)
    with open(wf.path, "rb") as f:
        f.seek(wf.data_offset + lo)
        if f.readinto(memoryview(buf)) != hi - lo:
            raise ValueError(f"{wf.path}: file is shorter than its header says")
    return [_view(buf, w, w.start - lo) for w in wf.weights]


def _view(buf: np.ndarray, w: WeightInfo, offset: int) -> np.ndarray:
    count = _prod(w.shape)
    if offset % w.dtype.itemsize:  # safetensors does not promise alignment: copy if unaligned
        raw = buf[offset : offset + count * w.dtype.itemsize].copy()
        return raw.view(w.dtype.numpy).reshape(w.shape)
    return np.frombuffer(buf, w.dtype.numpy, count, offset).reshape(w.shape)


def _aligned_empty(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    shift = (-raw.ctypes.data) % _ALIGN
    return raw[shift : shift + nbytes]


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
