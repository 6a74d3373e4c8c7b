"""Run a real worker on a loopback port for tests that drive it with tritonclient.

:func:`running` runs the worker in this process: tritonclient.grpc is synchronous, so the
worker runs its own trio loop in a background thread; tests talk to it over real gRPC on
127.0.0.1 exactly like any client would. :class:`ServerProcess` runs the real
``rsrv serve NODE_FILE`` command instead, for what only a process shows (signals, exit
status, memory, survival of hostile input).

The last section reaches into a running worker: its loop (:func:`in_loop`), its
scheduler's statistics, its model.py globals, and its device (:func:`held_device`).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import trio

from rsrv.config import load_node, resolve_worker
from rsrv.runtime import configure
from rsrv.worker import Worker
from support import BUNDLES
from support.waiting import wait_until


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
    return on_port(resolve_worker(load_node(None), None, variables), 0)


def node_config(directory: Path, node: str, worker: str | None = None):
    """The WorkerConfig of node file text ``node`` (written to ``directory/node.toml``,
    resolved without environment overrides), on a free port."""
    path = directory / "node.toml"
    path.write_text(node)
    return on_port(resolve_worker(load_node(path), worker, {}, source=path), 0)


def on_port(config, port: int):
    """``config`` serving gRPC on ``port`` (0: a free one, chosen when it binds)."""
    return msgspec.structs.replace(
        config, endpoints=msgspec.structs.replace(config.endpoints, port=port)
    )


@dataclass
class _Loop:
    """A worker's trio loop in its thread: how to reach it, and what it raised."""

    thread: threading.Thread
    token: trio.lowlevel.TrioToken | None = None
    scope: trio.CancelScope | None = None
    error: BaseException | None = None


_loops: dict[int, _Loop] = {}  # id(worker) -> its loop, while running

#: The thread an in-process worker's trio loop runs in (:func:`running`).
LOOP_THREAD = "rsrv-test-worker"


def threads_calling(monkeypatch, owner: Any, name: str) -> list[str]:
    """Replace the function ``owner.name`` with one that records the name of the thread
    each call runs in, then calls it; returns that (growing) list: whether work was
    done off the event loop (:data:`LOOP_THREAD` not in it)."""
    threads: list[str] = []
    real = getattr(owner, name)

    def recorded(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, recorded)
    return threads


@contextmanager
def running(config, **options) -> Iterator[Worker]:
    """Start a worker in a background thread; yield it once ready; stop it on exit
    (unless :func:`shut_down` stopped it already). ``options``: keyword arguments of
    :class:`Worker` (``allocator``)."""
    configure("cpu")
    worker = Worker(config, **options)
    started = threading.Event()

    async def main():
        loop.token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            loop.scope = nursery.cancel_scope
            await nursery.start(worker.run)
            started.set()

    def thread_main():
        try:
            trio.run(main)
        except BaseException as e:  # surfaced to the test below
            loop.error = e
        finally:
            started.set()

    loop = _loops[id(worker)] = _Loop(
        threading.Thread(target=thread_main, name=LOOP_THREAD, daemon=True)
    )
    loop.thread.start()
    try:
        assert started.wait(120), "the worker did not start within 120 s"
        if loop.error is not None:
            raise loop.error
        yield worker
    finally:
        if loop.thread.is_alive() and loop.scope is not None:
            with contextlib.suppress(trio.RunFinishedError):  # unless it is stopping already
                trio.from_thread.run_sync(loop.scope.cancel, trio_token=loop.token)
        loop.thread.join(30)
        _loops.pop(id(worker), None)
    assert not loop.thread.is_alive(), "the worker did not stop within 30 s"
    if loop.error is not None:
        raise loop.error


def shut_down(worker: Worker, timeout: float = 10.0) -> None:
    """``Worker.shutdown()`` on the worker's loop, as SIGTERM would; returns once
    ``Worker.run`` has returned, which must take less than ``timeout`` seconds after the
    shutdown itself (a hang guard)."""
    loop = _loops[id(worker)]
    trio.from_thread.run(worker.shutdown, trio_token=loop.token)
    loop.thread.join(timeout)
    assert not loop.thread.is_alive(), "Worker.run did not return after the shutdown"
    assert loop.error is None, loop.error


def url(server) -> str:
    """The gRPC address of a running :class:`Worker` or :class:`ServerProcess`."""
    return f"127.0.0.1:{server.port}"


def in_loop(worker: Worker, fn, *args):
    """``fn(*args)`` run synchronously on the worker's trio loop (e.g. to read
    ``worker.scheduler.stats(name)``, which needs the loop's clock); returns its result."""
    return trio.from_thread.run_sync(fn, *args, trio_token=_loops[id(worker)].token)


def rsrv_command() -> list[str]:
    """The ``rsrv`` command of this environment."""
    script = Path(sys.executable).parent / "rsrv"
    return [str(script)] if script.exists() else [sys.executable, "-m", "rsrv.cli"]


def run_rsrv(
    *args: str, env: Mapping[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """``rsrv *args`` to its end (120 s at most), its output captured as text, in this
    environment without its INFERENCE_* variables (plus ``env``)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("INFERENCE_")}
    return subprocess.run(
        [*rsrv_command(), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**environ, **(env or {})},
    )


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports: each is held until all are picked, so the
    kernel cannot hand out one port twice (picked one at a time, two can be the same)."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def free_port() -> int:
    return free_ports(1)[0]


def free_base_port(offsets: tuple[int, ...]) -> int:
    """A port ``p`` such that ``p + o`` is free for every offset ``o`` (a node's derived
    ports: a base and the workers after it), below the kernel's ephemeral range, where
    no client connection takes one of them meanwhile (what ``free_ports`` gives is in
    that range: a port after it, not held, may be a connection's by then)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(1000):
        base = rng.randrange(10000, low - max(offsets) - 1)
        with contextlib.ExitStack() as held:
            try:
                for offset in offsets:
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", base + offset))
            except OSError:
                continue
            return base
    raise RuntimeError(f"no free ports at {offsets} below {low}")


class ServerProcess:
    """A ``rsrv serve NODE_FILE`` (or ``rsrv node NODE_FILE``: ``command="node"``)
    subprocess; stderr is collected line by line.

    ``node`` is the node file's TOML; every ``{...port...}`` placeholder in it (``{port}``,
    ``{metrics_port}``, ``{port_b}``, ...) is replaced by a free port, found in
    ``self.ports`` (``self.port`` and ``self.metrics_port`` for the first two). Runs in
    ``workdir`` with no ``INFERENCE_SERVER_*`` variables but those in ``env``.
    ``command="gateway"`` runs ``rsrv gateway`` on the file instead (``node`` is then a
    gateway file).
    """

    def __init__(
        self,
        workdir: Path,
        node: str,
        env: Mapping[str, str] | None = None,
        command: str = "serve",
        file_name: str = "node.toml",
    ):
        names = dict.fromkeys(["port", "metrics_port", *re.findall(r"\{(\w*port\w*)\}", node)])
        self.ports = dict(zip(names, free_ports(len(names)), strict=True))
        self.port, self.metrics_port = self.ports["port"], self.ports["metrics_port"]
        for name, port in self.ports.items():
            node = node.replace("{" + name + "}", str(port))
        self.path = workdir / file_name
        self.path.write_text(node)
        environ = {k: v for k, v in os.environ.items() if not k.startswith("INFERENCE_SERVER_")}
        environ.update(env or {})
        self._popen = partial(
            subprocess.Popen,
            [*rsrv_command(), command, str(self.path)],
            cwd=workdir,
            env=environ,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stderr: list[str] = []
        self._start()
        self.url = url(self)

    def _start(self) -> None:
        self.process = self._popen()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def restart(self) -> None:
        """Kill the process (SIGKILL) and start a new one on the same file and ports."""
        self.kill()
        self._reader.join(5)
        self._start()

    def _read(self) -> None:
        for line in self.process.stderr:
            self.stderr.append(line.rstrip("\n"))

    def wait_ready(self, client, timeout: float = 60) -> None:
        """Until ``client`` (tritonclient) sees the server ready."""

        def ready() -> bool:
            assert self.process.poll() is None, "\n".join(self.stderr)
            try:
                return client.is_server_ready()
            except Exception:
                return False

        wait_until(ready, timeout, "the server to get ready", interval=0.1)

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


def examples_server(workdir: Path, cache_dir: Path) -> ServerProcess:
    """``rsrv serve`` of the example bundles in bundles/, in static mode."""
    return ServerProcess(
        workdir,
        f"""
model_repo = "{BUNDLES}"
base_port = {{port}}

[global]
cache_dir = "{cache_dir}"
model_control_mode = "static"
""",
    )


# -- inside a running worker -----------------------------------------------------------------


def sched_stats(worker: Worker, model: str):
    """The scheduler's statistics of ``model`` (queue depth, dispatches), read in the
    worker's loop."""
    return in_loop(worker, worker.scheduler.stats, model)


def hook_globals(worker: Worker, model: str) -> dict:
    """The module globals of ``model``'s model.py as the worker loaded it (the test's
    handles on its hooks or its meta glue)."""
    hooks = worker.models.get(model).bundle.hooks
    hook = hooks.meta or hooks.preprocess or hooks.postprocess
    return hook.fn.__globals__


@contextmanager
def held_device(worker: Worker) -> Iterator[threading.Event]:
    """Hold the worker's device: every execution waits until the yielded event is set
    (set on exit too; an execution waits 30 s at most). Requests then stay queued in the
    scheduler, as behind a slow model, while everything else (transport, decoding,
    admission) is the real server."""
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
