"""Hostile and careless clients against a real worker: every call and connection they
abandon is released, nothing they send can crash or exhaust the server.

One worker for the module (classifier, slow, simple), with small limits so that each
one is reached quickly: 8 calls in flight, 2 requests in flight per stream, a 1 s
receive timeout and a 2 s idle-connection timeout, 4 shared-memory regions.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as tshm
from support.bundles import make_repo
from support.clients import connect, infer_input, raises_status
from support.procfs import accepted_connections
from support.rawh2 import INFER, RawH2, message
from support.serving import held_device, in_loop, running, sched_stats, worker_config
from support.waiting import wait_until

from rsrv.protocol.generated.inference import grpc_service_pb2 as pb

SETTINGS = {
    "ENDPOINTS_MAX_CONCURRENT_REQUESTS": 8,
    "ENDPOINTS_MAX_REQUESTS_PER_STREAM": 2,
    "ENDPOINTS_RECEIVE_TIMEOUT_SECONDS": 1,
    "ENDPOINTS_IDLE_CONNECTION_SECONDS": 2,
    "ENDPOINTS_MAX_SHM_REGIONS": 4,
}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return make_repo(tmp_path_factory.mktemp("hardening"), "classifier", "slow", "simple")


@pytest.fixture(scope="module")
def worker_settings():
    return SETTINGS


def x_rows(n: int) -> np.ndarray:
    return np.random.default_rng(n).standard_normal((n, 256)).astype(np.float32)


def infer_request(n: int = 1) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="classifier")
    request.inputs.add(name="x", datatype="FP32", shape=[n, 256])
    request.raw_input_contents.append(x_rows(n).tobytes())
    return request


def inflight(worker) -> int:
    return worker.admission.inflight


def open_calls(worker) -> int:
    """Calls the transport still tracks, over every connection."""
    return in_loop(worker, lambda: sum(len(c.calls) for c in worker.server.connections))


def connections(worker) -> int:
    return in_loop(worker, lambda: len(worker.server.connections))


def queued(worker) -> int:
    return sched_stats(worker, "classifier").queue_depth


def settled(worker) -> bool:
    return inflight(worker) == 0 and open_calls(worker) == 0 and queued(worker) == 0


@pytest.fixture
def transport_warnings(caplog):
    """Fails the test if the transport logs a warning (purerpc logged two per cancel)."""
    caplog.set_level(logging.INFO)
    yield
    noisy = [
        r
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith(("rsrv.transport", "purerpc"))
    ]
    assert not noisy, [r.getMessage() for r in noisy]


# -- abandoned calls --------------------------------------------------------------------


def test_cancelled_unary_calls_free_their_slots_at_once(worker, transport_warnings):
    """grpcio's cancel() sends RST_STREAM: queued calls are withdrawn and every in-flight
    slot is free while the device is still busy (purerpc ignored RST_STREAM: the calls
    held their slots until the device freed)."""
    with grpc.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
        call = channel.unary_unary(
            INFER,
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        before = sched_stats(worker, "classifier").dispatches
        with held_device(worker):
            futures = [call.future(infer_request()) for _ in range(6)]
            wait_until(lambda: inflight(worker) == 6, what="6 calls in flight")
            for future in futures:
                future.cancel()
            wait_until(lambda: settled(worker), timeout=5, what="every cancelled call released")
        # at most the one batch that had started ran; the rest were withdrawn
        assert sched_stats(worker, "classifier").dispatches <= before + 1


def test_cancelled_stream_withdraws_its_requests(worker, triton, transport_warnings):
    """tritonclient's stop_stream(cancel_requests=True) resets the stream."""
    answers: queue.Queue = queue.Queue()
    with held_device(worker):
        triton.start_stream(callback=lambda result, error: answers.put(error))
        for _ in range(2):
            triton.async_stream_infer("classifier", [infer_input("x", x_rows(1))])
        wait_until(lambda: inflight(worker) == 2, what="2 stream requests in flight")
        triton.stop_stream(cancel_requests=True)
        wait_until(lambda: settled(worker), timeout=5, what="the stream's requests released")


def test_killed_client_releases_its_calls(worker, transport_warnings):
    """A client that dies mid-call (TCP reset, no HTTP/2 goodbye): its connection, calls,
    in-flight slots and queued requests all go at once."""
    baseline = connections(worker)
    with held_device(worker):
        raw = RawH2(worker.port)
        for _ in range(3):
            raw.call(infer_request().SerializeToString())
        wait_until(lambda: inflight(worker) == 3, what="3 calls in flight")
        raw.abort()
        wait_until(lambda: settled(worker), timeout=5, what="the dead client's calls released")
        wait_until(lambda: connections(worker) == baseline, timeout=5)


def test_half_sent_messages_are_dropped_after_the_receive_timeout(worker):
    """200 calls each stop half-way through a 1.9 MB message: after the receive timeout
    each fails with DEADLINE_EXCEEDED and its buffer is freed (purerpc kept them all)."""
    raws = [RawH2(worker.port) for _ in range(2)]  # 128 calls at most per connection
    whole = 1_900_000
    sids = []
    for i in range(200):
        raw = raws[i % 2]
        sid = raw.start()
        raw.send(sid, message(bytes(whole // 2), length=whole))
        sids.append((raw, sid))
    wait_until(lambda: open_calls(worker) == 0, timeout=20, what="half-sent calls dropped")
    for raw, sid in sids[:2]:
        code, text = raw.status(sid, timeout=5)
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert "did not arrive in full within 1 s" in text
        assert "endpoints.receive_timeout_seconds" in text
    for raw in raws:
        raw.close()


def test_unary_call_without_its_message_times_out(worker):
    raw = RawH2(worker.port)
    sid = raw.start()
    code, text = raw.status(sid, timeout=10)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert "did not arrive" in text
    raw.close()


def test_silent_and_idle_connections_are_closed(worker):
    silent = RawH2(worker.port, preface=False)  # TCP only: never speaks HTTP/2
    idle = RawH2(worker.port)  # speaks, then opens no call
    assert silent.wait_closed(10)
    assert idle.goaway(10)
    assert idle.closed


def test_a_busy_connection_stays_open_and_closes_once_idle(worker):
    """Calls 0.5 s apart for longer than the idle timeout (2 s) keep the connection open;
    once they stop it is closed with GOAWAY."""
    raw = RawH2(worker.port)
    for _ in range(7):
        sid = raw.call(b"", path="/inference.GRPCInferenceService/ServerLive")
        assert raw.status(sid) == (0, "")
        time.sleep(0.5)
    assert not raw.closed
    assert raw.goaway(10)
    assert raw.closed


def test_one_stream_cannot_take_every_slot(worker, triton):
    """A stream with many requests holds at most max_requests_per_stream slots; other
    clients are still admitted."""
    with held_device(worker):
        triton.start_stream(callback=lambda result, error: None)
        for _ in range(10):
            triton.async_stream_infer("classifier", [infer_input("x", x_rows(1))])
        wait_until(lambda: inflight(worker) == 2, what="the stream's 2 slots")
        other: queue.Queue = queue.Queue()
        with connect(worker) as second:
            second.async_infer(
                "classifier", [infer_input("x", x_rows(1))], lambda r, e: other.put((r, e))
            )
            wait_until(lambda: inflight(worker) == 3, what="the other client admitted")
            triton.stop_stream(cancel_requests=True)
    wait_until(lambda: settled(worker), timeout=10)


def test_descriptors_stay_flat(worker):
    """Connections abandoned every way there is leave no descriptor behind."""
    clients = []
    for i in range(40):
        raw = RawH2(worker.port, preface=i % 4 != 0)
        if i % 4 == 1:
            raw.start()  # a call without its message
        elif i % 4 == 2:
            raw.send(raw.start(), message(bytes(1000), length=100_000))  # half a message
        clients.append(raw)
    for raw in clients[::2]:
        raw.abort()
    assert accepted_connections(worker.port) > 0
    wait_until(lambda: connections(worker) == 0, timeout=15, what="every connection closed")
    for raw in clients[1::2]:
        raw.close()
    wait_until(lambda: accepted_connections(worker.port) == 0, timeout=5, what="no socket left")


# -- what a client sends ---------------------------------------------------------------


def test_compressed_flag_without_an_encoding(worker):
    raw = RawH2(worker.port)
    sid = raw.start()
    raw.send(sid, message(b"\x00" * 10, compressed=True), end=True)
    code, text = raw.status(sid)
    assert code == grpc.StatusCode.INTERNAL.value[0]
    assert text == "the message has the compressed flag set, but the call declared no grpc-encoding"
    raw.close()


def test_overlong_model_name_is_invalid_argument(tmp_path, cache_dir):
    config = worker_config(
        make_repo(tmp_path / "repo", "classifier"), cache_dir, MODEL_CONTROL_MODE="explicit"
    )
    with running(config) as w, connect(w) as triton:
        with raises_status("INVALID_ARGUMENT", "at most 255 bytes") as info:
            triton.load_model("m" * 5000)
        assert str(tmp_path) not in info.value.message()
        with raises_status("NOT_FOUND", "no such model") as info:
            triton.load_model("nope")
        assert str(tmp_path) not in info.value.message()


# -- shared memory -----------------------------------------------------------------------


@pytest.fixture
def shm_region():
    made = []

    def create(size: int):
        key = f"/rsrv_hard_{uuid.uuid4().hex[:10]}"
        handle = tshm.create_shared_memory_region(key[1:], key, size)
        made.append(handle)
        return key, handle

    yield create
    for handle in made:
        tshm.destroy_shared_memory_region(handle)


def test_truncated_region_fails_the_request_not_the_server(worker, triton, shm_region):
    """The client shrinks its registered object, then names it in a request: before,
    the worker died of SIGBUS; now the request fails and the worker serves on."""
    x = x_rows(8)
    key, handle = shm_region(x.nbytes)
    tshm.set_shared_memory_region(handle, [x])
    triton.register_system_shared_memory("xin", key, x.nbytes)
    triton.register_system_shared_memory("out", key, x.nbytes)
    try:
        tensor = grpcclient.InferInput("x", list(x.shape), "FP32")
        tensor.set_shared_memory("xin", x.nbytes)
        assert triton.infer("classifier", [tensor]).as_numpy("logits").shape == (8, 10)
        os.truncate(f"/dev/shm{key}", 16)
        with raises_status("INVALID_ARGUMENT", "is now 16 bytes", "must not shrink"):
            triton.infer("classifier", [tensor])
        output = grpcclient.InferRequestedOutput("logits")
        output.set_shared_memory("out", 8 * 10 * 4)
        with raises_status("INVALID_ARGUMENT", "is now 16 bytes"):
            triton.infer("classifier", [infer_input("x", x)], outputs=[output])
        assert triton.is_server_live()
        assert triton.infer("classifier", [infer_input("x", x)]).as_numpy("logits").shape == (
            8,
            10,
        )
    finally:
        triton.unregister_system_shared_memory()


def test_shared_memory_registrations_are_capped(worker, triton, shm_region):
    key, _ = shm_region(64)
    try:
        for i in range(4):
            triton.register_system_shared_memory(f"r{i}", key, 64)
        with raises_status("RESOURCE_EXHAUSTED", "4 regions", "endpoints.max_shm_regions"):
            triton.register_system_shared_memory("r4", key, 64)
    finally:
        triton.unregister_system_shared_memory()
    triton.register_system_shared_memory("again", key, 64)
    triton.unregister_system_shared_memory()


def test_threads_stay_flat_under_abandoned_calls(worker):
    """Cancelled calls leave no thread behind either."""
    before = threading.active_count()
    with grpc.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
        call = channel.unary_unary(
            INFER,
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        for _ in range(20):
            call.future(infer_request()).cancel()
    wait_until(lambda: settled(worker), timeout=10)
    assert threading.active_count() <= before + 4  # grpcio's own channel threads
