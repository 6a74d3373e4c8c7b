"""Meta models (specs/meta.md), against a real worker driven through tritonclient.

* the example ``bundles/region_pipeline`` end to end against a numpy reference of both
  stages and the glue, including the early exit, where stage 2 is never called;
* sub-calls re-enter the scheduler: they coalesce with direct traffic, carry the meta
  request's deadline, go ahead of fresh work under edf, and are cancelled with the request;
* the glue runs off the dispatch loop, in its own threads, at most
  ``scheduler.meta_concurrency`` requests at a time;
* load-time rules, hidden sub-models, readiness and residency in explicit mode, and a
  meta's compute reported as the sum of its sub-calls.

Orderings are made deterministic by holding one execution on the device: the worker's
executor is wrapped (:class:`Device`) so that a chosen execution waits for the test,
while the test queues the requests whose order it then checks.
"""

from __future__ import annotations

import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families
from safetensors.numpy import load_file
from support import BUNDLES
from support.bundles import make_repo
from support.clients import (
    connect,
    control,
    failure,
    index,
    infer_input,
    model_status,
    model_statuses,
)
from support.references import example_weights, patch_classifier_reference, scorer_reference
from support.serving import hook_globals, running, worker_config
from support.waiting import wait_until
from tritonclient.utils import InferenceServerException

from rsrv.protocol.generated.rsrv.control.v1 import control_pb2 as cpb
from rsrv.worker._metrics import exposition

# -- the numpy reference of bundles/region_pipeline ------------------------------------------

PATCH, GRID, TOP_K, THRESHOLD = 16, 4, 4, 0.0  # as the manifest's description says


def stage1(image: np.ndarray) -> np.ndarray:
    """Stage 1 of one image: one linear score per 16x16 region, regions row by row."""
    return scorer_reference(example_weights("region_scorer"), image[None])[0]


def stage2(crops: np.ndarray) -> np.ndarray:
    """Stage 2: the logits of each crop."""
    return patch_classifier_reference(example_weights("patch_classifier"), crops)


def crop(image: np.ndarray, region: int) -> np.ndarray:
    r, c = divmod(int(region), GRID)
    return image[r * PATCH : (r + 1) * PATCH, c * PATCH : (c + 1) * PATCH]


def pipeline_reference(image: np.ndarray) -> dict[str, np.ndarray]:
    """The glue: the TOP_K best regions scoring above THRESHOLD, best first (ties by
    region index), each labelled by stage 2; nothing (and no stage 2) when none."""
    scores = stage1(image)
    kept = sorted(
        (i for i in range(GRID * GRID) if scores[i] > THRESHOLD), key=lambda i: (-scores[i], i)
    )[:TOP_K]
    if not kept:
        return {
            "regions": np.zeros(0, np.int64),
            "scores": np.zeros(0),
            "labels": np.zeros(0, np.int64),
        }
    logits = stage2(np.stack([crop(image, i) for i in kept]))
    top2 = np.sort(logits, axis=1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0] > 1e-3).all(), "test image too close to a label tie"
    return {
        "regions": np.array(kept, np.int64),
        "scores": scores[kept],
        "labels": logits.argmax(axis=1),
    }


def image_with(seed: int, bright: dict[int, float]) -> np.ndarray:
    """A dark 64x64 image (scores about -1.4) with ``{region: brightness}`` regions; a
    region of brightness b scores about 4b - 2."""
    rng = np.random.default_rng(seed)
    image = rng.uniform(0.0, 0.3, (64, 64)).astype(np.float32)
    for region, level in bright.items():
        r, c = divmod(region, GRID)
        image[r * PATCH : (r + 1) * PATCH, c * PATCH : (c + 1) * PATCH] = rng.uniform(
            level - 0.05, level + 0.05, (PATCH, PATCH)
        )
    return image


CASES = {
    "one": (1, {5: 0.9}),
    "three": (2, {0: 0.7, 15: 0.95, 6: 0.8}),
    "top_k": (3, {1: 0.62, 2: 0.95, 4: 0.7, 8: 0.85, 11: 0.66, 13: 0.78}),
    "empty": (4, {}),
}
EXPECTED_REGIONS = {"one": [5], "three": [15, 6, 0], "top_k": [2, 8, 13, 4], "empty": []}


# -- driving a worker ------------------------------------------------------------------------


def infer(client, model: str, inputs: dict[str, np.ndarray], **kw) -> dict[str, np.ndarray]:
    """One ModelInfer; returns every output by name."""
    result = client.infer(model, [infer_input(k, v) for k, v in inputs.items()], **kw)
    return {
        o["name"]: result.as_numpy(o["name"]) for o in result.get_response(as_json=True)["outputs"]
    }


def scrape(worker) -> str:
    """``exposition(worker)``: it reads trio's clock (for usage averages, not used here),
    so it runs in a trio context of the test thread's own."""

    async def collect():
        return (await exposition(worker)).decode()

    return trio.run(collect)


@dataclass
class Execution:
    model: str
    size: int
    first_input: np.ndarray  # input 0 of the batch as assembled (padded to ``size``)


@dataclass
class Hold:
    entered: threading.Event = field(default_factory=threading.Event)  # on the device
    released: threading.Event = field(default_factory=threading.Event)  # set by the test
    left: threading.Event = field(default_factory=threading.Event)  # released, or 30 s passed


class Device:
    """Wraps a running worker's executor: records every execution and can hold the next
    execution(s) of a model on the device until the test releases them. The dispatch
    loop runs one batch at a time, so a held execution keeps everything else queued."""

    def __init__(self, worker):
        self.executions: list[Execution] = []
        self._holds: dict[str, list[Hold]] = {}
        inner = worker.executor.execute

        async def execute(key: str, size: int, inputs: list[np.ndarray]):
            model = key.rsplit("@", 1)[0]
            self.executions.append(Execution(model, size, np.array(inputs[0])))
            waiting = self._holds.get(model)
            if waiting:
                hold = waiting.pop(0)
                hold.entered.set()
                await trio.to_thread.run_sync(hold.released.wait, 30)
                hold.left.set()
            return await inner(key, size, inputs)

        worker.executor.execute = execute

    def hold(self, model: str) -> Hold:
        hold = Hold()
        self._holds.setdefault(model, []).append(hold)
        return hold

    def of(self, model: str) -> list[Execution]:
        return [e for e in self.executions if e.model == model]


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(64) as executor:
        yield executor


@pytest.fixture(scope="module")
def repo():
    """What the module's ``worker`` serves: bundles/ (fair discipline, dynamic mode)."""
    return BUNDLES


# -- a small repository of metas over the tiny model (tmp_path) ---------------------------------

X_SPEC = {"name": "x", "dtype": "f32", "shape": "nf", "dims": {"f": 3}}
Y_SPEC = {"name": "y", "dtype": "f32", "shape": "nk", "dims": {"k": 2}}


def write_meta(repo: Path, name: str, calls: list[str], model_py: str) -> Path:
    path = repo / name
    path.mkdir(parents=True)
    manifest = {
        "format_version": "2.0",
        "kind": "meta",
        "client_inputs": [X_SPEC],
        "client_outputs": [Y_SPEC],
        "meta": {"calls": calls},
    }
    (path / "manifest.yaml").write_bytes(msgspec.yaml.encode(manifest))
    (path / "model.py").write_text(model_py)
    return path


def add_tiny(repo: Path, template: Path, name: str) -> Path:
    return Path(shutil.copytree(template, repo / name))


def tiny_reference(template: Path, x: np.ndarray) -> np.ndarray:
    w = load_file(template / "weights.safetensors")
    return x @ w["w"] + w["b"]


def rows(value: float, n: int = 1) -> np.ndarray:
    return np.full((n, 3), value, np.float32)


# relay: optionally parks (until the test releases it) and sleeps, then calls tiny.
RELAY_PY = """\
import threading
import time

import rsrv

control = {"sleep": 0.0, "park": False}
entered = []  # one entry per request whose glue started
parked = threading.Event()
release = threading.Event()


@rsrv.meta(inputs=["x"], outputs=["y"])
def relay(call, x):
    entered.append(time.monotonic())
    if control["park"]:
        parked.set()
        release.wait(30)
    time.sleep(control["sleep"])
    return call("tiny", {"x": x})["y"]
"""

# spin: calls tiny over and over for up to 3 s, recording how it ended.
SPIN_PY = """\
import threading
import time

import rsrv

calls = []
ended = []
finished = threading.Event()


@rsrv.meta(inputs=["x"], outputs=["y"])
def spin(call, x):
    try:
        end = time.monotonic() + 3.0
        while True:
            y = call("tiny", {"x": x})["y"]
            calls.append(time.monotonic())
            if time.monotonic() > end:
                return y
            time.sleep(0.005)
    except BaseException as e:
        ended.append(type(e).__name__)
        raise
    finally:
        finished.set()
"""

# stray: calls a model it did not declare.
STRAY_PY = """\
import rsrv


@rsrv.meta(inputs=["x"], outputs=["y"])
def stray(call, x):
    return call("ghost", {"x": x})["y"]
"""

# plain: calls CALLEE, its one declared model.
PLAIN_PY = """\
import rsrv


@rsrv.meta(inputs=["x"], outputs=["y"])
def plain(call, x):
    return call(CALLEE, {"x": x})["y"]
"""


def plain(callee: str) -> str:
    return PLAIN_PY.replace("CALLEE", repr(callee))


@pytest.fixture
def tiny_repo(tmp_path, tiny_template) -> Path:
    """tiny (called by the metas), other (a copy nobody calls), relay, spin, stray."""
    repo = tmp_path / "repo"
    add_tiny(repo, tiny_template, "tiny")
    add_tiny(repo, tiny_template, "other")
    write_meta(repo, "relay", ["tiny"], RELAY_PY)
    write_meta(repo, "spin", ["tiny"], SPIN_PY)
    write_meta(repo, "stray", ["tiny"], STRAY_PY)
    return repo


# -- the example, end to end -------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_region_pipeline_matches_numpy_reference(worker, triton, case):
    seed, bright = CASES[case]
    image = image_with(seed, bright)
    expected = pipeline_reference(image)
    assert expected["regions"].tolist() == EXPECTED_REGIONS[case]  # the image is as meant
    before = {m: model_status(worker, m) for m in ("region_scorer", "patch_classifier")}
    stats_before = triton.get_inference_statistics("patch_classifier", as_json=True)

    out = infer(triton, "region_pipeline", {"image": image})

    assert out["regions"].dtype == np.int64 and out["labels"].dtype == np.int64
    assert out["scores"].dtype == np.float32
    np.testing.assert_array_equal(out["regions"], expected["regions"])
    np.testing.assert_allclose(out["scores"], expected["scores"], rtol=1e-5)
    np.testing.assert_array_equal(out["labels"], expected["labels"])

    after = {m: model_status(worker, m) for m in ("region_scorer", "patch_classifier")}
    assert after["region_scorer"].requests_served == before["region_scorer"].requests_served + 1
    k = len(expected["regions"])
    old, new = before["patch_classifier"], after["patch_classifier"]
    stats_after = triton.get_inference_statistics("patch_classifier", as_json=True)
    if case == "empty":  # early exit: stage 2 never ran
        assert (new.requests_served, new.rows_served, new.dispatches, new.compute_seconds) == (
            old.requests_served,
            old.rows_served,
            old.dispatches,
            old.compute_seconds,
        )
        assert stats_after == stats_before
    else:
        assert new.requests_served == old.requests_served + 1
        assert new.rows_served == old.rows_served + k
        executions = lambda s: int(s["model_stats"][0].get("execution_count", 0))  # noqa: E731
        assert executions(stats_after) == executions(stats_before) + 1


def test_sub_models_are_hidden_but_served(worker, triton):
    listed = {m.name: m for m in triton.get_model_repository_index().models}
    assert set(listed) == {"classifier", "region_pipeline", "severity_grader"}
    assert listed["region_pipeline"].state == "READY"
    assert triton.is_model_ready("region_pipeline")
    # Hidden from the index, not from the worker: they answer by name.
    for sub in ("region_scorer", "patch_classifier"):
        assert triton.is_model_ready(sub)
    crops = np.stack([crop(image_with(7, {3: 0.9}), 3)])
    out = infer(triton, "patch_classifier", {"crop": crops})
    np.testing.assert_allclose(out["logits"], stage2(crops), rtol=1e-5, atol=1e-5)
    config = triton.get_model_config("region_pipeline", as_json=True)["config"]
    assert [i["name"] for i in config["input"]] == ["image"]
    meta = triton.get_model_metadata("region_pipeline", as_json=True)
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == [
        ("image", "FP32", ["64", "64"])
    ]
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["outputs"]] == [
        ("regions", "INT64", ["-1"]),
        ("scores", "FP32", ["-1"]),
        ("labels", "INT64", ["-1"]),
    ]


def test_meta_compute_is_the_sum_of_its_sub_calls(worker, triton):
    def families() -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for family in text_string_to_metric_families(scrape(worker)):
            for s in family.samples:
                if "model" in s.labels:
                    out.setdefault(s.name, {})[s.labels["model"]] = s.value
        return out

    before, metrics_before = model_statuses(worker), families()
    for case in ("one", "three", "top_k", "empty"):
        infer(triton, "region_pipeline", {"image": image_with(*CASES[case])})
    after, metrics_after = model_statuses(worker), families()

    def delta(name, field):
        return getattr(after[name], field) - getattr(before[name], field)

    meta = after["region_pipeline"]
    assert meta.kind == "meta"
    assert delta("region_pipeline", "requests_served") == 4
    subs = delta("region_scorer", "compute_seconds") + delta("patch_classifier", "compute_seconds")
    assert subs > 0
    assert delta("region_pipeline", "compute_seconds") == pytest.approx(subs, rel=1e-9)
    assert delta("region_scorer", "requests_served") == 4  # early exit: one call only
    assert delta("patch_classifier", "requests_served") == 3
    assert (
        meta.weight_bytes
        == after["region_scorer"].weight_bytes + after["patch_classifier"].weight_bytes
    )

    compute = "rsrv_compute_seconds_total"
    assert metrics_after[compute]["region_pipeline"] == pytest.approx(meta.compute_seconds)
    metric_delta = {
        m: metrics_after[compute][m] - metrics_before[compute][m]
        for m in ("region_pipeline", "region_scorer", "patch_classifier")
    }
    assert metric_delta["region_pipeline"] == pytest.approx(
        metric_delta["region_scorer"] + metric_delta["patch_classifier"], rel=1e-9
    )
    assert metrics_after["rsrv_requests_total"]["region_pipeline"] >= 4


def test_model_statistics_of_a_meta(worker, triton):
    infer(triton, "region_pipeline", {"image": image_with(*CASES["one"])})
    stats = triton.get_inference_statistics("region_pipeline", as_json=True)
    meta = stats["model_stats"][0]["inference_stats"]
    assert int(meta["compute_infer"]["count"]) == int(meta["success"]["count"]) >= 1
    seconds = worker.pipeline.meta.stats["region_pipeline"].compute_seconds
    assert int(meta["compute_infer"]["ns"]) == pytest.approx(seconds * 1e9, abs=1e3)
    triton.get_inference_statistics("")  # every model, metas included


# -- sub-calls re-enter the scheduler ------------------------------------------------------------


def test_sub_calls_coalesce_with_direct_traffic_and_go_first_under_edf(cache_dir, pool):
    """While a held classifier execution occupies the device, queue: two direct
    patch_classifier requests, two region_pipeline requests (whose stage-1 calls queue
    behind them) and one more classifier request with an earlier deadline. Released,
    the stage-1 calls run first and together; their stage-2 calls then share a batch
    with the direct patch_classifier requests, ahead of them."""
    config = worker_config(BUNDLES, cache_dir, SCHEDULER_DISCIPLINE="edf")
    with running(config) as worker:
        client = connect(worker)
        device = Device(worker)
        first, second = device.hold("classifier"), device.hold("classifier")
        features = np.zeros((1, 256), np.float32)
        c0 = pool.submit(infer, client, "classifier", {"x": features})
        assert first.entered.wait(10)

        direct = [np.full((1, PATCH, PATCH), v, np.float32) for v in (0.25, 0.5)]
        p = [pool.submit(infer, client, "patch_classifier", {"crop": d}) for d in direct]
        wait_until(lambda: model_status(worker, "patch_classifier").queue_depth == 2)
        images = [image_with(11, {6: 0.9}), image_with(12, {9: 0.85})]
        metas = [pool.submit(infer, client, "region_pipeline", {"image": im}) for im in images]
        wait_until(lambda: model_status(worker, "region_scorer").queue_depth == 2)
        c1 = pool.submit(infer, client, "classifier", {"x": features}, timeout=10_000_000)
        wait_until(lambda: model_status(worker, "classifier").queue_depth == 1)

        first.released.set()
        # c1 (the earliest deadline among fresh work) holds the device while the glue
        # queues the stage-2 calls; a call may overtake it, the checks below allow that.
        second.entered.wait(10)
        try:
            wait_until(lambda: model_status(worker, "patch_classifier").queue_depth == 4, 5)
        except AssertionError:
            pass
        second.released.set()
        for future in [c0, c1, *p, *metas]:
            future.result(30)

        # Stage 1 went first after the held execution, both images in one batch, although
        # the direct requests had arrived (and fresh work had deadlines) before.
        order = [e.model for e in device.executions]
        assert order[:2] == ["classifier", "region_scorer"]
        batch = device.of("region_scorer")
        assert len(batch) == 1
        got = sorted(batch[0].first_input[:2].sum(axis=(1, 2)).tolist())
        assert got == pytest.approx(sorted(im.sum() for im in images), rel=1e-6)

        # Stage 2: some execution holds sub-call rows and direct rows, sub-calls first.
        mixed = []
        for e in device.of("patch_classifier"):
            real = [r for r in e.first_input if r.any()]
            is_direct = [bool(np.all(r == r.flat[0])) for r in real]
            if any(is_direct) and not all(is_direct):
                mixed.append(is_direct)
        assert mixed, [e.size for e in device.of("patch_classifier")]
        assert all(flags == sorted(flags) for flags in mixed)  # sub-call rows first
        stats = model_status(worker, "patch_classifier")
        assert stats.requests_served == 4 and stats.dispatches < 4

        for im, future in zip(images, metas, strict=True):
            expected, out = pipeline_reference(im), future.result()
            np.testing.assert_array_equal(out["regions"], expected["regions"])
            np.testing.assert_allclose(out["scores"], expected["scores"], rtol=1e-5)
            np.testing.assert_array_equal(out["labels"], expected["labels"])
        for d, future in zip(direct, p, strict=True):
            np.testing.assert_allclose(future.result()["logits"], stage2(d), rtol=1e-5, atol=1e-5)
        client.close()


def test_edf_orders_a_sub_call_ahead_of_fresh_work(tiny_repo, tiny_template, cache_dir, pool):
    """Fresh requests with earlier deadlines (for the same model and for another) are
    queued before a meta's call: under edf the call still runs first."""
    config = worker_config(tiny_repo, cache_dir, SCHEDULER_DISCIPLINE="edf")
    with running(config) as worker:
        client = connect(worker)
        device = Device(worker)
        held = device.hold("other")
        g = pool.submit(infer, client, "other", {"x": rows(100)})
        assert held.entered.wait(10)
        b3 = pool.submit(infer, client, "other", {"x": rows(3)}, timeout=3_000_000)
        wait_until(lambda: model_status(worker, "other").queue_depth == 1)
        b1 = pool.submit(infer, client, "tiny", {"x": rows(1)}, timeout=6_000_000)
        wait_until(lambda: model_status(worker, "tiny").queue_depth == 1)
        b2 = pool.submit(infer, client, "tiny", {"x": rows(2)}, timeout=6_000_000)
        wait_until(lambda: model_status(worker, "tiny").queue_depth == 2)
        m = pool.submit(infer, client, "relay", {"x": rows(7)}, timeout=20_000_000)
        wait_until(lambda: model_status(worker, "tiny").queue_depth == 3)
        held.released.set()
        for future in (g, b1, b2, b3, m):
            future.result(30)

        ran = [(e.model, e.first_input[:, 0].tolist()) for e in device.executions]
        # pure edf would run other[3], then tiny[1, 2], then tiny[7]
        assert ran == [("other", [100.0]), ("tiny", [7.0, 1.0]), ("other", [3.0]), ("tiny", [2.0])]
        np.testing.assert_allclose(
            m.result()["y"], tiny_reference(tiny_template, rows(7)), rtol=1e-6
        )
        client.close()


# -- deadlines -----------------------------------------------------------------------------------


def test_deadline_is_inherited_by_sub_calls(tiny_repo, cache_dir, pool):
    with running(worker_config(tiny_repo, cache_dir)) as worker:
        client = connect(worker)
        relay = hook_globals(worker, "relay")

        # Already past when the meta starts: its glue never runs.
        code, message = failure(lambda: infer(client, "relay", {"x": rows(1)}, timeout=1))
        assert code == "StatusCode.DEADLINE_EXCEEDED", message
        assert "meta model 'relay': the request's deadline has already passed" in message
        assert relay["entered"] == []

        # The glue outlives the deadline (0.1 s): the call after it fails at the boundary,
        # without reaching tiny, once the glue has slept.
        relay["control"]["sleep"] = 0.3
        start = time.monotonic()
        code, message = failure(lambda: infer(client, "relay", {"x": rows(1)}, timeout=100_000))
        assert code == "StatusCode.DEADLINE_EXCEEDED"
        assert "meta model 'relay': deadline passed before its call to 'tiny'" in message
        assert time.monotonic() - start >= 0.3  # not before the glue had slept
        assert len(relay["entered"]) == 1
        assert model_status(worker, "tiny").requests_served == 0
        relay["control"]["sleep"] = 0.0

        # The call queues behind a held execution: the scheduler fails it at the meta
        # request's deadline (0.3 s), not at the dispatch timeout, and while the device
        # is still held.
        device = Device(worker)
        held = device.hold("other")
        g = pool.submit(infer, client, "other", {"x": rows(1)})
        assert held.entered.wait(10)
        start = time.monotonic()
        code, message = failure(lambda: infer(client, "relay", {"x": rows(1)}, timeout=300_000))
        elapsed = time.monotonic() - start
        still_held = not held.left.is_set()
        held.released.set()
        g.result(10)
        assert code == "StatusCode.DEADLINE_EXCEEDED"
        assert "model 'tiny': deadline exceeded after" in message and "in the queue" in message
        assert still_held  # answered before the held execution left the device
        assert elapsed >= 0.3  # not before its deadline
        assert model_status(worker, "tiny").requests_served == 0

        # With time to spare it succeeds.
        assert infer(client, "relay", {"x": rows(1)}, timeout=10_000_000)["y"].shape == (1, 2)
        client.close()


ZEROING_PY = """\
import rsrv


@rsrv.preprocess(inputs=["x"], outputs=["x"])
def pre(x):
    try:
        x[:] = 0  # (refused: its inputs are read-only, as a client's)
    except ValueError:
        pass
    return x
"""

KEEPER_PY = """\
import numpy as np

import rsrv


@rsrv.meta(inputs=["x"], outputs=["y"])
def keeper(call, x):
    mine = np.array(x)  # the glue's own, writable array
    call("zeroing", {"x": mine})
    return call("tiny", {"x": mine})["y"]
"""


def test_a_sub_models_hook_cannot_change_the_glues_arrays(tiny_repo, tiny_template, cache_dir):
    """(call() handed the glue's arrays on as they were: a sub-model's preprocess zeroed
    them in place, where a client's inputs are read-only.)"""
    (add_tiny(tiny_repo, tiny_template, "zeroing") / "model.py").write_text(ZEROING_PY)
    write_meta(tiny_repo, "keeper", ["zeroing", "tiny"], KEEPER_PY)
    with running(worker_config(tiny_repo, cache_dir)) as worker, connect(worker) as client:
        x = rows(1.5, 2)
        np.testing.assert_allclose(
            infer(client, "keeper", {"x": x})["y"], tiny_reference(tiny_template, x), rtol=1e-6
        )


def test_grpc_deadline_stops_the_glue(tiny_repo, cache_dir):
    """A grpc-timeout is a deadline too: the glue's next call after it fails (with
    DEADLINE_EXCEEDED, or Cancelled when the transport cancels the call first) instead
    of running on for a client that has gone."""
    with running(worker_config(tiny_repo, cache_dir)) as worker:
        client = connect(worker)
        spin = hook_globals(worker, "spin")
        code, _ = failure(lambda: infer(client, "spin", {"x": rows(1)}, client_timeout=1.0))
        assert code == "StatusCode.DEADLINE_EXCEEDED"
        # its natural end (3 s of calls) would leave "ended" empty: this cannot pass late
        assert spin["finished"].wait(10), "the glue kept calling after the deadline"
        assert spin["ended"] in (["DeadlineExceeded"], ["Cancelled"])
        assert 0 < len(spin["calls"])
        time.sleep(0.3)  # a call already executing at the deadline still completes
        assert model_status(worker, "tiny").requests_served <= len(spin["calls"]) + 1
        client.close()


async def test_cancelling_a_meta_request_cancels_its_sub_call():
    """MetaRunner alone: a sub-call runs in the meta request's task, so cancelling the
    request cancels the call (trio.Cancelled in the glue) rather than letting it run."""
    from types import SimpleNamespace

    import rsrv
    from rsrv.worker._meta import MetaRunner

    seen = []  # what the glue's call raised
    sub_call = []  # what became of the sub-call
    entered = trio.Event()

    class SlowPipeline:
        async def infer_sub(self, model, tensors, deadline):
            entered.set()
            try:
                await trio.sleep(5)
            except trio.Cancelled:
                sub_call.append("cancelled")
                raise
            sub_call.append("finished")
            return {"y": tensors["x"]}, 0.0

    @rsrv.meta(inputs=["x"], outputs=["y"])
    def relay(call, x):
        try:
            return call("tiny", {"x": x})["y"]
        except BaseException as e:
            seen.append(type(e).__name__)
            raise

    served = SimpleNamespace(
        name="m",
        bundle=SimpleNamespace(
            hooks=SimpleNamespace(meta=relay), signature=SimpleNamespace(calls=("tiny",))
        ),
    )
    runner = MetaRunner(SlowPipeline(), concurrency=2)
    request = trio.CancelScope()

    async def run_request():
        with request:
            await runner.run(served, {"x": rows(1)}, None)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_request)
        await entered.wait()  # the sub-call is running
        request.cancel()
    assert request.cancelled_caught
    assert sub_call == ["cancelled"]  # cancelled, not run to the end of its 5 s
    assert seen == ["Cancelled"]
    assert not runner.stats and runner.limiter.borrowed_tokens == 0  # (nothing counted)


# -- the glue's threads ------------------------------------------------------------------------


def test_glue_runs_off_the_dispatch_loop(tiny_repo, tiny_template, cache_dir, pool):
    with running(worker_config(tiny_repo, cache_dir)) as worker:
        client = connect(worker)
        relay = hook_globals(worker, "relay")
        relay["control"]["park"] = True
        m = pool.submit(infer, client, "relay", {"x": rows(5)})
        assert relay["parked"].wait(10)

        # The meta is parked in its glue (for 30 s unless released); the device keeps
        # serving, the sub-model too: each answers well within the park.
        other = infer(client, "other", {"x": rows(2)}, client_timeout=20)
        tiny = infer(client, "tiny", {"x": rows(3)}, client_timeout=20)
        assert not m.done()
        np.testing.assert_allclose(other["y"], tiny_reference(tiny_template, rows(2)), rtol=1e-6)
        np.testing.assert_allclose(tiny["y"], tiny_reference(tiny_template, rows(3)), rtol=1e-6)

        relay["release"].set()
        np.testing.assert_allclose(
            m.result(10)["y"], tiny_reference(tiny_template, rows(5)), rtol=1e-6
        )
        client.close()


@pytest.mark.parametrize("reload", [False, True])
def test_a_meta_unloaded_while_in_its_glue_answers_and_leaves_no_counts(
    tiny_repo, tiny_template, cache_dir, pool, reload
):
    """The request the meta accepted is answered (it was INTERNAL, KeyError), and the
    unloaded meta's statistics stay forgotten (the request's count brought them back),
    or, loaded again meanwhile, the new load's count only its own requests (the old one
    was counted in them)."""
    config = worker_config(tiny_repo, cache_dir, MODEL_CONTROL_MODE="explicit")
    with running(config) as worker:
        client = connect(worker)
        client.load_model("tiny")
        client.load_model("relay")
        relay = hook_globals(worker, "relay")
        relay["control"]["park"] = True
        m = pool.submit(infer, client, "relay", {"x": rows(4)})
        assert relay["parked"].wait(10)
        client.unload_model("relay")
        if reload:  # (and a request of the new load, so that it has counters)
            client.load_model("relay")
            infer(client, "relay", {"x": rows(1)})
        relay["release"].set()
        np.testing.assert_allclose(
            m.result(10)["y"], tiny_reference(tiny_template, rows(4)), rtol=1e-6
        )
        if reload:
            stats = client.get_inference_statistics("relay").model_stats[0].inference_stats
            assert (stats.success.count, stats.fail.count) == (1, 0)
            assert model_status(worker, "relay").requests_served == 1
        else:
            assert "relay" not in worker.pipeline.statistics
            assert "relay" not in worker.pipeline.meta.stats
        client.close()


# strout: tiny, its y made a BYTES label by a postprocess that returns str (or, told so,
# an element that is neither bytes nor str); chain: calls strout, keeps what it got, then
# calls tiny, or fails after its calls when told so.
STROUT_PY = """\
import numpy as np

import rsrv

mode = {"v": "str"}


@rsrv.postprocess(inputs=["y"], outputs=["label"])
def label(y):
    if mode["v"] == "none":
        return np.array([None] * y.shape[0], object)
    return np.array(["1,2"] * y.shape[0])
"""
CHAIN_PY = """\
import rsrv

seen = []
mode = {"v": "ok"}


@rsrv.meta(inputs=["x"], outputs=["y"])
def chain(call, x):
    seen.append(call("strout", {"x": x})["label"])
    y = call("tiny", {"x": x})["y"]
    if mode["v"] == "fail":
        raise ValueError("glue bug")
    return y
"""


def test_a_bytes_output_of_a_hook_is_what_clients_and_metas_get_and_a_failed_meta_no_compute(
    tmp_path, tiny_template, cache_dir
):
    """A hook's str reach a client encoded, and a meta's call() as the same bytes (it
    got str); an element neither bytes nor str is the hook's error (it was sent as
    b'None'); a meta that fails after its calls counts no compute (it counted theirs)."""
    repo = tmp_path / "repo"
    add_tiny(repo, tiny_template, "tiny")
    strout = add_tiny(repo, tiny_template, "strout")
    manifest = msgspec.yaml.decode((strout / "manifest.yaml").read_bytes())
    manifest["client_outputs"] = [{"name": "label", "dtype": "bytes", "shape": "n"}]
    (strout / "manifest.yaml").write_bytes(msgspec.yaml.encode(manifest))
    (strout / "model.py").write_text(STROUT_PY)
    write_meta(repo, "chain", ["strout", "tiny"], CHAIN_PY)
    with running(worker_config(repo, cache_dir)) as worker:
        client = connect(worker)
        assert infer(client, "strout", {"x": rows(1, 2)})["label"].tolist() == [b"1,2"] * 2
        infer(client, "chain", {"x": rows(1, 2)})
        (label,) = hook_globals(worker, "chain")["seen"]
        assert label.dtype == object and label.tolist() == [b"1,2"] * 2

        hook_globals(worker, "chain")["mode"]["v"] = "fail"
        before = model_statuses(worker)["chain"]
        with pytest.raises(InferenceServerException, match="glue bug"):
            infer(client, "chain", {"x": rows(1)})
        after = model_statuses(worker)["chain"]
        assert (after.requests_served, after.compute_seconds) == (
            before.requests_served,
            before.compute_seconds,
        )

        hook_globals(worker, "strout")["mode"]["v"] = "none"
        with pytest.raises(InferenceServerException) as info:
            infer(client, "strout", {"x": rows(1)})
        assert info.value.status() == "StatusCode.INTERNAL"
        assert info.value.message() == (
            "model 'strout': postprocess produced 'label' with element 0 a NoneType; BYTES "
            "elements are bytes or str"
        )
        client.close()


def test_a_model_reloaded_as_a_meta_lets_its_compiled_load_go(tmp_path, tiny_template, cache_dir):
    """(its executable and weights stayed registered until the model was unloaded)"""
    repo = tmp_path / "repo"
    add_tiny(repo, tiny_template, "tiny")
    add_tiny(repo, tiny_template, "m")
    config = worker_config(repo, cache_dir, MODEL_CONTROL_MODE="explicit")
    with running(config) as worker:
        client = connect(worker)
        client.load_model("tiny")
        client.load_model("m")
        compiled = worker.models.get("m").key
        shutil.rmtree(repo / "m")
        write_meta(repo, "m", ["tiny"], plain("tiny"))
        client.load_model("m")
        np.testing.assert_allclose(
            infer(client, "m", {"x": rows(3)})["y"],
            tiny_reference(tiny_template, rows(3)),
            rtol=1e-6,
        )
        assert compiled not in worker.executor.versions
        assert compiled not in worker.weights.placements
        client.close()


def test_meta_concurrency_limit(tiny_repo, cache_dir, pool):
    config = worker_config(tiny_repo, cache_dir, SCHEDULER_META_CONCURRENCY=1)
    with running(config) as worker:
        client = connect(worker)
        relay = hook_globals(worker, "relay")
        relay["control"]["park"] = True
        m1 = pool.submit(infer, client, "relay", {"x": rows(1)})
        assert relay["parked"].wait(10)
        m2 = pool.submit(infer, client, "relay", {"x": rows(2)})  # no deadline: waits
        time.sleep(0.2)
        assert len(relay["entered"]) == 1 and not m2.done()

        start = time.monotonic()
        code, message = failure(lambda: infer(client, "relay", {"x": rows(3)}, timeout=200_000))
        assert code == "StatusCode.DEADLINE_EXCEEDED"
        assert "deadline passed while waiting for a meta slot" in message
        assert time.monotonic() - start >= 0.2  # at its deadline...
        assert not m1.done() and not m2.done()  # ...while the slot was still taken
        # Another model is not limited.
        assert infer(client, "other", {"x": rows(1)})["y"].shape == (1, 2)

        relay["release"].set()
        assert m1.result(10)["y"].shape == m2.result(10)["y"].shape == (1, 2)
        assert len(relay["entered"]) == 2  # the one that timed out never started
        client.close()


def test_parked_metas_leave_trio_threads_to_hooks(tmp_path, tiny_template, cache_dir, pool):
    """More metas in flight than trio's default thread limit: each parks in its glue
    until all have started, then calls a model whose postprocess hook needs a trio
    thread. The glue threads must not be taken from that pool."""
    default = trio.run(_default_thread_tokens)
    n = int(default) + 1
    repo = tmp_path / "repo"
    post = add_tiny(repo, tiny_template, "post")
    manifest = msgspec.yaml.decode((post / "manifest.yaml").read_bytes())
    manifest["client_outputs"] = [{"name": "z", "dtype": "f32", "shape": "nk", "dims": {"k": 2}}]
    (post / "manifest.yaml").write_bytes(msgspec.yaml.encode(manifest))
    (post / "model.py").write_text(
        "import rsrv\n\n\n@rsrv.postprocess(inputs=['y'], outputs=['z'])\n"
        "def double(y):\n    return y * 2\n"
    )
    write_meta(
        repo,
        "crowd",
        ["post"],
        f"""\
import threading

import rsrv

everyone = threading.Barrier({n}, timeout=10)


@rsrv.meta(inputs=["x"], outputs=["y"])
def crowd(call, x):
    everyone.wait()
    return call("post", {{"x": x}})["z"]
""",
    )
    config = worker_config(
        repo, cache_dir, SCHEDULER_META_CONCURRENCY=n, ENDPOINTS_MAX_CONCURRENT_REQUESTS=n + 8
    )
    with running(config) as worker:
        client = connect(worker)
        futures = [pool.submit(infer, client, "crowd", {"x": rows(i)}) for i in range(n)]
        for i, future in enumerate(futures):
            np.testing.assert_allclose(
                future.result(30)["y"], 2 * tiny_reference(tiny_template, rows(i)), rtol=1e-6
            )
        client.close()


async def _default_thread_tokens() -> float:
    return trio.to_thread.current_default_thread_limiter().total_tokens


# -- load-time rules ---------------------------------------------------------------------------


# mismatch: calls simple_string (a preprocess hook) with inputs of 1 and 2 rows
MISMATCH_PY = """\
import numpy as np

import rsrv


@rsrv.meta(inputs=["x"], outputs=["y"])
def mismatch(call, x):
    words = np.full((1, 16), b"a", dtype=object)
    call("simple_string", {"INPUT0": words, "INPUT1": np.concatenate([words, words])})
    return x[:, :2]
"""


def test_a_call_whose_inputs_disagree_on_rows_is_the_glues_error(tmp_path, cache_dir):
    """As a client's request: INVALID_ARGUMENT in Triton's words (the called model's
    preprocess ran, and was blamed: INTERNAL)."""
    repo = make_repo(tmp_path / "repo", "simple_string")
    write_meta(repo, "mismatch", ["simple_string"], MISMATCH_PY)
    with running(worker_config(repo, cache_dir)) as worker, connect(worker) as client:
        with pytest.raises(InferenceServerException) as info:
            infer(client, "mismatch", {"x": rows(1)})
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert (
        "call to 'simple_string': input 'INPUT1' batch size does not match other inputs for "
        "'simple_string' (2 rows along its batch axis; 'INPUT0' has 1)" in info.value.message()
    )


DOUBLING_PY = """\
import numpy as np
import rsrv


@rsrv.meta(inputs=["x"], outputs=["y"])
def doubling(call, x):
    y = call("tiny", {"x": x})["y"]
    return {"y": np.concatenate([y, y])}
"""


def test_a_meta_answering_other_rows_than_the_request_is_internal(
    tmp_path, tiny_template, cache_dir
):
    """Two rows for a request of one were served as the answer (OK)."""
    repo = tmp_path / "repo"
    add_tiny(repo, tiny_template, "tiny")
    write_meta(repo, "doubling", ["tiny"], DOUBLING_PY)
    with running(worker_config(repo, cache_dir)) as worker, connect(worker) as client:
        with pytest.raises(InferenceServerException) as info:
            infer(client, "doubling", {"x": rows(1)})
    assert (info.value.status(), info.value.message()) == (
        "StatusCode.INTERNAL",
        "model 'doubling': client output 'y' has 2 rows along its batch axis after the "
        "meta hook; the request has 1",
    )


def test_load_time_rules(tmp_path, tiny_template, cache_dir):
    repo = tmp_path / "repo"
    add_tiny(repo, tiny_template, "tiny")
    write_meta(repo, "inner", ["tiny"], plain("tiny"))
    write_meta(repo, "outer", ["inner"], plain("inner"))
    write_meta(repo, "selfish", ["selfish"], plain("selfish"))
    write_meta(repo, "dupe", ["tiny", "tiny"], plain("tiny"))
    write_meta(repo, "stray", ["tiny"], STRAY_PY)
    write_meta(repo, "caller", ["late"], plain("late"))
    write_meta(repo, "late", ["tiny"], plain("tiny"))
    write_meta(repo, "relay", ["tiny"], RELAY_PY)
    config = worker_config(repo, cache_dir, MODEL_CONTROL_MODE="explicit")
    with running(config) as worker:
        client = connect(worker)

        def load_error(name):
            code, message = failure(lambda: client.load_model(name))
            assert code == "StatusCode.FAILED_PRECONDITION", message
            return message

        client.load_model("tiny")
        client.load_model("inner")

        # A meta calling a meta: the later one is refused.
        rule = "meta.calls: 'inner' is a meta model; meta models may not call other meta models"
        assert rule in load_error("outer")
        state, reason = index(client)["outer"]
        assert state == "UNAVAILABLE" and rule in reason

        # Manifest rules: no self-call, no duplicates.
        rule = "meta.calls: a meta model may not call itself ('selfish')"
        assert rule in load_error("selfish")
        state, reason = index(client)["selfish"]
        assert state == "UNAVAILABLE" and rule in reason
        rule = "meta.calls: duplicate model(s) tiny"
        assert rule in load_error("dupe")
        state, reason = index(client)["dupe"]
        assert state == "UNAVAILABLE" and rule in reason

        # Only declared models may be called: fails at the call, naming the model.
        client.load_model("stray")
        code, message = failure(lambda: infer(client, "stray", {"x": rows(1)}))
        assert code == "StatusCode.FAILED_PRECONDITION"
        assert (
            "meta model 'stray' called undeclared model 'ghost'; add it to meta.calls "
            "(declared: tiny)"
        ) in message

        # A meta whose callee loads later as a meta: the callee is the one refused.
        client.load_model("caller")
        assert index(client)["caller"] == ("UNAVAILABLE", "waiting for model(s) late")
        assert not client.is_model_ready("caller")
        code, message = failure(lambda: infer(client, "caller", {"x": rows(1)}))
        assert code == "StatusCode.UNAVAILABLE"
        assert "meta model 'caller' is not ready: waiting for model(s) late" in message
        assert "kind: meta model 'late' is called by meta model(s) caller" in load_error("late")
        assert not client.is_model_ready("caller")

        # The valid ones serve; tiny, called by loaded metas, is not listed.
        shown = index(client)
        assert shown["inner"] == ("READY", "") and shown["stray"] == ("READY", "")
        assert "tiny" not in shown
        assert infer(client, "inner", {"x": rows(1)})["y"].shape == (1, 2)

        # A sub-model unloaded while a meta request is in its glue: the call is
        # UNAVAILABLE (the meta exists; what it needs does not).
        client.load_model("relay")
        relay = hook_globals(worker, "relay")
        relay["control"]["park"] = True
        with ThreadPoolExecutor(1) as one:
            m = one.submit(infer, client, "relay", {"x": rows(1)})
            assert relay["parked"].wait(10)
            client.unload_model("tiny")
            relay["release"].set()
            code, message = failure(lambda: m.result(10))
        assert code == "StatusCode.UNAVAILABLE"
        assert "call to 'tiny': Request for unknown model: 'tiny'" in message
        assert not client.is_model_ready("relay") and not client.is_model_ready("inner")
        client.close()


# -- explicit mode: readiness and residency ------------------------------------------------------


def test_explicit_mode_readiness_and_residency(cache_dir):
    config = worker_config(
        BUNDLES, cache_dir, MODEL_CONTROL_MODE="explicit", RUNTIME_WEIGHT_CACHE_BYTES=64 << 20
    )
    with running(config) as worker:
        client = connect(worker)

        def loaded(client):  # the index without the models not loaded
            return {k: v for k, v in index(client).items() if v != ("UNAVAILABLE", "unloaded")}

        image = image_with(*CASES["three"])

        # before any load, the index lists every model of the repository as unloaded
        assert set(index(client).values()) == {("UNAVAILABLE", "unloaded")}
        client.load_model("region_pipeline")  # before the models it calls
        assert not client.is_model_ready("region_pipeline")
        waiting = "waiting for model(s) region_scorer, patch_classifier"
        assert loaded(client) == {"region_pipeline": ("UNAVAILABLE", waiting)}
        code, message = failure(lambda: infer(client, "region_pipeline", {"image": image}))
        assert code == "StatusCode.UNAVAILABLE" and waiting in message
        # ModelControlStatus says so too (it said READY)
        assert model_statuses(worker)["region_pipeline"].state == "UNAVAILABLE"

        client.load_model("region_scorer")
        assert loaded(client) == {
            "region_pipeline": ("UNAVAILABLE", "waiting for model(s) patch_classifier")
        }
        client.load_model("patch_classifier")
        assert client.is_model_ready("region_pipeline")
        assert loaded(client) == {"region_pipeline": ("READY", "")}
        assert model_statuses(worker)["region_pipeline"].state == "READY"
        expected = pipeline_reference(image)
        out = infer(client, "region_pipeline", {"image": image})
        np.testing.assert_array_equal(out["regions"], expected["regions"])

        client.unload_model("patch_classifier")
        assert not client.is_model_ready("region_pipeline")
        assert loaded(client) == {
            "region_pipeline": ("UNAVAILABLE", "waiting for model(s) patch_classifier")
        }
        client.load_model("patch_classifier")
        assert client.is_model_ready("region_pipeline")

        subs = ("region_scorer", "patch_classifier")
        pinned = worker.weights.cache.pinned

        before = model_statuses(worker)
        assert before["region_pipeline"].residency == cpb.RESIDENCY_SYSTEM
        for sub in subs:
            assert before[sub].residency == cpb.RESIDENCY_SYSTEM
            assert worker.models.get(sub).key not in pinned

        assert control(worker, "set_residency", "region_pipeline", "device") == "device"
        now = model_statuses(worker)
        for sub in subs:
            assert now[sub].residency == cpb.RESIDENCY_DEVICE
            assert now[sub].device_resident
            assert worker.models.get(sub).key in pinned
        assert now["region_pipeline"].residency == cpb.RESIDENCY_DEVICE
        assert now["region_pipeline"].device_resident

        assert control(worker, "set_residency", "region_pipeline", "system") == "system"
        now = model_statuses(worker)
        for sub in subs:
            assert now[sub].residency == cpb.RESIDENCY_SYSTEM
            assert now[sub].host_resident
            assert worker.models.get(sub).key not in pinned
        out = infer(client, "region_pipeline", {"image": image})
        np.testing.assert_array_equal(out["labels"], expected["labels"])
        client.close()
