"""Helpers for the end-to-end KServe / Triton tests (test_kserve*, test_triton*,
test_shm_e2e): the extra test bundles, a model repository builder, status assertions.

No tests here. Every test module starts its own worker (module-scoped) on 127.0.0.1
port 0 with :func:`serving.running`, over a repository built by :func:`make_repo`.

Test bundles (exported once per session into a temporary directory, then copied):

* ``classifier``, ``severity_grader``: copies of the examples in bundles/.
* ``simple``: Triton's standard example model. INPUT0, INPUT1 INT32[n,16] ->
  OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1; compiled sizes 1, 4, 8.
* ``simple_string``: Triton's ``simple_string``: the same with BYTES tensors holding
  decimal integers; model.py parses them (preprocess) and formats the results
  (postprocess). A non-integer element makes the preprocess hook raise.
* ``slow``: x FP32[n,4] -> y = 2x; its preprocess sleeps ``x[0, 0]`` seconds (at most
  10), so a test can hold requests in flight, and raises ``ValueError("boom: ...")``
  when ``x[0, 0]`` is negative. ``ACTIVE[0]`` in its model.py counts sleeping hooks.
* ``unbatched``: x FP32[4] -> y FP32[3] = x W (no batch axis, one module).
* ``broken``: the classifier with an unsupported ``format_version``: UNAVAILABLE.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import trio
import tritonclient.grpc as grpcclient
from serving import BUNDLES
from tritonclient.utils import InferenceServerException

EXAMPLES = ("classifier", "severity_grader")
GENERATED = ("simple", "simple_string", "slow", "unbatched")

SIMPLE_STRING_MODEL_PY = '''\
"""simple_string: BYTES decimal integers in and out around an INT32 add/subtract."""

import numpy as np

import rsrv


@rsrv.preprocess(inputs=["INPUT0", "INPUT1"], outputs=["a", "b"])
def parse(input0, input1):
    def ints(t):
        return np.array([int(v) for v in t.reshape(-1)], np.int32).reshape(t.shape)
    return ints(input0), ints(input1)


@rsrv.postprocess(inputs=["sum", "diff"], outputs=["OUTPUT0", "OUTPUT1"])
def format_results(total, diff):
    def text(t):
        out = np.empty(t.size, dtype=object)
        out[:] = [str(int(v)).encode() for v in t.reshape(-1)]
        return out.reshape(t.shape)
    return text(total), text(diff)
'''

SLOW_MODEL_PY = '''\
"""slow: the preprocess hook sleeps x[0, 0] seconds (at most 10) to hold a request."""

import threading
import time

import rsrv

ACTIVE = [0]  # hooks sleeping right now (the tests poll it)
_LOCK = threading.Lock()


@rsrv.preprocess(inputs=["x"], outputs=["x"])
def hold(x):
    seconds = float(x.reshape(-1)[0])
    if seconds < 0:
        raise ValueError(f"boom: asked to hold for {seconds:g} seconds")
    with _LOCK:
        ACTIVE[0] += 1
    try:
        time.sleep(min(seconds, 10.0))
    finally:
        with _LOCK:
            ACTIVE[0] -= 1
    return x
'''


def _export(**kwargs) -> Path:
    from rsrv.export import export_jax

    return export_jax(provenance={"source": "tests/test_kserve_support.py"}, parity=False, **kwargs)


def _build_simple(out: Path) -> None:
    from rsrv.export import Input, Output

    _export(
        fn=lambda p, a, b: (a + b, a - b),
        params={},
        inputs=[Input("INPUT0", np.int32, ("n", 16)), Input("INPUT1", np.int32, ("n", 16))],
        outputs=[Output("OUTPUT0"), Output("OUTPUT1")],
        batch_sizes=[1, 4, 8],
        out_dir=out,
        description="Triton's simple: sum and difference of two INT32[16]",
    )


def _build_simple_string(out: Path) -> None:
    from rsrv.bundle._manifest import TensorSpec
    from rsrv.export import Input, Output

    def spec(name):
        return TensorSpec(name=name, dtype="bytes", shape="nk", dims={"k": 16})

    _export(
        fn=lambda p, a, b: (a + b, a - b),
        params={},
        inputs=[Input("a", np.int32, ("n", 16)), Input("b", np.int32, ("n", 16))],
        outputs=[Output("sum"), Output("diff")],
        batch_sizes=[1, 4],
        client_inputs=[spec("INPUT0"), spec("INPUT1")],
        client_outputs=[spec("OUTPUT0"), spec("OUTPUT1")],
        model_py=SIMPLE_STRING_MODEL_PY,
        out_dir=out,
        description="Triton's simple_string: BYTES decimal integers",
    )


def _build_slow(out: Path) -> None:
    from rsrv.export import Input, Output

    _export(
        fn=lambda p, x: x * p["scale"],
        params={"scale": np.float32(2.0)},
        inputs=[Input("x", np.float32, ("n", 4))],
        outputs=[Output("y")],
        batch_sizes=[1, 4],
        model_py=SLOW_MODEL_PY,
        out_dir=out,
        description="y = 2x after a preprocess that sleeps x[0, 0] seconds",
    )


UNBATCHED_W = np.arange(12, dtype=np.float32).reshape(4, 3) / 10


def _build_unbatched(out: Path) -> None:
    from rsrv.export import Input, Output

    _export(
        fn=lambda p, x: x @ p["w"],
        params={"w": UNBATCHED_W},
        inputs=[Input("x", np.float32, (4,))],
        outputs=[Output("y")],
        batch_sizes=[],
        out_dir=out,
        description="y = x W without a batch axis",
    )


_BUILDERS: dict[str, Callable[[Path], None]] = {
    "simple": _build_simple,
    "simple_string": _build_simple_string,
    "slow": _build_slow,
    "unbatched": _build_unbatched,
}


@functools.cache
def _scratch() -> Path:
    path = Path(tempfile.mkdtemp(prefix="rsrv-kserve-tests-"))
    atexit.register(shutil.rmtree, path, True)
    return path


_lock = threading.Lock()


def template(name: str) -> Path:
    """The session's built copy of test bundle ``name`` (built on first use)."""
    out = _scratch() / "templates" / name
    with _lock:
        if not out.is_dir():
            _BUILDERS[name](out)
    return out


def cache_dir() -> Path:
    """One compilation cache for every worker of the session."""
    return _scratch() / "cache"


def make_repo(root: Path, *names: str) -> Path:
    """A model repository at ``root`` holding copies of the named bundles."""
    root.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__")
    for name in names:
        if name in EXAMPLES:
            shutil.copytree(BUNDLES / name, root / name, ignore=ignore)
        elif name == "broken":
            shutil.copytree(BUNDLES / "classifier", root / name, ignore=ignore)
            manifest = root / name / "manifest.yaml"
            text = manifest.read_text()
            assert "format_version: '2.0'" in text
            manifest.write_text(text.replace("format_version: '2.0'", "format_version: '9.9'"))
        else:
            shutil.copytree(template(name), root / name, ignore=ignore)
    return root


# -- clients and assertions ------------------------------------------------------------------


def client(worker, **kwargs) -> grpcclient.InferenceServerClient:
    from serving import url

    return grpcclient.InferenceServerClient(url(worker), **kwargs)


def infer_input(name: str, array: np.ndarray, datatype: str | None = None) -> grpcclient.InferInput:
    from tritonclient.utils import np_to_triton_dtype

    tensor = grpcclient.InferInput(
        name, list(array.shape), datatype or np_to_triton_dtype(array.dtype)
    )
    tensor.set_data_from_numpy(array)
    return tensor


@contextlib.contextmanager
def raises_status(code: str, *fragments: str) -> Iterator[pytest.ExceptionInfo]:
    """Expect an InferenceServerException with gRPC status ``code`` (e.g. "NOT_FOUND")
    whose message contains every fragment."""
    with pytest.raises(InferenceServerException) as info:
        yield info
    check_error(info.value, code, *fragments)


def check_error(error: InferenceServerException, code: str, *fragments: str) -> None:
    assert error.status() == f"StatusCode.{code}", (error.status(), error.message())
    message = error.message() or ""
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert "Traceback" not in message


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.005)


def hook_globals(worker, model: str) -> dict:
    """The module globals of ``model``'s model.py as the worker loaded it."""
    hooks = worker.models.get(model).bundle.hooks
    hook = hooks.preprocess or hooks.postprocess
    return hook.fn.__globals__


def sched_stats(worker, model: str):
    """The scheduler's statistics of ``model`` (queue depth, dispatches), read in the
    worker's loop."""
    from serving import in_loop

    return in_loop(worker, worker.scheduler.stats, model)


def stats_of(triton, model: str):
    (stats,) = triton.get_inference_statistics(model).model_stats
    return stats


@contextlib.contextmanager
def held_device(worker) -> Iterator[threading.Event]:
    """Hold the worker's device: every execution waits until the yielded event is set
    (set on exit too). Requests then stay queued in the scheduler, as behind a slow
    model, while everything else (transport, decoding, admission) is the real server."""
    gate = threading.Event()
    original = worker.executor.execute

    async def execute(model, batch_size, inputs):
        await trio.to_thread.run_sync(gate.wait, 30.0)
        return await original(model, batch_size, inputs)

    worker.executor.execute = execute
    try:
        yield gate
    finally:
        gate.set()
        del worker.executor.execute  # the class's method again


# -- a raw purerpc client: no local deadline, one HTTP/2 connection -------------------------

SERVICE = "inference.GRPCInferenceService"


class RawChannel:
    """Calls over ONE purerpc connection (purerpc never reconnects). Unlike grpcio, purerpc
    sends ``grpc-timeout`` but enforces nothing itself, so a DEADLINE_EXCEEDED seen here
    was decided by the server. Failures raise purerpc's ``RpcFailedError`` (``.status``)."""

    def __init__(self, channel, port: int):
        self._channel = channel
        self._authority = f"127.0.0.1:{port}"

    async def _start(self, method: str, request_type, response_type, timeout: float | None):
        import datetime

        stream = await self._channel._grpc_socket.start_request(
            "http",
            SERVICE,
            method,
            request_type.DESCRIPTOR.full_name,
            self._authority,
            None if timeout is None else datetime.timedelta(seconds=timeout),
        )
        stream.expect_message_type(response_type)
        return stream

    async def unary(self, method: str, request, response_type, *, timeout: float | None = None):
        from purerpc.wrappers import (
            extract_message_from_singleton_stream,
            send_single_message_client,
        )

        stream = await self._start(method, type(request), response_type, timeout)
        await send_single_message_client(stream, request)
        return await extract_message_from_singleton_stream(stream)

    async def stream(
        self,
        method: str,
        requests: list,
        response_type,
        *,
        timeout: float | None = None,
        keep_open: bool = True,
    ) -> list:
        """Send ``requests`` on one stream (left open when ``keep_open``) and collect the
        responses until the server ends the stream (which raises on a non-OK status)."""
        from purerpc.wrappers import stream_to_async_iterator

        stream = await self._start(method, type(requests[0]), response_type, timeout)
        for request in requests:
            await stream.send_message(request)
        if not keep_open:
            await stream.close()
        return [response async for response in stream_to_async_iterator(stream)]


@contextlib.asynccontextmanager
async def raw_channel(worker):
    import purerpc

    async with purerpc.insecure_channel("127.0.0.1", worker.port) as channel:
        yield RawChannel(channel, worker.port)


def rpc_status(error) -> tuple[str, str]:
    """(status name, message) of a purerpc RpcFailedError."""
    return error.status.status_code.name, error.status.status_message
