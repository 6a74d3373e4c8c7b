"""The device weight cache (LRU bookkeeping), host staging and the staging routes, the
weight budget and the scratch measurement (driven by GPU-shaped allocator statistics),
and the WeightManager's transfer task with leases and prefetch, on both staging routes.
Real jax arrays on the CPU device; no worker. The end-to-end behaviour is in
test_weights_e2e.py; specs/weights.md.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import ml_dtypes
import numpy as np
import pytest
import trio
from support.allocator import GIB, H100_LIMIT, MIB, RecordedAllocator, Recording
from support.bundles import write_weights
from support.staging import ROUTE_IDS, ROUTES, assert_staged
from trio.testing import wait_all_tasks_blocked

from rsrv.bundle._safetensors import read_weights_header
from rsrv.config._schema import RuntimeConfig
from rsrv.errors import FailedPrecondition, NotFound
from rsrv.runtime import _weight_manager, configure
from rsrv.runtime._allocator import allocator_limit, measured_scratch
from rsrv.runtime._staging import (
    ALIGN,
    Staging,
    free,
    pin,
    place,
    stage,
    staging_route,
    to_device,
)
from rsrv.runtime._weight_cache import WeightCache
from rsrv.runtime._weight_manager import FileReplaced, WeightManager, weight_budget
from rsrv.worker._executor import DeviceExecutor

W = 4096  # bytes of one test model's weights
configure("cpu")  # as a worker runs: 64-bit tensors stay 64-bit on the device
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
    evicted = cache.make_room(4 * W)
    assert evicted == ["a", "c"]  # everything evictable; the leased one stays
    assert cache.counters.oversized_loads == 0  # (its copy may yet fail)
    big = arrays(4 * W)
    with caplog.at_level(logging.WARNING, logger="rsrv.runtime._weight_cache"):
        cache.admit("big", big, 4 * W, 0.001)  # loaded anyway: the one case over the budget
    assert "exceed the whole weight cache budget" in caplog.text
    assert cache.counters.oversized_loads == 1
    assert cache.resident_bytes == 5 * W
    cache.lru["b"].leases = 0
    assert cache.make_room(W) == ["b", "big"]  # and it is evicted like any other
    assert big[0].is_deleted()


def test_over_budget_because_of_models_in_use_is_logged(caplog):
    cache, _ = cache_with(2 * W, "a", "b")
    assert not cache.fits(W, protected=frozenset({"a", "b"}))
    assert cache.make_room(W, protected=frozenset({"a", "b"})) == []
    with caplog.at_level(logging.WARNING, logger="rsrv.runtime._weight_cache"):
        cache.admit("c", arrays(W), W, 0.001)
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


def test_stage_reads_a_tensor_in_as_many_reads_as_the_kernel_takes(tmp_path, monkeypatch):
    # Linux reads at most 2 GiB - 4 KiB per call: a larger tensor arrives in pieces
    path = tmp_path / "w.safetensors"
    tensors = {"a": np.arange(1000, dtype=np.float32), "b": np.arange(7, dtype=np.int8)}
    wf = weights_file(path, tensors)
    preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, offset: preadv(fd, [bufs[0][:999]], offset))
    host = stage(wf)
    for got, want in zip(host.arrays, tensors.values(), strict=True):
        np.testing.assert_array_equal(got, want)


def memories(*kinds: str) -> list:
    return [SimpleNamespace(kind=k) for k in kinds]


def test_the_staging_route_is_decided_from_the_device_and_the_setting():
    assert {m.kind for m in CPU.addressable_memories()} >= {"device", "pinned_host"}
    assert staging_route(CPU) is Staging.PAGEABLE  # auto on CPU: zero-copy adoption
    assert staging_route(CPU, "pageable") is Staging.PAGEABLE
    assert staging_route(CPU, "pinned") is Staging.PINNED  # the accelerator route on CPU
    # what auto decides on an accelerator, by its platform and its memory spaces
    gpu = SimpleNamespace(
        platform="gpu", addressable_memories=lambda: memories("device", "pinned_host")
    )
    assert staging_route(gpu) is Staging.PINNED
    assert staging_route(gpu, "pageable") is Staging.PAGEABLE
    bare = SimpleNamespace(platform="gpu", addressable_memories=lambda: memories("device"))
    assert staging_route(bare) is Staging.PAGEABLE
    with pytest.raises(ValueError, match="pinned staging needs a pinned_host memory space"):
        staging_route(bare, "pinned")
    with pytest.raises(ValueError):
        staging_route(CPU, "zero_copy")


def test_the_pageable_route_keeps_the_staged_buffer(tmp_path):
    host = stage(weights_file(tmp_path / "w.safetensors", MIXED))
    assert place(host, Staging.PAGEABLE, CPU) is host
    on_device = to_device(host, CPU)
    assert_staged(Staging.PAGEABLE, host.arrays, on_device)  # adopted, not copied
    free(on_device)


def test_the_pinned_route_copies_out_of_pinned_host_memory(tmp_path):
    order = ["w", "odd", "bf", "scalar", "empty", "h", "flag"]
    host = stage(weights_file(tmp_path / "w.safetensors", MIXED, order))
    floor = place(host, Staging.PINNED, CPU)
    assert floor.nbytes == host.nbytes
    assert [a.sharding.memory_kind for a in floor.arrays] == ["pinned_host"] * len(order)
    first = to_device(floor, CPU)
    assert_staged(Staging.PINNED, floor.arrays, first)  # a copy in device memory
    for name, a in zip(order, first, strict=True):
        assert a.dtype == MIXED[name].dtype
        np.testing.assert_array_equal(np.asarray(a), MIXED[name])
    free(first)  # eviction: the device copy goes, the pinned floor stays
    assert all(a.is_deleted() for a in first)
    assert not any(a.is_deleted() for a in floor.arrays)
    second = to_device(floor, CPU)  # the next load copies again, from the same floor
    assert_staged(Staging.PINNED, floor.arrays, second)
    for name, a in zip(order, second, strict=True):
        np.testing.assert_array_equal(np.asarray(a), MIXED[name])
    assert pin(host, CPU).arrays[0].sharding.memory_kind == "pinned_host"
    free(second)


# -- weight_budget and the scratch measurement, from GPU-shaped statistics -------------

BUDGET_0 = 69_271_855_948  # int(0.9 x H100_LIMIT): the wiggle binds at fraction 1.0


def test_the_allocator_limit_is_the_reported_bytes_limit():
    assert allocator_limit(RecordedAllocator([Recording().now()])) == H100_LIMIT
    assert CPU.memory_stats() is None or not CPU.memory_stats().get("bytes_limit")
    assert allocator_limit(CPU) is None  # CPU reports no statistics
    assert allocator_limit(RecordedAllocator([{"bytes_limit": -1}])) is None  # unset


def test_weight_budget_explicit_bytes_win():
    rt = RuntimeConfig(weight_cache_bytes=12345)
    assert weight_budget(rt, None) == 12345
    assert weight_budget(rt, H100_LIMIT, max_scratch=10**6) == 12345


def test_weight_budget_fraction_zero_turns_the_cache_off():
    assert weight_budget(RuntimeConfig(weight_cache_fraction=0), H100_LIMIT) is None
    rt = RuntimeConfig(weight_cache_fraction=0, weight_cache_bytes=12345)
    assert weight_budget(rt, None) == 12345  # an explicit budget takes precedence


def test_weight_budget_without_a_limit_has_no_cache():
    assert weight_budget(RuntimeConfig(), allocator_limit(CPU)) is None
    assert weight_budget(RuntimeConfig(), None) is None


def test_weight_budget_from_the_device_limit():
    rt = RuntimeConfig()  # fraction 1.0, wiggle 0.1
    assert weight_budget(rt, H100_LIMIT) == BUDGET_0
    assert weight_budget(rt, H100_LIMIT, 1536 * MIB) == BUDGET_0 - 1536 * MIB
    half = RuntimeConfig(weight_cache_fraction=0.5, weight_cache_wiggle_fraction=0.1)
    assert weight_budget(half, H100_LIMIT) == H100_LIMIT // 2  # the fraction binds
    assert weight_budget(half, H100_LIMIT, 30 * GIB) == BUDGET_0 - 30 * GIB  # the scratch
    assert weight_budget(rt, H100_LIMIT, 2 * H100_LIMIT) == 0  # never negative


def test_measured_scratch_counts_only_an_execution_that_raised_the_peak():
    rec = Recording().weights(350 * MIB).execution(96 * MIB)  # model a
    at_lease, after = rec.snapshots
    assert measured_scratch(at_lease, after) == 96 * MIB
    rec.weights(-350 * MIB).weights(350 * MIB).execution(64 * MIB)  # b replaces a
    assert rec.snapshots[3]["peak_bytes_in_use"] == rec.snapshots[2]["peak_bytes_in_use"]
    assert measured_scratch(*rec.snapshots[2:4]) is None  # it stayed under a's peak
    rec.weights(2 * 350 * MIB).execution(1536 * MIB)  # c beside b and a: a new peak
    assert measured_scratch(*rec.snapshots[4:6]) == 1536 * MIB
    rec.weights(-3 * 350 * MIB).weights(350 * MIB).execution(512 * MIB)  # compacted
    at_lease = rec.snapshots[6]  # peak - in_use would call 2.2 GiB this model's scratch,
    assert at_lease["peak_bytes_in_use"] - at_lease["bytes_in_use"] == (700 + 1536) * MIB
    assert measured_scratch(*rec.snapshots[6:8]) is None  # and shrink the budget by it
    assert measured_scratch(None, after) is None and measured_scratch(at_lease, None) is None
    assert measured_scratch({"bytes_in_use": 0}, after) is None  # no peak reported


async def test_a_larger_scratch_rederives_the_budget_and_trims_the_cache(files, caplog):
    """Three models lease in turn inside measure_scratch, as warm-ups do, against a
    recorded sequence: each execution's scratch is read from the statistics at its lease
    and after it, the budget is re-derived from the device limit whenever the largest
    scratch grows, and idle models are evicted at once to fit a smaller budget. The last
    scratch leaves no room at all: the next model is oversized, loaded anyway."""
    model = 350 * MIB  # what each model's weights would occupy on the GPU
    rec = Recording().start()
    for scratch in (96 * MIB, 64 * MIB, 1536 * MIB):  # a, b, c: measured, smaller, larger
        rec.weights(model).execution(scratch)
    rec.execution(BUDGET_0)  # a's second size: activations beyond (1 - wiggle) x limit
    allocator = RecordedAllocator(rec.snapshots)
    rt = RuntimeConfig()
    limit = allocator_limit(allocator)
    budgets = []
    async with trio.open_nursery() as nursery:
        m = WeightManager(
            weight_budget(rt, limit),
            CPU,
            resize=lambda scratch: weight_budget(rt, limit, scratch),
            allocator=allocator,
        )
        await nursery.start(m.run)
        for name, wf in files.items():
            await m.add(name, wf, "system")
        budgets.append(m.cache.budget)
        for name in "abca":
            async with m.measure_scratch(name), m.lease(name):
                pass
            budgets.append((m.max_scratch, m.cache.budget, list(m.cache.lru)))
        assert allocator.left == 0  # one read at the start, two per execution
        with caplog.at_level(logging.WARNING, logger="rsrv.runtime._weight_cache"):
            async with m.lease("b") as weights:  # leased outside a warm-up: no read
                assert float(weights[0][0]) == 2
        assert m.cache.counters.oversized_loads == 1
        nursery.cancel_scope.cancel()
    assert budgets == [
        BUDGET_0,
        (96 * MIB, BUDGET_0 - 96 * MIB, ["a"]),
        (96 * MIB, BUDGET_0 - 96 * MIB, ["a", "b"]),  # a smaller scratch: unchanged
        (1536 * MIB, BUDGET_0 - 1536 * MIB, ["a", "b", "c"]),
        (BUDGET_0, 0, []),  # no room left: every idle model evicted at once
    ]
    assert "exceed the whole weight cache budget" in caplog.text


async def test_no_statistics_no_scratch(files):
    """CPU reports no statistics: the measurement reads nothing more and notes nothing."""
    async with trio.open_nursery() as nursery:
        m = WeightManager(2 * W, CPU)
        await nursery.start(m.run)
        await m.add("a", files["a"], "system")
        async with m.measure_scratch("a"), m.lease("a"):
            pass
        assert m.max_scratch == 0 and m.cache.budget == 2 * W and not m._probes
        nursery.cancel_scope.cancel()


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


@pytest.fixture(params=ROUTES, ids=ROUTE_IDS)
def route(request) -> Staging:
    """The staging route of the WeightManager under test: every test using it runs on
    both (``pinned`` is the accelerator route, selected on the CPU device)."""
    return request.param


async def manager(nursery, budget, files, residency="system", route=None) -> WeightManager:
    m = WeightManager(budget, CPU, staging=route)
    await nursery.start(m.run)
    for name, wf in files.items():
        await m.add(name, wf, residency)
    return m


def held_copies(m: WeightManager) -> threading.Event:
    """Hold every copy of ``m`` until the returned event is set."""
    release = threading.Event()
    copy = m._copy
    m._copy = lambda *source: (release.wait(), copy(*source))[1]
    return release


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


async def test_lease_loads_on_demand_and_returns_the_right_weights(files, route):
    async with trio.open_nursery() as nursery:
        m = await manager(nursery, 2 * W, files, route=route)
        assert m.staging is route
        assert m.cache.resident_bytes == 0 and all(m.host_resident(k) for k in "abc")
        leased = []
        for name, value in [("a", 1), ("b", 2), ("c", 3), ("a", 1)]:
            async with m.lease(name) as weights:
                assert float(weights[0][0]) == value
                assert m.cache.lru[name].leases == 1
                assert_staged(route, m.placements[name].host.arrays, weights)
                leased.append(weights)
            assert m.cache.lru[name].leases == 0
        assert list(m.cache.lru) == ["c", "a"] and m.cache.counters.loads == 4
        # a and b were evicted: their device arrays are freed, their floors kept
        assert all(w[0].is_deleted() for w in leased[:2]) and not leased[3][0].is_deleted()
        assert_staged(route, m.placements["a"].host.arrays, leased[3])
        with pytest.raises(NotFound):
            async with m.lease("nope"):
                pass
        nursery.cancel_scope.cancel()


async def test_prefetch_fills_free_room_but_never_exceeds_the_budget(files, monkeypatch, route):
    async with trio.open_nursery() as nursery:
        m = await manager(nursery, W, files, route=route)
        peaks = record_peaks(monkeypatch, m)
        async with m.lease("a"):
            await m.prefetch("b")  # only room for a, which is in use: skipped
            assert not m.cache.is_resident("b") and m.cache.is_resident("a")
        await m.prefetch("b")  # now a can go
        assert list(m.cache.lru) == ["b"]
        await m.prefetch("b")  # already resident: nothing to do
        assert m.cache.counters.loads == 2 and max(peaks) == W
        nursery.cancel_scope.cancel()


async def test_prefetch_of_a_resident_model_marks_it_recently_used(files, route):
    async with trio.open_nursery() as nursery:
        m = await manager(nursery, 2 * W, files, route=route)
        for name in "ab":
            async with m.lease(name):
                pass
        await m.prefetch("a")  # a is about to run: b is now the least recently used
        async with m.lease("c"):
            pass
        assert list(m.cache.lru) == ["a", "c"] and m.cache.counters.loads == 3
        nursery.cancel_scope.cancel()


async def test_a_demanded_model_is_not_evicted_for_a_prefetch(files, route):
    """a's lease waits for a's transfer; c's prefetch is queued behind it. When c's turn
    comes, a is resident and demanded (or already leased): c must not evict it."""
    async with trio.open_nursery() as nursery:
        m = await manager(nursery, W, files, route=route)
        release = held_copies(m)
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


async def test_lock_before_lease_keeps_concurrent_runs_within_the_budget(files, monkeypatch, route):
    """Two runs at once (a dispatch and a warm-up): the waiting one must not hold weights.
    Leasing before taking the device lock loaded b beside the executing a: 2W > budget."""
    async with trio.open_nursery() as nursery:
        m = await manager(nursery, W, files, route=route)
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


async def test_a_failed_execution_counts_towards_auto_compaction(files):
    """weights.md §6: the check runs after each execution; it ran only after those that
    returned, so a model whose runs fail never had its loads compacted."""
    async with trio.open_nursery() as nursery:
        m = await manager(nursery, 2 * W, {"a": files["a"]})
        m.compaction_interval = 1
        executor = DeviceExecutor(m)

        def fail(size, inputs, weights):
            raise RuntimeError("the run failed")

        executor.versions["a"] = SimpleNamespace(key="a", compiled=SimpleNamespace(run=fail))
        with pytest.raises(RuntimeError, match="the run failed"):
            await executor.execute("a", 1, [])
        assert (m.cache.counters.loads, m.compactions) == (1, 1)
        assert not m.cache.lru  # (compacted)
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


async def test_unpinned_reads_the_file_on_every_load(files, monkeypatch, route):
    opened = []
    monkeypatch.setattr(
        "rsrv.runtime._weight_manager.stage",
        lambda wf, fd=None: (opened.append(wf.path.stem), stage(wf, fd))[1],
    )
    async with trio.open_nursery() as nursery:
        m = WeightManager(W, CPU, staging=route)
        await nursery.start(m.run)
        await m.add("a", files["a"], "unpinned")
        await m.add("b", files["b"], "system")
        assert opened == ["b"] and m.host_resident("b") and not m.host_resident("a")
        for name in "abab":
            async with m.lease(name) as weights:
                assert weights[0].sharding.memory_kind == "device"
        assert opened == ["b", "a", "a"]  # system staged once at add; unpinned per load
        assert_staged(route, m.placements["b"].host.arrays, m.cache.lru["b"].arrays)
        nursery.cancel_scope.cancel()


async def test_device_residency_is_placed_at_add_and_outside_the_budget(files, route):
    async with trio.open_nursery() as nursery:
        m = WeightManager(W, CPU, staging=route)
        await nursery.start(m.run)
        await m.add("p", files["a"], "device")
        assert "p" in m.cache.pinned and m.cache.resident_bytes == 0
        pinned = m.cache.pinned["p"]
        assert pinned.arrays[0].sharding.memory_kind == "device"
        for name, wf in [("b", files["b"]), ("c", files["c"])]:
            await m.add(name, wf, "system")
            async with m.lease(name):
                pass
        before = m.cache.lru["c"].arrays
        assert m.compact() == 1
        assert m.cache.pinned["p"] is pinned and not pinned.arrays[0].is_deleted()
        assert before[0].is_deleted() and not m.cache.is_resident("c")  # freed at once
        assert await m.compact_and_reload(["c"]) == 1  # loaded again, from its floor
        after = m.cache.lru["c"].arrays
        assert after is not before and float(after[0][0]) == 3
        assert_staged(route, m.placements["c"].host.arrays, after)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("residency", ["system", "unpinned"])
async def test_a_model_unpinned_into_a_full_cache_stays_within_the_budget(files, route, residency):
    """From device to an evictable floor, with the LRU already full: the idle model used
    longest ago gives way at once, not at the next admission."""
    async with trio.open_nursery() as nursery:
        m = await manager(nursery, 2 * W, {"a": files["a"], "b": files["b"]}, route=route)
        await m.add("c", files["c"], "device")
        for name in "ab":
            async with m.lease(name):
                pass
        assert m.cache.resident_bytes == 2 * W
        await m.set_residency("c", residency)
        assert m.cache.resident_bytes == 2 * W and set(m.cache.lru) == {"b", "c"}
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


async def test_remove_during_a_transfer_frees_what_was_copied(files, route):
    async with trio.open_nursery() as nursery:
        m = await manager(nursery, 2 * W, files, route=route)
        release, copied = threading.Event(), []
        copy = m._copy

        def slow_copy(*source):
            release.wait()
            copied.extend(copy(*source))
            return copied

        m._copy = slow_copy
        async with trio.open_nursery() as tasks:
            tasks.start_soon(m.prefetch, "a")
            await wait_all_tasks_blocked()
            m.remove("a")
            release.set()
        assert not m.cache.is_resident("a") and copied and copied[0].is_deleted()
        nursery.cancel_scope.cancel()


# -- SetModelResidency's guarantees ---------------------------------------------------------


async def test_pinning_a_model_not_on_the_device_makes_no_room(files):
    """Pinned weights are outside the budget: pinning c (not resident) leaves a and b,
    which fill the budget, where they are (it evicted one while c came as evictable)."""
    async with trio.open_nursery() as nursery:
        m = await manager(nursery, 2 * W, files)
        for name in "ab":
            async with m.lease(name):
                pass
        await m.set_residency("c", "device")
        assert "c" in m.cache.pinned and set(m.cache.lru) == {"a", "b"}
        assert m.cache.counters.evictions == 0
        nursery.cancel_scope.cancel()


def replace_by_rename(path: Path, fill: float) -> None:
    """A new bundle's weights renamed into place, as a new version is written."""
    staged = path.with_name("new.safetensors")
    write_weights(staged, {"w": np.full(W // 4, fill, np.float32)})
    os.rename(staged, path)


async def test_a_residency_change_keeps_the_weights_the_version_loaded(files):
    """The bundle replaced on disk by a rename: unpinned -> system stages through the
    file the version holds open (not the new one at its path); system -> unpinned finds
    the file at its path is not the one it loaded, and refuses (FAILED_PRECONDITION)."""
    async with trio.open_nursery() as nursery:
        m = await manager(nursery, 4 * W, {"a": files["a"]}, residency="unpinned")
        replace_by_rename(files["a"].path, 9.0)
        await m.set_residency("a", "system")
        m.compact()
        async with m.lease("a") as weights:
            assert float(weights[0][0]) == 1.0  # a's own
        replace_by_rename(files["a"].path, 7.0)
        with pytest.raises(FailedPrecondition, match="was replaced since it loaded"):
            await m.set_residency("a", "unpinned")
        assert m.placements["a"].residency == "system" and m.host_resident("a")
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("residency", ["system", "unpinned", "device"])
async def test_a_file_replaced_after_its_header_was_read_is_not_loaded(files, residency):
    """Renamed in while the version loaded (model.py imported, modules compiled): its
    identity was taken at registration, so the new file's bytes were read at the old
    header's offsets, and the model served garbage, READY."""
    replace_by_rename(files["a"].path, 9.0)  # (its header was read before)
    async with trio.open_nursery() as nursery:
        with pytest.raises(FileReplaced, match="was replaced since it loaded"):
            await manager(nursery, 4 * W, {"a": files["a"]}, residency=residency)
        nursery.cancel_scope.cancel()


async def test_a_device_version_made_system_refuses_a_replaced_file(files):
    """A device floor holds no file open: device -> system reads the path, which must
    still be the file it loaded (it staged the new bundle's weights as its own)."""
    async with trio.open_nursery() as nursery:
        m = await manager(nursery, 4 * W, {"a": files["a"]}, residency="device")
        replace_by_rename(files["a"].path, 9.0)
        with pytest.raises(FailedPrecondition, match="was replaced since it loaded"):
            await m.set_residency("a", "system")
        assert m.placements["a"].residency == "device"
        nursery.cancel_scope.cancel()


# -- the budget as it is when a copy ends ------------------------------------------------------


async def test_a_copy_is_admitted_within_the_budget_as_it_is_when_it_ends(files):
    """Models unpinned while a demand's copy runs take their room again; a prefetch
    that no longer fits (the budget shrank meanwhile) is dropped, not admitted over."""
    async with trio.open_nursery() as nursery:
        m = await manager(nursery, 2 * W, {"a": files["a"], "b": files["b"]})
        await m.add("c", files["c"], "device")
        async with m.lease("a"):
            pass
        release = held_copies(m)

        async def demand():
            async with m.lease("b"):
                pass

        nursery.start_soon(demand)
        await wait_all_tasks_blocked()  # room made for b beside a; its copy held
        await m.set_residency("c", "system")  # c is evictable now: a + c fill the budget
        release.set()
        with trio.fail_after(30):
            while not m.cache.is_resident("b"):
                await trio.sleep(0.001)
        assert m.cache.resident_bytes <= m.cache.budget and list(m.cache.lru)[-1] == "b"

        m.compact()
        async with m.lease("a"):
            pass
        release = held_copies(m)
        async with m.lease("a"):  # in use: the prefetch may not take its room
            nursery.start_soon(m.prefetch, "b")
            await wait_all_tasks_blocked()
            m.cache.budget = W  # (note_scratch shrinking it while b is copied)
            release.set()
            with trio.fail_after(30):
                while m._transfers:
                    await trio.sleep(0.001)
        assert list(m.cache.lru) == ["a"]
        nursery.cancel_scope.cancel()


async def test_a_failed_copy_counts_no_oversized_load(files, tmp_path):
    big = weights_file(tmp_path / "big.safetensors", {"w": np.zeros(3 * W // 4, np.float32)})
    async with trio.open_nursery() as nursery:
        m = await manager(nursery, 2 * W, {"big": big}, residency="unpinned")
        os.truncate(big.path, 100)  # (read on every load: this one fails)
        with pytest.raises(ValueError, match="shorter than its header"):
            async with m.lease("big"):
                pass
        assert m.cache.counters.oversized_loads == 0
        nursery.cancel_scope.cancel()


async def test_a_prefetch_leaves_the_model_whose_batch_waits_for_the_device(files):
    """(it evicted it: the batch then copied its weights again)"""
    async with trio.open_nursery() as nursery:
        m = await manager(nursery, 2 * W, files)
        executor = DeviceExecutor(m)
        ran = []
        for name in "abc":
            executor.versions[name] = SimpleNamespace(
                key=name, compiled=SimpleNamespace(run=lambda size, x, w: ran.append(1) or [])
            )
        async with m.lease("a"):
            pass
        async with m.lease("b"):
            pass
        loads = m.cache.counters.loads
        async with executor._device:  # (a warm-up of another model holds the device)
            nursery.start_soon(executor.execute, "a", 1, [])
            await wait_all_tasks_blocked()
            await executor.prefetch("c")  # may evict b, not a
        with trio.fail_after(30):
            while not ran:
                await trio.sleep(0.001)
        assert m.cache.is_resident("a") and not m.cache.is_resident("b")
        assert m.cache.counters.loads == loads + 1  # c's, and no copy of a again
        nursery.cancel_scope.cancel()


async def test_a_prefetch_queued_before_the_demand_of_the_model_about_to_run_is_skipped(files):
    """Budget for one model, nothing resident: a's batch waits for the device, c's
    prefetch is asked for before a's lease. c was copied into the free room, evicted by
    a's demand at once, and copied again at its own run: one wasted load."""
    async with trio.open_nursery() as nursery:
        m = await manager(nursery, W, files)
        executor = DeviceExecutor(m)
        ran = []
        for name in "ac":
            executor.versions[name] = SimpleNamespace(
                key=name, compiled=SimpleNamespace(run=lambda size, x, w: ran.append(1) or [])
            )
        async with executor._device:
            nursery.start_soon(executor.execute, "a", 1, [])
            await wait_all_tasks_blocked()
            await executor.prefetch("c")  # no room beside a, whose copy is to come
        with trio.fail_after(30):
            while not ran:
                await trio.sleep(0.001)
        assert m.cache.is_resident("a") and not m.cache.is_resident("c")
        assert m.cache.counters.loads == 1 and m.cache.counters.evictions == 0
        nursery.cancel_scope.cancel()


# -- a residency change while the weights are copied -----------------------------------------


async def test_an_unpinned_copy_reads_on_while_a_residency_change_closes_the_file(
    files, monkeypatch
):
    """unpinned -> system while the unpinned version's weights are read for a copy: the
    change closes the file the version held open; the copy, reading it in its thread,
    failed EBADF (or read whatever file took the descriptor's number). It reads its own."""
    release, reads = threading.Event(), []

    def held_first_read(file, fd=None):
        reads.append(fd)
        if len(reads) == 1:  # the copy's, holding its descriptor (not the change's)
            release.wait()
        return stage(file, fd)

    monkeypatch.setattr(_weight_manager, "stage", held_first_read)
    async with trio.open_nursery() as nursery:
        m = await manager(nursery, 4 * W, {"a": files["a"]}, residency="unpinned")
        async with trio.open_nursery() as tasks:
            tasks.start_soon(m.prefetch, "a")
            while "a" not in m._transfers:
                await trio.sleep(0.01)
            await wait_all_tasks_blocked()
            await m.set_residency("a", "system")
            assert m.placements["a"].fd is None  # the version's own descriptor closed
            other = os.open(files["b"].path, os.O_RDONLY)  # (may take its number)
            release.set()
        os.close(other)
        async with m.lease("a") as weights:
            assert float(weights[0][0]) == 1.0
        assert m.cache.counters.loads == 1  # the prefetch's copy, not a failed one
        nursery.cancel_scope.cancel()


async def test_a_version_pinned_while_its_evictable_copy_runs_is_admitted_pinned(files):
    async with trio.open_nursery() as nursery:
        m = await manager(nursery, W, {k: files[k] for k in "ab"})  # room for one
        release = held_copies(m)
        async with trio.open_nursery() as tasks:
            tasks.start_soon(m.prefetch, "a")  # an evictable copy
            while "a" not in m._transfers:
                await trio.sleep(0.01)
            await wait_all_tasks_blocked()
            tasks.start_soon(m.set_residency, "a", "device")  # joins the copy
            await wait_all_tasks_blocked()
            release.set()
        assert m.placements["a"].residency == "device" and "a" in m.cache.pinned
        async with m.lease("b"):  # a load that needs the room: a is not evicted for it
            assert m.cache.is_resident("a")
        nursery.cancel_scope.cancel()


async def test_a_version_unpinned_while_its_pinned_copy_runs_is_admitted_evictable(files):
    async with trio.open_nursery() as nursery:
        m = WeightManager(W, CPU)
        await nursery.start(m.run)
        release = held_copies(m)
        async with trio.open_nursery() as tasks:
            tasks.start_soon(m.add, "a", files["a"], "device")  # a pinned copy
            while "a" not in m._transfers:
                await trio.sleep(0.01)
            await wait_all_tasks_blocked()
            tasks.start_soon(m.set_residency, "a", "system")
            while m.placements["a"].residency != "system":
                await trio.sleep(0.01)
            assert "a" in m._transfers  # the change is made while the copy still runs
            release.set()
        assert "a" not in m.cache.pinned and m.cache.pinned_bytes == 0
        assert m.cache.is_resident("a")  # evictable, under the budget
        nursery.cancel_scope.cancel()


async def test_a_pin_cancelled_while_its_copy_runs_leaves_the_version_evictable(files):
    """SetModelResidency(device) cut off by its deadline while the weights are copied:
    the version stays ``system``, and its copy is admitted under the budget, not pinned
    outside it for good."""
    async with trio.open_nursery() as nursery:
        m = await manager(nursery, W, {"a": files["a"]})
        release = held_copies(m)
        with trio.move_on_after(0.2):
            await m.set_residency("a", "device")
        release.set()
        while m._transfers:
            await trio.sleep(0.01)
        assert m.placements["a"].residency == "system"
        assert "a" not in m.cache.pinned and m.cache.is_resident("a")
        nursery.cancel_scope.cancel()


async def test_warm_up_and_measured_costs_leave_out_the_wait_for_weights(files, monkeypatch):
    """The first warm-up run also waits for the weights to be copied (seconds for a
    large model): its cost was seeded with that wait, and edf then shed requests on
    it. The costs are the runs alone, as measured_seconds reports them."""
    from rsrv.worker import _executor

    async with trio.open_nursery() as nursery:
        m = await manager(nursery, 2 * W, {"a": files["a"]})
        copy = m._copy
        m._copy = lambda *source: (time.sleep(0.3), copy(*source))[1]
        monkeypatch.setattr(_executor, "zero_inputs", lambda compiled, size: [])
        executor = DeviceExecutor(m)
        compiled = SimpleNamespace(executables={1: None, 4: None}, run=lambda *args: [])
        served = SimpleNamespace(key="a", compiled=compiled)
        executor.versions["a"] = served
        start = time.perf_counter()
        costs = await executor.warm_up(served)
        assert time.perf_counter() - start >= 0.3  # (the copy happened)
        assert set(costs) == {1, 4} and max(costs.values()) < 0.1
        assert executor.measured_seconds("a", 4) <= costs[4] < 0.1
        assert executor.measured_seconds("a", 2) is None
        nursery.cancel_scope.cancel()


async def test_compaction_passes_over_a_version_retired_while_it_reloads(files):
    """CompactMemory reloads b and then c; c's version is retired while b's weights are
    copied (a reload replaced it): b is reloaded, c passed over (the whole call answered
    NOT_FOUND before)."""
    async with trio.open_nursery() as nursery:
        m = await manager(nursery, 3 * W, files)
        release = held_copies(m)
        reloading = []

        async def compact():
            reloading.append(await m.compact_and_reload(["b", "c"]))

        nursery.start_soon(compact)
        while "b" not in m._transfers:
            await trio.sleep(0.01)
        m.remove("c")
        release.set()
        with trio.fail_after(10):
            while not reloading:
                await trio.sleep(0.01)
        assert reloading == [1] and m.cache.is_resident("b")
        nursery.cancel_scope.cancel()


async def test_compaction_beside_an_execution_reloads_only_what_fits(files, monkeypatch):
    """Budget for one model; a executes (leased) while CompactMemory reloads b: b was
    loaded anyway, a demand, and the cache held 2W (warning: held by models in use)."""
    async with trio.open_nursery() as nursery:
        m = await manager(nursery, W, files)
        peaks = record_peaks(monkeypatch, m)
        async with m.lease("a"):
            assert await m.compact_and_reload(["b"]) == 0  # no room beside a: passed over
            assert m.cache.is_resident("a") and not m.cache.is_resident("b")
        assert await m.compact_and_reload(["b"]) == 1  # a is idle now: freed, b reloaded
        assert m.cache.is_resident("b") and max(peaks) == W
        nursery.cancel_scope.cancel()
