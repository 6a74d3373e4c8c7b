"""Run a real worker on a loopback port for tests that drive it with tritonclient.

:func:`running` runs the worker in this process: tritonclient.grpc is synchronous, so the
worker runs its own trio loop in a background thread; tests talk to it over real gRPC on
127.0.0.1 exactly like any client would. :class:`ServerProcess` runs the real
``rsrv serve NODE_FILE`` command instead, for what only a process shows (signals, exit
status, memory, survival of hostile input).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import trio

from rsrv.config import load_node, resolve_worker
from rsrv.runtime import configure
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


def node_config(directory: Path, node: str, worker: str | None = None):
    """The WorkerConfig of node file text ``node`` (written to ``directory/node.toml``,
    resolved without environment overrides), on a free port."""
    import msgspec

    path = directory / "node.toml"
    path.write_text(node)
    config = resolve_worker(load_node(path), worker, {}, source=path)
    return msgspec.structs.replace(
        config, endpoints=msgspec.structs.replace(config.endpoints, port=0)
    )


@contextmanager
def running(config) -> Iterator[Worker]:
    """Start a worker in a background thread; yield it once ready; stop it on exit."""
    configure("cpu")
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A ``rsrv serve NODE_FILE`` subprocess; stderr is collected line by line.

    ``node`` is the node file's TOML; ``{port}`` and ``{metrics_port}`` in it are
    replaced by free ports (``self.port``, ``self.metrics_port``). Runs in ``workdir``
    with no ``INFERENCE_SERVER_*`` variables but those in ``env``.
    """

    def __init__(self, workdir: Path, node: str, env: Mapping[str, str] | None = None):
        self.port, self.metrics_port = free_port(), free_port()
        path = workdir / "node.toml"
        path.write_text(
            node.replace("{port}", str(self.port)).replace("{metrics_port}", str(self.metrics_port))
        )
        environ = {k: v for k, v in os.environ.items() if not k.startswith("INFERENCE_SERVER_")}
        environ.update(env or {})
        script = Path(sys.executable).parent / "rsrv"
        command = [str(script)] if script.exists() else [sys.executable, "-m", "rsrv.cli"]
        self.process = subprocess.Popen(
            [*command, "serve", str(path)],
            cwd=workdir,
            env=environ,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stderr: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.url = f"127.0.0.1:{self.port}"

    def _read(self) -> None:
        for line in self.process.stderr:
            self.stderr.append(line.rstrip("\n"))

    def wait_ready(self, client, timeout: float = 60) -> None:
        """Until ``client`` (tritonclient) sees the server ready."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, "\n".join(self.stderr)
            try:
                if client.is_server_ready():
                    return
            except Exception:
                pass
            assert time.monotonic() < deadline, "the server did not get ready"
            time.sleep(0.1)

    def rss(self) -> int:
        """Resident memory of the server, in bytes."""
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        finally:
            self.kill()
            self._reader.join(5)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
