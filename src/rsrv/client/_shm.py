"""POSIX system shared memory from the client's side: create, write, read, destroy a
region that ``InferenceClient.register_system_shared_memory`` then registers.

Behaves like ``tritonclient.utils.shared_memory`` (create / set / get_contents_as_numpy
/ destroy), with two differences: a region is an object with methods, and creating one
whose key exists is FileExistsError (tritonclient's default, ``create_only=False``,
opens the existing object; ``SharedMemoryRegion(..., create=False)`` does). Linux only (the
objects live under ``/dev/shm``, as the server expects). BYTES tensors are written and
read in the length-prefixed wire format, so a BYTES input or output in shared memory is
what ``raw_input_contents`` would hold.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Sequence

import numpy as np

from rsrv.client._tensors import deserialize_bytes, numpy_dtype, serialize_bytes

__all__ = ["SharedMemoryRegion", "create_shared_memory_region"]

_SHM_DIR = "/dev/shm"


class SharedMemoryRegion:
    """A mapped POSIX shared-memory object: ``name`` (the region name to register),
    ``key`` (the object, e.g. ``/input0``), ``byte_size``. Use as a context manager, or
    call :meth:`destroy` (unmap, and unlink the object if this process created it)."""

    def __init__(self, name: str, key: str, byte_size: int, *, create: bool = True):
        self.name = name
        self.key = key if key.startswith("/") else "/" + key
        path = os.path.join(_SHM_DIR, self.key[1:])
        if "/" in self.key[1:] or self.key[1:] in ("", ".", ".."):
            raise ValueError(f"shared memory key {key!r} must be one name, e.g. '/input0'")
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, byte_size)
                _reserve(fd, byte_size, self.key)
            elif os.fstat(fd).st_size < byte_size:
                raise ValueError(f"shared memory object {self.key} is smaller than {byte_size}")
            self._map = mmap.mmap(fd, byte_size) if byte_size else None
        except BaseException:
            os.close(fd)
            if create:
                os.unlink(path)
            raise
        os.close(fd)
        self.byte_size = byte_size
        self._path = path
        self._owner = create

    def write(self, arrays: np.ndarray | Sequence[np.ndarray], offset: int = 0) -> int:
        """Copy ``arrays`` (one array, or several one after the other) into the region
        at ``offset``; returns the bytes written. BYTES (object) arrays are written
        serialized. Raises ValueError when they do not fit."""
        if isinstance(arrays, (np.ndarray, np.generic)):
            arrays = [np.asarray(arrays)]
        pieces = [_wire(a) for a in arrays]
        size = sum(len(p) for p in pieces)
        if offset < 0 or offset + size > self.byte_size:
            raise ValueError(
                f"{size} bytes at offset {offset} do not fit region '{self.name}' "
                f"of {self.byte_size} bytes"
            )
        if size:
            mapped, position = self._mapped(), offset
            for piece in pieces:
                mapped[position : position + len(piece)] = piece
                position += len(piece)
        return size

    def read(self, datatype: str | np.dtype, shape: Sequence[int], offset: int = 0) -> np.ndarray:
        """A copy of the tensor at ``offset``: ``datatype`` a KServe name ("FP32",
        "BYTES"...) or a numpy dtype, ``shape`` its shape. Raises ValueError when a
        dimension is negative, it runs past the region, or the region is closed."""
        if any(d < 0 for d in shape):
            raise ValueError(f"shape {list(shape)} has a negative dimension")
        count = int(np.prod(shape, dtype=np.int64))
        dtype = numpy_dtype(datatype)
        bytes_tensor = dtype == np.dtype(object)
        end = offset if bytes_tensor else offset + count * dtype.itemsize
        if offset < 0 or end > self.byte_size:
            raise ValueError(
                f"a {list(shape)} {datatype} tensor at offset {offset} runs past region "
                f"'{self.name}' of {self.byte_size} bytes"
            )
        if not count:
            return np.empty(shape, dtype=dtype)
        with memoryview(self._mapped()) as whole:  # (no copy of the rest of the region)
            if bytes_tensor:
                return deserialize_bytes(whole[offset:], count, exact=False).reshape(shape)
            return np.frombuffer(whole[offset:end], dtype=dtype).reshape(shape).copy()

    def _mapped(self) -> mmap.mmap:
        if self._map is None:
            raise ValueError(f"shared memory region '{self.name}' is closed")
        return self._map

    def close(self) -> None:
        """Unmap the region (the object stays)."""
        if self._map is not None:
            self._map.close()
            self._map = None

    def destroy(self) -> None:
        """Unmap, and remove the object if this process created it."""
        self.close()
        if self._owner:
            self._owner = False
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> SharedMemoryRegion:
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()


def create_shared_memory_region(name: str, key: str, byte_size: int) -> SharedMemoryRegion:
    """Create POSIX shared-memory object ``key`` of ``byte_size`` bytes, mapped, to be
    registered as region ``name``, its memory allocated now. Raises FileExistsError when
    ``key`` exists, OSError (ENOSPC) when /dev/shm has no room for it."""
    return SharedMemoryRegion(name, key, byte_size, create=True)


def _reserve(fd: int, byte_size: int, key: str) -> None:
    """Allocate the object's memory now: a write into an object /dev/shm has no room
    for would kill the process (SIGBUS), where this is an OSError (ENOSPC)."""
    if not byte_size:
        return
    try:
        os.posix_fallocate(fd, 0, byte_size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS):  # (a file system that cannot)
            return
        raise OSError(
            e.errno, f"shared memory object {key}: no room for {byte_size} bytes ({e.strerror})"
        ) from None


def _wire(array: np.ndarray) -> bytes | memoryview:
    if array.dtype == np.dtype(object) or array.dtype.kind in "SU":
        return serialize_bytes(array)
    array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return memoryview(array.reshape(-1).view(np.uint8))
