"""One request's life (rsrv.protocol._infer_flow): decoding and encoding leave the event
loop for a worker thread when they are expected to take long (many BYTES elements, large
copies), and stay on it otherwise; the estimates come from the request's header."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
from tritonclient.grpc import service_pb2 as t_svc

from rsrv.protocol._decode import request_decode_seconds
from rsrv.protocol._infer_flow import OFFLOAD_SECONDS, encode_seconds, infer_counted


class Backend:
    """What infer_counted uses of a backend: hold, infer and record."""

    def __init__(self, outputs):
        self.outputs = outputs
        self.records = []

    @contextlib.contextmanager
    def hold(self, served):
        yield "held"

    async def infer(self, served, inputs, deadline, held=None):
        assert held == "held"
        return self.outputs

    def record(self, served, ok, seconds, status, rows):
        self.records.append((ok, status))


class Served:
    bundle = type("B", (), {"signature": type("S", (), {"client_inputs": ()})()})()


def request(*inputs) -> t_svc.ModelInferRequest:
    message = t_svc.ModelInferRequest(model_name="m")
    for tensor in inputs:
        message.inputs.extend([tensor._get_tensor()])
        if tensor._get_content() is not None:
            message.raw_input_contents.extend([tensor._get_content()])
    return message


def tensor(name, array, datatype) -> tgrpc.InferInput:
    t = tgrpc.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def test_estimates_from_the_header():
    numeric = tensor("x", np.zeros((4096, 256), np.float32), "FP32")  # 4 MiB, zero-copy
    assert request_decode_seconds(request(numeric)) == 0.0
    few = tensor("s", np.array([[b"a"]] * 100, dtype=object), "BYTES")
    many = tensor("s", np.array([[b"a"]] * 20_000, dtype=object), "BYTES")
    assert request_decode_seconds(request(few)) < OFFLOAD_SECONDS
    assert request_decode_seconds(request(many)) > OFFLOAD_SECONDS
    in_shm = tgrpc.InferInput("x", [16384, 256], "FP32")
    in_shm.set_shared_memory("r", 16384 * 256 * 4)  # 16 MiB copied out of the region
    assert request_decode_seconds(request(in_shm)) > OFFLOAD_SECONDS
    bare = tgrpc.InferInput("x", [1, 256], "FP32")
    bare.set_shared_memory("r", 1024)
    message = request(bare)
    del message.inputs[0].parameters["shared_memory_byte_size"]
    request_decode_seconds(message)  # reads the map without adding the missing key
    assert sorted(message.inputs[0].parameters) == ["shared_memory_region"]
    assert encode_seconds({"y": np.zeros((8, 10), np.float32)}) < OFFLOAD_SECONDS
    assert encode_seconds({"y": np.array([b"a"] * 20_000, dtype=object)}) > OFFLOAD_SECONDS


@pytest.mark.parametrize("heavy", [False, True])
async def test_long_work_runs_in_a_worker_thread(heavy):
    loop_thread = threading.get_ident()
    threads = {}
    outputs = {"y": np.array([b"a"] * (20_000 if heavy else 10), dtype=object)}

    def prepare(now):
        threads["prepare"] = threading.get_ident()
        return {}, None

    def finish(outs):
        threads["finish"] = threading.get_ident()
        return "answer"

    backend = Backend(outputs)
    seconds = 1.0 if heavy else 0.0
    got = await infer_counted(backend, Served(), 0.0, prepare, finish, decode_seconds=seconds)
    assert got == "answer" and backend.records == [(True, "OK")]
    on_loop = {k: v == loop_thread for k, v in threads.items()}
    assert on_loop == {"prepare": not heavy, "finish": not heavy}
