"""Serve the `classifier` bundle's numpy forward pass with NVIDIA Triton (via PyTriton).

Run with the interpreter of the Triton virtual environment that ``benchmarks/run.py``
sets up (``results/triton-venv``, made from the system python3.11), not with rsrv's:

    results/triton-venv/bin/python benchmarks/triton_server.py \
        WEIGHTS GRPC_PORT HTTP_PORT METRICS_PORT

It depends on nothing from rsrv: the weights are parsed from the safetensors file with
plain numpy. The model is bound with ``@batch`` and Triton's dynamic batcher (max batch 8,
the classifier's largest compiled size in rsrv), serving gRPC on 127.0.0.1 only. The
statistics endpoint is left unrestricted (PyTriton guards it with an access token by
default) so the benchmark can read ModelStatistics; the other endpoints PyTriton
restricts stay restricted. Prints ``READY`` once Triton answers, then serves until
SIGTERM/SIGINT.
"""

from __future__ import annotations

import json
import signal
import struct
import sys
import threading

import numpy as np

_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I64": np.int64,
    "I32": np.int32,
    "U8": np.uint8,
}


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    with open(path, "rb") as f:
        data = f.read()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    body = memoryview(data)[8 + header_len :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        out[name] = (
            np.frombuffer(body[start:end], dtype=_DTYPES[info["dtype"]])
            .reshape(info["shape"])
            .copy()
        )
    return out


def main() -> None:
    weights_path, grpc_port, http_port, metrics_port = sys.argv[1], *map(int, sys.argv[2:5])
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import (
        DEFAULT_PROTECTED_ENDPOINTS,
        Triton,
        TritonConfig,
        TritonSecurityConfig,
    )

    w = read_safetensors(weights_path)
    hw, hb, ow, ob = w["hidden.w"], w["hidden.b"], w["out.w"], w["out.b"]

    @batch
    def infer(x: np.ndarray):
        h = np.maximum(x @ hw + hb, 0.0)
        return {"logits": (h @ ow + ob).astype(np.float32)}

    config = TritonConfig(
        grpc_address="127.0.0.1",
        grpc_port=grpc_port,
        http_address="127.0.0.1",
        http_port=http_port,
        metrics_port=metrics_port,
        allow_gpu_metrics=False,
        exit_on_error=True,
        log_verbose=0,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    security = TritonSecurityConfig(
        restricted_endpoints=[e for e in DEFAULT_PROTECTED_ENDPOINTS if e != "statistics"]
    )
    with Triton(config=config, security_config=security) as triton:
        triton.bind(
            model_name="classifier",
            infer_func=infer,
            inputs=[Tensor(name="x", dtype=np.float32, shape=(256,))],
            outputs=[Tensor(name="logits", dtype=np.float32, shape=(10,))],
            config=ModelConfig(
                max_batch_size=8, batcher=DynamicBatcher(max_queue_delay_microseconds=0)
            ),
            strict=True,
        )
        triton.run()
        print("READY", flush=True)
        stop.wait()


if __name__ == "__main__":
    main()
