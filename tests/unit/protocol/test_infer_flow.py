"""One request's life (rsrv.protocol._infer_flow): decoding and encoding leave the event
loop for a worker thread when they are expected to take long (many BYTES elements, large
copies), and stay on it otherwise; the estimates come from the checked request."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
from tritonclient.grpc import service_pb2 as t_svc

from rsrv.bundle import Tensor
from rsrv.dtypes import DType
from rsrv.protocol._decode import plan_request
from rsrv.protocol._infer_flow import OFFLOAD_SECONDS, encode_seconds, infer_counted
from rsrv.protocol._parameters import ShmTarget
from rsrv.protocol._rest_codec import RestInput, RestRequest, rest_decode_seconds
from rsrv.protocol._tensors import Decoding, InputPlan


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


def spec(name: str, dtype: DType, shape: tuple[int, ...]) -> Tensor:
    return Tensor(name, dtype, "nabc"[: len(shape)], shape, 0)


def test_estimates_from_the_checked_request():
    numeric = tensor("x", np.zeros((4096, 256), np.float32), "FP32")  # 4 MiB, zero-copy
    assert plan_request(request(numeric), [spec("x", DType.F32, (-1, 256))]).seconds == 0.0
    words = [spec("s", DType.BYTES, (-1, 1))]
    few = tensor("s", np.array([[b"a"]] * 100, dtype=object), "BYTES")
    many = tensor("s", np.array([[b"a"]] * 20_000, dtype=object), "BYTES")
    assert plan_request(request(few), words).seconds < OFFLOAD_SECONDS
    assert plan_request(request(many), words).seconds > OFFLOAD_SECONDS
    x = spec("x", DType.F32, (-1, 256))  # 16 MiB to copy out of a region
    in_shm = InputPlan(x, "x", (16384, 256), 16384 * 256, shm=ShmTarget("r", 16384 * 1024))
    assert Decoding([in_shm], None, None).seconds > OFFLOAD_SECONDS
    assert encode_seconds({"y": np.zeros((8, 10), np.float32)}) < OFFLOAD_SECONDS
    assert encode_seconds({"y": np.array([b"a"] * 20_000, dtype=object)}) > OFFLOAD_SECONDS


class Ready:
    """A request ready to decode, recording the thread it is decoded in."""

    def __init__(self, seconds: float, threads: dict):
        self.seconds, self.threads = seconds, threads

    def materialize(self):
        self.threads["decode"] = threading.get_ident()
        return {}


@pytest.mark.parametrize("heavy", [False, True])
async def test_long_work_runs_in_a_worker_thread(heavy):
    loop_thread = threading.get_ident()
    threads = {}
    outputs = {"y": np.array([b"a"] * (20_000 if heavy else 10), dtype=object)}

    def prepare(now):
        threads["prepare"] = threading.get_ident()
        return Ready(1.0 if heavy else 0.0, threads), None

    def finish(outs):
        threads["finish"] = threading.get_ident()
        return "answer"

    backend = Backend(outputs)
    prepare_seconds = 1.0 if heavy else 0.0  # (large raw entries to take out)
    got = await infer_counted(backend, Served(), 0.0, prepare, finish, prepare_seconds)
    assert got == "answer" and backend.records == [(True, "OK")]
    on_loop = {k: v == loop_thread for k, v in threads.items()}
    assert on_loop == {"prepare": not heavy, "decode": not heavy, "finish": not heavy}


def test_a_rest_shape_of_millions_of_dimensions_is_not_walked_to_estimate():
    """A REST BYTES input in binary data with a 2M-dimension shape (20M: the loop held
    2 s before the rank check refused it): the estimate counts nothing for it."""
    tensor = RestInput("s", "BYTES", [1] * 2_000_000, {"binary_data_size": 8})
    assert rest_decode_seconds(RestRequest([tensor])) == 0.0
    tensor = RestInput("s", "BYTES", [1, 4], {"binary_data_size": 8})
    assert rest_decode_seconds(RestRequest([tensor])) > 0.0
