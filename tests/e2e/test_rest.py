"""The KServe V2 REST endpoint of a real worker on 127.0.0.1 (``endpoints.http_port``),
driven by tritonclient.http (sync and aio), Triton's HTTP shared-memory example, and plain
JSON requests as curl sends them: every endpoint, JSON and binary tensors, compression
both ways, restricted protocols, and the same answers and statistics as the gRPC port.
(Bad input and limits: test_rest_errors.py.)
"""

from __future__ import annotations

import asyncio
import gc
import gzip
import json
import os
import uuid
import zlib

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aioclient
import tritonclient.utils.shared_memory as shm
from support.bundles import make_repo
from support.clients import connect, infer_input
from support.metrics import get_absolute
from support.procfs import accepted_connections
from support.rest import (
    http_connect,
    http_input,
    http_url,
    raises_http,
    request,
    with_http,
)
from support.serving import (
    LOOP_THREAD,
    ServerProcess,
    node_config,
    running,
    threads_calling,
    worker_config,
)
from support.waiting import wait_until
from tritonclient import utils

from rsrv.errors import InvalidArgument


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return make_repo(
        tmp_path_factory.mktemp("rest") / "repo", "classifier", "simple", "simple_string"
    )


@pytest.fixture(scope="module")
def worker_http() -> bool:
    return True


@pytest.fixture
def client(worker):
    c = http_connect(worker)
    yield c
    c.unregister_system_shared_memory()
    c.close()


def x_rows(rows: int) -> np.ndarray:
    return np.random.default_rng(rows).standard_normal((rows, 256)).astype(np.float32)


def grpc_logits(worker, x: np.ndarray) -> np.ndarray:
    with connect(worker) as triton:
        return triton.infer("classifier", [infer_input("x", x)]).as_numpy("logits")


# -- health and metadata ------------------------------------------------------------------------


def test_health_and_metadata(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("classifier")
    assert client.is_model_ready("classifier", "1")
    assert not client.is_model_ready("classifier", "7")
    assert not client.is_model_ready("no_such_model")
    meta = client.get_server_metadata()
    assert meta["name"] == "rsrv"
    assert {"model_repository", "binary_tensor_data", "system_shared_memory"} <= set(
        meta["extensions"]
    )
    model = client.get_model_metadata("classifier")
    assert model == {
        "name": "classifier",
        "versions": ["1"],
        "platform": "cpu",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 256]}],
        "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}],
    }
    assert client.get_model_metadata("classifier", "1")["versions"] == ["1"]
    config = client.get_model_config("classifier")
    assert config["name"] == "classifier"
    assert config["max_batch_size"] == 8
    assert config["input"][0]["dims"] == [256]
    assert config["dynamic_batching"]["preferred_batch_size"] == [1, 4, 8]
    with raises_http(404, "Request for unknown model: 'nope' is not found"):
        client.get_model_config("nope")


# -- inference ------------------------------------------------------------------------------------


@pytest.mark.parametrize("binary_in", [True, False], ids=["binary-in", "json-in"])
@pytest.mark.parametrize("binary_out", [True, False], ids=["binary-out", "json-out"])
def test_infer_matches_grpc(worker, client, binary_in, binary_out):
    x = x_rows(3)
    result = client.infer(
        "classifier",
        [http_input("x", x, binary=binary_in)],
        outputs=[httpclient.InferRequestedOutput("logits", binary_data=binary_out)],
        request_id="r-7",
    )
    response = result.get_response()
    assert response["id"] == "r-7"
    assert (response["model_name"], response["model_version"]) == ("classifier", "1")
    logits = result.as_numpy("logits")
    assert logits.shape == (3, 10)
    expected = grpc_logits(worker, x)
    if binary_out:
        np.testing.assert_array_equal(logits, expected)  # the same bytes as on gRPC
    else:
        np.testing.assert_allclose(logits, expected, rtol=1e-6)


@pytest.mark.parametrize("request_compression", [None, "gzip", "deflate"])
@pytest.mark.parametrize("response_compression", [None, "gzip", "deflate"])
def test_compression_both_ways(worker, client, request_compression, response_compression):
    x = x_rows(2)
    result = client.infer(
        "classifier",
        [http_input("x", x)],
        request_compression_algorithm=request_compression,
        response_compression_algorithm=response_compression,
    )
    np.testing.assert_array_equal(result.as_numpy("logits"), grpc_logits(worker, x))


def test_simple_and_strings(client):
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.ones((1, 16), np.int32)
    result = client.infer(
        "simple", [http_input("INPUT0", a), http_input("INPUT1", b, binary=False)]
    )
    assert result.as_numpy("OUTPUT0").tolist() == (a + b).tolist()
    assert result.as_numpy("OUTPUT1").tolist() == (a - b).tolist()
    words = np.array([[str(i).encode() for i in range(16)]], dtype=object)
    ones = np.array([[b"1"] * 16], dtype=object)
    for binary in (True, False):
        result = client.infer(
            "simple_string",
            [
                http_input("INPUT0", words, "BYTES", binary=binary),
                http_input("INPUT1", ones, "BYTES", binary=binary),
            ],
            outputs=[
                httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary),
                httpclient.InferRequestedOutput("OUTPUT1", binary_data=binary),
            ],
        )
        out = result.as_numpy("OUTPUT0").reshape(-1)
        assert [int(v) for v in out] == [i + 1 for i in range(16)]


def test_statistics_count_rest_requests_like_grpc(worker, client):
    def success() -> int:
        (stats,) = client.get_inference_statistics("simple")["model_stats"]
        return stats["inference_stats"]["success"]["count"]

    before = success()
    a = np.zeros((1, 16), np.int32)
    client.infer("simple", [http_input("INPUT0", a), http_input("INPUT1", a)])
    with connect(worker) as triton:
        triton.infer("simple", [infer_input("INPUT0", a), infer_input("INPUT1", a)])
        (grpc_stats,) = triton.get_inference_statistics("simple").model_stats
    assert success() == before + 2 == grpc_stats.inference_stats.success.count
    every = client.get_inference_statistics()["model_stats"]
    assert {s["name"] for s in every} == {"classifier", "simple", "simple_string"}
    one = client.get_inference_statistics("simple", "1")["model_stats"][0]
    assert isinstance(one["inference_count"], int) and one["version"] == "1"


def test_aio_client(worker):
    """tritonclient.http.aio (aiohttp) in its own asyncio loop."""

    async def main():
        async with aioclient.InferenceServerClient(http_url(worker)) as client:
            assert await client.is_server_live()
            assert await client.is_model_ready("classifier")
            assert (await client.get_model_metadata("classifier"))["name"] == "classifier"
            x = x_rows(4)
            inputs = [aioclient.InferInput("x", [4, 256], "FP32")]
            inputs[0].set_data_from_numpy(x)
            results = await asyncio.gather(
                *(
                    client.infer("classifier", inputs, request_compression_algorithm=c)
                    for c in (None, "gzip", "deflate", None)
                )
            )
            return x, [r.as_numpy("logits") for r in results]

    x, outputs = asyncio.run(main())
    expected = grpc_logits(worker, x)
    for logits in outputs:
        np.testing.assert_array_equal(logits, expected)


# -- plain JSON, as curl sends it ---------------------------------------------------------------


def test_plain_json_as_curl_sends_it(worker):
    assert request(worker, "GET", "/v2/health/live").json() == {"live": True}
    assert get_absolute(worker.http_port, "/v2/health/live") == (200, b'{"live":true}')
    assert request(worker, "GET", "/v2/health/ready").json() == {"ready": True}
    assert request(worker, "GET", "/v2/models/simple/ready").status == 200
    assert request(worker, "GET", "/v2/models/nope/ready").status == 400
    x = x_rows(2)
    body = {  # nested data, as a person writes it
        "id": "curl-1",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 256], "data": x.tolist()}],
    }
    answer = request(worker, "POST", "/v2/models/classifier/infer", body)
    assert answer.status == 200
    assert answer.headers["content-type"] == "application/json"
    reply = answer.json()
    assert reply["id"] == "curl-1"
    (out,) = reply["outputs"]
    assert (out["name"], out["datatype"], out["shape"]) == ("logits", "FP32", [2, 10])
    np.testing.assert_allclose(
        np.array(out["data"], np.float32).reshape(2, 10), grpc_logits(worker, x), rtol=1e-6
    )
    # curl --compressed: the answer comes back gzipped
    zipped = request(
        worker,
        "POST",
        "/v2/models/classifier/versions/1/infer",
        body,
        {"Accept-Encoding": "deflate, gzip, br"},
    )
    assert zipped.headers["content-encoding"] == "gzip"
    assert json.loads(gzip.decompress(zipped.body)) == reply
    deflated = request(
        worker, "POST", "/v2/models/classifier/infer", body, {"Accept-Encoding": "deflate"}
    )
    assert json.loads(zlib.decompress(deflated.body)) == reply


def test_a_body_of_megabytes_is_read_into_one_buffer(worker):
    """Past 1 MiB a body of a known length is copied into one buffer as it arrives (the
    pieces were joined at the end, holding the loop): an inference request, a body that
    is only whitespace (an empty object) and one that does not parse read as before."""
    x = x_rows(2)
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 256], "data": x.tolist()}]}
    padded = json.dumps(body).encode() + b" " * (3 << 20)
    answer = request(worker, "POST", "/v2/models/classifier/infer", padded)
    assert answer.status == 200, answer.body[:200]
    (out,) = answer.json()["outputs"]
    np.testing.assert_allclose(
        np.array(out["data"], np.float32).reshape(2, 10), grpc_logits(worker, x), rtol=1e-6
    )
    blank = request(worker, "POST", "/v2/repository/index", b" " * (2 << 20))
    assert blank.status == 200 and {m["name"] for m in blank.json()} >= {"classifier"}
    broken = request(worker, "POST", "/v2/repository/index", b"{" + b" " * (2 << 20))
    assert broken.status == 400 and "cannot parse the index request body" in broken.json()["error"]


def test_a_refused_request_is_freed_at_once(worker):
    """Its error held the request, body and all, in a reference cycle through its
    traceback until a garbage collection (eight refused 200 MB uploads: the worker's
    memory swung between 223 and 852 MB)."""
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [9, 256], "data": [0] * 2304}]}

    def errors() -> int:
        return sum(isinstance(o, InvalidArgument) for o in gc.get_objects())

    gc.collect()
    gc.disable()
    try:
        before = errors()
        for _ in range(3):
            answer = request(worker, "POST", "/v2/models/classifier/infer", body)
            assert answer.status == 400 and "exceeds the largest" in answer.json()["error"]
        assert errors() == before
    finally:
        gc.enable()


def test_an_answer_of_many_json_values_is_encoded_off_the_event_loop(worker, monkeypatch):
    """(Priced as a memory copy, 1M values written as JSON held the loop 0.5 s: every
    other call of the worker waited.) Here each value is priced at a second."""
    from rsrv.protocol import _rest_codec

    threads = threads_calling(monkeypatch, _rest_codec, "_json_values")
    monkeypatch.setattr(_rest_codec, "JSON_VALUE_ENCODE_SECONDS", 1.0)
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 256], "data": [0.5] * 256}]}
    assert request(worker, "POST", "/v2/models/classifier/infer", body).status == 200
    assert threads and LOOP_THREAD not in threads


def test_json_binary_output_parameter(worker):
    """binary_data_output asks for every output as binary data after the JSON."""
    a = np.arange(16, dtype=np.int32)
    body = {
        "parameters": {"binary_data_output": True},
        "inputs": [
            {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": a.tolist()},
            {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": a.tolist()},
        ],
    }
    answer = request(worker, "POST", "/v2/models/simple/infer", body)
    assert answer.headers["content-type"] == "application/octet-stream"
    size = int(answer.headers["inference-header-content-length"])
    header = json.loads(answer.body[:size])
    sizes = [o["parameters"]["binary_data_size"] for o in header["outputs"]]
    assert sizes == [64, 64]
    out0 = np.frombuffer(answer.body[size : size + 64], np.int32)
    assert out0.tolist() == (2 * a).tolist()


# -- repository, settings, restrictions -----------------------------------------------------------


def test_repository_load_unload_in_explicit_mode(repo, cache_dir):
    config = with_http(worker_config(repo, cache_dir, MODEL_CONTROL_MODE="explicit"))
    with running(config) as w:
        client = http_connect(w)
        index = {m["name"]: m["state"] for m in client.get_model_repository_index()}
        assert index["simple"] == "UNAVAILABLE"
        client.load_model("simple", config=json.dumps({"max_batch_size": 4}))
        assert client.is_model_ready("simple")
        assert client.get_model_config("simple")["max_batch_size"] == 4
        ready = request(w, "POST", "/v2/repository/index", {"ready": True}).json()
        assert [m["name"] for m in ready] == ["simple"]
        with raises_http(400, "Invalid config override"):
            client.load_model("simple", config="{not json")
        with raises_http(404, "failed to load 'nope', failed to poll from model repository"):
            client.load_model("nope")
        with raises_http(400, "the request carries file overrides"):
            client.load_model("simple", config="{}", files={"file:1/x.txt": b"x"})
        client.unload_model("simple")
        assert not client.is_model_ready("simple")
        with raises_http(404, "Request for unknown model: 'simple'"):
            client.get_model_metadata("simple")


def test_load_outside_explicit_mode_is_refused(client):
    with raises_http(400, "RepositoryModelLoad is only effective when model_control_mode"):
        client.load_model("simple")


def test_trace_and_log_settings(client):
    assert client.get_trace_settings()["trace_level"] == ["OFF"]
    assert client.update_trace_settings(settings={"trace_rate": "50"})["trace_rate"] == "50"
    with raises_http(400, "tracing is not supported: trace_level can only be OFF"):
        client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]})
    assert client.update_trace_settings(settings={"trace_rate": None})["trace_rate"] == "1000"
    logs = client.get_log_settings()
    assert logs["log_file"] == "" and isinstance(logs["log_verbose_level"], int)
    level = logs["log_verbose_level"]
    assert client.update_log_settings({"log_verbose_level": 1})["log_verbose_level"] == 1
    client.update_log_settings({"log_verbose_level": level})
    with raises_http(400, "unknown log setting 'log_colour'"):
        client.update_log_settings({"log_colour": True})


def test_restricted_protocols(repo, cache_dir, tmp_path):
    """Restricted groups need the header on REST as on gRPC: 403 with Triton's words."""
    config = node_config(
        tmp_path,
        f"""
model_repo = "{repo}"
[global]
cache_dir = "{cache_dir}"
[[global.endpoints.restricted]]
protocols = ["shared-memory", "model-repository"]
header = "admin-key"
value = "s3cret"
""",
    )
    with running(with_http(config)) as w:
        client = http_connect(w)
        with raises_http(403, "This protocol is restricted, expecting header 'admin-key'"):
            client.get_model_repository_index()
        with raises_http(403, "expecting header 'admin-key'"):
            client.get_system_shared_memory_status(headers={"admin-key": "wrong"})
        assert client.get_system_shared_memory_status(headers={"admin-key": "s3cret"}) == []
        assert client.get_model_repository_index(headers={"admin-key": "s3cret"})
        assert client.is_server_ready()  # unlisted groups stay open


# -- system shared memory ------------------------------------------------------------------


def test_simple_http_shm_client(worker):
    """Triton's simple_http_shm_client.py pattern: inputs and outputs in shared memory."""
    suffix = uuid.uuid4().hex[:12]
    triton_client = httpclient.InferenceServerClient(url=http_url(worker), verbose=False)
    triton_client.unregister_system_shared_memory()
    triton_client.unregister_cuda_shared_memory()

    input0_data = np.arange(start=0, stop=16, dtype=np.int32)
    input1_data = np.ones(shape=16, dtype=np.int32)
    input_byte_size = input0_data.size * input0_data.itemsize
    output_byte_size = input_byte_size

    shm_op_handle = shm.create_shared_memory_region(
        "output_data", f"/output_simple_{suffix}", output_byte_size * 2
    )
    shm_ip_handle = shm.create_shared_memory_region(
        "input_data", f"/input_simple_{suffix}", input_byte_size * 2
    )
    try:
        triton_client.register_system_shared_memory(
            "output_data", f"/output_simple_{suffix}", output_byte_size * 2
        )
        shm.set_shared_memory_region(shm_ip_handle, [input0_data])
        shm.set_shared_memory_region(shm_ip_handle, [input1_data], offset=input_byte_size)
        triton_client.register_system_shared_memory(
            "input_data", f"/input_simple_{suffix}", input_byte_size * 2
        )

        inputs = [
            httpclient.InferInput("INPUT0", [1, 16], "INT32"),
            httpclient.InferInput("INPUT1", [1, 16], "INT32"),
        ]
        inputs[0].set_shared_memory("input_data", input_byte_size)
        inputs[1].set_shared_memory("input_data", input_byte_size, offset=input_byte_size)
        outputs = [
            httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
            httpclient.InferRequestedOutput("OUTPUT1", binary_data=True),
        ]
        outputs[0].set_shared_memory("output_data", output_byte_size)
        outputs[1].set_shared_memory("output_data", output_byte_size, offset=output_byte_size)

        results = triton_client.infer(model_name="simple", inputs=inputs, outputs=outputs)

        output0 = results.get_output("OUTPUT0")
        assert output0 is not None
        output0_data = shm.get_contents_as_numpy(
            shm_op_handle, utils.triton_to_np_dtype(output0["datatype"]), output0["shape"]
        )
        output1 = results.get_output("OUTPUT1")
        output1_data = shm.get_contents_as_numpy(
            shm_op_handle,
            utils.triton_to_np_dtype(output1["datatype"]),
            output1["shape"],
            offset=output_byte_size,
        )
        assert output0["parameters"]["shared_memory_byte_size"] == 64
        assert output1["parameters"]["shared_memory_offset"] == 64
        assert (output0_data[0] == input0_data + input1_data).all()
        assert (output1_data[0] == input0_data - input1_data).all()

        status = triton_client.get_system_shared_memory_status()
        assert sorted(r["name"] for r in status) == ["input_data", "output_data"]
        (one,) = triton_client.get_system_shared_memory_status("input_data")
        assert one["byte_size"] == 128 and one["offset"] == 0
        with raises_http(404, "Unable to find system shared memory region: 'nope'"):
            triton_client.get_system_shared_memory_status("nope")
        with raises_http(409, "shared memory region 'input_data' already in manager"):
            triton_client.register_system_shared_memory(
                "input_data", f"/input_simple_{suffix}", input_byte_size * 2
            )
        triton_client.unregister_system_shared_memory("input_data")
        triton_client.unregister_system_shared_memory()
        assert triton_client.get_system_shared_memory_status() == []
        with raises_http(400, "CUDA shared memory is not supported by this cpu worker"):
            triton_client.register_cuda_shared_memory("c", b"\0" * 64, 0, 64)
        assert triton_client.get_cuda_shared_memory_status() == []
        assert request(worker, "GET", "/v2/cudasharedmemory/region/c/status").json() == []
    finally:
        triton_client.close()
        shm.destroy_shared_memory_region(shm_ip_handle)
        shm.destroy_shared_memory_region(shm_op_handle)


def test_a_register_request_with_a_null_offset_starts_at_0(worker):
    key = f"/rest_null_offset_{os.getpid()}"
    region = shm.create_shared_memory_region("null_offset", key, 64)
    try:
        path = "/v2/systemsharedmemory/region/null_offset"
        body = {"key": key, "byte_size": 64, "offset": None}
        assert request(worker, "POST", f"{path}/register", body).status == 200
        (status,) = request(worker, "GET", f"{path}/status").json()
        assert (status["offset"], status["byte_size"]) == (0, 64)
        assert request(worker, "POST", f"{path}/unregister").status == 200
    finally:
        shm.destroy_shared_memory_region(region)


# -- the command ------------------------------------------------------------------------------


def test_rsrv_serve_with_an_http_port(tmp_path, repo, cache_dir):
    server = ServerProcess(
        tmp_path,
        f"""
model_repo = "{repo}"
base_port = {{port}}
[global]
cache_dir = "{cache_dir}"
model_control_mode = "static"
[global.endpoints]
http_port = {{http_port}}
""",
    )
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.ports['http_port']}")
        server.wait_ready(client)
        a = np.ones((1, 16), np.int32)
        result = client.infer("simple", [http_input("INPUT0", a), http_input("INPUT1", a)])
        assert result.as_numpy("OUTPUT0").tolist() == (2 * a).tolist()
        assert any("KServe V2 REST on 127.0.0.1:" in line for line in server.stderr)
    finally:
        server.kill()


def test_connections_the_client_closes_are_released_at_once(worker):
    """A connection closed by the client between requests is closed here too at once,
    not when the idle timer (``idle_connection_seconds``) fires."""
    for _ in range(20):
        c = http_connect(worker)
        assert c.is_server_live()
        c.close()
    wait_until(lambda: accepted_connections(worker.http_port) == 0, 10, "every connection released")
