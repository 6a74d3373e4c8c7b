"""rsrv.client against a real worker: InferenceClient (and its synchronous facade)
gives what tritonclient gives for every example bundle, streams, shared memory, error
statuses, deadlines, and retries a call until a late server starts."""

from __future__ import annotations

import gc
import signal
import threading
import time
import uuid

import numpy as np
import pytest
import trio
import tritonclient.grpc as grpcclient
from purerpc.grpclib.status import StatusCode
from support.bundles import EXAMPLES, make_repo
from support.clients import connect, infer_input
from support.echo import FAIL, echo_server, wait_for
from support.serving import ServerProcess, free_port, held_device
from support.waiting import wait_until

from rsrv.client import (
    InferenceClient,
    InferenceServerError,
    RetryPolicy,
    ShmInput,
    ShmOutput,
    SyncInferenceClient,
    create_shared_memory_region,
)
from rsrv.client._rpc import call_unary
from rsrv.protocol.generated.inference import grpc_service_pb2 as pb
from rsrv.transport import ClientLimits

MODELS = [*EXAMPLES, "simple", "simple_string"]
SIMPLE_INPUTS = {"INPUT0": np.ones((1, 16), np.int32), "INPUT1": np.ones((1, 16), np.int32)}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return make_repo(tmp_path_factory.mktemp("client") / "repo", *MODELS)


def client_of(worker, **kwargs) -> InferenceClient:
    return InferenceClient("127.0.0.1", worker.port, **kwargs)


def inputs_for(metadata, rng: np.random.Generator, rows: int = 2) -> dict[str, np.ndarray]:
    """Random inputs of every input in ``metadata`` (-1 axes: ``rows``)."""
    out = {}
    for tensor in metadata.inputs:
        shape = [rows if d == -1 else d for d in tensor.shape]
        if tensor.datatype == "BYTES":
            values = rng.integers(0, 100, shape)
            out[tensor.name] = np.vectorize(lambda v: str(v).encode(), otypes=[object])(values)
        elif tensor.datatype == "UINT8":
            out[tensor.name] = rng.integers(0, 256, shape, dtype=np.uint8)
        elif tensor.datatype.startswith("INT"):
            out[tensor.name] = rng.integers(-50, 50, shape).astype(tensor.datatype.lower())
        else:
            out[tensor.name] = rng.random(shape).astype(np.float32)
    return out


def triton_outputs(worker, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    with connect(worker) as triton:
        result = triton.infer(model, [infer_input(k, v) for k, v in inputs.items()])
        return {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}


async def test_results_equal_tritonclients(worker):
    rng = np.random.default_rng(0)
    async with client_of(worker) as client:
        assert await client.server_live() and await client.server_ready()
        for model in MODELS:
            metadata = await client.model_metadata(model)
            inputs = inputs_for(metadata, rng)
            ours = await client.infer(model, inputs)
            theirs = await trio.to_thread.run_sync(triton_outputs, worker, model, inputs)
            assert sorted(ours.outputs) == sorted(theirs), model
            for name, expected in theirs.items():
                assert ours[name].dtype == expected.dtype, (model, name)
                np.testing.assert_array_equal(ours[name], expected, err_msg=f"{model}.{name}")
            assert ours.model_name == model and ours.model_version == "1"


async def test_metadata_calls_answer_what_tritonclient_gets(worker):
    with connect(worker) as triton:
        expected = {
            "server": triton.get_server_metadata().SerializeToString(),
            "model": triton.get_model_metadata("classifier").SerializeToString(),
            "config": triton.get_model_config("classifier").config.SerializeToString(),
            "index": [m.SerializeToString() for m in triton.get_model_repository_index().models],
        }
    async with client_of(worker) as client:
        assert (await client.server_metadata()).SerializeToString() == expected["server"]
        assert (await client.model_metadata("classifier")).SerializeToString() == expected["model"]
        assert (await client.model_config("classifier")).SerializeToString() == expected["config"]
        index = await client.repository_index()
        assert [m.SerializeToString() for m in index] == expected["index"]
        assert await client.model_ready("classifier")
        assert not await client.model_ready("no_such_model")
        await client.infer("classifier", {"x": np.ones((1, 256), np.float32)})
        (stats,) = (await client.model_statistics("classifier")).model_stats
        assert stats.name == "classifier" and stats.inference_count >= 1


async def test_error_statuses(worker):
    async with client_of(worker) as client:
        with pytest.raises(InferenceServerError) as info:
            await client.infer("classifier", {"x": np.ones((1, 255), np.float32)})
        assert info.value.code is StatusCode.INVALID_ARGUMENT
        assert "axis 1 has extent 255" in info.value.message
        with pytest.raises(InferenceServerError) as info:
            await client.infer("no_such_model", {"x": np.ones((1, 256), np.float32)})
        assert info.value.code is StatusCode.NOT_FOUND
        assert "no_such_model" in info.value.message and info.value.reached_server
        with pytest.raises(InferenceServerError) as info:
            await client.infer("classifier", {"x": np.ones((1, 256), np.float32)}, ["nope"])
        assert info.value.code is StatusCode.INVALID_ARGUMENT
        with pytest.raises(InferenceServerError) as info:
            await client.model_metadata("no_such_model")
        assert info.value.code is StatusCode.NOT_FOUND


async def test_deadline(worker):
    async with client_of(worker) as client:
        with held_device(worker):
            with pytest.raises(InferenceServerError) as info:
                await client.infer("classifier", {"x": np.ones((1, 256), np.float32)}, timeout=0.3)
        assert info.value.code is StatusCode.DEADLINE_EXCEEDED
        result = await client.infer("classifier", {"x": np.ones((1, 256), np.float32)}, timeout=30)
        assert result["logits"].shape == (1, 10)


async def test_streaming(worker):
    rng = np.random.default_rng(1)
    rows = [rng.standard_normal((1, 256)).astype(np.float32) for _ in range(12)]
    async with client_of(worker) as client:
        expected = [(await client.infer("classifier", {"x": x}))["logits"] for x in rows]
        async with client.stream() as stream:
            got = [None] * len(rows)

            async def one(i):
                got[i] = (await stream.infer("classifier", {"x": rows[i]}))["logits"]

            async with trio.open_nursery() as nursery:  # concurrent, matched by id
                for i in range(len(rows)):
                    nursery.start_soon(one, i)
            for a, b in zip(got, expected, strict=True):  # coalesced: another batch size
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
            # a failed request answers on the stream, which goes on
            with pytest.raises(InferenceServerError) as info:
                await stream.infer(
                    "classifier", {"x": np.ones((1, 7), np.float32)}, request_id="r7"
                )
            assert info.value.request_id == "r7" and "extent 7" in info.value.message
            sent = [await stream.send("classifier", {"x": x}) for x in rows[:3]]
            answers = [await stream.receive() for _ in sent]
            assert sorted(a.id for a in answers) == sorted(sent)


async def test_a_stream_keeps_going_past_a_misused_request(worker):
    """Two waits on one request id: the second is refused (ValueError), the first gets
    its answer; a request over the client's send limit fails RESOURCE_EXHAUSTED unsent,
    and the stream goes on."""
    x = np.ones((1, 256), np.float32)
    limits = ClientLimits(max_send_message_bytes=4096)
    async with client_of(worker, limits=limits) as client, client.stream() as stream:
        async with trio.open_nursery() as nursery:
            got = []

            async def first():
                got.append(await stream.infer("classifier", {"x": x}, request_id="same"))

            with held_device(worker):
                nursery.start_soon(first)
                await wait_for(lambda: "same" in stream._waiting, "the first request sent")
                with pytest.raises(ValueError, match="already waiting"):
                    await stream.infer("classifier", {"x": x}, request_id="same")
        assert got[0]["logits"].shape == (1, 10)
        with pytest.raises(InferenceServerError) as info:
            await stream.infer("classifier", {"x": np.ones((8, 256), np.float32)})
        assert info.value.code is StatusCode.RESOURCE_EXHAUSTED
        assert not info.value.reached_server
        assert (await stream.infer("classifier", {"x": x}))["logits"].shape == (1, 10)


async def test_a_cancelled_infers_answer_is_dropped_and_end_drains_the_stream(worker):
    """An infer given up on (its answer held up behind a busy device): its answer,
    coming later, is not what receive returns. After end(), the answers still due
    arrive and iteration ends when the server ends the stream."""
    x = np.ones((1, 256), np.float32)
    async with client_of(worker) as client, client.stream() as stream:
        with held_device(worker):
            with trio.move_on_after(0.2) as gave_up:
                await stream.infer("classifier", {"x": x}, request_id="gave-up")
            assert gave_up.cancelled_caught
            for again in (stream.infer, stream.send):  # its answer could not be told apart
                with pytest.raises(ValueError, match="'gave-up': the answer of a cancelled"):
                    await again("classifier", {"x": x}, request_id="gave-up")
            await stream.send("classifier", {"x": x}, request_id="wanted")
        await stream.end()
        with trio.fail_after(30):
            answers = [answer async for answer in stream]
        assert [answer.id for answer in answers] == ["wanted"]
        with pytest.raises(InferenceServerError, match="the stream has ended"):
            await stream.send("classifier", {"x": x})


async def test_a_stream_reset_on_an_oversized_answer_ends_alone(worker):
    """The client resets its stream when an answer is over its receive limit, while the
    worker is sending it: that ends the stream, never the worker."""
    x = np.ones((1, 256), np.float32)
    async with client_of(worker, limits=ClientLimits(max_receive_message_bytes=16)) as small:
        for _ in range(3):
            with pytest.raises(InferenceServerError) as info:
                async with small.stream() as stream:
                    await stream.infer("classifier", {"x": x})
            assert info.value.code is StatusCode.RESOURCE_EXHAUSTED
    async with client_of(worker) as client:
        assert (await client.infer("classifier", {"x": x}))["logits"].shape == (1, 10)


async def test_system_shared_memory(worker):
    suffix = uuid.uuid4().hex[:10]
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 3, dtype=np.int32)
    with (
        create_shared_memory_region("in", f"/rsrv_in_{suffix}", 128) as inp,
        create_shared_memory_region("out", f"/rsrv_out_{suffix}", 128) as out,
    ):
        inp.write([a, b])
        async with client_of(worker) as client:
            await client.register_system_shared_memory("in", inp.key, 128)
            await client.register_system_shared_memory("out", out.key, 128)
            try:
                assert set(await client.system_shared_memory_status()) == {"in", "out"}
                result = await client.infer(
                    "simple",
                    {
                        "INPUT0": ShmInput("in", 64, (1, 16), "INT32"),
                        "INPUT1": b,  # one from shared memory, one in the request
                    },
                    [ShmOutput("OUTPUT0", "out", 64), ShmOutput("OUTPUT1", "out", 64, 64)],
                )
                sum_, diff = result.tensors["OUTPUT0"], result.tensors["OUTPUT1"]
                assert (sum_.region, sum_.byte_size, diff.offset) == ("out", 64, 64)
                assert result.as_numpy("OUTPUT0") is None
                np.testing.assert_array_equal(out.read("INT32", sum_.shape), a + b)
                np.testing.assert_array_equal(out.read("INT32", diff.shape, 64), a - b)
                with pytest.raises(InferenceServerError) as info:
                    await client.infer(
                        "simple", {"INPUT0": ShmInput("nope", 64, (1, 16), "INT32"), "INPUT1": b}
                    )
                assert info.value.code is StatusCode.NOT_FOUND
            finally:
                await client.unregister_system_shared_memory()
            assert await client.system_shared_memory_status() == {}


def test_sync_client(worker):
    """The facade from plain code: same answers, errors, and its one thread joined."""
    before = threading.active_count()
    x = np.ones((2, 256), np.float32)
    with SyncInferenceClient("127.0.0.1", worker.port) as client:
        assert client.server_ready()
        assert threading.active_count() == before + 1
        logits = client.infer("classifier", {"x": x})["logits"]
        np.testing.assert_array_equal(
            logits, triton_outputs(worker, "classifier", {"x": x})["logits"]
        )
        with pytest.raises(InferenceServerError) as info:
            client.model_metadata("no_such_model")
        assert info.value.code is StatusCode.NOT_FOUND
    assert threading.active_count() == before

    async def close_in_trio(client: SyncInferenceClient) -> None:
        with pytest.raises(RuntimeError):  # a blocking call from a trio task
            client.server_ready()
        client.close()  # but closing works from anywhere

    trio.run(close_in_trio, SyncInferenceClient("127.0.0.1", worker.port))
    assert threading.active_count() == before
    SyncInferenceClient("127.0.0.1", worker.port).server_ready()  # dropped, never closed
    gc.collect()
    wait_until(lambda: threading.active_count() == before, 10, "the dropped client's thread")


def test_a_sync_call_the_close_cuts_short_may_have_reached_the_server(worker):
    """Its request held on the server's device when the client closes: UNAVAILABLE "the
    client was closed", with reached_server True (it said False, and the server ran it)."""
    client = SyncInferenceClient("127.0.0.1", worker.port)
    got = []

    def call():
        try:
            client.infer("classifier", {"x": np.ones((1, 256), np.float32)}, timeout=30)
        except InferenceServerError as e:
            got.append(e)

    with held_device(worker):
        caller = threading.Thread(target=call)
        caller.start()
        wait_until(lambda: client._loop._calls, 10, "the call running on the loop")
        time.sleep(0.3)  # (sent, and held on the device)
        client.close()
        caller.join(10)
    assert [(e.code, e.message, e.reached_server) for e in got] == [
        (StatusCode.UNAVAILABLE, "the client was closed", True)
    ]


def test_an_interrupted_sync_call_ends_on_the_clients_loop_too(worker):
    """Ctrl-C in a blocking call: the call is cancelled on the client's loop as well
    (its stream reset), not left running there to hold one of the stream slots."""
    x = np.ones((1, 256), np.float32)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    limits = ClientLimits(max_concurrent_streams=1)
    try:
        with SyncInferenceClient("127.0.0.1", worker.port, limits=limits) as client:
            with held_device(worker):
                signal.setitimer(signal.ITIMER_REAL, 0.3)
                with pytest.raises(KeyboardInterrupt):
                    client.infer("classifier", {"x": x})
                assert client.server_live(timeout=5)  # the one slot is free again
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_closing_the_sync_client_ends_a_call_between_retries_with_its_error():
    """Another thread's call waiting between retries (nothing listens) when the client
    closes fails InferenceServerError UNAVAILABLE at once, never with trio's Cancelled
    (a BaseException plain code does not catch)."""
    policy = RetryPolicy(attempts=1000, initial_backoff=0.2, max_backoff=0.2)
    client = SyncInferenceClient("127.0.0.1", free_port(), retry=policy)
    got = []

    def call():
        try:
            client.server_live(timeout=30)
        except BaseException as e:  # noqa: BLE001 - what reaches plain code is the test
            got.append(e)

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(0.5)
    client.close()
    caller.join(5)
    assert not caller.is_alive()
    assert [type(e) for e in got] == [InferenceServerError], got
    assert (got[0].code, got[0].message) == (StatusCode.UNAVAILABLE, "the client was closed")
    with pytest.raises(RuntimeError, match="the client is closed"):
        client.server_live()


async def test_closing_the_client_ends_a_call_between_retries_at_once():
    """A closed channel is no reason to go on retrying: the call ends at its next try."""
    policy = RetryPolicy(attempts=40, initial_backoff=0.1, max_backoff=0.1)
    client = InferenceClient("127.0.0.1", free_port(), retry=policy)
    ended = []

    async def call():
        # (closed during a try, that try's own failure is the answer; between tries,
        # the next finds the channel closed: either way UNAVAILABLE, and at once)
        with pytest.raises(InferenceServerError) as raised:
            await client.server_live()
        assert raised.value.code is StatusCode.UNAVAILABLE
        ended.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        async with client:
            nursery.start_soon(call)
            await trio.sleep(0.3)
        closed = trio.current_time()
    assert ended[0] - closed < 1.0  # (it slept out 40 x 0.1 s before)


async def test_retry_until_a_late_server_starts(tmp_path, cache_dir):
    port = free_port()
    retries = []

    class Counted(RetryPolicy):
        def backoff(self, attempt: int) -> float:
            retries.append(attempt)
            return super().backoff(attempt)

    policy = Counted(attempts=400, initial_backoff=0.02, max_backoff=0.2)
    server = None
    try:
        async with InferenceClient("127.0.0.1", port, retry=policy) as client:
            async with trio.open_nursery() as nursery:
                ready = []

                async def ask():
                    ready.append(await client.server_live(timeout=60))

                async def stream():  # its opening is retried too
                    async with client.stream(timeout=60) as stream:
                        while True:  # (the server listens while its models load)
                            try:
                                await stream.infer("simple", SIMPLE_INPUTS)
                                break
                            except InferenceServerError as e:
                                if "is loading" not in e.message:
                                    raise
                                await trio.sleep(0.05)
                    ready.append("streamed")

                nursery.start_soon(ask)
                nursery.start_soon(stream)
                await wait_for(lambda: len(retries) >= 2, "refused first attempts")
                repo = make_repo(tmp_path / "repo", "simple")
                server = ServerProcess(
                    tmp_path,
                    f'model_repo = "{repo}"\nbase_port = {port}\n\n[global]\n'
                    f'cache_dir = "{cache_dir}"\n',
                )
            assert sorted(ready, key=str) == [True, "streamed"]
    finally:
        if server is not None:
            server.kill()


async def test_only_calls_that_never_reached_the_server_are_retried():
    policy = RetryPolicy(attempts=5, initial_backoff=0.001)
    async with echo_server() as echo:
        from rsrv.transport import open_channel

        async with open_channel("127.0.0.1", echo.port) as channel:
            result = await call_unary(channel, FAIL, b"14:busy", retry=policy)
            assert (result.status, result.reached_server) == (StatusCode.UNAVAILABLE, True)
            assert echo.started == 1  # answered UNAVAILABLE by the server: not retried


def test_client_request_matches_tritonclients():
    """The ModelInferRequest we build is the one tritonclient builds."""
    from rsrv.client._tensors import build_request

    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    s = np.array([[b"a", b"bc"]], dtype=object)
    ours = build_request("m", {"x": x, "s": s}, ["y"], request_id="7", parameters={"k": 3})
    theirs = pb.ModelInferRequest()
    theirs.ParseFromString(
        grpcclient._utils._get_inference_request(
            model_name="m",
            inputs=[infer_input("x", x), infer_input("s", s, "BYTES")],
            model_version="",
            request_id="7",
            outputs=[grpcclient.InferRequestedOutput("y")],
            sequence_id=0,
            sequence_start=False,
            sequence_end=False,
            priority=0,
            timeout=None,
            parameters={"k": 3},
        ).SerializeToString()
    )
    assert ours == theirs
