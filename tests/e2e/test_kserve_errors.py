"""Bad input and limits, against a real worker on 127.0.0.1: every case answers a precise
gRPC status and a message naming the tensor (or region, or limit), and the server keeps
serving. Requests that tritonclient would refuse to send are built as raw protobuf and
sent through its stub. (Shared-memory cases: test_shm_e2e.py.)
"""

from __future__ import annotations

import gzip
import queue

import grpc
import jax.numpy as jnp
import numpy as np
import pytest
import trio
import tritonclient.grpc as grpcclient
from purerpc.grpclib.exceptions import RpcFailedError
from support.bundles import make_repo
from support.clients import (
    connect,
    infer_input,
    raises_status,
    raw_channel,
    rpc_status,
    stats_of,
)
from support.rawh2 import RawH2, message
from support.serving import held_device, hook_globals, running, sched_stats, worker_config
from support.waiting import wait_until
from tritonclient.grpc import service_pb2

from rsrv.protocol.generated.inference import grpc_service_pb2 as pb

MIB = 1 << 20


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return make_repo(
        tmp_path_factory.mktemp("errors") / "repo",
        "classifier",
        "simple",
        "simple_string",
        "slow",
        "broken",
    )


def x_rows(rows: int) -> np.ndarray:
    return np.random.default_rng(rows).standard_normal((rows, 256)).astype(np.float32)


def slow_input(seconds: float, rows: int = 1) -> list[grpcclient.InferInput]:
    return [infer_input("x", np.full((rows, 4), seconds, np.float32))]


def raw_error(triton, request) -> tuple[str, str]:
    """Send a raw ModelInferRequest through tritonclient's stub; (status name, message)."""
    with pytest.raises(grpc.RpcError) as info:
        triton._client_stub.ModelInfer(request)
    return info.value.code().name, info.value.details()


def request_for(model: str = "classifier", **tensors) -> service_pb2.ModelInferRequest:
    """A raw request; each tensor is (datatype, shape, raw bytes or None)."""
    request = service_pb2.ModelInferRequest(model_name=model)
    for name, (datatype, shape, data) in tensors.items():
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        if data is not None:
            request.raw_input_contents.append(data)
    return request


# -- models --------------------------------------------------------------------------------------


def test_unknown_model(triton):
    with raises_status("NOT_FOUND", "Request for unknown model: 'no_such_model'"):
        triton.infer("no_such_model", [infer_input("x", x_rows(1))])


def test_unavailable_model(triton):
    with raises_status(
        "UNAVAILABLE", "model 'broken' is unavailable", "format_version: unsupported version '9.9'"
    ):
        triton.infer("broken", [infer_input("x", x_rows(1))])


def test_empty_model_name(triton):
    assert raw_error(triton, request_for("", x=("FP32", [1, 256], x_rows(1).tobytes()))) == (
        "INVALID_ARGUMENT",
        "model_name is empty",
    )


# -- inputs through tritonclient -----------------------------------------------------------------


def test_missing_input(triton):
    with raises_status(
        "INVALID_ARGUMENT",
        "model 'simple' expects input tensor(s) 'INPUT1', missing from the request",
    ):
        triton.infer("simple", [infer_input("INPUT0", np.zeros((1, 16), np.int32))])


@pytest.mark.parametrize("model", ["simple", "simple_string"])
def test_inputs_that_disagree_on_rows(triton, model):
    """A request has one row count. A model with a preprocess (simple_string) ran it and
    blamed it: INTERNAL "preprocess made executable inputs of [1, 2] rows"."""
    dtype = np.int32 if model == "simple" else np.object_
    a, b = np.ones((1, 16), dtype), np.ones((2, 16), dtype)
    if model == "simple_string":
        a, b = a.astype(bytes).astype(object), b.astype(bytes).astype(object)
    with raises_status(
        "INVALID_ARGUMENT",
        f"input 'INPUT1' batch size does not match other inputs for '{model}' "
        "(2 rows along its batch axis; 'INPUT0' has 1)",
    ):
        triton.infer(model, [infer_input("INPUT0", a), infer_input("INPUT1", b)])


def test_undeclared_input(triton):
    with raises_status(
        "INVALID_ARGUMENT",
        "unexpected input tensor 'extra' for model 'classifier': the model's inputs are ['x']",
    ):
        triton.infer(
            "classifier",
            [infer_input("x", x_rows(1)), infer_input("extra", np.zeros(3, np.float32))],
        )


def test_dtype_mismatch(triton):
    with raises_status(
        "INVALID_ARGUMENT",
        "input tensor 'x' for model 'classifier': got datatype FP16, expected FP32",
    ):
        triton.infer("classifier", [infer_input("x", x_rows(1).astype(np.float16))])


def test_rank_mismatch(triton):
    with raises_status(
        "INVALID_ARGUMENT",
        "input tensor 'x' for model 'classifier': rank 1 "
        "(shape [256]) does not match the model's rank 2",
    ):
        triton.infer("classifier", [infer_input("x", x_rows(1)[0])])


def test_fixed_axis_mismatch(triton):
    with raises_status(
        "INVALID_ARGUMENT",
        "input tensor 'x' for model 'classifier': axis 1 has extent 255 but the model expects 256",
    ):
        triton.infer("classifier", [infer_input("x", x_rows(2)[:, :255].copy())])


def test_more_rows_than_the_largest_batch(triton):
    with raises_status(
        "INVALID_ARGUMENT",
        "model 'classifier': a request of 9 rows exceeds the largest compiled batch size 8",
    ):
        triton.infer("classifier", [infer_input("x", x_rows(9))])


def test_too_many_rows_are_refused_before_their_data_is_read(triton):
    """From the header alone: its shared-memory region is never looked at (a client
    could name gigabytes there; Triton refuses from the batch size too)."""
    x = grpcclient.InferInput("x", [100_000, 256], "FP32")
    x.set_shared_memory("unregistered", 100_000 * 256 * 4)
    with raises_status("INVALID_ARGUMENT", "a request of 100000 rows exceeds the largest"):
        triton.infer("classifier", [x])


def test_unknown_requested_output(triton):
    with raises_status(
        "INVALID_ARGUMENT",
        "unexpected inference output tensor 'nope' for "
        "model 'classifier': the model's outputs are ['logits']",
    ):
        triton.infer(
            "classifier",
            [infer_input("x", x_rows(1))],
            outputs=[grpcclient.InferRequestedOutput("nope")],
        )


def test_repeated_requested_output(triton):
    with raises_status(
        "INVALID_ARGUMENT",
        "output tensor 'logits' for model 'classifier' is requested more than once",
    ):
        triton.infer(
            "classifier",
            [infer_input("x", x_rows(1))],
            outputs=[grpcclient.InferRequestedOutput("logits")] * 2,
        )


# -- inputs as raw protobuf ------------------------------------------------------------------------

ONE_ROW = x_rows(1).tobytes()


def _both_set():
    request = request_for(
        "simple", INPUT0=("INT32", [1, 16], bytes(64)), INPUT1=("INT32", [1, 16], bytes(64))
    )
    request.inputs[0].contents.int_contents.extend(range(16))
    return request


def _typed(field: str, count: int, model="simple"):
    request = service_pb2.ModelInferRequest(model_name=model)
    for name in ("INPUT0", "INPUT1"):
        tensor = request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        getattr(tensor.contents, field).extend([1] * count)
    return request


def _x_entries(inputs: int, raw: int):
    """A classifier request declaring ``inputs`` tensors named x with ``raw`` raw entries."""
    x = service_pb2.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=[1, 256])
    return service_pb2.ModelInferRequest(
        model_name="classifier", inputs=[x] * inputs, raw_input_contents=[ONE_ROW] * raw
    )


def _with_param(key: str, **value):
    request = request_for(x=("FP32", [1, 256], ONE_ROW))
    for kind, v in value.items():
        setattr(request.parameters[key], kind, v)
    return request


RAW_CASES = {
    "raw byte length": (
        request_for(x=("FP32", [1, 256], bytes(1000))),
        "input tensor 'x' for model 'classifier': its raw_input_contents entry holds 1000 bytes "
        "but shape [1, 256] of FP32 needs 256 x 4 = 1024",
    ),
    "negative dims": (
        request_for(x=("FP32", [-2, 256], ONE_ROW)),
        "input tensor 'x' for model 'classifier': negative dimension -2 on axis 0",
    ),
    "zero rows": (
        request_for(x=("FP32", [0, 256], b"")),
        "input tensor 'x' for model 'classifier': the batch axis (axis 0) has 0 rows",
    ),
    "element-count overflow": (
        request_for(x=("FP32", [2**40, 256], ONE_ROW)),
        "input tensor 'x' for model 'classifier': shape [1099511627776, 256] has "
        "281474976710656 elements (1125899906842624 bytes), above the limit of 2147483647 "
        "bytes per tensor",
    ),
    "raw and typed contents both set": (
        _both_set(),
        "contents field must not be specified when using raw_input_contents for 'INPUT0' for "
        "model 'simple' (typed 'contents' and 'raw_input_contents' are both set",
    ),
    "typed contents in the wrong field": (
        _typed("fp32_contents", 16),
        "input tensor 'INPUT0' for model 'simple': typed contents for datatype INT32 belong in "
        "contents.int_contents, got fp32_contents",
    ),
    "typed element count": (
        _typed("int_contents", 15),
        "input tensor 'INPUT0' for model 'simple': contents.int_contents has 15 elements but "
        "shape [1, 16] needs 16",
    ),
    "no data": (
        request_for(x=("FP32", [1, 256], None)),
        "input tensor 'x' for model 'classifier': no data for 256 elements",
    ),
    "raw entry count": (
        _x_entries(inputs=1, raw=2),
        "request for model 'classifier' has 2 raw_input_contents entries but 1 inputs not in "
        "shared memory",
    ),
    "duplicate input": (
        _x_entries(inputs=2, raw=2),
        "input tensor 'x' for model 'classifier' appears more than once in the request",
    ),
    "BYTES length prefix past the end": (
        request_for(
            "simple_string",
            INPUT0=("BYTES", [1, 16], b"\xe8\x03\x00\x00" + bytes(64)),
            INPUT1=("BYTES", [1, 16], b"\x01\x00\x00\x001" * 16),
        ),
        "input tensor 'INPUT0' for model 'simple_string': BYTES element 0 claims 1000 bytes at "
        "offset 4, past the end of the 68-byte buffer",
    ),
    "timeout of the wrong type": (
        _with_param("timeout", string_param="soon"),
        "invalid value type for 'timeout' parameter for the request, expected int64_param",
    ),
    "negative timeout": (
        _with_param("timeout", int64_param=-5),
        "invalid value -5 for 'timeout' parameter",
    ),
    "priority of the wrong type": (
        _with_param("priority", string_param="high"),
        "invalid value type for 'priority' parameter, expected uint64_param or int64_param",
    ),
}


@pytest.mark.parametrize("case", sorted(RAW_CASES))
def test_bad_raw_request(triton, case):
    request, message = RAW_CASES[case]
    code, details = raw_error(triton, request)
    assert code == "INVALID_ARGUMENT", details
    assert message in details
    assert triton.is_server_live()


def test_undecodable_protobuf(worker):
    """Bytes that are not a ModelInferRequest: INVALID_ARGUMENT (purerpc alone would answer
    CANCELLED with a Python traceback)."""
    with grpc.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as info:
            call(b"\x0a\xff\xff\xff\xff\x0f", timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "cannot parse the request as inference.ModelInferRequest" in info.value.details()
        unknown = channel.unary_unary("/inference.GRPCInferenceService/NoSuchMethod")
        with pytest.raises(grpc.RpcError) as info:
            unknown(b"", timeout=30)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


# -- exceptions in handlers ------------------------------------------------------------------------


def test_hook_exception_is_internal_with_its_message(triton):
    before = stats_of(triton, "slow").inference_stats.fail.count
    with raises_status(
        "INTERNAL",
        "model 'slow': preprocess hook 'hold' failed: ValueError: "
        "boom: asked to hold for -1 seconds",
    ):
        triton.infer("slow", slow_input(-1))
    assert stats_of(triton, "slow").inference_stats.fail.count == before + 1
    assert triton.infer("slow", slow_input(0)).as_numpy("y").tolist() == [[0.0] * 4]

    words = np.array([[b"seven"] * 16], dtype=object)
    with raises_status(
        "INTERNAL",
        "model 'simple_string': preprocess hook 'parse' failed: "
        "ValueError: invalid literal for int()",
    ):
        triton.infer(
            "simple_string",
            [infer_input("INPUT0", words, "BYTES"), infer_input("INPUT1", words, "BYTES")],
        )


def test_unexpected_exception_in_a_handler_is_internal_not_cancelled(worker, triton):
    def broken(name=None):
        raise KeyError("registry exploded")

    worker.shm.status = broken
    try:
        with raises_status("INTERNAL", "KeyError: 'registry exploded'"):
            triton.get_system_shared_memory_status()
    finally:
        del worker.shm.status
    assert len(triton.get_system_shared_memory_status().regions) == 0


# -- deadlines ---------------------------------------------------------------------------------


def test_timeout_parameter_is_enforced_by_the_server(triton):
    """infer(timeout=µs) is a request parameter, not a client deadline: the server alone
    decides. The hook holds the request past it; it then fails before reaching the queue."""
    before = stats_of(triton, "slow").inference_stats.fail.count
    with raises_status(
        "DEADLINE_EXCEEDED", "model 'slow': the request's deadline has already passed"
    ):
        triton.infer("slow", slow_input(0.5), timeout=100_000)
    assert stats_of(triton, "slow").inference_stats.fail.count == before + 1


def test_timeout_parameter_expires_a_queued_request(worker, triton):
    done: queue.Queue = queue.Queue()
    with held_device(worker):
        dispatched = sched_stats(worker, "classifier").dispatches
        triton.async_infer(
            "classifier", [infer_input("x", x_rows(1))], lambda result, error: done.put(error)
        )
        wait_until(lambda: sched_stats(worker, "classifier").dispatches == dispatched + 1)
        with raises_status(
            "DEADLINE_EXCEEDED", "model 'classifier': deadline exceeded after", "in the queue"
        ):
            triton.infer("classifier", [infer_input("x", x_rows(1))], timeout=200_000)
        # answered while the device is still held: the first request has not finished
        assert done.empty()
        assert sched_stats(worker, "classifier").dispatches == dispatched + 1
    assert done.get(timeout=60) is None


async def test_grpc_timeout_is_enforced_by_the_server(worker, triton):
    """purerpc sends grpc-timeout but never enforces it: the status comes from the server."""
    request = pb.ModelInferRequest(model_name="slow")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    request.raw_input_contents.append(np.full((1, 4), 1.0, np.float32).tobytes())
    before = stats_of(triton, "slow").inference_stats.fail.count
    async with raw_channel(worker) as channel:
        with pytest.raises(RpcFailedError) as info:
            await channel.unary("ModelInfer", request, pb.ModelInferResponse, timeout=0.3)
        code, message = rpc_status(info.value)
        # the hook returns after the deadline: the scheduler refuses the request
        assert (code, message) == (
            "DEADLINE_EXCEEDED",
            "model 'slow': the request's deadline has already passed",
        )
        # the connection carries on
        ok = await channel.unary("ServerLive", pb.ServerLiveRequest(), pb.ServerLiveResponse)
        assert ok.live
    assert stats_of(triton, "slow").inference_stats.fail.count == before + 1


async def test_grpc_timeout_withdraws_a_queued_request(worker, triton):
    """With the device held by an earlier request, the call queues; it ends at its
    deadline, long before the device frees, and never runs."""
    request = pb.ModelInferRequest(model_name="classifier")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 256])
    request.raw_input_contents.append(x_rows(1).tobytes())

    def dispatches() -> int:
        return sched_stats(worker, "classifier").dispatches

    done: queue.Queue = queue.Queue()
    with held_device(worker):
        before = await trio.to_thread.run_sync(dispatches)
        triton.async_infer(
            "classifier", [infer_input("x", x_rows(1))], lambda result, error: done.put(error)
        )
        await trio.to_thread.run_sync(lambda: wait_until(lambda: dispatches() == before + 1))
        async with raw_channel(worker) as channel:
            with pytest.raises(RpcFailedError) as info:
                await channel.unary("ModelInfer", request, pb.ModelInferResponse, timeout=0.3)
            assert rpc_status(info.value) == (
                "DEADLINE_EXCEEDED",
                "deadline (grpc-timeout) expired before the call finished",
            )
            assert done.empty()  # ended while the device was still held
        await trio.to_thread.run_sync(
            lambda: wait_until(lambda: sched_stats(worker, "classifier").queue_depth == 0)
        )
    assert await trio.to_thread.run_sync(lambda: done.get(timeout=60)) is None
    assert await trio.to_thread.run_sync(dispatches) == before + 1  # withdrawn: never ran


async def test_grpc_timeout_ends_a_stream(worker):
    request = pb.ModelInferRequest(model_name="classifier", id="queued")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 256])
    request.raw_input_contents.append(x_rows(1).tobytes())
    with held_device(worker):
        async with raw_channel(worker) as channel:
            with pytest.raises(RpcFailedError) as info:
                await channel.stream(
                    "ModelStreamInfer", [request], pb.ModelStreamInferResponse, timeout=0.3
                )
    assert rpc_status(info.value) == (
        "DEADLINE_EXCEEDED",
        "deadline (grpc-timeout) expired before the stream ended",
    )


async def test_a_stream_message_that_cannot_be_parsed_is_answered_on_the_stream(worker):
    """(It ended the stream INVALID_ARGUMENT, cancelling the requests running beside it
    and dropping those after it.) As any failed request: its error_message, and the
    stream goes on."""

    class Garbage:  # (a message whose bytes are no ModelInferRequest)
        DESCRIPTOR = pb.ModelInferRequest.DESCRIPTOR

        def SerializeToString(self) -> bytes:
            return b"\xff\xff\xff"

    requests = []
    for i in range(4):
        request = pb.ModelInferRequest(model_name="classifier", id=f"r{i}")
        request.inputs.add(name="x", datatype="FP32", shape=[1, 256])
        request.raw_input_contents.append(x_rows(1).tobytes())
        requests.append(request)
    async with raw_channel(worker) as channel:
        answers = await channel.stream(
            "ModelStreamInfer",
            [*requests[:2], Garbage(), *requests[2:]],
            pb.ModelStreamInferResponse,
            keep_open=False,
        )
    assert sorted(a.infer_response.id for a in answers if not a.error_message) == [
        "r0",
        "r1",
        "r2",
        "r3",
    ]
    (failed,) = [a for a in answers if a.error_message]
    assert failed.error_message.startswith(
        "cannot parse the request as inference.ModelInferRequest"
    )


def test_client_timeout_is_also_counted_by_the_server(triton):
    """tritonclient's client_timeout gives up on the client side too; the server still
    enforces the same deadline and counts the failure."""
    before = stats_of(triton, "slow").inference_stats.fail.count
    with raises_status("DEADLINE_EXCEEDED"):
        triton.infer("slow", slow_input(1.0), client_timeout=0.3)
    wait_until(
        lambda: stats_of(triton, "slow").inference_stats.fail.count == before + 1,
        what="the server to count the expired call",
    )


# -- limits ------------------------------------------------------------------------------------


def test_in_flight_cap(repo, cache_dir):
    config = worker_config(repo, cache_dir, ENDPOINTS_MAX_CONCURRENT_REQUESTS=1)
    with running(config) as w, connect(w) as triton:
        active = hook_globals(w, "slow")["ACTIVE"]
        done: queue.Queue = queue.Queue()
        triton.async_infer("slow", slow_input(2.5), lambda result, error: done.put(error))
        wait_until(
            lambda: active[0] == 1 and w.admission.inflight == 1,
            what="the first request to hold its slot",
        )
        with raises_status(
            "RESOURCE_EXHAUSTED",
            "server is at its in-flight limit of 1 requests (endpoints.max_concurrent_requests)",
        ):
            triton.infer("classifier", [infer_input("x", x_rows(1))])
        with raises_status("RESOURCE_EXHAUSTED", "in-flight limit"):
            triton.is_server_live()  # every RPC counts
        assert w.admission.shed == 2
        assert done.get(timeout=60) is None  # the admitted one completes
        wait_until(lambda: w.admission.inflight == 0)
        assert triton.infer("classifier", [infer_input("x", x_rows(1))]).as_numpy(
            "logits"
        ).shape == (1, 10)


def test_queue_full(repo, cache_dir):
    config = worker_config(repo, cache_dir, SCHEDULER_MAX_QUEUE_DEPTH=1)
    with running(config) as w, connect(w) as triton:
        done: queue.Queue = queue.Queue()
        with held_device(w) as gate:
            triton.async_infer(
                "classifier", [infer_input("x", x_rows(1))], lambda result, error: done.put(error)
            )
            wait_until(
                lambda: sched_stats(w, "classifier").dispatches == 1,
                what="the first request on the device",
            )
            triton.async_infer(
                "classifier", [infer_input("x", x_rows(2))], lambda result, error: done.put(error)
            )
            wait_until(
                lambda: sched_stats(w, "classifier").queue_depth == 1,
                what="the second request queued",
            )
            with raises_status(
                "RESOURCE_EXHAUSTED",
                "model 'classifier': queue is full (1 requests queued, max_queue_depth 1)",
            ):
                triton.infer("classifier", [infer_input("x", x_rows(3))])
            gate.set()
            assert [done.get(timeout=60), done.get(timeout=60)] == [None, None]
        assert triton.infer("classifier", [infer_input("x", x_rows(3))]).as_numpy(
            "logits"
        ).shape == (3, 10)


@pytest.fixture(scope="module")
def small(repo, cache_dir):
    """A worker whose messages may not exceed 2 MiB."""
    config = worker_config(repo, cache_dir, ENDPOINTS_MAX_MESSAGE_BYTES=2 * MIB)
    with running(config) as w:
        yield w


def _big_request_input() -> list[grpcclient.InferInput]:
    return [infer_input("x", np.ones((3072, 256), np.float32))]  # 3 MiB


def test_oversized_message_fails_only_that_call(small):
    channel_args = [
        ("grpc.max_send_message_length", 64 * MIB),
        ("grpc.max_receive_message_length", 64 * MIB),
    ]
    with connect(small, channel_args=channel_args) as triton:
        done: queue.Queue = queue.Queue()
        active = hook_globals(small, "slow")["ACTIVE"]
        # a call in flight on the same connection while the big one is refused
        triton.async_infer("slow", slow_input(3.0), lambda result, error: done.put(error))
        wait_until(lambda: active[0] == 1, what="the slow call to be in flight")
        with raises_status(
            "RESOURCE_EXHAUSTED",
            "received message of",
            f"larger than the maximum {2 * MIB} (endpoints.max_message_bytes)",
        ):
            triton.infer("classifier", _big_request_input())
        assert active[0] == 1  # still in flight: it completes on the same connection
        assert done.get(timeout=60) is None
        result = triton.infer("classifier", [infer_input("x", x_rows(8))])
        assert result.as_numpy("logits").shape == (8, 10)
        # compressed below the limit, but inflating above it
        with raises_status("RESOURCE_EXHAUSTED", "(decompressed)", "larger than the maximum"):
            triton.infer("classifier", _big_request_input(), compression_algorithm="gzip")
        assert triton.infer(
            "classifier", [infer_input("x", x_rows(2))], compression_algorithm="gzip"
        ).as_numpy("logits").shape == (2, 10)


def test_oversized_response_fails_only_that_call(tmp_path, cache_dir):
    """An answer above endpoints.max_message_bytes: RESOURCE_EXHAUSTED naming the limit
    for that call (not CANCELLED), and the next call on the connection is served."""
    from rsrv.export import Input, Output, export_jax

    export_jax(  # 4 bytes in per row, 1 MiB out per row
        lambda p, x: jnp.tile(x, (1, MIB // 16)),
        {},
        inputs=[Input("x", np.float32, ("n", 4))],
        outputs=[Output("y")],
        batch_sizes=[1, 4],
        out_dir=tmp_path / "repo" / "expand",
        provenance={"source": "tests/e2e/test_kserve_errors.py"},
        parity=False,
    )
    config = worker_config(tmp_path / "repo", cache_dir, ENDPOINTS_MAX_MESSAGE_BYTES=2 * MIB)
    channel_args = [("grpc.max_receive_message_length", 64 * MIB)]
    with running(config) as w, connect(w, channel_args=channel_args) as triton:
        big = [infer_input("x", np.ones((4, 4), np.float32))]
        with raises_status("RESOURCE_EXHAUSTED", "exceeds the maximum", f"{2 * MIB}"):
            triton.infer("expand", big)
        y = triton.infer("expand", [infer_input("x", np.ones((1, 4), np.float32))])
        assert y.as_numpy("y").shape == (1, MIB // 4)
        answers = queue.Queue()
        triton.start_stream(callback=lambda result, error: answers.put(error))
        triton.async_stream_infer("expand", big)
        error = answers.get(timeout=60)
        triton.stop_stream()
        assert "exceeds the maximum" in error.message()
        # counted as the failures the clients received (both counted as successes before)
        stats = stats_of(triton, "expand").inference_stats
        assert (stats.success.count, stats.fail.count) == (1, 2)


async def test_oversized_message_keeps_the_connection(small):
    """On one purerpc connection (purerpc never reconnects): refused, then served."""
    big = pb.ModelInferRequest(model_name="classifier")
    big.inputs.add(name="x", datatype="FP32", shape=[3072, 256])
    big.raw_input_contents.append(bytes(3 * MIB))
    ok = pb.ModelInferRequest(model_name="classifier")
    ok.inputs.add(name="x", datatype="FP32", shape=[1, 256])
    ok.raw_input_contents.append(x_rows(1).tobytes())
    async with raw_channel(small) as channel:
        with pytest.raises(RpcFailedError) as info:
            await channel.unary("ModelInfer", big, pb.ModelInferResponse)
        code, message = rpc_status(info.value)
        assert code == "RESOURCE_EXHAUSTED"
        assert (
            f"received message of {big.ByteSize()} bytes, larger than the maximum "
            f"{2 * MIB}" in message
        )
        response = await channel.unary("ModelInfer", ok, pb.ModelInferResponse)
        assert np.frombuffer(response.raw_output_contents[0], np.float32).shape == (10,)
        # the same in a stream: the stream fails, the connection stays
        with pytest.raises(RpcFailedError) as info:
            await channel.stream("ModelStreamInfer", [big], pb.ModelStreamInferResponse)
        assert rpc_status(info.value)[0] == "RESOURCE_EXHAUSTED"
        response = await channel.unary("ModelInfer", ok, pb.ModelInferResponse)
        assert len(response.raw_output_contents) == 1


def test_largest_message_limit_keeps_the_window_valid(repo, cache_dir):
    """max_message_bytes = 2**31-1: the HTTP/2 window (2 x the limit in purerpc) is capped."""
    config = worker_config(
        repo,
        cache_dir,
        ENDPOINTS_MAX_MESSAGE_BYTES=2**31 - 1,
        MODEL_CONTROL_MODE="explicit",
    )
    with running(config) as w, connect(w) as triton:
        assert triton.is_server_live()
        triton.load_model("classifier")
        x = np.ones((8, 256), np.float32)
        assert triton.infer("classifier", [infer_input("x", x)]).as_numpy("logits").shape == (8, 10)


def test_unsupported_compression_fails_only_that_call(worker):
    """A grpc-encoding rsrv cannot inflate: UNIMPLEMENTED for the call, not a dropped
    connection."""
    path = "/inference.GRPCInferenceService/ServerLive"
    body = pb.ServerLiveRequest().SerializeToString()
    # grpcio only compresses with encodings it knows: speak HTTP/2 by hand
    raw = RawH2(worker.port)
    try:
        snappy = raw.start(path, headers=[("grpc-encoding", "snappy")])
        raw.send(snappy, message(gzip.compress(body), compressed=True), end=True)
        plain = raw.call(body, path)  # the other call on the connection
        unsupported, served = raw.status(snappy, 20), raw.status(plain, 20)
    finally:
        raw.close()
    assert unsupported is not None and unsupported[0] == 12  # UNIMPLEMENTED
    assert "snappy" in unsupported[1]
    assert served is not None and served[0] == 0


def test_a_compressed_request_is_inflated_off_the_event_loop(worker, monkeypatch):
    """A small gzip body may inflate to hundreds of megabytes (0.4 s of zlib for
    256 MiB): the worker inflates it in a worker thread, never on its event loop, where
    it would hold every other call up; and many compressed calls on one connection at
    once all go through."""
    from rsrv.transport._messages import MessageReader

    where: list[bool] = []
    decompress = MessageReader._decompress

    def recording(self, payload, room):
        try:
            trio.lowlevel.current_task()
            where.append(True)  # on the event loop
        except RuntimeError:
            where.append(False)
        return decompress(self, payload, room)

    monkeypatch.setattr(MessageReader, "_decompress", recording)
    path = "/inference.GRPCInferenceService/ServerLive"
    body = b"\x7a\xa0\x1f" + b"x" * 4000  # field 15, 4,000 bytes: unknown, ignored
    raw = RawH2(worker.port)
    try:  # 20 calls on one connection at once, each inflating 4 KB
        calls = [raw.start(path, headers=[("grpc-encoding", "gzip")]) for _ in range(20)]
        for call in calls:
            raw.send(call, message(gzip.compress(body), compressed=True), end=True)
        statuses = [raw.status(call, 20) for call in calls]
    finally:
        raw.close()
    assert statuses == [(0, "")] * 20, statuses
    assert where == [False] * 20
