"""The REST twins of tests/e2e/test_kserve_errors.py: every bad input of the gRPC suite
sent to the KServe V2 REST endpoint of a real worker (tritonclient.http where it can send
the mistake, plain HTTP as curl would otherwise) gets the same check, the same message
(where it does not name a gRPC field) and the matching HTTP status with a JSON
``{"error": ...}`` body; the server keeps serving. Limits of the HTTP exchange itself
(body size, encodings, slow bodies, disconnects) are here too.
"""

from __future__ import annotations

import gzip
import http.client
import json
import queue
import socket
import threading
import time
import zlib

import msgspec
import numpy as np
import pytest
import trio
import tritonclient.http as httpclient
from support.bundles import make_repo
from support.rest import (
    http_connect,
    http_input,
    raises_http,
    raw_exchange,
    request,
    with_http,
)
from support.serving import held_device, hook_globals, running, sched_stats, worker_config
from support.waiting import wait_until

from rsrv.protocol import _rest as rest_module

MIB = 1 << 20


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return make_repo(
        tmp_path_factory.mktemp("rest_errors") / "repo",
        "classifier",
        "simple",
        "simple_string",
        "slow",
        "broken",
    )


@pytest.fixture(scope="module")
def worker_http() -> bool:
    return True


@pytest.fixture
def client(worker):
    c = http_connect(worker)
    yield c
    c.close()


def in_background(worker, model: str, array: np.ndarray, name: str = "x") -> queue.Queue:
    """One inference from a thread of its own (its own client): the queue gets the
    result's first output, or the exception."""
    done: queue.Queue = queue.Queue()

    def call():
        c = http_connect(worker)
        try:
            result = c.infer(model, [http_input(name, array)])
            done.put(result.as_numpy(result.get_response()["outputs"][0]["name"]))
        except Exception as e:
            done.put(e)
        finally:
            c.close()

    threading.Thread(target=call, daemon=True).start()
    return done


def x_rows(rows: int) -> np.ndarray:
    return np.random.default_rng(rows).standard_normal((rows, 256)).astype(np.float32)


def fails(client, model: str) -> int:
    (stats,) = client.get_inference_statistics(model)["model_stats"]
    return stats["inference_stats"]["fail"]["count"]


def infer_raw(worker, body: dict, *parts: bytes, model="classifier", headers=None):
    """POST a JSON request with binary parts after it (as tritonclient.http sends them)."""
    data = json.dumps(body).encode()
    headers = dict(headers or {})
    if parts:
        headers["Inference-Header-Content-Length"] = str(len(data))
        data = data + b"".join(parts)
    return request(worker, "POST", f"/v2/models/{model}/infer", data, headers)


def tensor(name, datatype, shape, *, data=None, binary: int | None = None, **params):
    t = {"name": name, "datatype": datatype, "shape": shape}
    if binary is not None:
        params["binary_data_size"] = binary
    if params:
        t["parameters"] = params
    if data is not None:
        t["data"] = data
    return t


ONE_ROW = x_rows(1).tobytes()


# -- models --------------------------------------------------------------------------------------


def test_unknown_model(client):
    with raises_http(404, "Request for unknown model: 'no_such_model'"):
        client.infer("no_such_model", [http_input("x", x_rows(1))])


def test_unavailable_model(client):
    with raises_http(
        503, "model 'broken' is unavailable", "format_version: unsupported version '9.9'"
    ):
        client.infer("broken", [http_input("x", x_rows(1))])


def test_a_websocket_upgrade_is_refused(worker):
    """(The app ignored the websocket scope, and hypercorn answered 500.)"""
    reply = raw_exchange(
        worker,
        b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
        b"Upgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        b"Sec-WebSocket-Version: 13\r\n\r\n",
    )
    assert reply.startswith(b"HTTP/1.1 403"), reply[:100]


def test_empty_model_name(worker):
    answer = infer_raw(worker, {"inputs": []}, model="")
    assert (answer.status, answer.error) == (400, "model_name is empty")


def test_malformed_version(worker, client):
    with raises_http(400, "failed to get model version from specified version string 'x1'"):
        client.infer("classifier", [http_input("x", x_rows(1))], model_version="x1")
    # an empty version segment is no endpoint (it was the default version)
    answer = request(worker, "GET", "/v2/models/classifier/versions//ready")
    assert answer.status == 404 and "no KServe V2 endpoint" in answer.error
    assert request(worker, "POST", "/v2/models/classifier/versions//infer", b"{}").status == 404


# -- inputs through tritonclient.http ------------------------------------------------------------


def test_missing_input(client):
    with raises_http(
        400, "model 'simple' expects input tensor(s) 'INPUT1', missing from the request"
    ):
        client.infer("simple", [http_input("INPUT0", np.zeros((1, 16), np.int32))])


def test_inputs_that_disagree_on_rows(client):
    a, b = np.ones((1, 16), np.int32), np.ones((2, 16), np.int32)
    with raises_http(
        400,
        "input 'INPUT1' batch size does not match other inputs for 'simple' "
        "(2 rows along its batch axis; 'INPUT0' has 1)",
    ):
        client.infer("simple", [http_input("INPUT0", a), http_input("INPUT1", b)])


def test_undeclared_input(client):
    with raises_http(
        400,
        "unexpected input tensor 'extra' for model 'classifier': the model's inputs are ['x']",
    ):
        client.infer(
            "classifier",
            [http_input("x", x_rows(1)), http_input("extra", np.zeros(3, np.float32))],
        )


def test_dtype_mismatch(client):
    with raises_http(
        400, "input tensor 'x' for model 'classifier': got datatype FP16, expected FP32"
    ):
        client.infer("classifier", [http_input("x", x_rows(1).astype(np.float16))])


def test_rank_mismatch(client):
    with raises_http(
        400,
        "input tensor 'x' for model 'classifier': rank 1 "
        "(shape [256]) does not match the model's rank 2",
    ):
        client.infer("classifier", [http_input("x", x_rows(1)[0])])


def test_fixed_axis_mismatch(client):
    with raises_http(
        400,
        "input tensor 'x' for model 'classifier': axis 1 has extent 255 but the model expects 256",
    ):
        client.infer("classifier", [http_input("x", x_rows(2)[:, :255].copy(), binary=False)])


def test_more_rows_than_the_largest_batch(client):
    with raises_http(
        400, "model 'classifier': a request of 9 rows exceeds the largest compiled batch size 8"
    ):
        client.infer("classifier", [http_input("x", x_rows(9))])


def test_unknown_requested_output(client):
    with raises_http(
        400,
        "unexpected inference output tensor 'nope' for "
        "model 'classifier': the model's outputs are ['logits']",
    ):
        client.infer(
            "classifier",
            [http_input("x", x_rows(1))],
            outputs=[httpclient.InferRequestedOutput("nope")],
        )


def test_repeated_requested_output(client):
    with raises_http(
        400, "output tensor 'logits' for model 'classifier' is requested more than once"
    ):
        client.infer(
            "classifier",
            [http_input("x", x_rows(1))],
            outputs=[httpclient.InferRequestedOutput("logits")] * 2,
        )


def test_classification_output(client):
    with raises_http(400, "the classification extension is not supported"):
        client.infer(
            "classifier",
            [http_input("x", x_rows(1))],
            outputs=[httpclient.InferRequestedOutput("logits", class_count=3)],
        )


# -- inputs as plain JSON and binary data (the twins of the raw protobuf cases) -------------------

X = {"name": "x", "datatype": "FP32", "shape": [1, 256]}
S16 = [1] * 16


def _simple(data0=S16, data1=S16, datatype="INT32"):
    return {
        "inputs": [
            tensor("INPUT0", datatype, [1, 16], data=data0),
            tensor("INPUT1", datatype, [1, 16], data=data1),
        ]
    }


RAW_CASES = {
    "binary byte length": (
        ({"inputs": [tensor(**X, binary=1000)]}, bytes(1000)),
        "input tensor 'x' for model 'classifier': its binary data holds 1000 bytes "
        "but shape [1, 256] of FP32 needs 256 x 4 = 1024",
    ),
    "negative dims": (
        ({"inputs": [tensor("x", "FP32", [-2, 256], binary=1024)]}, ONE_ROW),
        "input tensor 'x' for model 'classifier': negative dimension -2 on axis 0",
    ),
    "zero rows": (
        ({"inputs": [tensor("x", "FP32", [0, 256], data=[])]},),
        "input tensor 'x' for model 'classifier': the batch axis (axis 0) has 0 rows",
    ),
    "element-count overflow": (
        ({"inputs": [tensor("x", "FP32", [2**40, 256], binary=1024)]}, ONE_ROW),
        "input tensor 'x' for model 'classifier': shape [1099511627776, 256] has "
        "281474976710656 elements (1125899906842624 bytes), above the limit of 2147483647 "
        "bytes per tensor",
    ),
    "data and binary data both set": (
        (
            {
                "inputs": [
                    tensor("INPUT0", "INT32", [1, 16], data=S16, binary=64),
                    tensor("INPUT1", "INT32", [1, 16], binary=64),
                ]
            },
            bytes(64),
            bytes(64),
        ),
        "input tensor 'INPUT0' for model 'simple': 'data' must not be set when the input is "
        "sent as binary data (binary_data_size 64)",
    ),
    "data of the wrong JSON type": (
        (_simple(data0=[1.5] * 16),),
        "input tensor 'INPUT0' for model 'simple': 'data' of datatype INT32 must hold integers",
    ),
    "data element count": (
        (_simple(data0=[1] * 15),),
        "input tensor 'INPUT0' for model 'simple': 'data' has 15 elements but shape "
        "[1, 16] needs 16",
    ),
    "data far beyond its shape": (  # (made Python objects of all of it before: GBs)
        (_simple(data0=[[]] * 10_000),),
        "input tensor 'INPUT0' for model 'simple': 'data' has more values than shape "
        "[1, 16] holds (16)",
    ),
    "BYTES data element count": (  # (small: the exact count, not "more values than")
        (_simple(data0=["a"] * 17, data1=["b"] * 16, datatype="BYTES"),),
        "input tensor 'INPUT0' for model 'simple_string': 'data' has 17 elements but shape "
        "[1, 16] needs 16",
    ),
    "BYTES data far beyond its shape": (  # (strings counted by their quotes: were not)
        (_simple(data0=["a\\"] * 20_000, data1=["b"] * 16, datatype="BYTES"),),
        "input tensor 'INPUT0' for model 'simple_string': 'data' has more values than "
        "shape [1, 16] holds (16)",
    ),
    "data out of range": (
        (_simple(data0=[2**31] * 16),),
        "input tensor 'INPUT0' for model 'simple': 'data' holds values outside the INT32 "
        "range [-2147483648, 2147483647]",
    ),
    "no data": (
        ({"inputs": [tensor(**X)]},),
        "input tensor 'x' for model 'classifier': no data for 256 elements",
    ),
    "binary parts and inputs disagree": (
        ({"inputs": [tensor(**X, binary=1024)]}, ONE_ROW, ONE_ROW),
        "request for model 'classifier' has 2048 bytes of binary data after the JSON header "
        "but its inputs' binary_data_size add up to 1024",
    ),
    "binary data past the end": (
        ({"inputs": [tensor(**X, binary=2048)]}, ONE_ROW),
        "input tensor 'x' for model 'classifier': binary_data_size 2048 at offset 0 runs "
        "past the 1024 bytes of binary data",
    ),
    "duplicate input": (
        ({"inputs": [tensor(**X, binary=1024)] * 2}, ONE_ROW, ONE_ROW),
        "input tensor 'x' for model 'classifier' appears more than once in the request",
    ),
    "BYTES length prefix past the end": (
        (
            {
                "inputs": [
                    tensor("INPUT0", "BYTES", [1, 16], binary=68),
                    tensor("INPUT1", "BYTES", [1, 16], binary=80),
                ]
            },
            b"\xe8\x03\x00\x00" + bytes(64),
            b"\x01\x00\x00\x001" * 16,
        ),
        "input tensor 'INPUT0' for model 'simple_string': BYTES element 0 claims 1000 bytes at "
        "offset 4, past the end of the 68-byte buffer",
    ),
    "datatype mismatch in JSON": (
        ({"inputs": [tensor("x", "FP16", [1, 256], data=[0.5] * 256)]},),
        "input tensor 'x' for model 'classifier': got datatype FP16, expected FP32",
    ),
    "timeout of the wrong type": (
        ({"inputs": [tensor(**X, binary=1024)], "parameters": {"timeout": "soon"}}, ONE_ROW),
        "invalid value type for 'timeout' parameter for the request, expected an integer",
    ),
    "negative timeout": (
        ({"inputs": [tensor(**X, binary=1024)], "parameters": {"timeout": -5}}, ONE_ROW),
        "invalid value -5 for 'timeout' parameter",
    ),
    "timeout past int64": (
        ({"inputs": [tensor(**X, binary=1024)], "parameters": {"timeout": 2**63}}, ONE_ROW),
        "invalid value for 'timeout' parameter for the request: 9223372036854775808 is "
        "outside the int64 range",
    ),
    "priority past uint64": (
        ({"inputs": [tensor(**X, binary=1024)], "parameters": {"priority": 2**64}}, ONE_ROW),
        "invalid value for 'priority', expected value < 2^64, got 18446744073709551616",
    ),
    "priority of the wrong type": (
        ({"inputs": [tensor(**X, binary=1024)], "parameters": {"priority": "high"}}, ONE_ROW),
        "invalid value type for 'priority' parameter, expected an integer >= 0",
    ),
    "shared-memory size without a region": (
        ({"inputs": [tensor(**X, shared_memory_byte_size=1024)]},),
        "'shared_memory_byte_size' and 'shared_memory_offset' can not be specified without "
        "'shared_memory_region' parameter for input tensor 'x' for model 'classifier'",
    ),
    "not a KServe request": (
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": ["one", 256]}]},),
        "cannot parse the request as a KServe V2 inference request (JSON): Expected `int`, "
        "got `str` - at `$.inputs[0].shape[0]`",
    ),
}


def _model_of(case: str) -> str:
    body = RAW_CASES[case][0][0]
    names = {t["name"] for t in body["inputs"]}
    if "INPUT0" in names:
        return "simple_string" if body["inputs"][0]["datatype"] == "BYTES" else "simple"
    return "classifier"


@pytest.mark.parametrize("case", sorted(RAW_CASES))
def test_bad_raw_request(worker, client, case):
    (body, *parts), message = RAW_CASES[case]
    answer = infer_raw(worker, body, *parts, model=_model_of(case))
    assert answer.status == 400, answer.body
    assert answer.headers["content-type"] == "application/json"
    assert message in answer.error
    assert client.is_server_live()


def test_fp16_data_has_no_json_form(tmp_path, cache_dir):
    """FP16 has no JSON form (as it has no typed protobuf field): binary data only."""
    import jax.numpy as jnp

    from rsrv.export import Input, Output, export_jax

    export_jax(
        lambda p, h: (h * 2).astype(jnp.float16),
        {},
        inputs=[Input("h", np.float16, ("n", 4))],
        outputs=[Output("y")],
        batch_sizes=[1],
        out_dir=tmp_path / "repo" / "half",
        provenance={"source": "tests/e2e/test_rest_errors.py"},
        parity=False,
    )
    with running(with_http(worker_config(tmp_path / "repo", cache_dir))) as w:
        answer = infer_raw(
            w, {"inputs": [tensor("h", "FP16", [1, 4], data=[1.0] * 4)]}, model="half"
        )
        assert answer.status == 400
        assert answer.error == (
            "input tensor 'h' for model 'half': FP16 data can only be sent as binary data "
            "(binary_data_size) or in shared memory, not as JSON 'data'"
        )
        c = http_connect(w)
        y = c.infer("half", [http_input("h", np.ones((1, 4), np.float16))]).as_numpy("y")
        assert y.tolist() == [[2.0] * 4]


def test_undecodable_json_and_unknown_endpoints(worker):
    """Bytes that are not JSON: 400 (the twin of an undecodable protobuf); an unknown path
    404 and a known one with another method 405 (the twins of an unknown method)."""
    answer = request(worker, "POST", "/v2/models/classifier/infer", b"\x0a\xff\xff{")
    assert answer.status == 400
    assert answer.error.startswith("cannot parse the request as a KServe V2 inference request")
    assert request(worker, "GET", "/v2/models/classifier/nosuch").status == 404
    answer = request(worker, "GET", "/v2/models/classifier/infer")
    assert (answer.status, answer.headers["allow"]) == (405, "POST")
    assert "method GET is not allowed" in answer.error
    # HEAD wherever GET is served (RFC 9110): GET's headers, no body (it was 405)
    got, head = (
        request(worker, "GET", "/v2/health/ready"),
        request(worker, "HEAD", "/v2/health/ready"),
    )
    assert (head.status, head.body) == (200, b"")
    assert head.headers["content-length"] == got.headers["content-length"] != "0"
    answer = request(worker, "PUT", "/v2/health/ready")
    assert (answer.status, answer.headers["allow"]) == (405, "GET, HEAD")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v2/models/simple/infer", b'{"id":"\xff","inputs":[]}'),
        (
            "/v2/models/simple_string/infer",
            b'{"inputs":[{"name":"INPUT0","datatype":"BYTES","shape":[1,16],"data":["\xff"]}]}',
        ),
        ("/v2/systemsharedmemory/region/r/register", b'{"key":"\xff","byte_size":4}'),
        ("/v2/repository/index", b'{"\xff":true}'),
    ],
)
def test_a_json_string_that_is_not_utf8_is_400(worker, path, body):
    answer = request(worker, "POST", path, body)
    assert answer.status == 400, answer.body
    assert "'utf-8' codec can't decode byte 0xff" in answer.error


@pytest.mark.parametrize("value", ["-1", "x", "999999", "\u00b2", "108\u00b9", "9" * 5000])
def test_bad_inference_header_length(worker, value):
    body = json.dumps({"inputs": [tensor(**X, binary=1024)]}).encode() + ONE_ROW
    answer = request(
        worker,
        "POST",
        "/v2/models/classifier/infer",
        body,
        {"Inference-Header-Content-Length": value},
    )
    assert answer.status == 400  # (5000 digits: a ValueError from int(), a 500)
    shown = value if len(value) <= 40 else value[:40] + "..."
    assert f"invalid Inference-Header-Content-Length '{shown}'" in answer.error


# -- exceptions in handlers ------------------------------------------------------------------------


def test_hook_exception_is_500_with_its_message(client):
    before = fails(client, "slow")
    with raises_http(
        500,
        "model 'slow': preprocess hook 'hold' failed: ValueError: "
        "boom: asked to hold for -1 seconds",
    ):
        client.infer("slow", [http_input("x", np.full((1, 4), -1, np.float32))])
    assert fails(client, "slow") == before + 1
    y = client.infer("slow", [http_input("x", np.zeros((1, 4), np.float32))]).as_numpy("y")
    assert y.tolist() == [[0.0] * 4]


def test_unexpected_exception_in_a_handler_is_500(worker, client):
    def broken(name=None):
        raise KeyError("registry exploded")

    worker.shm.status = broken
    try:
        with raises_http(500, "KeyError: 'registry exploded'"):
            client.get_system_shared_memory_status()
    finally:
        del worker.shm.status
    assert client.get_system_shared_memory_status() == []


# -- deadlines ---------------------------------------------------------------------------------


def test_timeout_parameter_is_enforced_by_the_server(client):
    before = fails(client, "slow")
    with raises_http(504, "model 'slow': the request's deadline has already passed"):
        client.infer("slow", [http_input("x", np.full((1, 4), 0.5, np.float32))], timeout=100_000)
    assert fails(client, "slow") == before + 1


def test_timeout_parameter_expires_a_queued_request(worker, client):
    with held_device(worker):
        dispatched = sched_stats(worker, "classifier").dispatches
        done = in_background(worker, "classifier", x_rows(1))
        wait_until(lambda: sched_stats(worker, "classifier").dispatches == dispatched + 1)
        with raises_http(504, "model 'classifier': deadline exceeded after", "in the queue"):
            client.infer("classifier", [http_input("x", x_rows(1))], timeout=200_000)
        assert done.empty()  # answered while the device is still held
    assert done.get(timeout=60).shape == (1, 10)


def test_a_client_that_disconnects_withdraws_its_queued_request(worker, client):
    """The twin of a gRPC call whose deadline or reset cancels it: the request leaves the
    scheduler's queue and never runs, and is counted as a failure (CANCELLED)."""
    body = json.dumps({"inputs": [tensor(**X, binary=1024)]}).encode()
    head = (
        f"POST /v2/models/classifier/infer HTTP/1.1\r\nHost: x\r\n"
        f"Inference-Header-Content-Length: {len(body)}\r\n"
        f"Content-Length: {len(body) + 1024}\r\n\r\n"
    ).encode()
    failed = client.get_inference_statistics("classifier")["model_stats"][0]
    failed = failed["inference_stats"]["fail"]["count"]
    with held_device(worker):
        before = sched_stats(worker, "classifier").dispatches
        first = in_background(worker, "classifier", x_rows(1))
        wait_until(lambda: sched_stats(worker, "classifier").dispatches == before + 1)
        with socket.create_connection(("127.0.0.1", worker.http_port)) as sock:
            sock.sendall(head + body + ONE_ROW)
            wait_until(lambda: sched_stats(worker, "classifier").queue_depth == 1)
        wait_until(lambda: sched_stats(worker, "classifier").queue_depth == 0)
    assert first.get(timeout=60).shape == (1, 10)
    assert sched_stats(worker, "classifier").dispatches == before + 1  # withdrawn: never ran
    stats = client.get_inference_statistics("classifier")["model_stats"][0]
    assert stats["inference_stats"]["fail"]["count"] == failed + 1


# -- limits ------------------------------------------------------------------------------------


def test_in_flight_cap_is_shared_with_grpc(repo, cache_dir):
    config = with_http(worker_config(repo, cache_dir, ENDPOINTS_MAX_CONCURRENT_REQUESTS=1))
    with running(config) as w:
        client = http_connect(w)
        active = hook_globals(w, "slow")["ACTIVE"]
        slow = in_background(w, "slow", np.full((1, 4), 2.5, np.float32))
        wait_until(lambda: active[0] == 1 and w.admission.inflight == 1)
        with raises_http(
            429,
            "server is at its in-flight limit of 1 requests (endpoints.max_concurrent_requests)",
        ):
            client.infer("classifier", [http_input("x", x_rows(1))])
        assert request(w, "GET", "/v2/health/live").status == 200  # a probe: never refused
        assert request(w, "GET", "/v2/health/ready").status == 200
        assert request(w, "GET", "/v2/models/classifier/ready").status == 429  # the rest do
        assert slow.get(timeout=60).shape == (1, 4)
        wait_until(lambda: w.admission.inflight == 0)
        assert client.infer("classifier", [http_input("x", x_rows(1))]).as_numpy(
            "logits"
        ).shape == (1, 10)


def test_queue_full(repo, cache_dir):
    config = with_http(worker_config(repo, cache_dir, SCHEDULER_MAX_QUEUE_DEPTH=1))
    with running(config) as w:
        client = http_connect(w)
        with held_device(w) as gate:
            first = in_background(w, "classifier", x_rows(1))
            wait_until(lambda: sched_stats(w, "classifier").dispatches == 1)
            second = in_background(w, "classifier", x_rows(2))
            wait_until(lambda: sched_stats(w, "classifier").queue_depth == 1)
            with raises_http(
                429, "model 'classifier': queue is full (1 requests queued, max_queue_depth 1)"
            ):
                client.infer("classifier", [http_input("x", x_rows(3))])
            gate.set()
            assert first.get(timeout=60).shape == (1, 10)
            assert second.get(timeout=60).shape == (2, 10)


@pytest.fixture(scope="module")
def small(repo, cache_dir):
    """A worker whose request bodies may not exceed 2 MiB."""
    config = with_http(worker_config(repo, cache_dir, ENDPOINTS_MAX_MESSAGE_BYTES=2 * MIB))
    with running(config) as w:
        yield w


def test_oversized_body_is_413_before_it_is_read(small):
    """A Content-Length above the limit is refused at once, before a byte of the body
    arrives; the server keeps serving."""
    head = (
        "POST /v2/models/classifier/infer HTTP/1.1\r\nHost: x\r\n"
        f"Content-Length: {64 * MIB}\r\n\r\n"
    ).encode()
    reply = raw_exchange(small, head)  # no body sent at all
    assert reply.startswith(b"HTTP/1.1 413 "), reply[:200]
    assert b"request body of 67108864 bytes is larger than the maximum 2097152" in reply
    client = http_connect(small)
    big = [http_input("x", np.ones((3072, 256), np.float32))]  # 3 MiB
    with raises_http(413, f"larger than the maximum {2 * MIB} (endpoints.max_message_bytes)"):
        client.infer("classifier", big)
    assert client.infer("classifier", [http_input("x", x_rows(8))]).as_numpy("logits").shape == (
        8,
        10,
    )
    # compressed below the limit, inflating above it
    with raises_http(413, "(decompressed)", "larger than the maximum"):
        client.infer("classifier", big, request_compression_algorithm="gzip")


def test_oversized_chunked_body_is_413(small):
    chunk = bytes(MIB)
    head = b"POST /v2/models/classifier/infer HTTP/1.1\r\nHost: x\r\n"
    head += b"Transfer-Encoding: chunked\r\n\r\n"
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(3)) + b"0\r\n\r\n"
    reply = raw_exchange(small, head + body)
    assert reply.startswith(b"HTTP/1.1 413 "), reply[:200]
    assert b"request body of more than 2097152 bytes" in reply


def test_body_that_does_not_arrive_in_time_is_408(repo, cache_dir):
    config = with_http(worker_config(repo, cache_dir, ENDPOINTS_RECEIVE_TIMEOUT_SECONDS=0.5))
    with running(config) as w:
        head = (
            b"POST /v2/models/classifier/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
        )
        reply = raw_exchange(w, head + b"{", timeout=10)
        assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
        assert b"did not arrive in full within 0.5 s" in reply


def test_an_inference_longer_than_the_idle_timeout_is_answered(repo, cache_dir):
    """Idle and receive timeouts of 1 s do not cut off a request that takes 2 s to
    answer: the connection is busy, not idle."""
    config = with_http(
        worker_config(
            repo,
            cache_dir,
            ENDPOINTS_RECEIVE_TIMEOUT_SECONDS=1,
            ENDPOINTS_IDLE_CONNECTION_SECONDS=1,
        )
    )
    with running(config) as w:
        x = np.array([[2.0, 1.0, 0.0, 0.0]], np.float32)  # the hook sleeps x[0, 0] s
        client = http_connect(w, network_timeout=60)
        y = client.infer("slow", [http_input("x", x)]).as_numpy("y")
        np.testing.assert_array_equal(y, 2 * x)
        client.close()


def test_unsupported_and_corrupt_compression(worker, client):
    body = json.dumps({"inputs": [tensor(**X, data=[0.0] * 256)]}).encode()
    path = "/v2/models/classifier/infer"
    answer = request(worker, "POST", path, body, {"Content-Encoding": "br"})
    assert answer.status == 415
    assert "request body encoded with 'br'; rsrv accepts gzip and deflate" in answer.error
    answer = request(worker, "POST", path, gzip.compress(body)[:-12], {"Content-Encoding": "gzip"})
    assert answer.status == 400
    assert answer.error.startswith("cannot decompress the gzip request body")
    for encoding, packed in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))):
        answer = request(worker, "POST", path, packed, {"Content-Encoding": encoding})
        assert answer.status == 200, answer.body
        answer = request(worker, "POST", path, packed + b"GARBAGE", {"Content-Encoding": encoding})
        assert answer.status == 400
        assert answer.error == f"the {encoding} request body has 7 bytes after its compressed data"
    # gzip members one after another are one body (RFC 1952)
    half = len(body) // 2
    members = gzip.compress(body[:half]) + gzip.compress(body[half:])
    answer = request(worker, "POST", path, members, {"Content-Encoding": "gzip"})
    assert answer.status == 200, answer.body
    # up to 1000 of them (each took a copy of the body's rest: 320,000 empty ones, 77 s)
    pieces = [body[i : i + 100] for i in range(0, len(body), 100)]
    members = b"".join(map(gzip.compress, pieces)) + gzip.compress(b"") * (1000 - len(pieces))
    answer = request(worker, "POST", path, members, {"Content-Encoding": "gzip"})
    assert answer.status == 200, answer.body
    answer = request(
        worker, "POST", path, members + gzip.compress(b""), {"Content-Encoding": "gzip"}
    )
    assert (answer.status, answer.error) == (
        400,
        "the gzip request body has more than 1000 members",
    )
    assert client.is_server_live()


# -- shared memory in requests ------------------------------------------------------------------


def test_unregistered_region_in_a_request(worker):
    in_shm = tensor(
        "INPUT0", "INT32", [1, 16], shared_memory_region="nope", shared_memory_byte_size=64
    )
    body = {"inputs": [in_shm, tensor("INPUT1", "INT32", [1, 16], data=S16)]}
    answer = infer_raw(worker, body, model="simple")
    assert answer.status == 404
    assert answer.error == (
        "Unable to find shared memory region: 'nope' (input tensor 'INPUT0' for model 'simple')"
    )


def test_a_connection_beyond_the_cap_closes_the_oldest_waiting_one(repo, cache_dir):
    """Clients that open connections and never finish their headers hold at most
    ``endpoints.max_connections`` of them (each held a descriptor, with no cap, until the
    process had none left). One more connection closes the oldest that waits for a
    request, so stalled connections never lock a client out; when every connection is
    answering a request, one more is refused."""
    config = with_http(worker_config(repo, cache_dir, ENDPOINTS_MAX_CONNECTIONS=3))
    live = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
    with running(config) as w:
        stalled = []
        for _ in range(3):
            sock = socket.create_connection(("127.0.0.1", w.http_port), timeout=10)
            sock.sendall(b"POST /v2/models/classifier/infer HTTP/1.1\r\nHost: x\r\n")
            stalled.append(sock)
        try:
            assert raw_exchange(w, live).startswith(b"HTTP/1.1 200 ")  # served
            assert received(stalled[0]) == b""  # the oldest, closed to make room
        finally:
            for sock in stalled:
                sock.close()
        with held_device(w) as gate:  # three connections, each answering a request
            busy = [in_background(w, "classifier", x_rows(1)) for _ in range(3)]
            wait_until(lambda: w.admission.inflight == 3, 20, "three requests under way")
            try:
                assert received_after(w, live) == b""  # refused
            finally:
                gate.set()
            for done in busy:
                assert done.get(timeout=30).shape == (1, 10)


def received(sock: socket.socket) -> bytes:
    """What the server sends before it closes ``sock`` (b"" when it closes it at once,
    or resets it with the request unread)."""
    try:
        return sock.recv(100)
    except ConnectionResetError:
        return b""


def received_after(worker, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", worker.http_port), timeout=10) as sock:
        sock.sendall(request)
        return received(sock)


# -- probes, floods and clients that misbehave -----------------------------------------------


def test_an_answer_being_compressed_holds_its_slot_so_a_shutdown_waits_for_it(worker, monkeypatch):
    """(Compressed once out of its in-flight slot, a large gzip answer was lost at a
    graceful shutdown, which waits only for the calls in flight: the client got 0 bytes.)"""
    started, release = threading.Event(), threading.Event()
    real = rest_module._compress

    def compress(body, encoding):
        started.set()
        assert release.wait(30)
        return real(body, encoding)

    monkeypatch.setattr(rest_module, "_compress", compress)
    monkeypatch.setattr(rest_module, "COMPRESS_ON_LOOP", 0)  # (in a thread: the loop goes on)
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 256], "data": [0.5] * 256}]}
    answers = queue.Queue()
    path = "/v2/models/classifier/infer"
    headers = {"Accept-Encoding": "gzip"}
    asking = threading.Thread(
        target=lambda: answers.put(request(worker, "POST", path, body, headers))
    )
    asking.start()
    try:
        assert started.wait(30)
        assert worker.admission.inflight == 1
    finally:
        release.set()
        asking.join(30)
    answer = answers.get(timeout=1)
    assert answer.status == 200 and answer.headers["content-encoding"] == "gzip"
    assert json.loads(gzip.decompress(answer.body))["outputs"][0]["shape"] == [1, 10]
    wait_until(lambda: worker.admission.inflight == 0)


def test_the_probes_answer_while_the_worker_drains(worker):
    """/v2/health/live and /ready answer from the stop signal on (a Kubernetes probe
    must not fail as a refusal): live true, ready false; other requests are 503."""
    worker.admission.close()  # (what the stop signal does first)
    try:
        assert request(worker, "GET", "/v2/health/live").status == 200
        ready = request(worker, "GET", "/v2/health/ready")
        assert ready.status == 400 and json.loads(ready.body) == {"ready": False}
        assert request(worker, "GET", "/v2/models/classifier/ready").status == 503
    finally:
        worker.admission.closed = False


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v2/models/classifier/infer", b'{"inputs": [], "x": ' + b"[" * 3000 + b"]" * 3000 + b"}"),
        (
            "/v2/models/classifier/infer",
            json.dumps(
                {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 256], "data": 0}]}
            )
            .replace("0}", "[" * 3000 + "0" + "]" * 3000 + "}")
            .encode(),
        ),
        ("/v2/repository/index", b'{"ready": ' + b"[" * 3000 + b"]" * 3000 + b"}"),
    ],
    ids=["an unknown field", "data", "another endpoint"],
)
def test_json_nested_too_deeply_is_400(worker, client, path, body):
    """It was 500, "RecursionError: maximum recursion depth exceeded" (and INTERNAL)."""
    answer = request(worker, "POST", path, body)
    assert answer.status == 400, answer.body
    assert "nested too deeply" in answer.error or "'data' of datatype FP32" in answer.error
    assert client.is_server_live()


def test_an_inference_request_that_cannot_be_parsed_counts_as_the_models_failure(worker, client):
    """As a ModelInfer that fails INVALID_ARGUMENT does: JSON that does not parse, a
    malformed Inference-Header-Content-Length (they were answered 400, counted nowhere)."""
    before = fails(client, "classifier")
    assert request(worker, "POST", "/v2/models/classifier/infer", b"{nope").status == 400
    answer = request(
        worker,
        "POST",
        "/v2/models/classifier/infer",
        b"{}",
        {"Inference-Header-Content-Length": "x"},
    )
    assert answer.status == 400
    assert fails(client, "classifier") == before + 2


@pytest.mark.parametrize(
    ("path", "owner", "parse"),
    [
        ("/v2/models/classifier/infer", rest_module, "parse_rest_request"),
        ("/v2/repository/index", msgspec.json, "decode"),  # (every other route's parse)
    ],
)
def test_a_large_json_body_is_parsed_off_the_event_loop(worker, monkeypatch, path, owner, parse):
    """12M request parameters (157 MB) were parsed on the loop: every call of the
    worker, health probes included, waited 7 s. A small body is parsed in place."""
    real, on_loop = getattr(owner, parse), []

    def spy(*args, **kwargs):
        on_loop.append(trio.lowlevel.in_trio_run())
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, parse, spy)
    members = ", ".join(f'"k{i}": 1' for i in range(100_000))  # (1.2 MB)
    for body in ("{}", "{" + members + "}"):
        request(worker, "POST", path, body.encode())
    assert on_loop == [True, False]


@pytest.mark.parametrize("path", ["/v2/nosuch", "/v2/health/live"])
def test_a_post_refused_before_its_body_is_read_is_answered_not_reset(worker, path):
    """A 32 MiB POST to an unknown path (404) or one that takes GET (405): the body is
    read and dropped, so that the client, still sending it, reads the answer (it got a
    broken pipe)."""
    conn = http.client.HTTPConnection("127.0.0.1", worker.http_port, timeout=30)
    try:
        conn.request("POST", path, body=bytes(32 << 20), headers={"Content-Type": "a/b"})
        answer = conn.getresponse()
        assert answer.status in (404, 405)
        assert "error" in json.loads(answer.read())
    finally:
        conn.close()


def test_a_client_that_reads_none_of_its_answer_is_closed_after_the_receive_timeout(
    tmp_path, cache_dir
):
    """Its 16 MiB answer makes no progress: the connection is closed after
    ``receive_timeout_seconds``, freeing its place under ``max_connections`` (it held
    it, and a graceful stop, for as long as the client lived)."""
    from rsrv.export import Input, export_jax

    export_jax(
        lambda p, x: x,
        {},
        inputs=[Input("x", np.float32, ("n", 1 << 22))],
        outputs=["y"],
        batch_sizes=[1],
        out_dir=tmp_path / "repo" / "echo",
        parity=False,
    )
    config = with_http(
        worker_config(
            tmp_path / "repo",
            cache_dir,
            ENDPOINTS_MAX_CONNECTIONS=1,
            ENDPOINTS_RECEIVE_TIMEOUT_SECONDS=1,
        )
    )
    body = {
        "inputs": [tensor("x", "FP32", [1, 1 << 22], binary=16 << 20)],
        "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
    }
    header = json.dumps(body).encode()
    head = (
        f"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nContent-Type: a/b\r\n"
        f"Inference-Header-Content-Length: {len(header)}\r\n"
        f"Content-Length: {len(header) + (16 << 20)}\r\n\r\n"
    ).encode()
    live = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
    with running(config) as w:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", w.http_port))
            sock.sendall(head + header + bytes(16 << 20))
            time.sleep(0.5)
            assert received_after(w, live) == b""  # the one connection is answering
            end = time.monotonic() + 10
            while not received_after(w, live).startswith(b"HTTP/1.1 200 "):
                assert time.monotonic() < end, "the non-reading connection was never closed"
                time.sleep(0.2)
