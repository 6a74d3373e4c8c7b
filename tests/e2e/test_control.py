"""Explicit model control and the control service, against a running worker.

RepositoryModelLoad / Unload go through tritonclient; ModelControlStatus,
SetModelResidency, SetModelPolicy and CompactMemory through our own ControlClient.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import numpy as np
import pytest
import trio
import tritonclient.grpc as tc
from purerpc.grpclib.status import StatusCode
from support.bundles import (
    WEIGHT_BYTES,
    X,
    expected,
    export_linear,
    infer_y,
    linear_params,
    make_repo,
    matches,
    x_input,
)
from support.clients import connect, index, server_error, status_of
from support.serving import hook_globals, running, worker_config
from support.waiting import wait_until

from rsrv.client import ControlClient
from rsrv.config import ModelSchedConfig
from rsrv.export import Input, Output, export_jax
from rsrv.protocol.generated.rsrv.control.v1 import control_pb2 as pb
from rsrv.worker import Worker
from rsrv.worker._executor import DeviceExecutor


@pytest.fixture
def repo(tmp_path):
    path = tmp_path / "repo"
    path.mkdir()
    for name, seed in (("a", 0), ("b", 1), ("c", 2)):
        export_linear(path / name, seed)
    return path


def export_columns(out_dir, seed: int):
    """Like the linear bundle, but the batch runs along axis 1 of x f32[3,n]."""
    return export_jax(
        lambda p, x: x.T @ p["w"] + p["b"],
        linear_params(seed),
        inputs=[Input("x", np.float32, (3, "n"), letters="fn")],
        outputs=[Output("y", letters="nk")],
        batch_sizes=[1, 2, 4],
        out_dir=out_dir,
    )


@asynccontextmanager
async def serving(config) -> AsyncIterator[tuple[Worker, tc.InferenceServerClient]]:
    """:func:`support.serving.running` for async tests (started and stopped off the test's trio
    loop), with a tritonclient connected to it."""
    manager = running(config)
    worker = await trio.to_thread.run_sync(manager.__enter__)
    try:
        with connect(worker) as client:
            yield worker, client
    finally:
        await trio.to_thread.run_sync(manager.__exit__, None, None, None)


async def statuses(client: ControlClient) -> dict[str, pb.ModelStatus]:
    return {m.name: m for m in (await client.status()).models}


# -- explicit mode: RepositoryModelLoad / Unload ------------------------------------------


def test_explicit_mode_loads_and_unloads_only_on_request(repo, cache_dir):
    (repo / "broken").mkdir()
    (repo / "broken" / "manifest.yaml").write_text("kind: model\n")
    config = worker_config(repo, cache_dir, MODEL_CONTROL_MODE="explicit", MODEL_POLL_SECONDS=0.05)
    unloaded = ("UNAVAILABLE", "unloaded")
    with running(config) as worker, connect(worker) as client:
        # nothing loads at startup; the index lists what may be loaded
        assert index(client) == {n: unloaded for n in ("a", "b", "broken", "c")}
        assert client.is_server_ready()
        assert status_of(lambda: infer_y(client, "a", X)) == "StatusCode.NOT_FOUND"
        export_linear(repo / "d", seed=3)
        time.sleep(0.3)  # six poll intervals: the worker never loads on its own
        assert index(client) == {n: unloaded for n in ("a", "b", "broken", "c", "d")}

        client.load_model("a")
        assert index(client)["a"] == ("READY", "")
        assert client.is_model_ready("a")
        assert matches(infer_y(client, "a", X), 0, X)
        client.load_model("d")
        assert matches(infer_y(client, "d", X), 3, X)

        assert status_of(lambda: client.load_model("nope")) == "StatusCode.NOT_FOUND"
        assert status_of(lambda: client.load_model("broken")) == "StatusCode.FAILED_PRECONDITION"
        state, reason = index(client)["broken"]
        assert state == "UNAVAILABLE" and "manifest.yaml" in reason

        export_linear(repo / "a", seed=5)  # a load of a loaded model reloads it
        client.load_model("a")
        assert matches(infer_y(client, "a", X), 5, X)

        (repo / "a" / "model.b2.mlir").write_text("garbage")  # a failed reload...
        assert status_of(lambda: client.load_model("a")) == "StatusCode.FAILED_PRECONDITION"
        state, reason = index(client)["a"]
        assert state == "READY" and "model.b2.mlir" in reason  # ...keeps the old version
        assert matches(infer_y(client, "a", X), 5, X)

        client.unload_model("a")
        assert index(client)["a"] == unloaded
        assert status_of(lambda: infer_y(client, "a", X)) == "StatusCode.NOT_FOUND"
        assert status_of(lambda: client.unload_model("a")) == "StatusCode.NOT_FOUND"
        client.unload_model("broken")
        assert index(client) == {
            "a": unloaded,
            "b": unloaded,
            "broken": unloaded,
            "c": unloaded,
            "d": ("READY", ""),
        }
        assert matches(infer_y(client, "d", X), 3, X)

        export_linear(repo / "a", seed=5)  # repaired
        client.load_model("a")  # loaded afresh: its statistics start from zero
        stats = client.get_inference_statistics("a").model_stats[0]
        assert (stats.inference_stats.success.count, stats.execution_count) == (0, 0)
        assert matches(infer_y(client, "a", X), 5, X)


def test_a_request_that_outlives_its_models_unload_is_not_counted_in_the_next_load(
    tmp_path, cache_dir
):
    """protocol.md §2: an unloaded model's counters are dropped, so a later load starts
    from zero. A request held in its preprocess across an unload and a new load was
    counted (as failed) in the new load's statistics."""
    repo = make_repo(tmp_path / "repo", "slow")
    config = worker_config(repo, cache_dir, MODEL_CONTROL_MODE="explicit")
    with running(config) as worker, connect(worker) as client:
        client.load_model("slow")
        active = hook_globals(worker, "slow")["ACTIVE"]
        done = queue.Queue()
        held = [tc.InferInput("x", [1, 4], "FP32")]
        held[0].set_data_from_numpy(np.full((1, 4), 2.0, np.float32))  # (2 s in preprocess)
        client.async_infer("slow", held, lambda result, error: done.put(error))
        wait_until(lambda: active[0] == 1, what="the request to be in its preprocess")
        client.unload_model("slow")
        client.load_model("slow")
        error = done.get(timeout=60)
        assert error is not None and error.status() == "StatusCode.NOT_FOUND"
        stats = client.get_inference_statistics("slow").model_stats[0].inference_stats
        assert (stats.success.count, stats.fail.count) == (0, 0)


async def test_a_load_whose_client_gives_up_still_finishes(repo, cache_dir, monkeypatch):
    """RepositoryModelLoad cut off by its client's deadline while it warms up: the load
    finishes (as Triton's does), the old load of a is retired and its pinned weights
    freed, and b is READY. (Cut off between its steps, loads kept their weights
    registered and pinned, and b stayed LOADING: ServerReady false for good.)"""
    warm_up = DeviceExecutor.warm_up

    async def slow_warm_up(self, served):
        await trio.sleep(1.0)
        return await warm_up(self, served)

    monkeypatch.setattr(DeviceExecutor, "warm_up", slow_warm_up)
    config = worker_config(
        repo, cache_dir, MODEL_CONTROL_MODE="explicit", RUNTIME_WEIGHT_CACHE_BYTES=1 << 20
    )
    async with serving(config) as (worker, client):
        await trio.to_thread.run_sync(client.load_model, "a")
        async with ControlClient("127.0.0.1", worker.port) as control:
            await control.set_residency("a", "device")
        for name in ("a", "a", "b"):
            with pytest.raises(tc.InferenceServerException, match="DEADLINE_EXCEEDED"):
                await trio.to_thread.run_sync(
                    lambda name=name: client.load_model(name, client_timeout=0.3)
                )
        with trio.fail_after(30):
            while not (
                client.is_server_ready()
                and client.is_model_ready("b")
                and len(worker.weights.placements) == 2
            ):
                await trio.sleep(0.05)
        assert sorted(worker.executor.versions) == sorted(worker.weights.placements)
        assert len(worker.weights.cache.pinned) == 1  # a's newest load alone
        assert matches(infer_y(client, "a", X), 0, X) and matches(infer_y(client, "b", X), 1, X)


def test_repository_load_and_unload_need_explicit_mode(repo, cache_dir):
    config = worker_config(repo, cache_dir, MODEL_POLL_SECONDS=60)
    with running(config) as worker, connect(worker) as client:
        assert status_of(lambda: client.load_model("a")) == "StatusCode.FAILED_PRECONDITION"
        assert status_of(lambda: client.unload_model("a")) == "StatusCode.FAILED_PRECONDITION"
        assert set(index(client)) == {"a", "b", "c"}


# -- ModelControlStatus ----------------------------------------------------------------------


async def test_model_control_status_reports_every_field(repo, cache_dir):
    export_columns(repo / "cols", seed=4)
    (repo / "broken").mkdir()
    (repo / "broken" / "manifest.yaml").write_text("kind: model\n")
    config = worker_config(repo, cache_dir, MODEL_POLL_SECONDS=60)
    config = msgspec.structs.replace(
        config,
        scheduler=msgspec.structs.replace(
            config.scheduler, models={"cols": ModelSchedConfig(weight=2.5, max_batch_size=2)}
        ),
    )
    async with serving(config) as (worker, client):
        for rows in (1, 1, 1, 2, 2):  # one at a time: one dispatch each
            infer_y(client, "a", X[:rows])
        y = client.infer("cols", [x_input(X.T)]).as_numpy("y")
        assert np.allclose(y, expected(4, X), rtol=1e-5)

        async with ControlClient("127.0.0.1", worker.port) as control:
            response = await control.status()
            models = await statuses(control)

    assert response.discipline == "fair"
    assert response.control_mode == "dynamic"
    assert response.weight_cache_budget_bytes == 0  # CPU, no weight_cache_bytes: cache off
    assert response.weight_cache_resident_bytes == 0  # nothing evictable: all pinned
    assert response.weight_cache_loads == 4  # each model copied once, at load
    assert response.weight_cache_evictions == 0
    assert list(models) == ["a", "b", "broken", "c", "cols"]

    a = models["a"]
    assert (a.kind, a.state) == ("model", "READY")
    assert a.residency == pb.RESIDENCY_DEVICE  # the cache is off: everything on the device
    assert a.device_resident and not a.host_resident
    assert a.weight_bytes == WEIGHT_BYTES
    assert a.weight == 1.0
    assert a.queue_depth == 0
    assert (a.requests_served, a.rows_served, a.dispatches) == (5, 7, 5)
    assert a.compute_seconds > 0
    assert a.max_batch_size == 4  # the largest compiled size
    assert (a.batch_input_name, a.batch_axis) == ("x", 0)

    cols = models["cols"]
    assert cols.weight == 2.5
    assert cols.max_batch_size == 2  # capped by scheduler.models.cols.max_batch_size
    assert (cols.batch_input_name, cols.batch_axis) == ("x", 1)
    assert (cols.requests_served, cols.rows_served, cols.dispatches) == (1, 2, 1)

    b = models["b"]
    assert (b.requests_served, b.dispatches, b.compute_seconds) == (0, 0, 0.0)

    broken = models["broken"]
    assert broken.state == "UNAVAILABLE"
    assert (broken.kind, broken.weight_bytes, broken.batch_axis) == ("", 0, -1)


# -- SetModelResidency -----------------------------------------------------------------------


async def test_set_model_residency_in_explicit_mode(repo, cache_dir):
    """A budget for one model's weights: b and c evict each other, a pinned on the
    device never leaves it; system keeps a host copy, unpinned does not."""
    config = worker_config(
        repo, cache_dir, MODEL_CONTROL_MODE="explicit", RUNTIME_WEIGHT_CACHE_BYTES=WEIGHT_BYTES + 8
    )
    async with serving(config) as (worker, client):
        for name in ("a", "b", "c"):
            client.load_model(name)
        async with ControlClient("127.0.0.1", worker.port) as control:
            response = await control.status()
            assert response.weight_cache_budget_bytes == WEIGHT_BYTES + 8
            models = await statuses(control)
            for m in models.values():  # the default floor while the cache is on
                assert m.residency == pb.RESIDENCY_SYSTEM and m.host_resident

            assert await control.set_residency("a", "device") == "device"
            a = (await statuses(control))["a"]
            assert a.residency == pb.RESIDENCY_DEVICE
            assert a.device_resident and not a.host_resident

            evictions = response.weight_cache_evictions
            for name in ("b", "c", "b", "c", "a", "b", "c"):
                seed = "abc".index(name)
                assert matches(infer_y(client, name, X), seed, X)
                models = await statuses(control)
                assert models["a"].device_resident  # never evicted
                assert models[name].device_resident
                assert sum(m.device_resident for m in models.values()) == 2
            response = await control.status()
            assert response.weight_cache_evictions >= evictions + 5
            assert response.weight_cache_resident_bytes <= WEIGHT_BYTES + 8

            assert await control.set_residency("b", "unpinned") == "unpinned"
            b = (await statuses(control))["b"]
            assert b.residency == pb.RESIDENCY_UNPINNED and not b.host_resident
            assert matches(infer_y(client, "b", X), 1, X)  # read from the weights file

            assert await control.set_residency("b", "system") == "system"
            with pytest.raises(ValueError, match="'pinned': expected one of unpinned"):
                await control.set_residency("b", "pinned")
            b = (await statuses(control))["b"]
            assert b.residency == pb.RESIDENCY_SYSTEM and b.host_resident

            assert await control.set_residency("a", "system") == "system"
            infer_y(client, "b", X)
            infer_y(client, "c", X)
            a = (await statuses(control))["a"]
            assert a.residency == pb.RESIDENCY_SYSTEM and a.host_resident
            assert not a.device_resident  # evictable again, and evicted
            assert matches(infer_y(client, "a", X), 0, X)

            # the floor set over RPC survives a reload of the model
            await control.set_residency("c", "device")
            client.load_model("c")
            c = (await statuses(control))["c"]
            assert c.residency == pb.RESIDENCY_DEVICE and c.device_resident


async def test_a_residency_change_that_cannot_be_made_changes_nothing(repo, cache_dir):
    """The weights file is gone: unpinned (which reads from it) is FAILED_PRECONDITION,
    and the model stays system, serving from its host copy (it used to drop that copy
    first, and fail every request after)."""
    config = worker_config(
        repo, cache_dir, MODEL_CONTROL_MODE="explicit", RUNTIME_WEIGHT_CACHE_BYTES=WEIGHT_BYTES + 8
    )
    async with serving(config) as (worker, client):
        client.load_model("a")
        async with ControlClient("127.0.0.1", worker.port) as control:
            (repo / "a" / "weights.safetensors").unlink()
            with server_error(StatusCode.FAILED_PRECONDITION, "weights file cannot be read"):
                await control.set_residency("a", "unpinned")
            a = (await statuses(control))["a"]
            assert a.residency == pb.RESIDENCY_SYSTEM and a.host_resident
            await control.compact_memory([])  # off the device: back from the host copy
            assert matches(infer_y(client, "a", X), 0, X)


async def test_a_residency_change_failing_on_one_version_changes_none(tmp_path, cache_dir):
    """Two versions; version 2's weights file is gone: unpinned fails FAILED_PRECONDITION
    and version 1, changed first, is put back; no floor is kept for reloads (it was left
    half changed, and the floor kept)."""
    repo = tmp_path / "repo"
    for n in (1, 2):
        export_linear(repo / "m" / str(n), seed=n)
        manifest = repo / "m" / str(n) / "manifest.yaml"
        manifest.write_text(manifest.read_text() + "version_policy: {all: true}\n")
    config = worker_config(
        repo, cache_dir, MODEL_CONTROL_MODE="explicit", RUNTIME_WEIGHT_CACHE_BYTES=4 * WEIGHT_BYTES
    )
    async with serving(config) as (worker, client):
        client.load_model("m")
        async with ControlClient("127.0.0.1", worker.port) as control:
            (repo / "m" / "2" / "weights.safetensors").unlink()
            with server_error(StatusCode.FAILED_PRECONDITION, "weights file cannot be read"):
                await control.set_residency("m", "unpinned")
            versions = worker.models.entries["m"].versions
            assert {n: v.model.residency for n, v in versions.items()} == {1: "system", 2: "system"}
            assert "m" not in worker.loader.residency
            assert (await statuses(control))["m"].residency == pb.RESIDENCY_SYSTEM


async def test_a_residency_set_during_a_reload_holds_for_the_new_load(repo, cache_dir, monkeypatch):
    """SetModelResidency waits for a reload in progress, and sets the new load's floor
    (it used to set the old load's, and the new one came up with the old floor); the
    floor, and SetModelPolicy's weight, are kept across later reloads until unload."""
    warm_up = DeviceExecutor.warm_up
    warming = threading.Event()  # (set on the worker's own loop, in its thread)

    async def slow_warm_up(self, served):
        warming.set()
        await trio.sleep(0.5)
        return await warm_up(self, served)

    monkeypatch.setattr(DeviceExecutor, "warm_up", slow_warm_up)
    config = worker_config(
        repo, cache_dir, MODEL_CONTROL_MODE="explicit", RUNTIME_WEIGHT_CACHE_BYTES=WEIGHT_BYTES + 8
    )
    async with serving(config) as (worker, client):
        client.load_model("a")
        async with ControlClient("127.0.0.1", worker.port) as control:
            assert await control.set_policy("a", weight=3.5) == 3.5
            async with trio.open_nursery() as nursery:
                warming.clear()
                nursery.start_soon(trio.to_thread.run_sync, client.load_model, "a")
                while not warming.is_set():
                    await trio.sleep(0.01)
                assert await control.set_residency("a", "device") == "device"
            a = (await statuses(control))["a"]
            assert (a.residency, a.device_resident, a.weight) == (pb.RESIDENCY_DEVICE, True, 3.5)
            client.load_model("a")
            a = (await statuses(control))["a"]
            assert (a.residency, a.weight) == (pb.RESIDENCY_DEVICE, 3.5)
            client.unload_model("a")
            client.load_model("a")
            a = (await statuses(control))["a"]
            assert (a.residency, a.weight) == (pb.RESIDENCY_SYSTEM, 1.0)  # forgotten


async def test_residency_and_compaction_wait_for_a_first_load(repo, cache_dir, monkeypatch):
    """A controller loading a model and setting its floor at once: SetModelResidency and
    CompactMemory sent while its first load runs wait for it (both answered UNAVAILABLE
    "model 'a' is loading" at once; a reload was waited for)."""
    warm_up = DeviceExecutor.warm_up
    warming = threading.Event()

    async def slow_warm_up(self, served):
        warming.set()
        await trio.sleep(0.5)
        return await warm_up(self, served)

    monkeypatch.setattr(DeviceExecutor, "warm_up", slow_warm_up)
    config = worker_config(repo, cache_dir, MODEL_CONTROL_MODE="explicit")
    async with serving(config) as (worker, client):
        async with ControlClient("127.0.0.1", worker.port) as control:
            for call in (
                lambda: control.set_residency("a", "device"),
                lambda: control.compact_memory(["a"]),
            ):
                async with trio.open_nursery() as nursery:
                    warming.clear()
                    nursery.start_soon(trio.to_thread.run_sync, client.load_model, "a")
                    while not warming.is_set():
                        await trio.sleep(0.01)
                    await call()
                client.unload_model("a")


async def test_set_model_residency_needs_explicit_mode(repo, cache_dir):
    config = worker_config(repo, cache_dir, MODEL_POLL_SECONDS=60)
    async with serving(config) as (worker, _):
        async with ControlClient("127.0.0.1", worker.port) as control:
            for name in ("a", "nope"):  # (the mode first, as the repository RPCs: was NOT_FOUND)
                with server_error(StatusCode.FAILED_PRECONDITION, "explicit"):
                    await control.set_residency(name, "device")


async def test_unknown_models_are_not_found_for_every_control_rpc(repo, cache_dir):
    config = worker_config(repo, cache_dir, MODEL_CONTROL_MODE="explicit")
    async with serving(config) as (worker, client):
        client.load_model("a")
        async with ControlClient("127.0.0.1", worker.port) as control:
            with server_error(StatusCode.NOT_FOUND, "nope"):
                await control.set_residency("nope", "system")
            with server_error(StatusCode.NOT_FOUND, "nope"):
                await control.set_policy("nope", weight=2.0)
            with server_error(StatusCode.NOT_FOUND, "nope"):
                await control.compact_memory(["a", "nope"])
            with server_error(StatusCode.NOT_FOUND, "b"):  # in the repo, not loaded
                await control.set_policy("b", weight=2.0)
            assert [m.name for m in (await control.status()).models] == ["a"]


# -- SetModelPolicy --------------------------------------------------------------------------


async def test_set_model_policy_changes_the_weight_live(repo, cache_dir):
    config = worker_config(repo, cache_dir, MODEL_POLL_SECONDS=60)
    async with serving(config) as (worker, client):
        async with ControlClient("127.0.0.1", worker.port) as control:
            assert (await statuses(control))["a"].weight == 1.0
            assert await control.set_policy("a", weight=3.5) == 3.5
            models = await statuses(control)
            assert (models["a"].weight, models["b"].weight) == (3.5, 1.0)
            assert await control.set_policy("a") == 3.5  # nothing set: unchanged
            for bad in (0.0, -1.0):
                with server_error(StatusCode.INVALID_ARGUMENT, "weight"):
                    await control.set_policy("a", weight=bad)
            assert (await statuses(control))["a"].weight == 3.5
            assert matches(infer_y(client, "a", X), 0, X)


# -- CompactMemory ---------------------------------------------------------------------------


async def test_compact_memory_frees_evictable_weights_and_reloads_the_listed(repo, cache_dir):
    config = worker_config(
        repo, cache_dir, MODEL_CONTROL_MODE="explicit", RUNTIME_WEIGHT_CACHE_BYTES=10 * WEIGHT_BYTES
    )
    async with serving(config) as (worker, client):
        for name in ("a", "b", "c"):
            client.load_model(name)
            infer_y(client, name, X)
        async with ControlClient("127.0.0.1", worker.port) as control:
            await control.set_residency("c", "device")
            before = await control.status()
            assert before.weight_cache_resident_bytes == 2 * WEIGHT_BYTES  # a, b (c pinned)
            assert all(m.device_resident for m in before.models)

            response = await control.compact_memory(["b"])
            assert response.reloaded_models == 1
            assert response.resident_bytes_after == WEIGHT_BYTES
            after = await control.status()
            assert after.weight_cache_resident_bytes == WEIGHT_BYTES
            assert after.weight_cache_evictions == before.weight_cache_evictions + 2
            assert after.weight_cache_loads == before.weight_cache_loads + 1
            models = await statuses(control)
            assert not models["a"].device_resident and models["a"].host_resident
            assert models["b"].device_resident
            assert models["c"].device_resident  # pinned weights are not evictable

            # c stays on the device (pinned), b is copied once: one reloaded, as loaded
            loads = (await control.status()).weight_cache_loads
            response = await control.compact_memory(["c", "b", "b"])
            assert response.reloaded_models == 1
            assert (await control.status()).weight_cache_loads == loads + 1

            response = await control.compact_memory()
            assert (response.reloaded_models, response.resident_bytes_after) == (0, 0)
            assert matches(infer_y(client, "a", X), 0, X)  # loaded again on demand
            assert (await statuses(control))["a"].device_resident


# -- meta models -----------------------------------------------------------------------------


async def test_control_rpcs_on_a_meta_model(tmp_path, cache_dir):
    """A meta model has no weights or policy of its own: residency and compaction act on
    the models it calls; a policy change is refused, not NOT_FOUND."""
    import shutil

    from support import BUNDLES

    repo = tmp_path / "repo"
    for name in ("region_pipeline", "region_scorer", "patch_classifier"):
        shutil.copytree(BUNDLES / name, repo / name)
    config = worker_config(
        repo, cache_dir, MODEL_CONTROL_MODE="explicit", RUNTIME_WEIGHT_CACHE_BYTES=1 << 20
    )
    async with serving(config) as (worker, client):
        for name in ("region_scorer", "patch_classifier", "region_pipeline"):
            client.load_model(name)
        subs = ("region_scorer", "patch_classifier")
        async with ControlClient("127.0.0.1", worker.port) as control:
            models = await statuses(control)
            meta = models["region_pipeline"]
            assert (meta.kind, meta.state) == ("meta", "READY")
            assert meta.weight_bytes == sum(models[s].weight_bytes for s in subs)

            with server_error(StatusCode.FAILED_PRECONDITION, "meta model"):
                await control.set_policy("region_pipeline", weight=2.0)

            assert await control.set_residency("region_pipeline", "device") == "device"
            models = await statuses(control)
            for name in ("region_pipeline", *subs):
                assert models[name].residency == pb.RESIDENCY_DEVICE, name
                assert models[name].device_resident, name

            await control.set_residency("region_pipeline", "system")
            response = await control.compact_memory(["region_pipeline"])
            assert response.reloaded_models == 2
            assert response.resident_bytes_after == meta.weight_bytes
            assert all(m.device_resident for m in (await statuses(control)).values())
