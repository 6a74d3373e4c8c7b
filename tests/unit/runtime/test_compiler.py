"""The compilation cache on disk: an entry is loaded only when its checksum matches,
its key covers what changes the machine code, and a write that fails leaves nothing."""

from __future__ import annotations

import builtins
import errno
import hashlib
import logging
import os
import time

import pytest
from support import ROOT

from rsrv.runtime import Compiler
from rsrv.runtime import _compiler as compiler_module

MODULE = (ROOT / "bundles" / "classifier" / "model.b1.mlir").read_bytes()


def entries(cache) -> list:
    return sorted((cache / "executables").glob("*.bin"))


def test_an_entry_is_loaded_until_it_is_damaged_then_compiled_again(tmp_path, caplog):
    """A damaged entry that still loaded could crash the worker (SIGILL), and again at
    every restart: its checksum no longer matches, so it is compiled again, and
    replaced."""
    assert not Compiler(tmp_path).compile(MODULE).cached
    assert Compiler(tmp_path).compile(MODULE).cached
    (entry,) = entries(tmp_path)
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0xFF  # (inside the executable: the length is unchanged)
    entry.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, "rsrv.runtime"):
        assert not Compiler(tmp_path).compile(MODULE).cached
    assert "checksum does not match" in caplog.text
    assert Compiler(tmp_path).compile(MODULE).cached


def test_a_bounded_cache_removes_the_least_recently_used_entries(tmp_path):
    """(Nothing was ever removed: the cache grew with every module a worker loaded.)"""
    modules = [
        (ROOT / "bundles" / "classifier" / f"model.b{n}.mlir").read_bytes() for n in (1, 4, 8)
    ]
    unbounded = Compiler(tmp_path / "sizes")
    names, sizes = [], []  # each module's entry (its name is its key: the same below)
    for module in modules:
        unbounded.compile(module)
        (new,) = set(entries(tmp_path / "sizes")) - {
            tmp_path / "sizes" / "executables" / n for n in names
        }
        names.append(new.name)
        sizes.append(new.stat().st_size)
    a, b, c = modules

    def kept() -> set[str]:
        return {names.index(e.name) for e in entries(tmp_path)}

    # room for two of the three (sizes vary by some bytes between compilations)
    compiler = Compiler(tmp_path, max_bytes=sum(sizes) - min(sizes) // 2)
    for module in (a, b):
        assert not compiler.compile(module).cached
        time.sleep(0.05)  # (mtimes a coarse file system clock still orders)
    assert compiler.compile(a).cached  # a hit renews a: b is now the least recently used
    time.sleep(0.05)
    assert not compiler.compile(c).cached
    assert kept() == {0, 2}
    for module in (a, c):
        assert compiler.compile(module).cached
        time.sleep(0.05)
    assert not compiler.compile(b).cached  # (and now a, the oldest, goes)
    assert kept() == {1, 2}

    # an entry larger than the whole bound is not written, and removes nothing
    tiny = Compiler(tmp_path, max_bytes=min(sizes) // 2)
    assert not tiny.compile(a).cached
    assert kept() == {1, 2}


def test_the_key_covers_the_xla_flags(tmp_path, monkeypatch):
    """Machine code built under other XLA flags (another ISA) is not handed over."""
    Compiler(tmp_path).compile(MODULE)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=SSE4_2")
    assert not Compiler(tmp_path).compile(MODULE).cached
    assert len(entries(tmp_path)) == 2


def test_a_write_that_fails_leaves_no_file(tmp_path, monkeypatch, caplog):
    """(On a full disk every load wrote another partial temporary file.) One left by a
    process killed while writing is removed by a later start, once an hour old."""

    def full(fd, mode):
        os.close(fd)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(compiler_module.os, "fdopen", full)
    with caplog.at_level(logging.WARNING, "rsrv.runtime"):
        assert not Compiler(tmp_path).compile(MODULE).cached
    assert "No space left on device" in caplog.text
    assert list((tmp_path / "executables").iterdir()) == []
    monkeypatch.undo()
    old, new = tmp_path / "executables" / ".tmp-old", tmp_path / "executables" / ".tmp-new"
    for tmp in (old, new):
        tmp.write_bytes(b"partial")
    hours_ago = time.time() - 2 * 3600
    os.utime(old, (hours_ago, hours_ago))
    Compiler(tmp_path)
    assert not old.exists() and new.exists()  # (new: perhaps another process writing it)


@pytest.mark.parametrize("cache", [False, True])
def test_without_a_usable_cache_it_still_compiles(tmp_path, cache):
    """No cache, or a file where its directory should be: compiled every time."""
    where = None
    if cache:
        where = tmp_path / "cache"
        where.mkdir()
        (where / "executables").write_text("not a directory")
    assert not Compiler(where).compile(MODULE).cached
    assert not Compiler(where).compile(MODULE).cached


def test_a_cache_the_worker_may_not_read_costs_only_the_compilation(tmp_path, monkeypatch, caplog):
    """A cache directory the worker may not enter (another uid's volume, mode 0700):
    looking for an entry raised PermissionError, and every model failed to load."""
    executables = tmp_path / "executables"
    stat, real_open = os.stat, builtins.open

    def refused(path) -> None:
        if str(path).startswith(str(executables) + os.sep):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(os, "stat", lambda path, *a, **k: refused(path) or stat(path, *a, **k))
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: refused(f) or real_open(f, *a, **k))
    with caplog.at_level(logging.WARNING, "rsrv.runtime"):
        assert not Compiler(tmp_path).compile(MODULE).cached
    assert "Permission denied" in caplog.text


@pytest.mark.slow  # (9 s on 2 cores, 2.3 GB of memory: hashing and reading 2 GiB)
def test_an_entry_over_2_gib_loads(tmp_path):
    """Linux reads at most 2 GiB - 4 KiB at a time: an entry of more, read in one
    unbuffered read, came back short, failed its checksum and was compiled (and
    written) again at every start."""
    size = (1 << 31) + 64
    entry = tmp_path / "entry.bin"
    digest = hashlib.sha256()
    zeros = bytes(1 << 24)
    for _ in range(size >> 24):
        digest.update(zeros)
    digest.update(bytes(size % (1 << 24)))
    with open(entry, "wb") as f:
        f.write(compiler_module._MAGIC + digest.digest())
        f.truncate(f.tell() + size)  # (sparse)
    assert len(compiler_module._checked(entry)) == size
