"""rsrv.client parts without a worker: retry backoff, entering a client twice (or again
after a failed open), shared-memory bounds, BYTES inputs given as lists, outputs that do
not fill their shape, errors that cross processes, and a stream's answers."""

from __future__ import annotations

import errno
import math
import os
import pickle
import re
import uuid

import numpy as np
import pytest
import trio
from purerpc.grpclib.status import StatusCode
from support.echo import UNARY, echo_server, wait_for

from rsrv.client import (
    InferenceClient,
    InferenceServerError,
    InferStream,
    RetryPolicy,
    create_shared_memory_region,
)
from rsrv.client._tensors import InferResult, build_request, deserialize_bytes
from rsrv.protocol.generated.inference import grpc_service_pb2 as pb
from rsrv.transport import GrpcServer, Method, UnaryResult


def test_backoff_is_capped_for_any_attempt():
    policy = RetryPolicy(attempts=math.inf, initial_backoff=0.05, max_backoff=2.0)
    assert 1.6 <= policy.backoff(1024) <= 2.0  # 2.0 ** 1024 overflows a float
    assert 0.04 <= policy.backoff(0) <= 0.06
    assert max(policy.backoff(6) for _ in range(200)) <= 2.0  # 3.2 s, jittered, capped


async def test_a_client_is_entered_once_at_a_time():
    async with echo_server() as echo:
        client = InferenceClient("127.0.0.1", echo.port)
        async with client:
            with pytest.raises(RuntimeError, match="open already"):
                async with client:
                    pass
            assert (await client.channel.unary(UNARY, b"hi")).response == b"hi"  # still open
        async with client:  # again, after it was closed
            assert (await client.channel.unary(UNARY, b"hi")).response == b"hi"


async def test_what_the_block_raises_comes_out_as_it_was_raised():
    """Out of ``async with`` a client or a stream: the block's exception as itself (not
    in the group of the client's own nursery), a group the block raised as that group
    (a one-member group was stripped of its layers), with its context still shown."""

    def raised_while_handling() -> ValueError:
        try:
            raise KeyError("first")
        except KeyError:
            return ValueError("second")

    async with echo_server() as echo:
        for where in ("client", "stream"):
            for thrown in (
                KeyError("plain"),
                ExceptionGroup("mine", [KeyError("one")]),
                ExceptionGroup("outer", [ExceptionGroup("inner", [ValueError(1)])]),
            ):
                with pytest.raises(BaseException) as info:
                    async with InferenceClient("127.0.0.1", echo.port) as client:
                        if where == "client":
                            raise thrown
                        async with client.stream():
                            raise thrown
                # (trio's cancel scopes may hand a group on as a copy: compare contents)
                assert repr(info.value) == repr(thrown), where
            error = raised_while_handling()
            with pytest.raises(ValueError) as info:
                async with InferenceClient("127.0.0.1", echo.port) as client:
                    if where == "client":
                        try:
                            raise KeyError("first")
                        except KeyError:
                            raise error  # noqa: B904 (its context is the point)
                    async with client.stream():
                        try:
                            raise KeyError("first")
                        except KeyError:
                            raise error  # noqa: B904
            assert isinstance(info.value.__context__, KeyError), where
            assert not info.value.__suppress_context__, where


async def test_a_client_whose_open_failed_can_be_entered_again():
    async with echo_server() as echo:
        client = InferenceClient("127.0.0.1", echo.port)
        with trio.CancelScope() as scope:
            scope.cancel()  # the open is cancelled
            async with client:
                pass
        assert scope.cancelled_caught  # the open was cut short
        async with client:
            assert (await client.channel.unary(UNARY, b"hi")).response == b"hi"


@pytest.mark.parametrize(
    ("headers", "port", "error"),
    [
        ({"x-user": "名"}, 8001, "headers['x-user']: the value must be printable ASCII"),
        ({"X-User": "a"}, 8001, "headers['X-User']: not a metadata key a call may carry"),
        ({"grpc-timeout": "1S"}, 8001, "headers['grpc-timeout']: not a metadata key"),
        ({}, "8001", "port must be an int, not str"),
        ({}, 70000, "port 70000 is not a TCP port (1 to 65535)"),  # (retried 5 times)
        ({}, -1, "port -1 is not a TCP port"),
        ({"x-k": b"v"}, 8001, "headers['x-k']: a header is a str and its value a str, not bytes"),
        ({b"x-k": "v"}, 8001, "a header is a str and its value a str, not bytes"),  # (said str)
    ],
)
def test_settings_no_call_could_use_are_refused_at_once(headers, port, error):
    with pytest.raises((ValueError, TypeError), match=re.escape(error)):
        InferenceClient("127.0.0.1", port, headers=headers)


def test_shared_memory_reads_stay_inside_the_region():
    key = f"/rsrv_pieces_{uuid.uuid4().hex[:10]}"
    with create_shared_memory_region("r", key, 64) as region:
        region.write(np.array([b"ab", b"c\x00"], dtype=object))
        assert list(region.read("BYTES", [2])) == [b"ab", b"c\x00"]
        for offset in (-51, 65):
            with pytest.raises(ValueError, match="runs past region"):
                region.read("BYTES", [1], offset=offset)
        with pytest.raises(ValueError, match="negative dimension"):
            region.read("FP32", [-1])
        region.close()
        with pytest.raises(ValueError, match="is closed"):
            region.read("FP32", [1])
        with pytest.raises(ValueError, match="is closed"):
            region.write(np.ones(1, np.float32))
    with create_shared_memory_region("z", key + "z", 0) as empty:
        assert empty.write(np.zeros(0, np.float32)) == 0
        assert empty.read("FP32", [0]).shape == (0,)
        with pytest.raises(ValueError, match="runs past region"):
            empty.read("FP32", [1])


def test_bytes_given_as_a_list_keep_their_trailing_nul_bytes():
    request = build_request("m", {"s": [b"ab\x00\x00", b"c"], "t": ["x\x00"]})
    first = deserialize_bytes(request.raw_input_contents[0], 2)
    assert list(first) == [b"ab\x00\x00", b"c"]
    assert list(deserialize_bytes(request.raw_input_contents[1], 1)) == [b"x\x00"]
    assert [t.datatype for t in request.inputs] == ["BYTES", "BYTES"]


@pytest.mark.parametrize(
    ("raw", "typed", "got"),
    [
        (bytes(4), None, "4 bytes"),  # too short
        (bytes(12), None, "12 bytes"),  # too long
        (None, [], "0 values"),  # no raw contents, no typed ones
    ],
)
def test_an_output_that_does_not_fill_its_shape_is_refused_naming_it(raw, typed, got):
    response = pb.ModelInferResponse(model_name="m")
    output = response.outputs.add(name="y", datatype="FP32", shape=[2])
    if raw is not None:
        response.raw_output_contents.append(raw)
    else:
        output.contents.fp32_contents.extend(typed)
    with pytest.raises(ValueError, match=f"output 'y' .* FP32\\[2\\] but {got}"):
        InferResult(response)


def test_an_error_survives_pickling():
    error = InferenceServerError(
        StatusCode.NOT_FOUND, "no model", reached_server=False, request_id="r1"
    )
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.code, copy.message, copy.reached_server, copy.request_id) == (
        StatusCode.NOT_FOUND,
        "no model",
        False,
        "r1",
    )
    assert str(copy) == "NOT_FOUND: no model"


class HeldCall:
    """A stream call whose sends wait (flow control) until ``flowing``; answers are
    put in with ``answer``."""

    done, status, message, reached_server = False, None, "", True

    def __init__(self):
        self.flowing = trio.Event()
        self.sent: list[str] = []
        self._in, self._out = trio.open_memory_channel(10)

    async def send(self, payload: bytes) -> None:
        await self.flowing.wait()
        self.sent.append(pb.ModelInferRequest.FromString(payload).id)

    def answer(self, request_id: str) -> None:
        response = pb.ModelInferResponse(id=request_id, model_name="m")
        self._in.send_nowait(
            pb.ModelStreamInferResponse(infer_response=response).SerializeToString()
        )

    def __aiter__(self):
        return self._out.__aiter__()


async def test_an_infer_cancelled_before_its_request_was_sent_drops_no_answer():
    """Only an answer that may yet come is dropped: a request never sent (cancelled
    while its send waited) has none, and a later request with its id gets its own."""
    call = HeldCall()
    stream = InferStream(call)
    x = {"x": np.zeros((1,), np.float32)}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream._read)
        with trio.move_on_after(0.1):
            await stream.infer("m", x, request_id="job-1")
        assert call.sent == [] and not stream._abandoned
        call.flowing.set()
        await stream.send("m", x, request_id="job-1")
        call.answer("job-1")
        with trio.fail_after(5):
            assert (await stream.receive()).id == "job-1"
        nursery.cancel_scope.cancel()


async def test_an_infer_with_the_id_of_a_send_still_unanswered_is_refused():
    """send("job") then infer("job"): the infer took the send's answer (the wrong
    output) and its own went to receive(). Refused now; an automatic id skips a
    caller's id of its form."""
    call = HeldCall()
    call.flowing.set()
    stream = InferStream(call)
    x = {"x": np.zeros((1,), np.float32)}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream._read)
        await stream.send("m", x, request_id="job")
        with trio.fail_after(5), pytest.raises(ValueError, match="'job': the answer of a"):
            await stream.infer("m", x, request_id="job")  # (it waited, and took the send's)
        upcoming = f"rsrv-{int(stream._new_id().split('-')[1]) + 1}"
        await stream.send("m", x, request_id=upcoming)
        auto = await stream.send("m", x)
        assert auto != upcoming and call.sent == ["job", upcoming, auto]
        call.answer("job")
        with trio.fail_after(5):
            assert (await stream.receive()).id == "job"
        got = []

        async def infer_job():
            got.append(await stream.infer("m", x, request_id="job"))  # answered: free

        nursery.start_soon(infer_job)
        await wait_for(lambda: "job" in stream._waiting, "the second job sent")
        call.answer("job")
        await wait_for(lambda: got, "its answer")
        nursery.cancel_scope.cancel()


def test_a_refusal_with_a_retry_pushback_never_reached_the_server():
    """A gateway with no ready worker, a worker shutting down: they say so with a
    pushback, and the error said reached_server True, without the pushback."""
    refused = UnaryResult(
        StatusCode.UNAVAILABLE, "no worker is ready", trailers=(("grpc-retry-pushback-ms", "2000"),)
    )
    error = InferenceServerError.of(refused)
    assert (error.reached_server, error.retry_after) == (False, 2.0)
    failed = InferenceServerError.of(UnaryResult(StatusCode.UNAVAILABLE, "reset"))
    assert (failed.reached_server, failed.retry_after) == (True, None)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.reached_server, copy.retry_after) == (False, 2.0)


async def test_closing_the_client_ends_a_long_pushback_wait_at_once():
    """The server asked for 30 s between attempts: a client closed meanwhile ended the
    call only once they had passed (5 s in the report)."""
    pushback = (("grpc-retry-pushback-ms", "30000"),)
    async with echo_server(trailers_of=lambda error: pushback) as echo:
        client = InferenceClient("127.0.0.1", echo.port, retry=RetryPolicy(attempts=3))
        client.service = "/rsrv.test.Echo/"
        ended = []

        async def call():
            with pytest.raises(InferenceServerError) as raised:
                await client._call_serialized("Fail", b"14:busy", None)
            ended.append(raised.value)

        with trio.fail_after(10):  # (a guard: the wait was 30 s)
            async with trio.open_nursery() as nursery:
                async with client:
                    nursery.start_soon(call)
                    await wait_for(lambda: echo.started == 1, "the first attempt")
        assert ended[0].code is StatusCode.UNAVAILABLE and echo.started == 1


def test_shared_memory_that_does_not_fit_is_refused_at_creation(monkeypatch):
    """An object /dev/shm had no room for was created sparse, and the first write
    killed the process (SIGBUS), leaving the object behind."""

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    key = f"/rsrv-test-{uuid.uuid4().hex}"
    with pytest.raises(OSError, match=r"no room for 8388608 bytes \(No space left") as raised:
        create_shared_memory_region("r", key, 8 << 20)
    assert raised.value.errno == errno.ENOSPC
    assert not os.path.exists(f"/dev/shm{key}")
    for bad in (".", ".."):
        with pytest.raises(ValueError, match="must be one name"):
            create_shared_memory_region("r", bad, 8)


def test_the_request_takes_one_output_name_numpy_parameters_and_names_a_bad_input():
    request = build_request(
        "m",
        {"x": np.zeros(2, np.float32)},
        "logits",  # (its letters were asked for: "unexpected output 'l'")
        parameters={"n": np.int64(3), "flag": np.bool_(True)},  # (TypeError)
    )
    assert [o.name for o in request.outputs] == ["logits"]
    assert request.parameters["n"].int64_param == 3 and request.parameters["flag"].bool_param
    with pytest.raises(ValueError, match="^input 'z': "):
        build_request("m", {"z": np.zeros(2, np.complex64)})


def test_a_numpy_scalar_is_written_to_shared_memory():
    with create_shared_memory_region("r", f"/rsrv-test-{uuid.uuid4().hex}", 8) as region:
        assert region.write(np.float32(2.5)) == 4
        assert region.read("FP32", [1])[0] == 2.5


async def test_an_answer_that_cannot_be_parsed_ends_the_stream_saying_so():
    """A server whose stream answers are not ModelStreamInferResponse: iteration ends,
    and leaving the block raises INTERNAL naming the parse error (the call is reset)."""

    async def garbage(requests, call):
        async for _ in requests:
            yield b"\xff\xff"

    path = "/inference.GRPCInferenceService/ModelStreamInfer"
    server = GrpcServer([Method(path, garbage, bytes, bytes, True, True)], "127.0.0.1", 0)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve)
        async with InferenceClient("127.0.0.1", port) as client:
            with pytest.raises(InferenceServerError, match="cannot parse an answer") as info:
                async with client.stream() as stream:
                    await stream.send("m", {"x": np.zeros((1, 3), np.float32)})
                    assert [answer async for answer in stream] == []
            assert info.value.code == StatusCode.INTERNAL
        await server.close(timeout=1)
        nursery.cancel_scope.cancel()
