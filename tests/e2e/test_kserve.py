"""Every GRPCInferenceService RPC through the real ``tritonclient.grpc`` against a real
worker on 127.0.0.1: health, metadata, config, infer (sync, async, streaming), statistics,
repository index and control, CUDA shared memory, trace and log settings, the bind
address, and batch coalescing seen end to end. (System shared memory: test_shm_e2e.py;
bad input: test_kserve_errors.py; Triton's client examples: test_triton_examples.py.)
"""

from __future__ import annotations

import errno
import logging
import queue
import socket
import threading
import time
from functools import partial

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from support.bundles import SIMPLE_STRING_MODEL_PY, UNBATCHED_W, make_repo
from support.clients import connect, infer_input, raises_status, stats_of
from support.references import (
    classifier_inputs,
    classifier_reference,
    coral_grade,
    example_weights,
    grader_inputs,
    grader_reference,
)
from support.rest import http_connect, http_input, with_http
from support.serving import (
    LOOP_THREAD,
    held_device,
    on_port,
    running,
    sched_stats,
    threads_calling,
    worker_config,
)
from support.waiting import wait_until
from tritonclient.grpc import service_pb2

import rsrv

MODELS = ("classifier", "severity_grader", "simple", "unbatched", "broken")


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return make_repo(tmp_path_factory.mktemp("kserve") / "repo", *MODELS)


@pytest.fixture(scope="module")
def weights():
    return {name: example_weights(name) for name in ("classifier", "severity_grader")}


# -- health and metadata ---------------------------------------------------------------------


def test_health(triton):
    assert triton.is_server_live()
    assert triton.is_server_ready()  # every model tried; a broken one does not block it
    assert triton.is_model_ready("classifier")
    assert triton.is_model_ready("severity_grader")
    assert not triton.is_model_ready("no_such_model")
    assert not triton.is_model_ready("broken")


def test_server_metadata(triton):
    meta = triton.get_server_metadata()
    assert meta.name == "rsrv"
    assert meta.version == rsrv.__version__
    assert set(meta.extensions) == {
        "model_repository",
        "model_configuration",
        "statistics",
        "logging",
        "parameters",
        "system_shared_memory",
    }
    as_json = triton.get_server_metadata(as_json=True)
    assert as_json["name"] == "rsrv"


def _tensors(meta_tensors):
    return [(t.name, t.datatype, list(t.shape)) for t in meta_tensors]


def test_model_metadata(triton):
    meta = triton.get_model_metadata("classifier")
    assert meta.name == "classifier"
    assert list(meta.versions) == ["1"]
    assert meta.platform == "cpu"
    assert _tensors(meta.inputs) == [("x", "FP32", [-1, 256])]
    assert _tensors(meta.outputs) == [("logits", "FP32", [-1, 10])]

    # client-facing tensors: model.py turns the module's logits into one grade per row
    meta = triton.get_model_metadata("severity_grader")
    assert _tensors(meta.inputs) == [("image", "UINT8", [-1, 32, 32, 3])]
    assert _tensors(meta.outputs) == [("grade", "INT64", [-1])]

    meta = triton.get_model_metadata("unbatched")
    assert _tensors(meta.inputs) == [("x", "FP32", [4])]
    assert _tensors(meta.outputs) == [("y", "FP32", [3])]


def test_model_metadata_of_unknown_and_unavailable_models(triton):
    with raises_status("NOT_FOUND", "Request for unknown model: 'no_such_model'"):
        triton.get_model_metadata("no_such_model")
    with raises_status("UNAVAILABLE", "model 'broken' is unavailable", "format_version"):
        triton.get_model_metadata("broken")


def test_model_config(triton):
    config = triton.get_model_config("classifier").config
    assert config.name == "classifier"
    assert config.max_batch_size == 8
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [
        ("x", grpcclient.model_config_pb2.TYPE_FP32, [256])
    ]
    assert [(o.name, o.data_type, list(o.dims)) for o in config.output] == [
        ("logits", grpcclient.model_config_pb2.TYPE_FP32, [10])
    ]
    assert list(config.dynamic_batching.preferred_batch_size) == [1, 4, 8]

    config = triton.get_model_config("severity_grader").config
    assert config.max_batch_size == 8
    assert [(o.name, o.data_type, list(o.dims)) for o in config.output] == [
        ("grade", grpcclient.model_config_pb2.TYPE_INT64, [])
    ]

    # no batch axis: max_batch_size 0, full dims, no dynamic batching
    config = triton.get_model_config("unbatched").config
    assert config.max_batch_size == 0
    assert [list(i.dims) for i in config.input] == [[4]]
    assert [list(o.dims) for o in config.output] == [[3]]
    assert not config.HasField("dynamic_batching")

    as_json = triton.get_model_config("simple", as_json=True)["config"]
    assert as_json["max_batch_size"] == 8
    assert as_json["dynamic_batching"]["preferred_batch_size"] == [1, 4, 8]
    with raises_status("NOT_FOUND", "no_such_model"):
        triton.get_model_config("no_such_model")


# -- inference -------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8])
def test_infer_classifier_matches_reference(triton, weights, rows):
    x = classifier_inputs(np.random.default_rng(rows), rows)
    result = triton.infer("classifier", [infer_input("x", x)])
    logits = result.as_numpy("logits")
    assert logits.dtype == np.float32 and logits.shape == (rows, 10)
    np.testing.assert_allclose(
        logits, classifier_reference(weights["classifier"], x), rtol=1e-4, atol=1e-4
    )
    response = result.get_response()
    assert (response.model_name, response.model_version) == ("classifier", "1")


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_infer_grader_matches_reference(triton, weights, rows):
    images = grader_inputs(np.random.default_rng(100 + rows), rows)
    images[0] = 255  # a white image: the highest grade
    result = triton.infer("severity_grader", [infer_input("image", images)])
    grades = result.as_numpy("grade")
    assert grades.dtype == np.int64 and grades.shape == (rows,)
    reference = grader_reference(weights["severity_grader"], images)
    assert np.abs(reference).min() > 1e-2  # no logit near 0 that could flip a grade
    np.testing.assert_array_equal(grades, coral_grade(reference))
    assert grades[0] == 6


def test_infer_unbatched(triton):
    x = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    y = triton.infer("unbatched", [infer_input("x", x)]).as_numpy("y")
    np.testing.assert_allclose(y, x @ UNBATCHED_W, rtol=1e-6)


def _simple_inputs(rows=1):
    a = np.arange(16 * rows, dtype=np.int32).reshape(rows, 16)
    b = np.full((rows, 16), 3, np.int32)
    return a, b, [infer_input("INPUT0", a), infer_input("INPUT1", b)]


def test_infer_requested_outputs_filter_and_order_and_id(triton):
    a, b, inputs = _simple_inputs(2)
    outputs = [
        grpcclient.InferRequestedOutput("OUTPUT1"),
        grpcclient.InferRequestedOutput("OUTPUT0"),
    ]
    result = triton.infer("simple", inputs, outputs=outputs, request_id="req-42")
    response = result.get_response()
    assert response.id == "req-42"
    assert [o.name for o in response.outputs] == ["OUTPUT1", "OUTPUT0"]
    assert len(response.raw_output_contents) == 2
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)

    only = triton.infer("simple", inputs, outputs=[grpcclient.InferRequestedOutput("OUTPUT1")])
    assert [o.name for o in only.get_response().outputs] == ["OUTPUT1"]
    assert only.as_numpy("OUTPUT0") is None
    np.testing.assert_array_equal(only.as_numpy("OUTPUT1"), a - b)


def test_infer_accepts_timeout_priority_and_custom_parameters(triton):
    a, b, inputs = _simple_inputs()
    result = triton.infer(
        "simple", inputs, priority=3, timeout=10_000_000, parameters={"note": "hello", "n": 7}
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)


def test_infer_typed_contents(triton):
    """Inputs as typed contents (int_contents) instead of raw bytes."""
    request = service_pb2.ModelInferRequest(model_name="simple")
    for name, values in (("INPUT0", range(16)), ("INPUT1", [1] * 16)):
        tensor = request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        tensor.contents.int_contents.extend(values)
    response = triton._client_stub.ModelInfer(request)
    total = np.frombuffer(response.raw_output_contents[0], np.int32)
    np.testing.assert_array_equal(total, np.arange(16) + 1)


def test_async_infer(triton, weights):
    """The async_infer callback pattern, several requests in flight at once."""
    done: queue.Queue = queue.Queue()

    def callback(rows, result, error):
        done.put((rows, result, error))

    inputs = {rows: classifier_inputs(np.random.default_rng(rows), rows) for rows in (1, 2, 5, 8)}
    for rows, x in inputs.items():
        triton.async_infer("classifier", [infer_input("x", x)], partial(callback, rows))
    for _ in inputs:
        rows, result, error = done.get(timeout=60)
        assert error is None, error
        np.testing.assert_allclose(
            result.as_numpy("logits"),
            classifier_reference(weights["classifier"], inputs[rows]),
            rtol=1e-4,
            atol=1e-4,
        )


def test_stream_infer_bad_request_does_not_end_the_stream(worker, weights):
    """start_stream / async_stream_infer / stop_stream: the bad requests' callbacks get an
    error, and the requests after them still succeed."""
    results: queue.Queue = queue.Queue()
    rng = np.random.default_rng(7)
    sent = {}
    with connect(worker) as triton:
        triton.start_stream(callback=lambda result, error: results.put((result, error)))
        for i in range(6):
            if i == 2:  # wrong datatype
                bad = np.zeros((1, 256), np.float64)
                triton.async_stream_infer(
                    "classifier", [infer_input("x", bad)], request_id="bad-dtype"
                )
                continue
            if i == 4:  # unknown model
                triton.async_stream_infer(
                    "no_such_model", [infer_input("x", bad)], request_id="bad-model"
                )
                continue
            sent[f"ok-{i}"] = x = classifier_inputs(rng, 1 + i)
            triton.async_stream_infer("classifier", [infer_input("x", x)], request_id=f"ok-{i}")
        got, errors = {}, []
        for _ in range(6):
            result, error = results.get(timeout=60)
            if error is not None:
                errors.append(error)
            else:
                got[result.get_response().id] = result.as_numpy("logits")
        triton.stop_stream()
    assert sorted(got) == sorted(sent)
    for request_id, x in sent.items():
        np.testing.assert_allclose(
            got[request_id], classifier_reference(weights["classifier"], x), rtol=1e-4, atol=1e-4
        )
    dtype, model = sorted((e.message() for e in errors), key=lambda m: "Request" in m)
    assert "input tensor 'x' for model 'classifier': got datatype FP64, expected FP32" in dtype
    assert "Request for unknown model: 'no_such_model' is not found" in model


# -- statistics ------------------------------------------------------------------------------


def test_statistics(triton):
    before = stats_of(triton, "simple")
    sent = int(time.time() * 1000)  # in ms since the epoch, rounded down as the server does
    for rows in (1, 3, 8):  # one after the other: one execution each, at sizes 1, 4, 8
        triton.infer("simple", _simple_inputs(rows)[2])
    with raises_status("INVALID_ARGUMENT"):
        triton.infer("simple", [infer_input("INPUT0", np.zeros((1, 16), np.int32))])
    after = stats_of(triton, "simple")
    answered = time.time() * 1000

    assert (after.name, after.version) == ("simple", "1")
    s0, s1 = before.inference_stats, after.inference_stats
    assert s1.success.count - s0.success.count == 3
    assert s1.fail.count - s0.fail.count == 1
    assert s1.queue.count - s0.queue.count == 3
    assert s1.compute_input.count - s0.compute_input.count == 3
    assert s1.compute_infer.count - s0.compute_infer.count == 3
    assert s1.compute_output.count == s0.compute_output.count  # simple has no postprocess
    assert s1.success.ns > s0.success.ns and s1.compute_infer.ns > s0.compute_infer.ns
    assert after.inference_count - before.inference_count == 1 + 3 + 8  # rows
    assert after.execution_count - before.execution_count == 3  # executions
    batches = {b.batch_size: b.compute_infer.count for b in after.batch_stats}
    old = {b.batch_size: b.compute_infer.count for b in before.batch_stats}
    assert {k: batches[k] - old.get(k, 0) for k in batches} == {1: 1, 4: 1, 8: 1}
    assert sent <= after.last_inference <= answered  # stamped by the requests just sent

    grader0 = stats_of(triton, "severity_grader").inference_stats.compute_output.count
    triton.infer(
        "severity_grader", [infer_input("image", grader_inputs(np.random.default_rng(0), 2))]
    )
    assert stats_of(triton, "severity_grader").inference_stats.compute_output.count == grader0 + 1


def test_statistics_of_every_model_and_of_an_unknown_one(triton):
    names = [s.name for s in triton.get_inference_statistics().model_stats]
    assert names == ["classifier", "severity_grader", "simple", "unbatched"]  # READY ones
    with raises_status("NOT_FOUND", "no_such_model"):
        triton.get_inference_statistics("no_such_model")


def test_coalescing_32_concurrent_requests(worker):
    """32 concurrent one-row requests: fewer executions than inferences."""
    with connect(worker) as triton:
        before = stats_of(triton, "classifier")
        x = classifier_inputs(np.random.default_rng(32), 1)
        errors = []

        def call():
            try:
                triton.infer("classifier", [infer_input("x", x)])
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=call) for _ in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        after = stats_of(triton, "classifier")
    inferences = after.inference_count - before.inference_count
    executions = after.execution_count - before.execution_count
    assert inferences == 32
    assert executions < inferences


def test_coalescing_of_a_queued_backlog(worker):
    """With the device busy, 32 queued one-row requests run as full batches of 8."""
    done: queue.Queue = queue.Queue()
    with connect(worker) as triton:
        before = stats_of(triton, "classifier")
        x = classifier_inputs(np.random.default_rng(33), 1)
        dispatched = sched_stats(worker, "classifier").dispatches
        with held_device(worker) as gate:
            triton.async_infer(
                "classifier", [infer_input("x", x)], lambda result, error: done.put(error)
            )
            wait_until(
                lambda: sched_stats(worker, "classifier").dispatches == dispatched + 1,
                what="the first request to reach the device",
            )
            for _ in range(32):
                triton.async_infer(
                    "classifier", [infer_input("x", x)], lambda result, error: done.put(error)
                )
            wait_until(
                lambda: sched_stats(worker, "classifier").queue_depth == 32,
                what="32 queued requests",
            )
            gate.set()
            errors = [done.get(timeout=60) for _ in range(33)]
        assert errors == [None] * 33
        after = stats_of(triton, "classifier")
    assert after.inference_count - before.inference_count == 33
    assert after.execution_count - before.execution_count == 1 + 4  # 1, then 4 x 8 rows


# -- repository --------------------------------------------------------------------------------


def test_repository_index(triton):
    index = {m.name: m for m in triton.get_model_repository_index().models}
    assert sorted(index) == sorted(MODELS)
    for name in MODELS:
        if name != "broken":
            assert (index[name].state, index[name].version, index[name].reason) == (
                "READY",
                "1",
                "",
            )
    broken = index["broken"]
    assert broken.state == "UNAVAILABLE"
    assert "manifest.yaml: format_version: unsupported version '9.9'" in broken.reason
    # ... while the others serve
    assert triton.is_model_ready("classifier")

    ready = triton._client_stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(ready=True))
    assert sorted(m.name for m in ready.models) == sorted(set(MODELS) - {"broken"})


def test_load_and_unload_need_explicit_mode(triton):
    with raises_status(
        "FAILED_PRECONDITION",
        "RepositoryModelLoad is only effective when model_control_mode is "
        "'explicit'; this worker runs in 'dynamic' mode",
    ):
        triton.load_model("classifier")
    with raises_status(
        "FAILED_PRECONDITION",
        "RepositoryModelUnload is only effective when model_control_mode is "
        "'explicit'; this worker runs in 'dynamic' mode",
    ):
        triton.unload_model("classifier")
    assert triton.is_model_ready("classifier")


def _explicit_index(triton) -> list[tuple[str, str, str, str]]:
    return [
        (m.name, m.version, m.state, m.reason) for m in triton.get_model_repository_index().models
    ]


def test_explicit_mode_index_reads_the_repository_off_the_event_loop(repo, cache_dir, monkeypatch):
    # listing the repository stats every model directory (slow on a network volume)
    from rsrv.worker import _reporting

    threads = threads_calling(monkeypatch, _reporting, "discover")
    config = worker_config(repo, cache_dir, MODEL_CONTROL_MODE="explicit")
    with running(config) as w, connect(w) as triton:
        assert ("classifier", "", "UNAVAILABLE", "unloaded") in _explicit_index(triton)
    assert threads and LOOP_THREAD not in threads


def test_explicit_mode_load_and_unload(repo, cache_dir):
    config = worker_config(repo, cache_dir, MODEL_CONTROL_MODE="explicit")
    unloaded = [(name, "", "UNAVAILABLE", "unloaded") for name in sorted(MODELS)]
    with running(config) as w, connect(w) as triton:
        assert triton.is_server_ready()
        assert _explicit_index(triton) == unloaded  # nothing loaded: all listed, as Triton
        assert not triton.is_model_ready("classifier")
        x = classifier_inputs(np.random.default_rng(0), 2)
        with raises_status("NOT_FOUND", "Request for unknown model: 'classifier'"):
            triton.infer("classifier", [infer_input("x", x)])

        triton.load_model("classifier")
        assert triton.is_model_ready("classifier")
        assert triton.infer("classifier", [infer_input("x", x)]).as_numpy("logits").shape == (2, 10)
        assert _explicit_index(triton) == [
            ("classifier", "1", "READY", "") if m[0] == "classifier" else m for m in unloaded
        ]

        triton.unload_model("classifier")
        assert not triton.is_model_ready("classifier")
        with raises_status("NOT_FOUND", "Request for unknown model: 'classifier'"):
            triton.infer("classifier", [infer_input("x", x)])
        with raises_status("NOT_FOUND", "Request for unknown model: 'classifier'"):
            triton.get_model_metadata("classifier")
        assert _explicit_index(triton) == unloaded
        with raises_status("NOT_FOUND", "Request for unknown model: 'classifier'"):
            triton.unload_model("classifier")

        # a name that is not in the repository (Triton's words); names that would leave it
        with raises_status(
            "NOT_FOUND", "failed to load 'no_such_model', failed to poll from model repository"
        ):
            triton.load_model("no_such_model")
        for name in ("../repo/classifier", "..", ".hidden", "a/b"):
            with raises_status("INVALID_ARGUMENT", f"failed to load {name!r}"):
                triton.load_model(name)
        # an override beyond what the bundle can do is refused, and nothing is loaded
        with raises_status("INVALID_ARGUMENT", "max_batch_size 16 is not between 1 and", "8"):
            triton.load_model("classifier", config='{"max_batch_size": 16}')
        assert _explicit_index(triton) == unloaded

        # a broken bundle: the error, then UNAVAILABLE with its reason in the index
        with raises_status("FAILED_PRECONDITION", "failed to load 'broken'", "format_version"):
            triton.load_model("broken")
        index = {m.name: m for m in triton.get_model_repository_index().models}
        assert index["broken"].state == "UNAVAILABLE"
        assert "format_version" in index["broken"].reason

        # load again after an unload: a fresh version serves
        triton.load_model("classifier")
        assert triton.is_model_ready("classifier")
        assert triton.infer("classifier", [infer_input("x", x)]).as_numpy("logits").shape == (2, 10)


# -- CUDA shared memory, trace and log settings -------------------------------------------------


def test_cuda_shared_memory(triton):
    assert len(triton.get_cuda_shared_memory_status().regions) == 0
    raw_handle = b"aGFuZGxl"  # base64; no CUDA IPC handle can be used here anyway
    with raises_status(
        "FAILED_PRECONDITION", "CUDA shared memory is not supported", "use system shared memory"
    ):
        triton.register_cuda_shared_memory("gpu_region", raw_handle, 0, 64)
    triton.unregister_cuda_shared_memory("gpu_region")
    triton.unregister_cuda_shared_memory()  # all: what Triton's shm example calls first
    assert len(triton.get_cuda_shared_memory_status().regions) == 0


def _trace(settings) -> dict[str, list[str]]:
    return {k: list(v.value) for k, v in settings.settings.items()}


def test_trace_settings(triton):
    defaults = _trace(triton.get_trace_settings())
    assert defaults["trace_level"] == ["OFF"]
    assert defaults["trace_rate"] == ["1000"]

    updated = _trace(
        triton.update_trace_settings(settings={"trace_rate": "50", "trace_level": ["OFF"]})
    )
    assert updated["trace_rate"] == ["50"] and updated["trace_level"] == ["OFF"]
    assert _trace(triton.get_trace_settings())["trace_rate"] == ["50"]
    assert _trace(triton.get_trace_settings(model_name="classifier"))["trace_rate"] == ["50"]
    # a setting without a value goes back to its default
    assert _trace(triton.update_trace_settings(settings={"trace_rate": None}))["trace_rate"] == [
        "1000"
    ]

    with raises_status(
        "INVALID_ARGUMENT", "tracing is not supported", "trace_level can only be OFF"
    ):
        triton.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]})
    with raises_status("INVALID_ARGUMENT", "unknown trace setting 'trace_colour'"):
        triton.update_trace_settings(settings={"trace_colour": "blue"})
    with raises_status("INVALID_ARGUMENT", "'trace_count' takes one integer"):
        triton.update_trace_settings(settings={"trace_count": "many"})
    with raises_status("NOT_FOUND", "no_such_model"):
        triton.get_trace_settings(model_name="no_such_model")
    assert _trace(triton.get_trace_settings()) == defaults


def _logs(settings) -> dict:
    out = {}
    for key, value in settings.settings.items():
        out[key] = getattr(value, value.WhichOneof("parameter_choice"))
    return out


def test_log_settings(triton):
    rsrv_logger = logging.getLogger("rsrv")
    level = rsrv_logger.level
    defaults = _logs(triton.get_log_settings())
    assert defaults == {
        "log_file": "",
        "log_info": True,
        "log_warning": True,
        "log_error": True,
        "log_verbose_level": 0,
        "log_format": "default",
    }
    try:
        updated = _logs(triton.update_log_settings({"log_verbose_level": 1}))
        assert updated["log_verbose_level"] == 1
        assert rsrv_logger.level == logging.DEBUG
        updated = _logs(triton.update_log_settings({"log_verbose_level": 0, "log_info": False}))
        assert (updated["log_verbose_level"], updated["log_info"]) == (0, False)
        assert rsrv_logger.level == logging.WARNING
        assert _logs(triton.get_log_settings()) == updated

        # (tritonclient refuses to send these: raw requests)
        for key, value, message in [
            ("log_colour", "blue", "unknown log setting 'log_colour'"),
            ("log_info", "yes", "log setting 'log_info' takes a bool value"),
            ("log_format", "xml", "log_format is 'default', fixed at start"),
            ("log_format", "json", "log_format is 'default', fixed at start"),  # (no effect)
        ]:
            request = service_pb2.LogSettingsRequest()
            request.settings[key].string_param = value
            with pytest.raises(grpc.RpcError) as info:
                triton._client_stub.LogSettings(request)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in info.value.details()
        with raises_status("INVALID_ARGUMENT", "log_file is not supported"):
            triton.update_log_settings({"log_file": "/tmp/rsrv.log"})
    finally:
        triton.update_log_settings({"log_verbose_level": 0, "log_info": True})
    assert _logs(triton.get_log_settings()) == defaults
    assert rsrv_logger.level == level


# -- the bind address ------------------------------------------------------------------------


def _other_local_ipv4() -> str | None:
    """A non-loopback IPv4 address of this machine, or None."""
    candidates = []
    try:
        candidates.append(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: only picks a route
            candidates.append(probe.getsockname()[0])
        except OSError:
            pass
    for address in candidates:
        if address.startswith("127.") or address == "0.0.0.0":
            continue
        with socket.socket() as s:  # really ours?
            try:
                s.bind((address, 0))
            except OSError:
                continue
        return address
    return None


def _connects(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=5):
            return True
    except OSError:
        return False


def _explicit_empty(tmp_path, cache_dir, **settings):
    (tmp_path / "empty").mkdir(exist_ok=True)
    return worker_config(tmp_path / "empty", cache_dir, MODEL_CONTROL_MODE="explicit", **settings)


def test_bind_address_is_honoured(tmp_path, cache_dir):
    other = _other_local_ipv4()
    if other is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    with running(_explicit_empty(tmp_path, cache_dir, ENDPOINTS_HOST="127.0.0.1")) as w:
        assert _connects("127.0.0.1", w.port)
        assert not _connects(other, w.port)
    # the control: a worker bound to every interface is reachable there
    with running(_explicit_empty(tmp_path, cache_dir, ENDPOINTS_HOST="0.0.0.0")) as w:
        assert _connects(other, w.port)
        with grpcclient.InferenceServerClient(f"{other}:{w.port}") as triton:
            assert triton.is_server_live()


def _flatten(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [e for sub in error.exceptions for e in _flatten(sub)]
    return [error]


def test_second_worker_on_the_same_port_fails_to_bind(tmp_path, cache_dir):
    with running(_explicit_empty(tmp_path, cache_dir)) as first:
        config = on_port(_explicit_empty(tmp_path, cache_dir), first.port)
        with pytest.raises(BaseException) as info:  # noqa: B017 - checked below
            with running(config):
                pass
        errors = _flatten(info.value)
        assert any(isinstance(e, OSError) and e.errno == errno.EADDRINUSE for e in errors), errors
        with connect(first) as triton:  # the first one is unaffected
            assert triton.is_server_live()


# simple_string's model.py, its postprocess returning numpy bytes and str arrays
NUMPY_TEXT_MODEL_PY = (
    SIMPLE_STRING_MODEL_PY.split("@rsrv.postprocess")[0]
    + """
@rsrv.postprocess(inputs=["sum", "diff"], outputs=["OUTPUT0", "OUTPUT1"])
def format_results(total, diff):
    as_bytes = np.array([str(int(v)).encode() for v in total.reshape(-1)])  # dtype S
    as_str = np.array([str(int(v)) for v in diff.reshape(-1)])  # dtype U
    return as_bytes.reshape(total.shape), as_str.reshape(diff.shape)
"""
)


def test_a_bytes_output_may_come_from_a_hook_as_numpy_bytes_or_str(tmp_path, cache_dir):
    """What np.asarray makes of a list of bytes or of str (dtype S, U), not only object
    arrays, is a BYTES output."""
    repo = make_repo(tmp_path / "repo", "simple_string")
    (repo / "simple_string" / "model.py").write_text(NUMPY_TEXT_MODEL_PY)
    with running(worker_config(repo, cache_dir)) as w, connect(w) as triton:
        numbers = np.array([[str(i).encode() for i in range(16)]], dtype=object)
        result = triton.infer(
            "simple_string",
            [infer_input("INPUT0", numbers, "BYTES"), infer_input("INPUT1", numbers, "BYTES")],
        )
        assert result.as_numpy("OUTPUT0").tolist() == [[str(2 * i).encode() for i in range(16)]]
        assert result.as_numpy("OUTPUT1").tolist() == [[b"0"] * 16]


def test_large_bytes_requests_and_answers_decode_off_the_loop_correctly(tmp_path, cache_dir):
    """20,000 BYTES elements in (decoded in a worker thread: longer than the codec may
    hold the event loop) and 20,000 out (encoded in one too), over gRPC and REST, shared
    memory included, with a deadline; the answers are exact."""
    repo = make_repo(tmp_path / "repo", "words")
    text = np.array([[b"w"] * 10_000, [b"w"] * 9_000 + [b""] * 1_000], dtype=object)
    with running(with_http(worker_config(repo, cache_dir))) as w, connect(w) as triton:
        rest = http_connect(w, network_timeout=60)
        grpc_in = infer_input("text", text, "BYTES")
        grpc_answer = triton.infer("words", [grpc_in], client_timeout=60)
        rest_answer = rest.infer("words", [http_input("text", text, "BYTES")], timeout=60_000_000)
        for answer in (grpc_answer, rest_answer):
            assert answer.as_numpy("counts").tolist() == [[10_000], [9_000]]
            oks = answer.as_numpy("oks")
            assert oks.shape == (2, 10_000) and set(oks.ravel().tolist()) == {b"ok"}
