"""Seeded mutational fuzzing of every RPC against a real ``rsrv serve`` process.

Valid request bodies (ModelInfer for every example model, in raw, typed, BYTES-free and
shared-memory forms, and one for each other RPC) are mutated at the byte level (bit
flips, overwrites, insertions, deletions, truncation, duplicated slices) and at the field
level (shapes, datatypes, names, parameters of every type, counts), then sent as raw
bytes. Every answer must be a deliberate status: never UNKNOWN or CANCELLED, never an
INTERNAL that leaks a Python exception, never a traceback; every classifier answer that
succeeds must equal the numpy reference for the request as the wire defines it; the
process must survive and still answer correctly at the end.

``just test`` runs a few thousand cases; the ``slow`` test runs 50,000.
"""

from __future__ import annotations

import random
import re
import threading

import grpc
import numpy as np
import pytest
from support import references
from support.clients import connect, infer_input
from support.serving import examples_server

from rsrv.protocol.generated.inference import grpc_service_pb2 as pb
from rsrv.protocol.generated.rsrv.control.v1 import control_pb2 as cpb

INFERENCE = "/inference.GRPCInferenceService/"
CONTROL = "/rsrv.control.v1.ControlService/"
LEAK = re.compile(r"^[A-Z]\w*(Error|Exception|Warning)\b|Traceback|<[a-z_.]+ object at 0x")


def classifier_reference(x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):  # fuzzed bytes hold NaN and inf
        weights = references.example_weights("classifier")
        return references.classifier_reference(weights, x)


def _infer(model: str, name: str, dtype: str, array: np.ndarray, typed: str | None = None):
    request = pb.ModelInferRequest(model_name=model, id="fuzz")
    tensor = request.inputs.add(name=name, datatype=dtype, shape=list(array.shape))
    if typed:
        getattr(tensor.contents, typed).extend(array.reshape(-1).tolist())
    else:
        request.raw_input_contents.append(array.tobytes())
    return request


def seeds(rng: np.random.Generator) -> list[tuple[str, bytes]]:
    x1 = rng.standard_normal((1, 256)).astype(np.float32)
    x8 = rng.standard_normal((8, 256)).astype(np.float32)
    image = rng.integers(0, 255, (2, 32, 32, 3), dtype=np.uint8)
    region = rng.random((64, 64)).astype(np.float32)
    infer = [
        _infer("classifier", "x", "FP32", x1),
        _infer("classifier", "x", "FP32", x8),
        _infer("classifier", "x", "FP32", x1, typed="fp32_contents"),
        _infer("severity_grader", "image", "UINT8", image),
        _infer("severity_grader", "image", "UINT8", image[:1], typed="uint_contents"),
        _infer("region_pipeline", "image", "FP32", region),
    ]
    shm = _infer("classifier", "x", "FP32", x1)
    del shm.raw_input_contents[:]
    params = shm.inputs[0].parameters
    params["shared_memory_region"].string_param = "nowhere"
    params["shared_memory_byte_size"].int64_param = 1024
    out = shm.outputs.add(name="logits")
    out.parameters["shared_memory_region"].string_param = "nowhere"
    out.parameters["shared_memory_byte_size"].int64_param = 40
    infer.append(shm)
    timed = _infer("classifier", "x", "FP32", x1)
    timed.parameters["timeout"].int64_param = 10_000_000
    timed.parameters["priority"].uint64_param = 1
    infer.append(timed)
    calls = [(INFERENCE + "ModelInfer", r.SerializeToString()) for r in infer]
    others = {
        "ServerLive": pb.ServerLiveRequest(),
        "ServerReady": pb.ServerReadyRequest(),
        "ModelReady": pb.ModelReadyRequest(name="classifier", version="1"),
        "ServerMetadata": pb.ServerMetadataRequest(),
        "ModelMetadata": pb.ModelMetadataRequest(name="severity_grader"),
        "ModelConfig": pb.ModelConfigRequest(name="classifier"),
        "ModelStatistics": pb.ModelStatisticsRequest(name="classifier"),
        "RepositoryIndex": pb.RepositoryIndexRequest(ready=True),
        "RepositoryModelLoad": pb.RepositoryModelLoadRequest(model_name="classifier"),
        "RepositoryModelUnload": pb.RepositoryModelUnloadRequest(model_name="classifier"),
        "SystemSharedMemoryStatus": pb.SystemSharedMemoryStatusRequest(name="r"),
        "SystemSharedMemoryRegister": pb.SystemSharedMemoryRegisterRequest(
            name="r", key="/rsrv_fuzz_absent", offset=0, byte_size=64
        ),
        "SystemSharedMemoryUnregister": pb.SystemSharedMemoryUnregisterRequest(name="r"),
        "CudaSharedMemoryStatus": pb.CudaSharedMemoryStatusRequest(),
        "CudaSharedMemoryRegister": pb.CudaSharedMemoryRegisterRequest(name="c", byte_size=8),
        "TraceSetting": pb.TraceSettingRequest(model_name="classifier"),
    }
    calls += [(INFERENCE + k, v.SerializeToString()) for k, v in others.items()]
    control = {
        "ModelControlStatus": cpb.ModelControlStatusRequest(),
        "SetModelPolicy": cpb.SetModelPolicyRequest(name="classifier", weight=1.0),
        "SetModelResidency": cpb.SetModelResidencyRequest(name="classifier", residency=1),
        "CompactMemory": cpb.CompactMemoryRequest(reload_models=["classifier"]),
    }
    calls += [(CONTROL + k, v.SerializeToString()) for k, v in control.items()]
    return calls


# -- mutations -------------------------------------------------------------------------------

INTERESTING = [0, 1, -1, 2, 255, 256, 1 << 31, (1 << 31) - 1, -(1 << 31), (1 << 63) - 1, 1 << 40]
DTYPES = ["FP32", "FP16", "BF16", "FP64", "INT8", "UINT8", "INT64", "BOOL", "BYTES", "", "fp32"]


def mutate_bytes(data: bytes, rnd: random.Random) -> bytes:
    buf = bytearray(data)
    for _ in range(rnd.randint(1, 4)):
        op = rnd.randrange(6)
        at = rnd.randrange(len(buf) + 1)
        if op == 0 and buf:
            i = rnd.randrange(len(buf))
            buf[i] ^= 1 << rnd.randrange(8)
        elif op == 1 and buf:
            i = rnd.randrange(len(buf))
            buf[i] = rnd.choice([0, 0x7F, 0x80, 0xFF, rnd.randrange(256)])
        elif op == 2:
            buf[at:at] = bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 8)))
        elif op == 3 and buf:
            del buf[at : at + rnd.randint(1, 16)]
        elif op == 4:
            del buf[at:]
        else:
            end = min(len(buf), at + rnd.randint(1, 64))
            buf[end:end] = buf[at:end]
    return bytes(buf)


def mutate_fields(request: pb.ModelInferRequest, rnd: random.Random) -> None:
    for _ in range(rnd.randint(1, 3)):
        op = rnd.randrange(10)
        tensors = list(request.inputs) or [request.inputs.add(name="x")]
        tensor = rnd.choice(tensors)
        if op == 0:
            shape = list(tensor.shape) or [1]
            shape[rnd.randrange(len(shape))] = rnd.choice(INTERESTING)
            del tensor.shape[:]
            tensor.shape.extend(max(min(s, (1 << 63) - 1), -(1 << 63)) for s in shape)
        elif op == 1:
            if rnd.random() < 0.5:
                tensor.shape.append(rnd.choice([1, 2, 0]))
            elif tensor.shape:
                del tensor.shape[-1]
        elif op == 2:
            tensor.datatype = rnd.choice(DTYPES)
        elif op == 3:
            tensor.name = rnd.choice(["", "x", "image", "y", "x" * 300, "\u00e9", "logits"])
        elif op == 4:
            request.model_name = rnd.choice(
                ["", "classifier", "region_scorer", "nope", "a/b", "x" * 5000, "severity_grader"]
            )
        elif op == 5:
            request.raw_input_contents.append(bytes(rnd.randrange(2048)))
        elif op == 6:
            target = rnd.choice([request.parameters, tensor.parameters])
            key = rnd.choice(
                [
                    "timeout",
                    "priority",
                    "shared_memory_region",
                    "shared_memory_byte_size",
                    "shared_memory_offset",
                    "binary_data",
                    "classification",
                ]
            )
            kind = rnd.randrange(5)
            value = target[key]
            if kind == 0:
                value.int64_param = rnd.choice(INTERESTING)
            elif kind == 1:
                value.uint64_param = rnd.choice([0, 1, (1 << 64) - 1])
            elif kind == 2:
                value.string_param = rnd.choice(["", "r", "nowhere", "\x00"])
            elif kind == 3:
                value.bool_param = rnd.random() < 0.5
            else:
                value.double_param = rnd.choice([0.0, -1.0, float("nan"), float("inf")])
        elif op == 7:
            extra = request.inputs.add()
            extra.CopyFrom(tensor)
        elif op == 8:
            out = request.outputs.add(name=rnd.choice(["logits", "grade", "nope", "regions"]))
            if rnd.random() < 0.3:
                out.parameters["classification"].int64_param = 3
        else:
            tensor.contents.int64_contents.extend([rnd.choice(INTERESTING)] * rnd.randint(1, 9))


def cases(seed: int, count: int):
    rnd = random.Random(seed)
    base = seeds(np.random.default_rng(seed))
    for _ in range(count):
        path, body = rnd.choice(base)
        if path.endswith("ModelInfer") and rnd.random() < 0.5:
            request = pb.ModelInferRequest.FromString(body)
            mutate_fields(request, rnd)
            body = request.SerializeToString()
            if rnd.random() < 0.3:
                body = mutate_bytes(body, rnd)
        else:
            body = mutate_bytes(body, rnd)
        yield path, body


# -- the oracle ------------------------------------------------------------------------------


def expected_classifier(body: bytes) -> np.ndarray | None:
    """The classifier's answer to ``body`` as the wire defines it, or None when the
    request is not one plain raw FP32 [n, 256] input (other forms are checked for
    status only)."""
    try:
        request = pb.ModelInferRequest.FromString(body)
    except Exception:
        return None
    if (
        request.model_name != "classifier"
        or len(request.inputs) != 1
        or len(request.raw_input_contents) != 1
        or request.inputs[0].parameters
    ):
        return None
    tensor = request.inputs[0]
    shape = list(tensor.shape)
    raw = request.raw_input_contents[0]
    if tensor.datatype != "FP32" or len(shape) != 2 or shape[1] != 256 or shape[0] < 1:
        return None
    if len(raw) != shape[0] * 1024:
        return None
    return classifier_reference(np.frombuffer(raw, np.float32).reshape(shape))


class Findings:
    def __init__(self):
        self.codes: dict[str, int] = {}
        self.bad: list[str] = []
        self.lock = threading.Lock()

    def check(self, path: str, body: bytes, error: grpc.RpcError | None, response) -> None:
        code = "OK" if error is None else error.code().name
        problem = None
        if error is not None:
            message = error.details() or ""
            if code in ("UNKNOWN", "CANCELLED") or LEAK.search(message):
                problem = f"{code}: {message[:300]}"
        elif path.endswith("ModelInfer"):
            want = expected_classifier(body)
            if want is not None:
                reply = pb.ModelInferResponse.FromString(response)
                got = np.frombuffer(reply.raw_output_contents[0], np.float32)
                if got.shape != (want.size,) or not np.allclose(
                    got.reshape(want.shape), want, rtol=1e-4, atol=1e-4, equal_nan=True
                ):
                    problem = "wrong classifier answer"
        with self.lock:
            self.codes[code] = self.codes.get(code, 0) + 1
            if problem:
                self.bad.append(f"{path} {body[:80]!r}: {problem}")


def fuzz(url: str, seed: int, count: int, threads: int = 4) -> Findings:
    findings = Findings()
    work = list(cases(seed, count))

    def run(part: list[tuple[str, bytes]]) -> None:
        with grpc.insecure_channel(url) as channel:
            methods = {}
            for path, body in part:
                call = methods.get(path) or methods.setdefault(path, channel.unary_unary(path))
                try:
                    response = call(body, timeout=30)
                except grpc.RpcError as e:
                    findings.check(path, body, e, None)
                else:
                    findings.check(path, body, None, response)

    workers = [
        threading.Thread(target=run, args=(work[i::threads],), daemon=True) for i in range(threads)
    ]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return findings


def run_campaign(tmp_path, cache_dir, seed: int, count: int) -> Findings:
    server = examples_server(tmp_path, cache_dir)
    try:
        with connect(server) as triton:
            server.wait_ready(triton)
            findings = fuzz(server.url, seed, count)
            assert server.process.poll() is None, "\n".join(server.stderr[-30:])
            x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
            logits = triton.infer("classifier", [infer_input("x", x)]).as_numpy("logits")
            np.testing.assert_allclose(logits, classifier_reference(x), rtol=1e-4, atol=1e-4)
        tracebacks = [line for line in server.stderr if "Traceback" in line]
        assert not tracebacks, "\n".join(server.stderr[-40:])
    finally:
        server.kill()
    assert not findings.bad, findings.bad[:10]
    return findings


def test_fuzz_every_rpc(tmp_path, cache_dir):
    findings = run_campaign(tmp_path, cache_dir, seed=12, count=3000)
    print("\nfuzz: 3,000 cases, statuses", dict(sorted(findings.codes.items())))
    # the campaign reached both sides of the checks
    assert findings.codes.get("OK", 0) > 100 and findings.codes.get("INVALID_ARGUMENT", 0) > 100


@pytest.mark.slow
def test_fuzz_every_rpc_long(tmp_path, cache_dir):
    findings = run_campaign(tmp_path, cache_dir, seed=2026, count=50_000)
    print("\nfuzz: 50,000 cases, statuses", dict(sorted(findings.codes.items())))
