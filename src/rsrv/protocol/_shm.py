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

The object belongs to the client, which may shrink, replace or remove it at any time.
So a region is never mapped: every read or write opens the object, checks that it is
still the object that was registered (device and inode) and still large enough, and
copies with ``pread`` / ``pwrite``, which report a shrink as a short count instead of
the SIGBUS a mapping would raise. The outcomes, each failing only that request:

==========================================  ====================  ==========================
object removed since registration           NOT_FOUND             shared memory object 'k'
                                                                  of region 'x' no longer
                                                                  exists
object replaced (a new object, same key)    FAILED_PRECONDITION   ... was replaced since
object shrunk below the registered window   INVALID_ARGUMENT      ... is now N bytes
==========================================  ====================  ==========================

No descriptor is held between requests, and at most ``max_regions`` regions may be
registered at once (RESOURCE_EXHAUSTED beyond: endpoints.max_shm_regions).

A request uses each region as it was registered when the request was checked
(:meth:`SharedMemoryRegistry.check` returns that registration, which ``read`` and
``write`` take instead of a name): unregistering the region meanwhile, or registering
its name again for another object, changes nothing for the request, whose outputs are
written where its client registered them, as Triton, which defers an unregister until
the requests using the region are done. (Looked up by name again at the end, an output
went to whatever object held the name then: another client's, answered OK.)

Thread safety: every method may be called from any thread; unregistering a region while
a copy from it is under way lets that copy finish.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rsrv.errors import (
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    RsrvError,
)

__all__ = [
    "DISABLED_MESSAGE",
    "AlreadyExists",
    "RegionInfo",
    "Registration",
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


@dataclass(frozen=True, slots=True)
class Registration:
    """A registered window and the identity of the object it lies in (no descriptor:
    keeping one after its region is unregistered costs nothing)."""

    info: RegionInfo
    path: str
    identity: tuple[int, int]  # (st_dev, st_ino) at registration


_OPEN_FLAGS = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


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
    directory holding POSIX shared-memory objects (``/dev/shm`` on Linux);
    ``max_regions`` caps how many regions are registered at once.
    """

    def __init__(self, enabled: bool = True, *, root: str = "/dev/shm", max_regions: int = 256):
        self.enabled = enabled
        self.max_regions = max_regions
        self._root = root
        self._lock = threading.Lock()
        self._regions: dict[str, Registration] = {}

    # --- registration -------------------------------------------------------------------

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Register ``byte_size`` bytes at ``offset`` of the shared-memory object ``key``."""
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
        path = os.path.join(self._root, bare)
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except OSError as e:
            raise InvalidArgument(
                f"Unable to open shared memory region: '{key}' "
                f"(registering region '{name}'): {e.strerror}"
            ) from None
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgument(
                f"Unable to open shared memory region: '{key}' "
                f"(registering region '{name}'): not a shared-memory object"
            )
        # Python ints do not overflow; the check is exact.
        if offset + byte_size > st.st_size:
            raise InvalidArgument(
                f"failed to register shared memory region '{name}': invalid args: "
                f"offset {offset} + byte_size {byte_size} exceeds the size {st.st_size} "
                f"of shared memory object '{key}'"
            )
        info = RegionInfo(name, key, offset, byte_size)
        region = Registration(info, path, (st.st_dev, st.st_ino))
        with self._lock:
            if name in self._regions:
                raise AlreadyExists(f"shared memory region '{name}' already in manager")
            if len(self._regions) >= self.max_regions:
                raise ResourceExhausted(
                    f"cannot register shared memory region '{name}': {len(self._regions)} "
                    f"regions are registered, the limit (endpoints.max_shm_regions); "
                    "unregister some first"
                )
            self._regions[name] = region

    def unregister(self, name: str | None = None) -> None:
        """Forget region ``name`` (an unknown name is fine); None or "" means all."""
        with self._lock:
            if name:
                self._regions.pop(name, None)
            else:
                self._regions.clear()

    def close(self) -> None:
        """Forget every region (shutdown)."""
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

    def check(self, name: str, offset: int, byte_size: int) -> Registration:
        """The registration of region ``name`` (for ``read`` and ``write`` to use),
        once ``[offset, offset + byte_size)`` is known to lie in it."""
        return self._region(name, offset, byte_size)

    def read(self, region: str | Registration, offset: int, byte_size: int) -> bytearray:
        """A copy of ``byte_size`` bytes at ``offset`` in ``region`` (a name: as
        registered now; a registration: as it was when checked)."""
        region = self._region(region, offset, byte_size)
        out = bytearray(byte_size)
        with self._open(region, offset + byte_size) as fd:
            view = memoryview(out)
            start = region.info.offset + offset
            done = 0
            while done < byte_size:
                try:
                    n = os.preadv(fd, [view[done:]], start + done)
                except OSError as e:
                    raise _copy_failed(region, "read", e) from None
                if n <= 0:
                    raise _shrunk(region, start + done)
                done += n
        return out

    def write(self, region: str | Registration, offset: int, data) -> int:
        """Copy the bytes-like ``data`` to ``offset`` in ``region`` (as in ``read``);
        returns its size."""
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")  # C-contiguous data only, as bytes-like objects are
        size = view.nbytes
        region = self._region(region, offset, size)
        with self._open(region, offset + size) as fd:
            start = region.info.offset + offset
            done = 0
            while done < size:
                try:
                    done += os.pwrite(fd, view[done:], start + done)
                except OSError as e:
                    raise _copy_failed(region, "write", e) from None
        return size

    def _region(self, region: str | Registration, offset: int, byte_size: int) -> Registration:
        if isinstance(region, str):
            with self._lock:
                region = self._lookup(region)
        _check_bounds(region.info, offset, byte_size)
        return region

    @contextmanager
    def _open(self, region: Registration, needed: int) -> Iterator[int]:
        """The region's object, opened, once it is known to be the registered one and
        to hold the window's first ``needed`` bytes."""
        info = region.info
        what = f"shared memory object '{info.key}' of region '{info.name}'"
        try:
            fd = os.open(region.path, _OPEN_FLAGS)
        except FileNotFoundError:
            raise NotFound(f"{what} no longer exists; register the region again") from None
        except OSError as e:
            raise InvalidArgument(f"cannot open {what}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != region.identity:
                raise FailedPrecondition(
                    f"{what} was replaced since the region was registered; "
                    "register the region again"
                )
            if st.st_size < info.offset + needed:
                raise _shrunk(region, st.st_size)
            yield fd
        finally:
            os.close(fd)

    def _lookup(self, name: str) -> Registration:
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


def _copy_failed(region: Registration, how: str, error: OSError) -> RsrvError:
    """A ``pread`` / ``pwrite`` of the region's object that failed: RESOURCE_EXHAUSTED
    when the memory behind it ran out (a sparse object written on a full ``/dev/shm``),
    else INTERNAL; naming the region and the system's reason."""
    info = region.info
    message = (
        f"cannot {how} shared memory object '{info.key}' of region '{info.name}': "
        f"{error.strerror or error}"
    )
    if error.errno in (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT):
        return ResourceExhausted(message)
    return Internal(message)


def _shrunk(region: Registration, size: int) -> InvalidArgument:
    info = region.info
    return InvalidArgument(
        f"shared memory object '{info.key}' of region '{info.name}' is now {size} bytes, "
        f"smaller than the registered window (offset {info.offset} + byte_size "
        f"{info.byte_size}); the client must not shrink a registered object"
    )


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
