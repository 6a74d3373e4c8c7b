"""Shared machinery of the benchmarks: server processes, the closed-loop load generator,
percentiles, tables and plots.

Every server runs in its own process on 127.0.0.1 (a free port picked by the OS), so
the load generator (threads of this process, one ``tritonclient.grpc`` client each) never
shares a GIL with the server it measures. Everything is bounded: start-up waits, load
durations and request counts all have limits, and every process started here is stopped
by its id.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
HOST = "127.0.0.1"


def free_port() -> int:
    """A port the OS considers free on 127.0.0.1 now (bound and released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


# -- server processes ------------------------------------------------------------------


class ServerProcess:
    """A server in a child process, stopped by its pid (SIGTERM, then SIGKILL)."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        port: int,
        *,
        env: dict[str, str] | None = None,
        log: Path | None = None,
    ):
        self.name, self.port = name, port
        self.log = log or RESULTS / "logs" / f"{name}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log, "wb")
        self.started_at = time.perf_counter()
        self.proc = subprocess.Popen(
            list(argv),
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    @property
    def url(self) -> str:
        return f"{HOST}:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM to the child, then whatever is left of its process group (pytriton
        starts tritonserver and a backend stub in it) gets SIGTERM, then SIGKILL."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)  # the group of our child, by its id
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(1.0)
        if self.proc.poll() is None:
            self.proc.wait(10)
        self._log_file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def wait_ready(
    server: ServerProcess, timeout: float, models: Sequence[str] = (), poll: float = 0.05
) -> float:
    """Seconds from process start until ServerReady and every model in ``models`` is
    ready (tritonclient, over gRPC). Raises RuntimeError if it dies or times out."""
    import tritonclient.grpc as grpcclient

    deadline = server.started_at + timeout
    client = None
    pending = list(models)
    while time.perf_counter() < deadline:
        if not server.alive():
            raise RuntimeError(
                f"{server.name} exited with code {server.proc.returncode}:\n{server.log_tail()}"
            )
        try:
            if client is None:
                client = grpcclient.InferenceServerClient(server.url)
            if client.is_server_ready(client_timeout=2):
                pending = [m for m in pending if not client.is_model_ready(m, client_timeout=2)]
                if not pending:
                    elapsed = time.perf_counter() - server.started_at
                    client.close()
                    return elapsed
        except Exception:  # not listening yet
            pass
        time.sleep(poll)
    raise RuntimeError(
        f"{server.name} was not ready within {timeout:.0f} s "
        f"(models not ready: {pending[:5]}):\n{server.log_tail()}"
    )


def node_toml(
    repo: Path,
    port: int,
    cache_dir: Path,
    *,
    weight_cache_bytes: int | None = None,
    models: dict[str, dict] | None = None,
    scheduler: dict | None = None,
) -> str:
    """A one-worker node file for ``rsrv serve``: static model set, no in-flight cap."""

    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        return json.dumps(str(v))

    lines = [
        f"model_repo = {value(repo)}",
        "",
        "[global]",
        f"cache_dir = {value(cache_dir)}",
        'model_control_mode = "static"',
        "",
        "[global.runtime]",
        'backend = "cpu"',
    ]
    if weight_cache_bytes is not None:
        lines.append(f"weight_cache_bytes = {weight_cache_bytes}")
    lines += ["", "[global.scheduler]", "max_queue_depth = 8192"]
    lines += [f"{k} = {value(v)}" for k, v in (scheduler or {}).items()]
    for name, policy in (models or {}).items():
        lines += ["", f"[global.scheduler.models.{name}]"]
        lines += [f"{k} = {value(v)}" for k, v in policy.items()]
    lines += [
        "",
        "[global.endpoints]",
        f'host = "{HOST}"',
        f"port = {port}",
        "max_concurrent_requests = 0",
        "shutdown_grace_seconds = 2.0",
        "",
        "[global.logging]",
        'level = "warning"',
        "",
    ]
    return "\n".join(lines)


def start_rsrv(name: str, repo: Path, cache_dir: Path, **node) -> ServerProcess:
    """``rsrv serve`` on a node file written to results/nodes/NAME.toml."""
    port = free_port()
    path = RESULTS / "nodes" / f"{name}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(node_toml(repo, port, cache_dir, **node))
    return ServerProcess(
        f"rsrv-{name}", [sys.executable, "-m", "rsrv.cli", "serve", str(path)], port
    )


def control_status(port: int):
    """ModelControlStatus of the worker on ``port`` (rsrv.client.ControlClient)."""
    import trio

    from rsrv.client import ControlClient

    async def get():
        async with ControlClient(HOST, port) as control:
            return await control.status()

    return trio.run(get)


# -- load ------------------------------------------------------------------------------


@dataclass
class LoadResult:
    concurrency: int
    seconds: float
    completed: int
    errors: int
    latencies: list[float] = field(repr=False)  # seconds, of completions in the window
    per_model: dict[str, int] = field(default_factory=dict)
    first_error: str = ""
    rounds: list[float] = field(default_factory=list)  # req/s of each interleaved round

    @property
    def rps(self) -> float:
        return self.completed / self.seconds if self.seconds else 0.0

    def summary(self) -> dict:
        return {
            "concurrency": self.concurrency,
            "req_s": round(self.rps, 1),
            "p50_ms": ms(percentile(self.latencies, 50)),
            "p99_ms": ms(percentile(self.latencies, 99)),
            "completed": self.completed,
            "errors": self.errors,
            "seconds": round(self.seconds, 2),
            "rounds_req_s": [round(r, 1) for r in self.rounds],
        }


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def ms(seconds: float) -> float | None:
    return None if math.isnan(seconds) else round(seconds * 1e3, 3)


def closed_loop(
    url: str,
    inputs: dict[str, dict[str, np.ndarray]],
    concurrency: int,
    duration: float,
    *,
    warmup: float = 0.5,
    choose: Callable[[random.Random, int], str] | None = None,
    seed: int = 0,
    at_start: Callable[[], None] | None = None,
    at_end: Callable[[], None] | None = None,
    max_requests: int = 2_000_000,
    timeout: float = 60.0,
) -> LoadResult:
    """``concurrency`` threads, each with its own ``tritonclient.grpc`` client (its own
    connection), send back-to-back requests for ``warmup + duration`` seconds.

    ``inputs`` maps model name -> input name -> array; each request of thread ``i`` goes
    to ``choose(rng, i)`` (default: the first model). Only requests that start after the
    warm-up and finish within the window count, for throughput and latency alike.
    ``at_start`` / ``at_end`` run in the calling thread when the window opens and closes
    (e.g. to read server counters).
    """
    import tritonclient.grpc as grpcclient

    names = list(inputs)
    choose = choose or (lambda rng, i: names[0])
    barrier = threading.Barrier(concurrency + 1)
    go = threading.Event()
    lock = threading.Lock()
    window: list[float] = [0.0, 0.0]
    latencies: list[float] = []
    per_model: dict[str, int] = {}
    errors = [0, ""]
    budget = [max_requests]

    def worker(index: int) -> None:
        rng = random.Random(seed * 7919 + index)
        client = grpcclient.InferenceServerClient(
            url, channel_args=[("grpc.use_local_subchannel_pool", 1)]
        )
        prepared = {}
        for model, tensors in inputs.items():
            prepared[model] = []
            for name, array in tensors.items():
                t = grpcclient.InferInput(name, list(array.shape), _triton_dtype(array.dtype))
                t.set_data_from_numpy(array)
                prepared[model].append(t)
        mine: list[float] = []
        counts: dict[str, int] = {}
        try:
            barrier.wait(60)
            go.wait(60)
            start, end = window
            while True:
                t0 = time.perf_counter()
                if t0 >= end or budget[0] <= 0:
                    break
                model = choose(rng, index)
                try:
                    client.infer(model, prepared[model], client_timeout=timeout)
                except Exception as e:
                    with lock:
                        errors[0] += 1
                        errors[1] = errors[1] or f"{type(e).__name__}: {e}"[:300]
                    time.sleep(0.01)
                    continue
                t1 = time.perf_counter()
                if t0 >= start and t1 <= end:
                    mine.append(t1 - t0)
                    counts[model] = counts.get(model, 0) + 1
                    budget[0] -= 1  # approximate across threads; only a safety bound
        finally:
            client.close()
            with lock:
                latencies.extend(mine)
                for k, v in counts.items():
                    per_model[k] = per_model.get(k, 0) + v

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    barrier.wait(60)  # every client is connected and its inputs are built
    now = time.perf_counter()
    window[0], window[1] = now + warmup, now + warmup + duration
    go.set()
    _sleep_until(window[0])
    if at_start is not None:
        at_start()
    _sleep_until(window[1])
    if at_end is not None:
        at_end()
    for t in threads:
        t.join(timeout + 10)
    return LoadResult(
        concurrency, duration, len(latencies), errors[0], latencies, per_model, errors[1]
    )


def _sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def _triton_dtype(dtype) -> str:
    return {
        "float32": "FP32",
        "float16": "FP16",
        "int64": "INT64",
        "int32": "INT32",
        "uint8": "UINT8",
    }[np.dtype(dtype).name]


def merge(results: Sequence[LoadResult]) -> LoadResult:
    """Interleaved repetitions of one point, as one result (sums and pooled latencies)."""
    per_model: dict[str, int] = {}
    for r in results:
        for k, v in r.per_model.items():
            per_model[k] = per_model.get(k, 0) + v
    return LoadResult(
        results[0].concurrency,
        sum(r.seconds for r in results),
        sum(r.completed for r in results),
        sum(r.errors for r in results),
        [x for r in results for x in r.latencies],
        per_model,
        next((r.first_error for r in results if r.first_error), ""),
    )


# -- output ----------------------------------------------------------------------------


def table(rows: Sequence[Sequence], header: Sequence[str]) -> str:
    """A GitHub-flavoured markdown table (also readable as plain text)."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [
        max(len(str(h)), *(len(r[i]) for r in cells)) if cells else len(str(h))
        for i, h in enumerate(header)
    ]

    def line(values):
        return "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)) + " |"

    out = [line([str(h) for h in header]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    return "\n".join(out)


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.3g}" if abs(value) < 10 else f"{value:,.0f}"
    return str(value)


def ratio(a: float | None, b: float | None) -> float | None:
    if not a or not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def save_json(name: str, data: dict) -> Path:
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=_json_default) + "\n")
    return path


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(type(o).__name__)


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
