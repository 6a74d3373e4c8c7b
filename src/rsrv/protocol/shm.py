"""System shared memory regions (Triton's SystemSharedMemory* RPCs).

A client creates a POSIX shared-memory object (``shm_open``; on Linux a file under
``/dev/shm``), registers a window of it under a region name, and then names that region
in tensor parameters instead of sending the bytes: inputs are read from it and outputs
written into it.

Status decisions (chosen to match Triton's ``SharedMemoryManager`` wherever Triton is
precise, so that tritonclient users see the messages they know):

==========================================  ====================  ==========================
case                                        status                message starts with
==========================================  ====================  ==========================
register while disabled by configuration    FAILED_PRECONDITION   system shared memory is
                                                                  disabled by configuration
register an existing name                   ALREADY_EXISTS        shared memory region 'x'
                                                                  already in manager
bad key (path component, empty, NUL, ..)    INVALID_ARGUMENT      cannot register shared
                                                                  memory region 'x' - invalid
                                                                  shm key
key names no shared-memory object           INVALID_ARGUMENT      Unable to open shared
                                                                  memory region: 'key'
offset < 0, byte_size <= 0, or the window   INVALID_ARGUMENT      failed to register shared
runs past the object's size                                       memory region 'x': ...
status / read / write of an unknown name    NOT_FOUND             Unable to find (system)
                                                                  shared memory region: 'x'
read / write past the registered window     INVALID_ARGUMENT      Invalid offset + byte size
                                                                  for shared memory region
unregister an unknown name                  OK (no-op)
==========================================  ====================  ==========================

Triton answers INTERNAL when ``shm_open`` fails; a key naming nothing is the caller's
mistake, so rsrv answers INVALID_ARGUMENT. The disabled case has no Triton counterpart
(Triton answers UNIMPLEMENTED on platforms without shared memory); FAILED_PRECONDITION
says "not until the configuration changes" and the message names the setting.

Thread safety: every method may be called from any thread. A read or write pins its
region (a use count) for the duration of the copy, so a region unregistered meanwhile
stays mapped until the copy ends and is unmapped by its last user: never a dangling
mapping, never a segfault. The name is freed at once, so it can be registered again.
"""

from __future__ import annotations

import mmap
import os
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rsrv.errors import FailedPrecondition, InvalidArgument, NotFound, RsrvError

__all__ = [
    "DISABLED_MESSAGE",
    "AlreadyExists",
    "RegionInfo",
    "SharedMemoryRegistry",
]

DISABLED_MESSAGE = (
    "system shared memory is disabled by configuration (endpoints.system_shared_memory)"
)


class AlreadyExists(RsrvError):
    """A region of that name is already registered (gRPC ALREADY_EXISTS, as Triton)."""

    code = "ALREADY_EXISTS"


@dataclass(frozen=True, slots=True)
class RegionInfo:
    """A registered region, as SystemSharedMemoryStatus reports it."""

    name: str
    key: str
    offset: int
    byte_size: int


class _Region:
    """One mapping. ``view`` covers exactly the registered window."""

    __slots__ = ("info", "_mm", "_delta", "users", "retired")

    def __init__(self, info: RegionInfo, mm: mmap.mmap, delta: int) -> None:
        self.info = info
        self._mm = mm
        self._delta = delta  # mmap offsets must be page aligned: window starts here
        self.users = 0
        self.retired = False

    def read(self, offset: int, byte_size: int) -> bytes:
        start = self._delta + offset
        return self._mm[start : start + byte_size]

    def write(self, offset: int, data: memoryview) -> None:
        start = self._delta + offset
        self._mm[start : start + data.nbytes] = data

    def unmap(self) -> None:
        self._mm.close()


def _validate_key(name: str, key: str) -> str:
    """The file name under /dev/shm that ``key`` denotes, or InvalidArgument."""
    bare = key[1:] if key.startswith("/") else key
    if not bare or "/" in bare or "\x00" in bare or bare in (".", ".."):
        raise InvalidArgument(
            f"cannot register shared memory region '{name}' - invalid shm key {key!r}: "
            "the key must name a POSIX shared-memory object (an optional leading '/' "
            "then a name without '/', NUL, '.' or '..')"
        )
    return bare


class SharedMemoryRegistry:
    """The system shared memory regions registered with one worker.

    ``enabled`` is ``endpoints.system_shared_memory``. When disabled, ``register`` raises
    FailedPrecondition, ``status`` is empty and ``unregister`` is a no-op. ``root`` is the
    directory holding POSIX shared-memory objects (``/dev/shm`` on Linux).
    """

    def __init__(self, enabled: bool = True, *, root: str = "/dev/shm") -> None:
        self.enabled = enabled
        self._root = root
        self._lock = threading.Lock()
        self._regions: dict[str, _Region] = {}

    # --- registration -------------------------------------------------------------------

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Map ``byte_size`` bytes at ``offset`` of the shared-memory object ``key``."""
        if not self.enabled:
            raise FailedPrecondition(
                f"cannot register shared memory region '{name}': {DISABLED_MESSAGE}"
            )
        if not name:
            raise InvalidArgument("cannot register a shared memory region with an empty name")
        bare = _validate_key(name, key)
        if offset < 0 or byte_size <= 0:
            raise InvalidArgument(
                f"failed to register shared memory region '{name}': invalid args: "
                f"offset {offset} must be >= 0 and byte_size {byte_size} must be > 0"
            )
        with self._lock:
            if name in self._regions:
                raise AlreadyExists(f"shared memory region '{name}' already in manager")
            region = self._map(name, key, bare, offset, byte_size)
            self._regions[name] = region

    def _map(self, name: str, key: str, bare: str, offset: int, byte_size: int) -> _Region:
        path = os.path.join(self._root, bare)
        flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags)
        except OSError as e:
            raise InvalidArgument(
                f"Unable to open shared memory region: '{key}' "
                f"(registering region '{name}'): {e.strerror}"
            ) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidArgument(
                    f"Unable to open shared memory region: '{key}' "
                    f"(registering region '{name}'): not a shared-memory object"
                )
            size = st.st_size
            # Python ints do not overflow; the checks below are exact.
            if offset + byte_size > size:
                raise InvalidArgument(
                    f"failed to register shared memory region '{name}': invalid args: "
                    f"offset {offset} + byte_size {byte_size} exceeds the size {size} "
                    f"of shared memory object '{key}'"
                )
            delta = offset % mmap.ALLOCATIONGRANULARITY
            try:
                mm = mmap.mmap(
                    fd,
                    byte_size + delta,
                    flags=mmap.MAP_SHARED,
                    prot=mmap.PROT_READ | mmap.PROT_WRITE,
                    offset=offset - delta,
                )
            except (OSError, ValueError, OverflowError) as e:
                raise InvalidArgument(
                    f"failed to register shared memory region '{name}': cannot map '{key}': {e}"
                ) from None
        finally:
            os.close(fd)
        return _Region(RegionInfo(name, key, offset, byte_size), mm, delta)

    def unregister(self, name: str | None = None) -> None:
        """Forget region ``name`` (an unknown name is fine); None or "" means all."""
        with self._lock:
            if name:
                region = self._regions.pop(name, None)
                doomed = [region] if region is not None else []
            else:
                doomed = list(self._regions.values())
                self._regions.clear()
            for region in doomed:
                region.retired = True
                if region.users == 0:
                    region.unmap()
                # else: the last reader/writer unmaps it in _pin

    def close(self) -> None:
        """Release every mapping (shutdown). In-flight copies finish first."""
        self.unregister(None)

    def status(self, name: str | None = None) -> list[RegionInfo]:
        """Every region (``name`` empty or None) or just ``name`` (NotFound if unknown)."""
        with self._lock:
            if not name:
                return [r.info for r in self._regions.values()]
            region = self._regions.get(name)
            if region is None:
                raise NotFound(f"Unable to find system shared memory region: '{name}'")
            return [region.info]

    # --- data ---------------------------------------------------------------------------

    def check(self, name: str, offset: int, byte_size: int) -> RegionInfo:
        """Validate that ``[offset, offset + byte_size)`` lies in region ``name``."""
        with self._lock:
            region = self._lookup(name)
            _check_bounds(region.info, offset, byte_size)
            return region.info

    def read(self, name: str, offset: int, byte_size: int) -> bytes:
        """A copy of ``byte_size`` bytes at ``offset`` in region ``name``."""
        with self._pin(name, offset, byte_size) as region:
            return region.read(offset, byte_size)

    def write(self, name: str, offset: int, data) -> int:
        """Copy the bytes-like ``data`` to ``offset`` in region ``name``; returns its size."""
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")  # C-contiguous data only, as bytes-like objects are
        with self._pin(name, offset, view.nbytes) as region:
            region.write(offset, view)
        return view.nbytes

    @contextmanager
    def _pin(self, name: str, offset: int, byte_size: int) -> Iterator[_Region]:
        with self._lock:
            region = self._lookup(name)
            _check_bounds(region.info, offset, byte_size)
            region.users += 1
        try:
            yield region
        finally:
            with self._lock:
                region.users -= 1
                if region.retired and region.users == 0:
                    region.unmap()

    def _lookup(self, name: str) -> _Region:
        if not self.enabled:
            raise FailedPrecondition(
                f"cannot use shared memory region '{name}': {DISABLED_MESSAGE}"
            )
        region = self._regions.get(name)
        if region is None:
            raise NotFound(f"Unable to find shared memory region: '{name}'")
        return region

    def __len__(self) -> int:
        with self._lock:
            return len(self._regions)


def _check_bounds(info: RegionInfo, offset: int, byte_size: int) -> None:
    if offset < 0 or byte_size < 0:
        raise InvalidArgument(
            f"Invalid offset + byte size for shared memory region: '{info.name}': "
            f"offset {offset} and byte size {byte_size} must be >= 0"
        )
    if offset + byte_size > info.byte_size:
        raise InvalidArgument(
            f"Invalid offset + byte size for shared memory region: '{info.name}': "
            f"offset {offset} + byte size {byte_size} exceeds the region's "
            f"{info.byte_size} bytes"
        )
