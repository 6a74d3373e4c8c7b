"""System shared memory registry, against real POSIX shared-memory objects."""

from __future__ import annotations

import errno
import os
import threading
import uuid
from multiprocessing import shared_memory

import numpy as np
import pytest
import tritonclient.utils.shared_memory as tshm
from support.assertions import raises

from rsrv.errors import (
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from rsrv.protocol._shm import (
    DISABLED_MESSAGE,
    AlreadyExists,
    RegionInfo,
    SharedMemoryRegistry,
)


@pytest.fixture
def posix_shm():
    """Factory for POSIX shared-memory objects (multiprocessing), unlinked afterwards."""
    made: list[shared_memory.SharedMemory] = []

    def make(size: int) -> shared_memory.SharedMemory:
        obj = shared_memory.SharedMemory(
            name=f"rsrv_test_{uuid.uuid4().hex[:12]}", create=True, size=size
        )
        made.append(obj)
        return obj

    yield make
    for obj in made:
        obj.close()
        obj.unlink()


@pytest.fixture
def registry():
    reg = SharedMemoryRegistry()
    yield reg
    reg.close()


def test_register_read_write_status_unregister(registry, posix_shm):
    obj = posix_shm(4096)
    obj.buf[:8] = b"abcdefgh"
    registry.register("r", "/" + obj.name, 0, 4096)
    assert registry.status() == [RegionInfo("r", "/" + obj.name, 0, 4096)]
    assert registry.status("r") == [RegionInfo("r", "/" + obj.name, 0, 4096)]
    data = registry.read("r", 2, 4)
    assert data == b"cdef" and isinstance(data, bytearray)  # a private, writable copy
    assert registry.write("r", 100, b"XYZ") == 3
    assert bytes(obj.buf[100:103]) == b"XYZ"  # visible to the client
    registry.unregister("r")
    assert registry.status() == []
    with raises(NotFound, "Unable to find shared memory region: 'r'"):
        registry.read("r", 0, 1)


def test_key_without_leading_slash(registry, posix_shm):
    obj = posix_shm(64)
    registry.register("r", obj.name, 0, 64)
    assert registry.status("r")[0].key == obj.name


def test_unaligned_offset_window(registry, posix_shm):
    obj = posix_shm(10_000)
    obj.buf[5000:5004] = b"WXYZ"
    registry.register("w", obj.name, 4998, 100)  # mmap needs page alignment internally
    assert registry.read("w", 2, 4) == b"WXYZ"
    registry.write("w", 0, b"12")
    assert bytes(obj.buf[4998:5000]) == b"12"
    with raises(InvalidArgument, "'w'", "exceeds"):
        registry.read("w", 90, 11)


def test_write_numpy_array(registry, posix_shm):
    obj = posix_shm(64)
    registry.register("r", obj.name, 0, 64)
    array = np.arange(4, dtype=np.float32)
    registry.write("r", 8, memoryview(array.view(np.uint8)))
    np.testing.assert_array_equal(np.frombuffer(obj.buf[8:24], dtype=np.float32), array)
    registry.write("r", 0, array.reshape(2, 2))  # multi-dimensional buffers are flattened
    np.testing.assert_array_equal(np.frombuffer(obj.buf[:16], dtype=np.float32), array)


def test_with_tritonclient_shared_memory_utils(registry):
    key = f"/rsrv_test_{uuid.uuid4().hex[:12]}"
    handle = tshm.create_shared_memory_region("tc", key, 48)
    try:
        tshm.set_shared_memory_region(handle, [np.arange(6, dtype=np.int64)])
        registry.register("tc", key, 0, 48)
        got = np.frombuffer(registry.read("tc", 0, 48), dtype=np.int64)
        np.testing.assert_array_equal(got, np.arange(6))
        registry.write("tc", 0, np.full(6, 9, dtype=np.int64))
        np.testing.assert_array_equal(
            tshm.get_contents_as_numpy(handle, np.int64, [6]), np.full(6, 9)
        )
    finally:
        registry.unregister("tc")
        tshm.destroy_shared_memory_region(handle)


@pytest.mark.parametrize(
    "key",
    ["a/b", "/a/b", "../x", "..", ".", "", "/", "//x", "/dev/shm/x", "a\x00b", "/..", "x/"],
)
def test_key_with_path_component_rejected(registry, key):
    with raises(InvalidArgument, "'r'", "invalid shm key"):
        registry.register("r", key, 0, 8)
    assert registry.status() == []


def test_key_naming_nothing(registry):
    with raises(InvalidArgument, "Unable to open shared memory region: '/rsrv_nope_", "'r'"):
        registry.register("r", f"/rsrv_nope_{uuid.uuid4().hex}", 0, 8)


def test_symlinks_and_non_files_refused(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"\x00" * 64)
    os.symlink(target, tmp_path / "link")
    (tmp_path / "dir").mkdir()
    reg = SharedMemoryRegistry(root=str(tmp_path))
    reg.register("ok", "target", 0, 64)  # a plain object in the root is fine
    with raises(InvalidArgument, "Unable to open shared memory region: 'link'"):
        reg.register("l", "link", 0, 8)
    with raises(InvalidArgument, "Unable to open shared memory region: 'dir'"):
        reg.register("d", "dir", 0, 8)
    reg.close()


@pytest.mark.parametrize(
    ("offset", "byte_size", "needle"),
    [
        (0, 65, "exceeds the size 64"),
        (60, 5, "exceeds the size 64"),
        (2**63, 2**63, "exceeds the size 64"),  # no overflow: Python ints are exact
        (-1, 8, "offset -1"),
        (0, 0, "byte_size 0"),
    ],
)
def test_register_bounds(registry, posix_shm, offset, byte_size, needle):
    obj = posix_shm(64)
    with raises(InvalidArgument, "'r'", needle):
        registry.register("r", obj.name, offset, byte_size)
    assert registry.status() == []


def test_register_whole_object_and_tail(registry, posix_shm):
    obj = posix_shm(64)
    registry.register("all", obj.name, 0, 64)
    registry.register("tail", obj.name, 60, 4)  # two regions may share a key
    registry.write("tail", 0, b"TAIL")
    assert registry.read("all", 60, 4) == b"TAIL"


def test_register_existing_name(registry, posix_shm):
    obj = posix_shm(64)
    registry.register("r", obj.name, 0, 64)
    with raises(AlreadyExists, "shared memory region 'r' already in manager"):
        registry.register("r", obj.name, 0, 32)
    assert AlreadyExists.code == "ALREADY_EXISTS"
    assert registry.status("r")[0].byte_size == 64


def test_empty_name_rejected(registry, posix_shm):
    obj = posix_shm(64)
    with raises(InvalidArgument, "empty name"):
        registry.register("", obj.name, 0, 64)


def test_status_unknown_name(registry):
    with raises(NotFound, "Unable to find system shared memory region: 'ghost'"):
        registry.status("ghost")


def test_unregister_unknown_ok_and_all(registry, posix_shm):
    obj = posix_shm(64)
    registry.unregister("ghost")
    for name in ("a", "b", "c"):
        registry.register(name, obj.name, 0, 64)
    registry.unregister("b")
    assert [r.name for r in registry.status()] == ["a", "c"]
    registry.unregister("")
    assert registry.status() == []
    registry.register("a", obj.name, 0, 64)  # the name is free again
    registry.unregister(None)
    assert len(registry) == 0


def test_read_write_bounds(registry, posix_shm):
    obj = posix_shm(64)
    registry.register("r", obj.name, 16, 32)
    with raises(InvalidArgument, "'r'", "exceeds the region's 32 bytes"):
        registry.read("r", 30, 4)
    with raises(InvalidArgument, "'r'", "exceeds"):
        registry.write("r", 31, b"ab")
    with raises(InvalidArgument, "'r'", ">= 0"):
        registry.read("r", -1, 4)
    with raises(InvalidArgument, "'r'", "exceeds"):
        registry.check("r", 0, 33)
    assert registry.check("r", 0, 32).info == RegionInfo("r", obj.name, 16, 32)


def test_disabled(posix_shm):
    obj = posix_shm(64)
    reg = SharedMemoryRegistry(enabled=False)
    with raises(FailedPrecondition, "'r'", DISABLED_MESSAGE):
        reg.register("r", obj.name, 0, 64)
    assert "endpoints.system_shared_memory" in DISABLED_MESSAGE
    assert reg.status() == []
    reg.unregister("r")
    reg.unregister(None)
    with raises(FailedPrecondition, "'r'", DISABLED_MESSAGE):
        reg.read("r", 0, 1)


def _held(name: str) -> list[str]:
    """This process's descriptors and mappings of the shared-memory object ``name``."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    with open("/proc/self/maps") as maps:
        mapped = [line.split()[-1] for line in maps if name in line]
    return [f for f in fds if name in f] + mapped


def test_registered_regions_hold_no_descriptor_or_mapping(posix_shm):
    obj = posix_shm(64)
    obj.buf[:4] = b"data"
    client_view = _held(obj.name)  # the test's own SharedMemory maps it once
    reg = SharedMemoryRegistry()
    for i in range(50):
        reg.register(f"r{i}", obj.name, 0, 64)
    assert reg.read("r7", 0, 4) == b"data"
    reg.write("r9", 4, b"more")
    assert _held(obj.name) == client_view
    reg.close()
    assert reg.status() == []


def test_registration_cap(posix_shm):
    obj = posix_shm(64)
    reg = SharedMemoryRegistry(max_regions=3)
    for i in range(3):
        reg.register(f"r{i}", obj.name, 0, 64)
    with raises(ResourceExhausted, "'r3'", "3 regions", "endpoints.max_shm_regions"):
        reg.register("r3", obj.name, 0, 64)
    reg.unregister("r0")
    reg.register("r3", obj.name, 0, 64)  # room again


def test_truncated_object_is_an_error_not_a_crash(registry, posix_shm):
    """A client that shrinks its object after registering it: reads and writes past the
    new end fail with INVALID_ARGUMENT (a mapping would have raised SIGBUS)."""
    obj = posix_shm(1 << 16)
    registry.register("r", obj.name, 0, 1 << 16)
    os.truncate(f"/dev/shm/{obj.name}", 100)
    assert len(registry.read("r", 0, 100)) == 100  # what is left still reads
    with raises(InvalidArgument, "'r'", "is now 100 bytes", "must not shrink"):
        registry.read("r", 0, 1 << 16)
    with raises(InvalidArgument, "'r'", "is now 100 bytes"):
        registry.write("r", 1000, b"x" * 10)
    os.truncate(f"/dev/shm/{obj.name}", 0)
    with raises(InvalidArgument, "is now 0 bytes"):
        registry.read("r", 0, 1)


def test_removed_or_replaced_object(registry, posix_shm):
    obj = posix_shm(64)
    path = f"/dev/shm/{obj.name}"
    registry.register("r", obj.name, 0, 64)
    os.rename(path, path + "_moved")
    try:
        with raises(NotFound, "no longer exists", "register the region again"):
            registry.read("r", 0, 4)
        with open(path, "wb") as f:  # a new object under the same key
            f.write(bytes(64))
        with raises(FailedPrecondition, "was replaced"):
            registry.write("r", 0, b"x")
    finally:
        os.replace(path + "_moved", path)


def test_concurrent_reads_while_registrations_change(posix_shm):
    """Readers and writers in threads, regions unregistered/re-registered under them."""
    obj = posix_shm(1 << 20)
    obj.buf[:8] = b"12345678"
    reg = SharedMemoryRegistry()
    reg.register("r", obj.name, 0, 1 << 20)
    stop = threading.Event()
    errors: list[BaseException] = []
    counts = {"ok": 0, "missing": 0}
    lock = threading.Lock()

    def worker(write: bool) -> None:
        try:
            while not stop.is_set():
                try:
                    if write:
                        reg.write("r", 1 << 19, b"\x01" * (1 << 19))
                    else:
                        data = reg.read("r", 0, 1 << 20)
                        assert data[:8] == b"12345678"
                    key = "ok"
                except NotFound:
                    key = "missing"
                with lock:
                    counts[key] += 1
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i % 2 == 1,)) for i in range(6)]
    for t in threads:
        t.start()
    try:
        for _ in range(300):
            reg.unregister("r")
            reg.register("r", obj.name, 0, 1 << 20)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    reg.close()
    assert not errors, errors
    assert counts["ok"] > 0


def test_a_copy_the_system_refuses_names_the_region_and_why(registry, posix_shm, monkeypatch):
    """A write to a sparse object on a full /dev/shm fails ENOSPC (an I/O error EIO):
    it was an unmapped OSError, INTERNAL without the region's name."""
    obj = posix_shm(64)
    registry.register("r", "/" + obj.name, 0, 64)

    def refused(code):
        def call(*args):
            raise OSError(code, os.strerror(code))

        return call

    monkeypatch.setattr(os, "pwrite", refused(errno.ENOSPC))
    expected = f"cannot write shared memory object '/{obj.name}' of region 'r'"
    with raises(ResourceExhausted, expected, "No space left on device"):
        registry.write("r", 0, b"x")
    monkeypatch.setattr(os, "preadv", refused(errno.EIO))
    with raises(Internal, "cannot read shared memory object", "Input/output error"):
        registry.read("r", 0, 1)
