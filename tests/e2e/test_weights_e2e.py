"""On-demand device weights end to end: a real worker, real CPU execution, tritonclient.

Every test runs on both staging routes (``route``): ``pageable``, the CPU default, where
the device adopts the staged host buffer, and ``pinned``, the accelerator route selected
on the CPU device (``runtime.weight_staging``), where the staged floor sits in
``pinned_host`` memory and every device load is a copy into ``device`` memory. Every
answer is compared bitwise with the answer of an all-resident worker (the CPU default:
no weight cache, pageable) for the same input. Requests are either sent one at a time or
use full batches (2 rows), so each runs alone at the same compiled size on both workers.
Resident bytes are read inside the worker's trio loop, after every response and after
every admission to the cache; at the end of each test every resident model's device
arrays are checked against its floor as its route says, and every device copy no longer
resident must have been freed. See specs/weights.md.
"""

from __future__ import annotations

import logging
import shutil
import threading
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.allocator import RecordedAllocator, Recording
from support.bundles import infer_y, write_weights
from support.clients import connect
from support.serving import in_loop, node_config, running, worker_config
from support.staging import ROUTE_IDS, ROUTES, assert_staged

from rsrv.export import Input, Output, export_jax
from rsrv.runtime import Staging
from rsrv.runtime._staging import stage
from rsrv.runtime._weight_cache import WeightCache

D = 16  # input features of the small models
W = (D * 32 + 32) * 4  # weight bytes of every small model (both layouts): 2176
SMALL = [f"m{i:02d}" for i in range(12)]  # m00-m07 layout A, m08-m11 layout B
SLOW = ["s0", "s1", "s2"]  # slower to run, for prefetch
S = 128  # features of the slow models
W_SLOW = (S * S + S) * 4


def layout_a(p, x):  # x f32[n,16] -> f32[n,32]; w f32[16,32], b f32[32]
    return jnp.tanh(x @ p["w"]) + p["b"]


def layout_b(p, x):  # x f32[n,16] -> f32[n,16]; w1, w2 f32[16,16], b f32[32]
    return jnp.tanh(x @ p["w1"]) @ p["w2"] + p["b"][:D] * p["b"][D:]


def layout_big(p, x):  # w f32[16,136]: 4W
    return jnp.tanh(x @ p["w"])


def layout_slow(p, x):  # many dependent matmuls: an execution takes a while
    return jax.lax.fori_loop(0, 64, lambda i, h: jnp.tanh(h @ p["w"] + p["b"]), x)


LAYOUTS = {  # layout -> (fn, weight shapes, features, batch sizes)
    "a": (layout_a, {"b": (32,), "w": (D, 32)}, D, [1, 2]),
    "b": (layout_b, {"b": (32,), "w1": (D, D), "w2": (D, D)}, D, [1, 2]),
    "big": (layout_big, {"w": (D, 4 * 34)}, D, [1, 2]),
    "slow": (layout_slow, {"b": (S,), "w": (S, S)}, S, [2]),
}
MODELS = {
    **{n: "a" for n in SMALL[:8]},
    **{n: "b" for n in SMALL[8:]},
    "big": "big",
    **{n: "slow" for n in SLOW},
}


@dataclass
class Store:
    bundles: Path  # every model, also the all-resident reference worker's repository
    cache: Path  # shared compilation cache: each distinct module compiles once

    def copy(self, names, repo: Path) -> Path:
        for name in names:
            shutil.copytree(self.bundles / name, repo / name)
        return repo


def seeded_weights(path: Path, layout: str, seed: int, *, in_place: bool = False) -> None:
    """Weights of ``layout`` drawn from ``seed`` into the file ``path`` (see
    :func:`write_weights` for ``in_place``)."""
    rng = np.random.default_rng(seed)
    shapes = LAYOUTS[layout][1]
    tensors = {
        k: (rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32) for k, s in shapes.items()
    }
    write_weights(path, tensors, sorted(shapes), in_place=in_place)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Store:
    root = tmp_path_factory.mktemp("weights")
    templates = {}
    for layout, (fn, shapes, features, sizes) in LAYOUTS.items():
        params = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
        templates[layout] = export_jax(
            fn,
            params,
            inputs=[Input("x", np.float32, ("n", features))],
            outputs=[Output("y")],
            batch_sizes=sizes,
            out_dir=root / "templates" / layout,
        )
    bundles = root / "bundles"
    for seed, (name, layout) in enumerate(MODELS.items()):
        shutil.copytree(templates[layout], bundles / name)
        seeded_weights(bundles / name / "weights.safetensors", layout, seed)
    return Store(bundles, root / "cache")


def inputs(name: str, rows: int, rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal((rows, LAYOUTS[MODELS[name]][2])).astype(np.float32)


class Reference:
    """The all-resident worker's answers, computed on demand and remembered."""

    def __init__(self, worker):
        self.client = connect(worker)
        self.answers: dict[tuple[str, bytes], np.ndarray] = {}
        self.lock = threading.Lock()

    def __call__(self, name: str, x: np.ndarray) -> np.ndarray:
        key = (name, x.tobytes())
        with self.lock:
            if key not in self.answers:
                self.answers[key] = infer_y(self.client, name, x)
            return self.answers[key]


@pytest.fixture(scope="module")
def reference(store):
    with running(worker_config(store.bundles, store.cache, MODEL_CONTROL_MODE="static")) as w:
        assert not w.weights.cache.enabled  # CPU, no weight_cache_bytes: no cache
        assert set(w.weights.cache.pinned) == {w.models.get(n).key for n in MODELS}
        ref = Reference(w)
        rng = np.random.default_rng(0)  # different weights do give different answers
        x = inputs("m00", 1, rng)
        assert not np.array_equal(ref("m00", x), ref("m01", x))
        yield ref
        ref.client.close()


@pytest.fixture(params=ROUTES, ids=ROUTE_IDS)
def route(request) -> Staging:
    """The staging route of the worker under test (``runtime.weight_staging``)."""
    return request.param


def same(got: np.ndarray, want: np.ndarray) -> bool:
    """Bitwise equal."""
    return got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


@dataclass
class Probe:
    """Sees every admission to a worker's weight cache (and keeps the arrays admitted)."""

    admits: defaultdict[int, list] = field(default_factory=lambda: defaultdict(list))
    arrays: defaultdict[int, list] = field(default_factory=lambda: defaultdict(list))

    def peak(self, worker) -> int:
        """The largest evictable resident bytes right after any admission."""
        return max(bytes_ for _, bytes_, _ in self.admits[id(worker.weights.cache)])

    def loads(self, worker, key: str) -> int:
        return sum(1 for k, _, _ in self.admits[id(worker.weights.cache)] if k == key)


@pytest.fixture
def probe(monkeypatch) -> Probe:
    p = Probe()
    admit = WeightCache.admit

    def spy_admit(cache, name, *args, **kwargs):
        resident = admit(cache, name, *args, **kwargs)
        p.admits[id(cache)].append((name, cache.resident_bytes, kwargs.get("pinned", False)))
        p.arrays[id(cache)].append(resident.arrays)
        return resident

    monkeypatch.setattr(WeightCache, "admit", spy_admit)
    return p


def check_staging(worker, route: Staging, probe: Probe) -> int:
    """On the worker's loop: the worker took ``route``; every resident model's device
    arrays are in device memory and relate to its staged floor (if it keeps one) as the
    route says (:func:`assert_staged`); every device copy admitted earlier that is no
    longer resident has been freed. Returns how many models had a floor to compare."""

    def check() -> int:
        weights, cache = worker.weights, worker.weights.cache
        assert weights.staging is route
        resident = {**cache.lru, **cache.pinned}
        compared = 0
        for key, r in resident.items():
            host = weights.placements[key].host
            if host is not None:
                assert_staged(route, host.arrays, r.arrays)
                compared += 1
            assert all(a.sharding.memory_kind == "device" for a in r.arrays)
        live = {id(r.arrays) for r in resident.values()}
        for arrays in probe.arrays[id(cache)]:
            if id(arrays) not in live:
                assert all(a.is_deleted() for a in arrays)
        return compared

    return in_loop(worker, check)


def node_file(
    tmp_path: Path,
    store: Store,
    repo: Path,
    budget: int,
    residency: dict[str, str],
    route: Staging,
) -> object:
    """A worker config from a TOML node file with per-model residency, on a free port."""
    lines = [
        f'model_repo = "{repo}"',
        "",
        "[global]",
        f'cache_dir = "{store.cache}"',
        'model_control_mode = "static"',
        "",
        "[global.runtime]",
        f"weight_cache_bytes = {budget}",
        f'weight_staging = "{route.value}"',
    ]
    for name, floor in residency.items():
        lines += ["", f"[global.scheduler.models.{name}]", f'residency = "{floor}"']
    return node_config(tmp_path, "\n".join(lines) + "\n")


def random_traffic(seed: int, names: list[str], n: int) -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(name, inputs(name, int(rng.integers(1, 3)), rng)) for name in rng.choice(names, n)]


def concurrently(worker, probe: Probe, requests, check, threads: int = 4) -> None:
    """Send ``requests`` from ``threads`` clients at once; ``check(name, x, y, resident)``
    after every response, with the evictable resident bytes read right then."""
    local = threading.local()
    clients = []

    def one(request):
        if not hasattr(local, "client"):
            local.client = connect(worker)
            clients.append(local.client)
        name, x = request
        y = infer_y(local.client, name, x)
        check(name, x, y, in_loop(worker, lambda: worker.weights.cache.resident_bytes))

    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, requests))
    finally:
        for client in clients:
            client.close()


# -- many models under a budget of three ------------------------------------------------


def test_many_models_random_traffic_within_budget(store, reference, probe, tmp_path, route):
    repo = store.copy(SMALL, tmp_path / "repo")
    config = worker_config(
        repo,
        store.cache,
        RUNTIME_WEIGHT_CACHE_BYTES=3 * W,
        RUNTIME_WEIGHT_STAGING=route.value,
        MODEL_CONTROL_MODE="static",
    )
    with running(config) as w:
        cache = w.weights.cache
        assert cache.budget == 3 * W
        client = connect(w)
        served = Counter()
        for name, x in random_traffic(1, SMALL, 200):  # one at a time, rows 1 or 2
            y = infer_y(client, name, x)
            assert in_loop(w, lambda: cache.resident_bytes) <= 3 * W
            assert same(y, reference(name, x)), name
            served[name] += 1
        client.close()

        rng = np.random.default_rng(2)  # then 4 clients at once, full batches of 2 rows
        burst = [(name, inputs(name, 2, rng)) for name in rng.choice(SMALL, 100)]

        def check(name, x, y, resident):
            assert resident <= 3 * W
            assert same(y, reference(name, x)), name

        concurrently(w, probe, burst, check)
        assert check_staging(w, route, probe) == 3

        def final():
            c = cache.counters
            return (
                c.loads,
                c.evictions,
                c.bytes_transferred,
                c.oversized_loads,
                c.load_seconds,
                len(cache.lru),
                cache.resident_bytes,
                dict(cache.pinned),
            )

        loads, evictions, transferred, oversized, seconds, n_lru, resident, pinned = in_loop(
            w, final
        )
    assert len(served) == 12
    assert loads > 12 and evictions > 0 and seconds > 0 and oversized == 0
    assert loads - evictions == n_lru == 3 and resident == 3 * W and not pinned
    assert transferred == loads * W
    assert probe.peak(w) <= 3 * W  # at every admission, startup warm-ups included


# -- a device-resident model ------------------------------------------------------------


def test_device_model_is_never_evicted(store, reference, probe, tmp_path, route):
    repo = store.copy(SMALL, tmp_path / "repo")
    config = node_file(tmp_path, store, repo, 3 * W, {"m00": "device"}, route)
    assert config.scheduler.models["m00"].residency == "device"
    with running(config) as w:
        cache = w.weights.cache
        key = w.models.get("m00").key
        pinned = cache.pinned[key]
        assert w.models.get("m00").residency == "device"
        assert w.models.get("m01").residency == "system"

        def state():
            return (
                cache.pinned.get(key),
                key in cache.lru,
                cache.resident_bytes,
                cache.pinned_bytes,
                any(a.is_deleted() for a in pinned.arrays),
            )

        client = connect(w)
        for name, x in random_traffic(3, SMALL, 150):
            y = infer_y(client, name, x)
            now, in_lru, resident, pinned_bytes, deleted = in_loop(w, state)
            assert now is pinned and not in_lru and not deleted
            assert resident <= 3 * W and pinned_bytes == W
            assert same(y, reference(name, x)), name
        client.close()
        assert check_staging(w, route, probe) == 3
        compacted = in_loop(w, lambda: dict(cache.lru))
        assert in_loop(w, w.weights.compact) == 3  # compaction leaves it too
        assert in_loop(w, lambda: cache.pinned.get(key)) is pinned
        assert all(a.is_deleted() for r in compacted.values() for a in r.arrays)
        x = inputs("m00", 1, np.random.default_rng(4))
        with connect(w) as client:
            assert same(infer_y(client, "m00", x), reference("m00", x))
            for name in ("m01", "m02"):  # reloaded after the compaction: new copies
                assert same(infer_y(client, name, x), reference(name, x))
        assert check_staging(w, route, probe) == 2
        evictions = in_loop(w, lambda: cache.counters.evictions)
    assert probe.loads(w, key) == 1  # placed once, at load
    assert evictions > 0  # the others were evicted meanwhile


# -- unpinned reads the file on every device load ---------------------------------------


def test_unpinned_rereads_the_file_and_system_keeps_its_host_copy(
    store, reference, probe, tmp_path, monkeypatch, route
):
    staged = Counter()

    def spy_stage(wf, fd=None):
        staged[wf.path.parent.name] += 1
        return stage(wf, fd)

    monkeypatch.setattr("rsrv.runtime._weight_manager.stage", spy_stage)
    repo = store.copy(["m00", "m01", "m02"], tmp_path / "repo")
    config = node_file(tmp_path, store, repo, W, {"m00": "unpinned", "m01": "system"}, route)
    x = inputs("m00", 2, np.random.default_rng(5))
    with running(config) as w, connect(w) as client:
        cache = w.weights.cache
        un, sys_ = w.models.get("m00").key, w.models.get("m01").key
        assert not w.weights.host_resident(un) and w.weights.host_resident(sys_)
        assert same(infer_y(client, "m00", x), reference("m00", x))
        assert same(infer_y(client, "m01", x), reference("m01", x))
        assert same(infer_y(client, "m02", x), reference("m02", x))
        assert in_loop(w, lambda: list(cache.lru)) == [w.models.get("m02").key]
        # Same layout, different values: m00 now holds m05's weights, m01 m06's. m00's
        # file is overwritten in place: a loaded unpinned version holds its file open, so
        # an atomic replacement (a new bundle version) would not reach it, by design.
        seeded_weights(
            repo / "m00" / "weights.safetensors", "a", list(MODELS).index("m05"), in_place=True
        )
        seeded_weights(repo / "m01" / "weights.safetensors", "a", list(MODELS).index("m06"))
        assert (repo / "m00" / "weights.safetensors").read_bytes() == (
            store.bundles / "m05" / "weights.safetensors"
        ).read_bytes()
        y = infer_y(client, "m00", x)
        assert same(y, reference("m05", x)) and not same(y, reference("m00", x))
        assert same(infer_y(client, "m01", x), reference("m01", x))  # its host floor
        assert check_staging(w, route, probe) == 1
        assert same(infer_y(client, "m00", x), reference("m05", x))
        assert check_staging(w, route, probe) == 0  # m00 has no floor to compare
    assert staged["m01"] == staged["m02"] == 1  # system: staged once, at load
    assert staged["m00"] == probe.loads(w, un) >= 3  # unpinned: every device load


def test_unpinned_version_keeps_its_own_weights_when_the_bundle_is_replaced(
    store, reference, probe, tmp_path, route
):
    """A new bundle version written atomically (rename) does not leak into the loaded
    version: its requests keep getting the weights it was loaded with."""
    repo = store.copy(["m00", "m01"], tmp_path / "repo")
    config = node_file(tmp_path, store, repo, W, {"m00": "unpinned"}, route)
    x = inputs("m00", 2, np.random.default_rng(6))
    with running(config) as w, connect(w) as client:
        assert same(infer_y(client, "m00", x), reference("m00", x))
        seeded_weights(repo / "m00" / "weights.safetensors", "a", list(MODELS).index("m05"))
        for _ in range(3):  # m01 evicts m00; each reload reads the file m00 holds open
            assert same(infer_y(client, "m01", x), reference("m01", x))
            assert same(infer_y(client, "m00", x), reference("m00", x))
        check_staging(w, route, probe)


# -- a budget derived from GPU-shaped allocator statistics; a model larger than it -------


def test_budget_from_allocator_statistics_and_an_oversized_model(
    store, reference, probe, tmp_path, route, caplog
):
    """The worker derives its budget from a recorded allocator (GPU-shaped statistics: no
    weight_cache_bytes) and re-derives it as warm-ups measure larger scratch: the
    last run needs all of ``(1 - wiggle) x limit`` but three small models' worth. "big"
    (four models' worth) is then larger than the whole budget: it answers anyway, alone
    over the budget, with the warning."""
    caplog.set_level(logging.INFO, logger="rsrv.runtime")
    names = ["m00", "m01", "m02", "big"]
    runs = 2 * len(names)  # every model is compiled at batch sizes 1 and 2
    rec = Recording().start()
    limit = rec.snapshots[0]["bytes_limit"]
    last = int(0.9 * limit) - 3 * W  # the default wiggle is 0.1
    for i in range(runs - 1):  # each run raises the peak: a larger scratch every time
        rec.weights(W).execution((i + 1) * 64 * 2**20)
    rec.execution(last)
    allocator = RecordedAllocator(rec.snapshots)
    repo = store.copy(names, tmp_path / "repo")
    config = worker_config(
        repo, store.cache, RUNTIME_WEIGHT_STAGING=route.value, MODEL_CONTROL_MODE="static"
    )
    assert config.runtime.weight_cache_bytes is None
    with running(config, allocator=allocator) as w, connect(w) as client:
        cache = w.weights.cache
        assert allocator.left == 0  # the limit at start, two reads per warm-up run
        assert (w.weights.max_scratch, cache.budget) == (last, 3 * W)
        assert in_loop(w, lambda: cache.resident_bytes) <= 3 * W  # trimmed to fit it
        big = w.models.get("big").key
        traffic = random_traffic(6, names, 40) + [
            ("big", inputs("big", 1, np.random.default_rng(7)))
        ]
        for name, x in traffic:
            y = infer_y(client, name, x)
            lru, resident = in_loop(w, lambda: (list(cache.lru), cache.resident_bytes))
            assert same(y, reference(name, x)), name
            if name == "big":  # the single-oversized case: alone, over the budget
                assert lru == [big] and resident == 4 * W
            else:
                assert resident <= 3 * W and big not in lru
        check_staging(w, route, probe)
        oversized = in_loop(w, lambda: cache.counters.oversized_loads)
    assert allocator.left == 0  # dispatches read no statistics
    # its warm-up load came before the last run shrank the budget; every later one is over it
    assert oversized == probe.loads(w, big) - 1 >= 2
    assert "exceed the whole weight cache budget" in caplog.text
    assert f"weight cache budget {3 * W} bytes (largest scratch {last} bytes)" in caplog.text


# -- prefetch ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("names", "budget", "transfers"),
    [
        (SLOW[:2], W_SLOW, False),  # two alternating, room for one: prefetch must not overfill
        (SLOW, 2 * W_SLOW, True),  # three in turn, room for two: the next one loads meanwhile
    ],
    ids=["two-models-room-for-one", "three-models-room-for-two"],
)
def test_prefetch_runs_next_models_weights_meanwhile(
    store, reference, probe, tmp_path, route, names, budget, transfers
):
    repo = store.copy(names, tmp_path / "repo")
    config = worker_config(
        repo,
        store.cache,
        RUNTIME_WEIGHT_CACHE_BYTES=budget,
        RUNTIME_WEIGHT_STAGING=route.value,
        MODEL_CONTROL_MODE="static",
    )
    with running(config) as w:
        weights, cache = w.weights, w.weights.cache
        calls = []
        prefetch = weights.prefetch

        async def spy_prefetch(key):
            before = cache.is_resident(key)
            await prefetch(key)
            calls.append((key, before, cache.is_resident(key)))

        weights.prefetch = spy_prefetch
        rng = np.random.default_rng(8)
        # four clients, each cycling through the models from its own offset
        requests = [
            (names[(i + k) % len(names)], inputs(names[0], 2, rng))
            for k in range(30)
            for i in range(4)
        ]

        def check(name, x, y, resident):
            assert resident <= budget
            assert same(y, reference(name, x)), name

        concurrently(w, probe, requests, check)
        check_staging(w, route, probe)
        loads = in_loop(w, lambda: cache.counters.loads)
    assert calls, "the scheduler never prefetched"
    assert loads > len(names)  # the budget really is too small for all of them
    assert probe.peak(w) <= budget  # a prefetch never overfills it
    if transfers:  # some prefetches found the weights absent and left them resident
        assert [c for c in calls if not c[1] and c[2]], calls
