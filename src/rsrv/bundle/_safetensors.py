"""Weights files: the safetensors header and the executable's weight argument order.

rsrv reads safetensors itself (the format is an 8-byte length, a JSON header, then one
data region): every dtype rsrv serves, bf16 included, maps straight to numpy, and the
byte offsets let :mod:`rsrv.runtime._staging` read each tensor straight into an aligned
staging buffer.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from rsrv.dtypes import DType

ORDER_KEY = "argument_order"

# safetensors spells dtypes as rsrv's tokens in upper case ("F32", "BF16", "BOOL").
_SAFETENSORS_DTYPES = {d.value.upper(): d for d in DType if d is not DType.BYTES}


@dataclass(frozen=True, slots=True)
class WeightInfo:
    name: str
    dtype: DType
    shape: tuple[int, ...]
    start: int  # byte offset within the data region
    end: int


@dataclass(frozen=True, slots=True)
class WeightsFile:
    """The header of a weights file: the executable's weight arguments, in order, and
    the file it was read from (``identity``: see :func:`file_identity`)."""

    path: Path
    data_offset: int  # where the data region starts in the file
    weights: tuple[WeightInfo, ...]  # in argument order
    identity: tuple[int, ...] = ()
    nbytes: int = field(init=False)  # of every weight (summed once: status calls read it)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", sum(w.end - w.start for w in self.weights))


def _ints(value) -> bool:
    """A JSON list of integers (not booleans)."""
    return isinstance(value, list) and all(type(x) is int for x in value)


def file_identity(st: os.stat_result) -> tuple[int, ...]:
    """A file as it was: device, inode (reused once freed), size and modification time.
    A weights file whose identity differs from its header's is another file: its data
    is not where the header says."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def read_weights_header(path: Path) -> WeightsFile:
    """Read and check the header; raise ``ValueError`` naming what is wrong. The
    identity is the file's the header was read from (a bundle replaced by rename
    meanwhile is caught when the data is read)."""
    with open(path, "rb") as f:
        identity = file_identity(os.fstat(f.fileno()))
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > 100 * 2**20:
            raise ValueError(f"not a safetensors file (header length {n} is implausible)")
        text = f.read(n)
    if len(text) != n:
        raise ValueError(
            f"not a safetensors file (its header length is {n} bytes, the file ends after "
            f"{len(text)})"
        )
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not a safetensors file (header is not JSON: {e})") from None
    except RecursionError:
        raise ValueError("not a safetensors file (its header nests too deep)") from None
    size = identity[2] - 8 - n
    if not isinstance(header, dict):
        raise ValueError("not a safetensors file (its header is not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise ValueError("__metadata__ must be a JSON object of strings")
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
        except (TypeError, json.JSONDecodeError):  # (TypeError: not a string)
            order = None
        if not isinstance(order, list) or not all(isinstance(x, str) for x in order):
            raise ValueError(f"metadata {ORDER_KEY!r} must be a JSON list of tensor names")
    if len(set(order)) != len(order):
        twice = sorted({x for x in order if order.count(x) > 1})
        raise ValueError(f"{ORDER_KEY} names tensor {twice[0]!r} more than once")
    infos = []
    for name in order:
        if name not in header:
            raise ValueError(f"{ORDER_KEY} names tensor {name!r}, which the file does not contain")
        entry = header[name]
        if not isinstance(entry, dict):
            raise ValueError(f"tensor {name!r}: its entry is not a JSON object")
        raw_dtype = entry.get("dtype")
        dtype = _SAFETENSORS_DTYPES.get(raw_dtype) if isinstance(raw_dtype, str) else None
        if dtype is None:
            raise ValueError(f"tensor {name!r} has unsupported dtype {entry.get('dtype')!r}")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not _ints(shape) or min(shape, default=0) < 0:
            raise ValueError(f"tensor {name!r}: shape must be a list of sizes >= 0, not {shape!r}")
        if not _ints(offsets) or len(offsets) != 2:
            raise ValueError(f"tensor {name!r}: data_offsets must be [start, end], not {offsets!r}")
        shape, (start, end) = tuple(shape), offsets
        if not 0 <= start <= end <= size or end - start != dtype.itemsize * math.prod(shape):
            raise ValueError(f"tensor {name!r} has inconsistent data_offsets {[start, end]}")
        infos.append(WeightInfo(name, dtype, shape, start, end))
    ranges = sorted((w.start, w.end, w.name) for w in infos if w.end > w.start)
    for (_, end, first), (start, _, second) in itertools.pairwise(ranges):
        if start < end:
            raise ValueError(f"tensors {first!r} and {second!r} overlap in the file")
    return WeightsFile(path, 8 + n, tuple(infos), identity)
