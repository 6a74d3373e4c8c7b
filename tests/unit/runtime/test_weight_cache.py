"""The device weight cache (LRU bookkeeping), host staging, the weight budget, and the
WeightManager's transfer task with leases and prefetch. Real jax arrays on the CPU
device; no worker. The end-to-end behaviour is in test_weights_e2e.py; specs/weights.md.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import jax
import ml_dtypes
import numpy as np
import pytest
import trio
from support.bundles import write_weights
from trio.testing import wait_all_tasks_blocked

from rsrv.bundle._safetensors import read_weights_header
from rsrv.config._schema import RuntimeConfig
from rsrv.errors import NotFound
from rsrv.runtime import _staging as staging
from rsrv.runtime._staging import ALIGN, free, stage, to_device
from rsrv.runtime._weight_cache import WeightCache
from rsrv.runtime._weight_manager import WeightManager, weight_budget
from rsrv.worker._executor import DeviceExecutor

W = 4096  # bytes of one test model's weights
CPU = jax.devices("cpu")[0]


def arrays(nbytes: int = W, fill: float = 0.0) -> list[jax.Array]:
    return [jax.device_put(np.full(nbytes // 4, fill, np.float32), CPU)]


def cache_with(budget: int | None, *names: str) -> tuple[WeightCache, dict[str, list]]:
    """A cache with ``names`` admitted in order (the first is least recently used)."""
    cache = WeightCache(budget)
    held = {}
    for name in names:
        held[name] = arrays()
        cache.admit(name, held[name], W, 0.001)
    return cache, held


# -- WeightCache: LRU order -------------------------------------------------------------


def test_touch_order_decides_the_victim():
    cache, held = cache_with(3 * W, "a", "b", "c")
    assert list(cache.lru) == ["a", "b", "c"]
    cache.get("a")  # a is now the most recently used; b the least
    assert list(cache.lru) == ["b", "c", "a"]
    assert cache.make_room(W) == ["b"]
    assert not cache.is_resident("b") and held["b"][0].is_deleted()
    assert all(not held[n][0].is_deleted() for n in "ac")
    cache.admit("d", arrays(), W, 0.001)
    cache.get("c")
    assert cache.make_room(2 * W) == ["a", "d"]  # oldest first, as many as needed
    assert list(cache.lru) == ["c"]
    assert cache.counters.evictions == 3


def test_make_room_evicts_only_what_is_needed():
    cache, _ = cache_with(4 * W, "a", "b")
    assert cache.make_room(2 * W) == []  # 2W free already
    assert cache.make_room(3 * W) == ["a"]
    assert cache.resident_bytes == W


def test_leased_and_protected_entries_are_skipped():
    cache, held = cache_with(3 * W, "a", "b", "c")
    cache.lru["a"].leases = 1  # executing right now
    assert cache.make_room(W, protected=frozenset({"b"})) == ["c"]
    assert list(cache.lru) == ["a", "b"]
    assert not held["a"][0].is_deleted() and not held["b"][0].is_deleted()
    assert held["c"][0].is_deleted()


def test_pinned_is_never_evicted_nor_counted_in_the_budget():
    cache, _ = cache_with(2 * W, "a")
    pinned = arrays()
    cache.admit("p", pinned, W, 0.001, pinned=True)
    assert cache.resident_bytes == W and cache.pinned_bytes == W
    assert cache.is_resident("p") and cache.get("p").arrays is pinned
    cache.make_room(10 * W)
    assert cache.clear() == 0
    assert cache.is_resident("p") and not pinned[0].is_deleted()
    assert not cache.evict("p")  # evict() never touches a pinned model
    cache.drop("p")  # unload frees it, pinned or not
    assert pinned[0].is_deleted() and not cache.is_resident("p")


def test_oversized_model_evicts_everything_evictable_and_loads_with_a_warning(caplog):
    cache, held = cache_with(3 * W, "a", "b", "c")
    cache.lru["b"].leases = 1
    with caplog.at_level(logging.WARNING, logger="rsrv.runtime._weight_cache"):
        evicted = cache.make_room(4 * W)
    assert evicted == ["a", "c"]  # everything evictable; the leased one stays
    assert "exceed the whole weight cache budget" in caplog.text
    assert cache.counters.oversized_loads == 1
    big = arrays(4 * W)
    cache.admit("big", big, 4 * W, 0.001)  # loaded anyway: the one case over the budget
    assert cache.resident_bytes == 5 * W
    cache.lru["b"].leases = 0
    assert cache.make_room(W) == ["b", "big"]  # and it is evicted like any other
    assert big[0].is_deleted()


def test_over_budget_because_of_models_in_use_is_logged(caplog):
    cache, _ = cache_with(2 * W, "a", "b")
    assert not cache.fits(W, protected=frozenset({"a", "b"}))
    with caplog.at_level(logging.WARNING, logger="rsrv.runtime._weight_cache"):
        assert cache.make_room(W, protected=frozenset({"a", "b"})) == []
    assert "held by models in use" in caplog.text
    assert cache.counters.oversized_loads == 0


def test_fits_counts_only_what_cannot_be_evicted():
    cache, _ = cache_with(3 * W, "a", "b", "c")
    assert cache.fits(3 * W)
    cache.lru["a"].leases = 1
    assert cache.fits(2 * W) and not cache.fits(3 * W)
    assert not cache.fits(2 * W, protected=frozenset({"b"}))
    assert WeightCache(None).fits(10**12)


def test_clear_frees_every_evictable_model_at_once():
    cache, held = cache_with(4 * W, "a", "b", "c")
    cache.admit("p", arrays(), W, 0.001, pinned=True)
    cache.lru["b"].leases = 1
    assert cache.clear() == 2
    assert list(cache.lru) == ["b"] and cache.is_resident("p")
    assert held["a"][0].is_deleted() and held["c"][0].is_deleted()
    assert not held["b"][0].is_deleted()
    assert cache.counters.evictions == 2


def test_eviction_deletes_the_device_arrays_immediately():
    cache, held = cache_with(2 * W, "a")
    assert cache.evict("a")
    assert held["a"][0].is_deleted()  # not when Python gets round to collecting them
    assert not cache.evict("a")
    free(held["a"])  # freeing twice is harmless


def test_counters():
    cache, _ = cache_with(3 * W, "a", "b", "c")
    cache.make_room(W)
    c = cache.counters
    assert (c.loads, c.evictions, c.bytes_transferred) == (3, 1, 3 * W)
    assert c.load_seconds == pytest.approx(0.003)
    assert c.loads - c.evictions == len(cache.lru)


def test_cache_off_keeps_everything_resident():
    cache, held = cache_with(None, "a", "b", "c")
    assert not cache.enabled and cache.resident_bytes == 0 and cache.pinned_bytes == 3 * W
    assert cache.make_room(10**12) == [] and cache.clear() == 0
    assert not any(h[0].is_deleted() for h in held.values())


def test_unpin_makes_a_pinned_model_evictable():
    cache, _ = cache_with(W)
    pinned = arrays()
    cache.admit("p", pinned, W, 0.001, pinned=True)
    assert cache.unpin("p") is not None
    assert cache.make_room(W) == ["p"] and pinned[0].is_deleted()


# -- staging ----------------------------------------------------------------------------


def weights_file(path: Path, tensors: dict[str, np.ndarray], order: list[str] | None = None):
    """The header of a new weights file at ``path``."""
    return read_weights_header(write_weights(path, tensors, order))


MIXED = {
    "odd": np.arange(3, dtype=np.int8),  # 3 bytes: the next tensor is misaligned in the file
    "w": np.random.default_rng(0).standard_normal((7, 5)).astype(np.float32),
    "h": np.arange(5, dtype=np.float16),
    "bf": np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(2, 3),
    "scalar": np.asarray(2.5, np.float64),
    "empty": np.zeros((0, 4), np.float32),
    "flag": np.array([True, False]),
}


def test_stage_reads_every_tensor_into_one_aligned_buffer(tmp_path):
    order = ["w", "odd", "bf", "scalar", "empty", "h", "flag"]  # argument order, not file order
    wf = weights_file(tmp_path / "w.safetensors", MIXED, order)
    host = stage(wf)
    assert host.nbytes == wf.nbytes == sum(a.nbytes for a in MIXED.values())
    assert [a.shape for a in host.arrays] == [MIXED[n].shape for n in order]
    base = host.arrays[0].base
    for name, a in zip(order, host.arrays, strict=True):
        assert a.dtype == MIXED[name].dtype
        np.testing.assert_array_equal(a, MIXED[name])
        assert a.ctypes.data % ALIGN == 0, name
        assert a.base is base  # views into one buffer


def test_aligned_staging_is_adopted_by_the_cpu_device_without_a_copy(tmp_path):
    wf = weights_file(tmp_path / "w.safetensors", MIXED, ["odd", "w", "h"])
    host = stage(wf)
    on_device = to_device(host, CPU)
    for h, d in zip(host.arrays, on_device, strict=True):
        assert d.unsafe_buffer_pointer() == h.ctypes.data  # zero-copy
        np.testing.assert_array_equal(np.asarray(d), h)
    # whereas a misaligned host array (what the file layout gives) is copied
    raw = np.zeros(4 * 64 + ALIGN, np.uint8)
    misaligned = np.frombuffer(raw, np.float32, 64, (-raw.ctypes.data) % ALIGN + 4)
    assert jax.device_put(misaligned, CPU).unsafe_buffer_pointer() != misaligned.ctypes.data
    free(on_device)
    assert all(d.is_deleted() for d in on_device)


def test_stage_rejects_a_truncated_file(tmp_path):
    path = tmp_path / "w.safetensors"
    wf = weights_file(path, {"w": np.ones(1000, np.float32)})
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="shorter than its header"):
        stage(wf)


def test_pin_on_cpu_keeps_the_staged_buffer(tmp_path):
    host = stage(weights_file(tmp_path / "w.safetensors", {"w": np.ones(8, np.float32)}))
    assert staging.pin(host, CPU) is host


# -- weight_budget ----------------------------------------------------------------------


class FakeDevice:
    def __init__(self, limit: int | None):
        self.limit = limit

    def memory_stats(self):
        return None if self.limit is None else {"bytes_limit": self.limit, "bytes_in_use": 0}


def test_weight_budget_explicit_bytes_win():
    rt = RuntimeConfig(weight_cache_bytes=12345)
    assert weight_budget(rt, CPU) == 12345
    assert weight_budget(rt, FakeDevice(10**9), max_scratch=10**6) == 12345


def test_weight_budget_fraction_zero_turns_the_cache_off():
    assert weight_budget(RuntimeConfig(weight_cache_fraction=0), FakeDevice(10**9)) is None
    rt = RuntimeConfig(weight_cache_fraction=0, weight_cache_bytes=12345)
    assert weight_budget(rt, CPU) == 12345  # an explicit budget takes precedence


def test_weight_budget_cpu_has_no_limit_so_no_cache():
    assert CPU.memory_stats() is None or not CPU.memory_stats().get("bytes_limit")
    assert weight_budget(RuntimeConfig(), CPU) is None
    assert weight_budget(RuntimeConfig(), FakeDevice(None)) is None


def test_weight_budget_from_the_device_limit():
    limit = 1000 * 2**20
    rt = RuntimeConfig(weight_cache_fraction=0.5, weight_cache_wiggle_fraction=0.1)
    assert weight_budget(rt, FakeDevice(limit)) == limit // 2  # fraction binds
    rt = RuntimeConfig(weight_cache_fraction=1.0, weight_cache_wiggle_fraction=0.1)
    scratch = 50 * 2**20
    assert weight_budget(rt, FakeDevice(limit), scratch) == int(0.9 * limit) - scratch
    assert weight_budget(rt, FakeDevice(limit), 2 * limit) == 0  # never negative


# -- WeightManager: transfer task, leases, prefetch -------------------------------------


@pytest.fixture
def files(tmp_path) -> dict[str, object]:
    """Three weights files of W bytes each: a, b, c filled with 1, 2, 3."""
    return {
        name: weights_file(
            tmp_path / f"{name}.safetensors", {"w": np.full(W // 4, i + 1, np.float32)}
        )
        for i, name in enumerate("abc")
    }


async def manager(nursery, budget, files, residency="system") -> WeightManager:
    m = WeightManager(budget, CPU)
    await nursery.start(m.run)
    for name, wf in files.items():
        await m.add(name, wf, residency)
    return m


def record_peaks(monkeypatch, m: WeightManager) -> list[int]:
    """Resident bytes after every admission (the only time they grow)."""
    peaks = []
    admit = WeightCache.admit

    def spy(cache, *args, **kwargs):
        resident = admit(cache, *args, **kwargs)
        if cache is m.cache:
            peaks.append(cache.resident_bytes)
        return resident

    monkeypatch.setattr(WeightCache, "admit", spy)
    return peaks


async def test_lease_loads_on_demand_and_returns_the_right_weights(files):
    async with trio.open_nursery() as nursery:
        m = await manager(nursery, 2 * W, files)
        assert m.cache.resident_bytes == 0 and all(m.host_resident(k) for k in "abc")
        for name, value in [("a", 1), ("b", 2), ("c", 3), ("a", 1)]:
            async with m.lease(name) as weights:
                assert float(weights[0][0]) == value
                assert m.cache.lru[name].leases == 1
            assert m.cache.lru[name].leases == 0
        assert list(m.cache.lru) == ["c", "a"] and m.cache.counters.loads == 4
        with pytest.raises(NotFound):
            async with m.lease("nope"):
                pass
        nursery.cancel_scope.cancel()


async def test_prefetch_fills_free_room_but_never_exceeds_the_budget(files, monkeypatch):
    async with trio.open_nursery() as nursery:
        m = await manager(nursery, W, files)
        peaks = record_peaks(monkeypatch, m)
        async with m.lease("a"):
            await m.prefetch("b")  # only room for a, which is in use: skipped
            assert not m.cache.is_resident("b") and m.cache.is_resident("a")
        await m.prefetch("b")  # now a can go
        assert list(m.cache.lru) == ["b"]
        await m.prefetch("b")  # already resident: nothing to do
        assert m.cache.counters.loads == 2 and max(peaks) == W
        nursery.cancel_scope.cancel()


async def test_prefetch_of_a_resident_model_marks_it_recently_used(files):
    async with trio.open_nursery() as nursery:
        m = await manager(nursery, 2 * W, files)
        for name in "ab":
            async with m.lease(name):
                pass
        await m.prefetch("a")  # a is about to run: b is now the least recently used
        async with m.lease("c"):
            pass
        assert list(m.cache.lru) == ["a", "c"] and m.cache.counters.loads == 3
        nursery.cancel_scope.cancel()


async def test_a_demanded_model_is_not_evicted_for_a_prefetch(files):
    """a's lease waits for a's transfer; c's prefetch is queued behind it. When c's turn
    comes, a is resident and demanded (or already leased): c must not evict it."""
    async with trio.open_nursery() as nursery:
        m = await manager(nursery, W, files)
        release = threading.Event()
        copy = m._copy
        m._copy = lambda placement: (release.wait(), copy(placement))[1]
        got = {}

        async def lease_a():
            async with m.lease("a") as weights:
                got["a"] = float(weights[0][0])
                await trio.sleep(0.01)

        async with trio.open_nursery() as tasks:
            tasks.start_soon(lease_a)
            await wait_all_tasks_blocked()
            tasks.start_soon(m.prefetch, "c")
            await wait_all_tasks_blocked()
            release.set()
        assert got["a"] == 1
        assert list(m.cache.lru) == ["a"] and m.cache.counters.evictions == 0
        nursery.cancel_scope.cancel()


async def test_lock_before_lease_keeps_concurrent_runs_within_the_budget(files, monkeypatch):
    """Two runs at once (a dispatch and a warm-up): the waiting one must not hold weights.
    Leasing before taking the device lock loaded b beside the executing a: 2W > budget."""
    async with trio.open_nursery() as nursery:
        m = await manager(nursery, W, files)
        peaks = record_peaks(monkeypatch, m)
        executor = DeviceExecutor(m)
        running, release = threading.Event(), threading.Event()
        seen = []

        def run(name):
            def run_(size, inputs, weights):
                if name == "a":
                    running.set()
                    release.wait()
                seen.append((name, float(weights[0][0])))
                return []

            return run_

        for name in "ab":
            executor.versions[name] = SimpleNamespace(
                key=name, compiled=SimpleNamespace(run=run(name))
            )
        nursery.start_soon(executor.execute, "a", 1, [])
        try:
            with trio.fail_after(30):
                while not running.is_set():  # a is loaded, leased and executing
                    await trio.sleep(0.001)
            nursery.start_soon(executor.execute, "b", 1, [])  # e.g. a warm-up: waits for a
            await wait_all_tasks_blocked()
            await executor.prefetch("b")  # the scheduler's hook: skipped, no room beside a
            assert list(m.cache.lru) == ["a"]  # b neither leased nor prefetched over budget
        finally:
            release.set()
        with trio.fail_after(30):
            while len(seen) < 2:
                await trio.sleep(0.001)
        assert seen == [("a", 1), ("b", 2)]
        assert max(peaks) == W
        nursery.cancel_scope.cancel()


async def test_a_failed_transfer_fails_its_lease_and_a_later_one_retries(files):
    async with trio.open_nursery() as nursery:
        m = await manager(nursery, 2 * W, {"a": files["a"]}, residency="unpinned")
        saved = files["a"].path.read_bytes()
        os.truncate(files["a"].path, len(saved) // 2)  # the open file loses its data
        with pytest.raises(ValueError, match="shorter than its header"):
            async with m.lease("a"):
                pass
        with pytest.raises(ValueError):  # the scheduler logs a failed prefetch
            await m.prefetch("a")
        files["a"].path.write_bytes(saved)  # same inode: the held file is whole again
        async with m.lease("a") as weights:  # no stale error: the next lease reads again
            assert float(weights[0][0]) == 1
        nursery.cancel_scope.cancel()


async def test_unpinned_reads_the_file_on_every_load(files, monkeypatch):
    opened = []
    monkeypatch.setattr(
        "rsrv.runtime._weight_manager.stage",
        lambda wf, fd=None: (opened.append(wf.path.stem), stage(wf, fd))[1],
    )
    async with trio.open_nursery() as nursery:
        m = WeightManager(W, CPU)
        await nursery.start(m.run)
        await m.add("a", files["a"], "unpinned")
        await m.add("b", files["b"], "system")
        assert opened == ["b"] and m.host_resident("b") and not m.host_resident("a")
        for name in "abab":
            async with m.lease(name):
                pass
        assert opened == ["b", "a", "a"]  # system staged once at add; unpinned per load
        nursery.cancel_scope.cancel()


async def test_device_residency_is_placed_at_add_and_outside_the_budget(files):
    async with trio.open_nursery() as nursery:
        m = WeightManager(W, CPU)
        await nursery.start(m.run)
        await m.add("p", files["a"], "device")
        assert "p" in m.cache.pinned and m.cache.resident_bytes == 0
        pinned = m.cache.pinned["p"]
        for name, wf in [("b", files["b"]), ("c", files["c"])]:
            await m.add(name, wf, "system")
            async with m.lease(name):
                pass
        assert m.compact() == 1
        assert m.cache.pinned["p"] is pinned and not pinned.arrays[0].is_deleted()
        nursery.cancel_scope.cancel()


async def test_cache_off_places_every_model_at_add(files):
    async with trio.open_nursery() as nursery:
        m = WeightManager(None, CPU)
        await nursery.start(m.run)
        for name, wf in files.items():
            await m.add(name, wf, m.residency_for(None))
        assert m.residency_for(None) == "device" and set(m.cache.pinned) == set("abc")
        assert WeightManager(W, CPU).residency_for(None) == "system"
        nursery.cancel_scope.cancel()


async def test_remove_during_a_transfer_frees_what_was_copied(files):
    async with trio.open_nursery() as nursery:
        m = await manager(nursery, 2 * W, files)
        release, copied = threading.Event(), []
        copy = m._copy

        def slow_copy(placement):
            release.wait()
            copied.extend(copy(placement))
            return copied

        m._copy = slow_copy
        async with trio.open_nursery() as tasks:
            tasks.start_soon(m.prefetch, "a")
            await wait_all_tasks_blocked()
            m.remove("a")
            release.set()
        assert not m.cache.is_resident("a") and copied and copied[0].is_deleted()
        nursery.cancel_scope.cancel()
