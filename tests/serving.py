"""Run a real worker on a loopback port for tests that drive it with tritonclient.

tritonclient.grpc is synchronous, so the worker runs its own trio loop in a background
thread; tests talk to it over real gRPC on 127.0.0.1 exactly like any client would.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import trio

from rsrv.config import load_node, resolve_worker
from rsrv.runtime import backend
from rsrv.worker import Worker

ROOT = Path(__file__).resolve().parent.parent
BUNDLES = ROOT / "bundles"


def worker_config(
    repo: Path = BUNDLES,
    cache_dir: Path | None = None,
    env: Mapping[str, str] | None = None,
    **settings: Any,
):
    """A WorkerConfig on a free port; ``settings`` are INFERENCE_SERVER_* style overrides,
    e.g. ``SCHEDULER_MAX_QUEUE_DEPTH=2``."""
    variables = {
        "INFERENCE_SERVER_MODEL_REPO": str(repo),
        "INFERENCE_SERVER_ENDPOINTS_PORT": "1",
    }  # replaced by port 0 below
    if cache_dir is not None:
        variables["INFERENCE_SERVER_CACHE_DIR"] = str(cache_dir)
    variables.update({f"INFERENCE_SERVER_{k}": str(v) for k, v in settings.items()})
    variables.update(env or {})
    config = resolve_worker(load_node(None), None, variables)
    import msgspec

    return msgspec.structs.replace(
        config, endpoints=msgspec.structs.replace(config.endpoints, port=0)
    )


@contextmanager
def running(config) -> Iterator[Worker]:
    """Start a worker in a background thread; yield it once ready; stop it on exit."""
    backend.configure("cpu")
    worker = Worker(config)
    started = threading.Event()
    state: dict[str, Any] = {}

    async def main():
        state["token"] = _tokens[id(worker)] = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            state["scope"] = nursery.cancel_scope
            await nursery.start(worker.run)
            started.set()

    def thread_main():
        try:
            trio.run(main)
        except BaseException as e:  # surfaced to the test below
            state["error"] = e
        finally:
            started.set()

    thread = threading.Thread(target=thread_main, name="rsrv-test-worker", daemon=True)
    thread.start()
    assert started.wait(120), "the worker did not start within 120 s"
    if "error" in state:
        raise state["error"]
    try:
        yield worker
    finally:
        trio.from_thread.run_sync(state["scope"].cancel, trio_token=state["token"])
        thread.join(30)
        assert not thread.is_alive(), "the worker did not stop within 30 s"
        _tokens.pop(id(worker), None)
        if "error" in state:
            raise state["error"]


def url(worker: Worker) -> str:
    return f"127.0.0.1:{worker.port}"


_tokens: dict[int, trio.lowlevel.TrioToken] = {}  # id(worker) -> its loop, while running


def in_loop(worker: Worker, fn, *args):
    """``fn(*args)`` run synchronously on the worker's trio loop (e.g. to read
    ``worker.scheduler.stats(name)``, which needs the loop's clock); returns its result."""
    return trio.from_thread.run_sync(fn, *args, trio_token=_tokens[id(worker)])
