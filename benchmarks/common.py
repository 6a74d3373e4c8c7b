"""Shared machinery of the benchmarks: server processes and node files, the closed-loop
load generator, interleaved rounds, page-cache dropping, percentiles, tables and plots.

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
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
COMPILE_CACHE = RESULTS / "cache"  # shared by the figures that do not time compilation
HOST = "127.0.0.1"
START_TIMEOUT = 240.0


def log(msg: str) -> None:
    """A progress line on stderr (stdout carries the tables)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ('' where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


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
    server: ServerProcess, timeout: float, models: Sequence[str] = (), poll: float = 0.02
) -> float:
    """Seconds from process start until ServerReady and every model in ``models`` is
    READY (tritonclient, over gRPC). Up to 8 models are asked one by one (ModelReady);
    more through one RepositoryIndex per poll, so polling costs the same for 10 models or
    1,000 (PyTriton's Triton refuses RepositoryIndex; it serves one model). Polls at
    least once, even past the deadline. Raises RuntimeError if the server dies or is not
    ready in time."""
    import tritonclient.grpc as grpcclient

    deadline = server.started_at + timeout
    client = None
    pending = set(models)
    try:
        while True:
            if not server.alive():
                raise RuntimeError(
                    f"{server.name} exited with code {server.proc.returncode}:\n{server.log_tail()}"
                )
            try:
                if client is None:
                    client = grpcclient.InferenceServerClient(server.url)
                if client.is_server_ready(client_timeout=2):
                    if len(pending) > 8:
                        index = client.get_model_repository_index(client_timeout=10)
                        pending -= {m.name for m in index.models if m.state == "READY"}
                    else:
                        pending = {m for m in pending if not client.is_model_ready(m)}
                    if not pending:
                        return time.perf_counter() - server.started_at
            except Exception:  # not listening yet
                pass
            if time.perf_counter() >= deadline:
                break
            time.sleep(poll)
    finally:
        if client is not None:
            client.close()
    raise RuntimeError(
        f"{server.name} was not ready within {timeout:.0f} s "
        f"(models not ready: {sorted(pending)[:5]}):\n{server.log_tail()}"
    )


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (VmRSS in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def node_toml(
    repo: Path,
    port: int,
    cache_dir: Path,
    *,
    runtime: dict | None = None,
    models: dict[str, dict] | None = None,
    scheduler: dict | None = None,
    endpoints: dict | None = None,
) -> str:
    """A one-worker node file for ``rsrv serve``: static model set, no in-flight cap.

    ``runtime`` adds to ``[global.runtime]`` (``backend = "cpu"`` unless given),
    ``scheduler`` to ``[global.scheduler]``, ``endpoints`` to ``[global.endpoints]``;
    ``models`` maps a model name to its ``[global.scheduler.models.NAME]`` policy."""

    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        return json.dumps(str(v))

    def section(name: str, values: dict) -> list[str]:
        return ["", f"[{name}]", *(f"{k} = {value(v)}" for k, v in values.items())]

    lines = [
        f"model_repo = {value(repo)}",
        *section("global", {"cache_dir": cache_dir, "model_control_mode": "static"}),
        *section("global.runtime", {"backend": "cpu", **(runtime or {})}),
        *section("global.scheduler", {"max_queue_depth": 8192, **(scheduler or {})}),
    ]
    for name, policy in (models or {}).items():
        lines += section(f"global.scheduler.models.{name}", policy)
    lines += section(
        "global.endpoints",
        {
            "host": HOST,
            "port": port,
            "max_concurrent_requests": 0,
            "shutdown_grace_seconds": 2.0,
            **(endpoints or {}),
        },
    )
    lines += section("global.logging", {"level": "warning"})
    return "\n".join(lines) + "\n"


def start_rsrv(
    name: str, repo: Path, cache_dir: Path = COMPILE_CACHE, *, env=None, **node
) -> ServerProcess:
    """``rsrv serve`` on a node file written to results/nodes/NAME.toml (``node``: the
    keyword arguments of :func:`node_toml`)."""
    port = free_port()
    path = RESULTS / "nodes" / f"{name}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(node_toml(repo, port, cache_dir, **node))
    return ServerProcess(
        f"rsrv-{name}", [sys.executable, "-m", "rsrv.cli", "serve", str(path)], port, env=env
    )


def control_status(port: int):
    """ModelControlStatus of the worker on ``port`` (rsrv.client.ControlClient)."""
    import trio

    from rsrv.client import ControlClient

    async def get():
        async with ControlClient(HOST, port) as control:
            return await control.status()

    return trio.run(get)


class ModelCounts:
    """A model's success and fail counts from a server's ModelStatistics (tritonclient,
    one connection until :meth:`close`), summed over its versions."""

    def __init__(self, url: str, model: str):
        import tritonclient.grpc as grpcclient

        self.model = model
        self.client = grpcclient.InferenceServerClient(url)

    def read(self) -> tuple[int, int]:
        stats = self.client.get_inference_statistics(self.model, client_timeout=10)
        mine = [m for m in stats.model_stats if m.name == self.model]
        return (
            sum(m.inference_stats.success.count for m in mine),
            sum(m.inference_stats.fail.count for m in mine),
        )

    def close(self) -> None:
        self.client.close()


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
    http: bool = False,
) -> LoadResult:
    """``concurrency`` threads, each with its own ``tritonclient.grpc`` client (its own
    connection), send back-to-back requests for ``warmup + duration`` seconds. With
    ``http`` the clients are ``tritonclient.http`` ones (KServe V2 REST, inputs and
    outputs as binary data) and ``url`` is the server's HTTP address.

    ``inputs`` maps model name -> input name -> array; each request of thread ``i`` goes
    to ``choose(rng, i)`` (default: the first model). Requests that finish within the
    window (after the warm-up) count, for throughput and latency alike: completions
    per second of the window, with no client's request in flight at an edge lost.
    ``at_start`` / ``at_end`` run in the calling thread when the window opens and closes
    (e.g. to read server counters).
    """
    import tritonclient.grpc as grpcclient

    if http:
        import tritonclient.http as httpclient

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
        if http:
            lib = httpclient
            client = httpclient.InferenceServerClient(url, network_timeout=timeout)
            options = {}
        else:
            lib = grpcclient
            client = grpcclient.InferenceServerClient(
                url, channel_args=[("grpc.use_local_subchannel_pool", 1)]
            )
            options = {"client_timeout": timeout}
        prepared = {}
        for model, tensors in inputs.items():
            prepared[model] = []
            for name, array in tensors.items():
                t = lib.InferInput(name, list(array.shape), triton_dtype(array.dtype))
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
                    client.infer(model, prepared[model], **options)
                except Exception as e:
                    with lock:
                        errors[0] += 1
                        errors[1] = errors[1] or f"{type(e).__name__}: {e}"[:300]
                    time.sleep(0.01)
                    continue
                t1 = time.perf_counter()
                if start <= t1 <= end:  # (one that straddles an edge counts once, at its end)
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


def closed_loop_reading(read: Callable[[], Any], *args: Any, **kwargs: Any):
    """:func:`closed_loop` with ``read()`` (e.g. server counters) taken as the window
    opens and as it closes: ``(result, reading at the start, reading at the end)``."""
    readings: list = []

    def take() -> None:
        readings.append(read())

    result = closed_loop(*args, at_start=take, at_end=take, **kwargs)
    return result, readings[0], readings[1]


def _sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def triton_dtype(dtype) -> str:
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


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of process ``pid`` so far (None: this process, all its
    threads), from /proc (Linux)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def interleave(servers: dict, rounds: int, run) -> dict[str, LoadResult]:
    """``run(name, server)`` for every server, ``rounds`` times, the order rotating each
    round (so drifting background load hits every server alike); the results of one
    server are merged (``.rounds`` keeps each round's req/s)."""
    names = list(servers)
    got: dict[str, list[LoadResult]] = {n: [] for n in names}
    for r in range(rounds):
        for name in rotated(names, r):
            got[name].append(run(name, servers[name]))
    merged = {}
    for n, v in got.items():
        merged[n] = merge(v)
        merged[n].rounds = [x.rps for x in v]
    return merged


def rotated(items: Sequence, r: int) -> list:
    """``items`` rotated left by ``r`` (the order of round ``r``)."""
    items = list(items)
    k = r % len(items) if items else 0
    return items[k:] + items[:k]


def round_ratios(a: LoadResult, b: LoadResult) -> list[float]:
    """Throughput ratio a / b of each round (the two ran next to each other in time)."""
    return [x / y for x, y in zip(a.rounds, b.rounds, strict=False) if y]


def spread(values: Sequence[float]) -> str:
    """' (lo-hi)' over rounds, or '' for fewer than two."""
    return f" ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else ""


def rounds(n: int) -> str:
    """'1 round' / '3 rounds'."""
    return f"{n} round" + ("" if n == 1 else "s")


def load_cell(s: dict | None, extra: str = "") -> str:
    """A closed loop's result as a table cell: "req/s (p50 / p99[; extra])" (ms), and
    "; N errors" when requests failed; "-" when it has none (no request completed)."""
    if not s or s.get("p50_ms") is None:
        return "-"
    failed = f"; {s['errors']} errors" if s.get("errors") else ""
    return f"{s['req_s']:,.0f} ({s['p50_ms']:.2f} / {s['p99_ms']:.2f}{extra}{failed})"


def times(value: float | None, values: Sequence[float] = ()) -> str:
    """'1.23x (1.10-1.30)': a ratio and its per-round range; '-' when there is none."""
    return "-" if value is None else f"{value:.2f}x{spread(values)}"


def stop_all(servers) -> None:
    for s in servers:
        if s is not None:
            s.stop()


# -- the page cache --------------------------------------------------------------------


def drop_from_page_cache(path: Path, *, sync: bool = False) -> bool:
    """Ask the kernel to forget a file's cached pages (``posix_fadvise(DONTNEED)``; no
    privileges needed). ``sync`` first writes dirty pages back (a file just written has
    them, and dirty pages are not dropped). False where the call does not exist."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        if sync:
            os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


class PageCacheDropper:
    """Drops files from the page cache, over and over from a background thread, while
    it is open (``with dropper: ...``); reusable."""

    def __init__(self, paths: list[Path], interval: float, proc: bool = False):
        self.paths, self.interval, self.proc = paths, interval, proc
        self.passes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def method(self) -> str:
        if self.proc:
            return f"1 written to /proc/sys/vm/drop_caches every {self.interval * 1e3:.0f} ms"
        return (
            f"posix_fadvise(POSIX_FADV_DONTNEED) on every weights file every "
            f"{self.interval * 1e3:.0f} ms"
        )

    def drop_once(self) -> None:
        if self.proc:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
        else:
            for path in self.paths:
                drop_from_page_cache(path)
        self.passes += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.drop_once()

    def __enter__(self):
        self.drop_once()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="drop-page-cache", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)


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


def rps_ratio(a: LoadResult, b: LoadResult) -> float | None:
    """``a``'s req/s over ``b``'s; None (no figure) when either had failed requests."""
    return None if a.errors or b.errors else ratio(a.rps, b.rps)


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


def save_plot(name: str, draw: Callable, data: dict) -> None:
    """results/NAME.png: ``draw(pyplot, data)`` returns the figure (Agg backend);
    nothing when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return
    fig = draw(plt, data)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=110)
    plt.close(fig)


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
