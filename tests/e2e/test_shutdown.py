"""Graceful shutdown and operator output of the real ``rsrv serve`` process.

SIGTERM while 100 requests are in flight: every request gets its answer or an explicit
error, shared memory is released, the process exits 0. SIGINT likewise. With
``logging.format = "json"`` every stderr line is a JSON object, including the effective
configuration and each model's load. Without a node file, from a checkout, it says
which repository it serves.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.utils.shared_memory as shm
from support.bundles import X, expected, export_linear, infer_y, matches, x_input
from support.clients import connect
from support.metrics import Scrape
from support.serving import (
    ServerProcess,
    free_ports,
    rsrv_command,
    running,
    shut_down,
    worker_config,
)
from support.waiting import wait_until

import rsrv

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="POSIX signals, /proc, /dev/shm")

GRACE = 20.0


def served(tmp_path: Path, cache_dir: Path, **logging: str) -> ServerProcess:
    """``rsrv serve`` on ``tmp_path/repo`` (static mode, no in-flight cap)."""
    return ServerProcess(
        tmp_path,
        f"""
model_repo = "repo"
base_port = {{port}}
metrics_base_port = {{metrics_port}}

[global]
cache_dir = "{cache_dir}"
model_control_mode = "static"

[global.endpoints]
max_concurrent_requests = 0
shutdown_grace_seconds = {GRACE}

[global.logging]
{"".join(f'{k} = "{v}"' + chr(10) for k, v in logging.items())}
""",
    )


@pytest.fixture
def serve(tmp_path, cache_dir):
    started: list[ServerProcess] = []

    def start(**logging: str) -> ServerProcess:
        server = served(tmp_path, cache_dir, **logging)
        started.append(server)
        return server

    yield start
    for server in started:
        server.kill()


def test_sigterm_with_100_requests_in_flight(tmp_path, serve):
    """Requests sit in a 100 ms preprocess hook and then queue for a slow executable when
    SIGTERM arrives: the accepted ones are all answered correctly, later ones are refused
    UNAVAILABLE "shutting down", the shared-memory region is released (and was never held
    open or mapped), exit status 0."""
    export_linear(tmp_path / "repo" / "slow", seed=0, work=3000, hook_seconds=0.1)
    server = serve(format="json")
    key = f"/rsrv_test_shutdown_{os.getpid()}"
    region = shm.create_shared_memory_region("x_in", key, X.nbytes)
    try:
        with connect(server) as client:
            server.wait_ready(client)
            pid = server.process.pid
            shm.set_shared_memory_region(region, [X])
            client.register_system_shared_memory("x_in", key, X.nbytes)
            inp = tc.InferInput("x", list(X.shape), "FP32")
            inp.set_shared_memory("x_in", X.nbytes)
            assert matches(client.infer("slow", [inp]).as_numpy("y"), 0, X)
            assert f"/dev/shm{key}" not in Path(f"/proc/{pid}/maps").read_text()
            assert not [
                fd
                for fd in Path(f"/proc/{pid}/fd").iterdir()
                if f"/dev/shm{key}" in os.path.realpath(fd)
            ]

            answers: dict[int, Any] = {}
            lock = threading.Lock()
            xs = [
                np.random.default_rng(i).standard_normal((1 + i % 3, 3)).astype(np.float32)
                for i in range(110)
            ]

            def send(i: int, inputs=None) -> None:
                def callback(result, error):
                    with lock:
                        answers[i] = error if error else result.as_numpy("y")

                client.async_infer("slow", inputs or [x_input(xs[i])], callback)

            for i in range(100):
                send(i)

            def accepted() -> int:  # answered, then in flight: a request is never counted twice
                with lock:
                    answered = len(answers)
                return answered + int(Scrape(server.metrics_port).value("rsrv_inflight_requests"))

            wait_until(lambda: accepted() >= 100, timeout=10)
            with lock:
                answered_before = len(answers)
            server.process.send_signal(signal.SIGTERM)
            # Logged just before Worker.shutdown refuses new calls (before its first await).
            wait_until(lambda: any("received SIGTERM" in line for line in server.stderr), 10)
            for i in range(100, 110):  # arrive while it drains
                send(i)
            # a client connecting during the drain is answered too, not reset
            with connect(server) as late:
                try:
                    late.infer("slow", [x_input(xs[0])])
                    late_error = None
                except tc.InferenceServerException as e:
                    late_error = e
            status = server.wait_exit(GRACE + 10)
            wait_until(lambda: len(answers) == 110, timeout=10)
    finally:
        shm.destroy_shared_memory_region(region)

    assert status == 0, "\n".join(server.stderr[-20:])
    ok = [i for i, a in answers.items() if isinstance(a, np.ndarray)]
    errors = {i: a for i, a in answers.items() if not isinstance(a, np.ndarray)}
    for i in ok:
        assert matches(answers[i], 0, xs[i]), i
    for i, e in [*errors.items(), ("late", late_error)]:
        assert e.status() == "StatusCode.UNAVAILABLE", (i, str(e))
        assert "shutting down" in e.message(), (i, str(e))
    # all 100 were accepted before the signal, most still in flight: each was answered
    assert answered_before < 50
    assert sorted(ok) == list(range(100))
    assert sorted(errors) == list(range(100, 110))

    logs = [json.loads(line) for line in server.stderr]
    messages = [entry["message"] for entry in logs]
    assert any("received SIGTERM" in m for m in messages)
    assert any("released 1 shared memory region" in m for m in messages)
    assert not [
        e
        for e in logs
        if e["level"] in ("WARNING", "ERROR", "CRITICAL")
        and ("purerpc" in e["logger"] or "transport" in e["logger"])
    ]


def test_json_logs_and_sigint(tmp_path, serve):
    export_linear(tmp_path / "repo" / "a", seed=0)
    export_linear(tmp_path / "repo" / "b", seed=1)
    server = serve(format="json", level="info")
    with connect(server) as client:
        server.wait_ready(client)
        assert matches(infer_y(client, "b", X), 1, X)
        server.process.send_signal(signal.SIGINT)
        assert server.wait_exit(GRACE + 10) == 0

    assert server.stderr
    logs = [json.loads(line) for line in server.stderr]  # every line is one JSON object
    for entry in logs:
        assert {"time", "level", "worker", "logger", "message"} <= set(entry)
        assert entry["worker"] == "worker0"
    messages = [entry["message"] for entry in logs]

    config = [m for m in messages if m.startswith("effective configuration: ")]
    assert len(config) == 1
    effective = json.loads(config[0].removeprefix("effective configuration: "))
    assert effective["model_repo"] == str(tmp_path / "repo")
    assert effective["endpoints"]["port"] == server.port
    assert effective["endpoints"]["metrics_port"] == server.metrics_port
    assert effective["logging"]["format"] == "json"
    assert effective["model_control_mode"] == "static"

    for name in ("a", "b"):
        loaded = [m for m in messages if m.startswith(f"model {name} loaded: ")]
        assert len(loaded) == 1 and " s (" in loaded[0] and "32 weight bytes" in loaded[0]
        ready = [m for m in messages if m.startswith(f"model {name} version ")]
        assert len(ready) == 1 and "residency device" in ready[0]
    assert any(m.startswith(f"gRPC listening on 127.0.0.1:{server.port}") for m in messages)
    assert any("received SIGINT" in m for m in messages)


def test_shutdown_answers_accepted_requests_and_unmaps_shared_memory(tmp_path, cache_dir):
    """In-process: Worker.shutdown() with requests in their preprocess hook and queued;
    each is answered, the region is unmapped, and Worker.run returns."""
    export_linear(tmp_path / "repo" / "slow", seed=2, work=3000, hook_seconds=0.1)
    config = static(tmp_path, cache_dir, ENDPOINTS_MAX_CONCURRENT_REQUESTS=0)
    key = f"/rsrv_test_inproc_{os.getpid()}"
    region = shm.create_shared_memory_region("x_in", key, X.nbytes)
    try:
        with running(config) as worker, connect(worker) as client:
            shm.set_shared_memory_region(region, [X])
            client.register_system_shared_memory("x_in", key, X.nbytes)
            assert f"/dev/shm{key}" in Path("/proc/self/maps").read_text()
            answers: list[Any] = []

            def callback(result, error):
                answers.append(error if error else result.as_numpy("y"))

            for _ in range(40):
                client.async_infer("slow", [x_input(X)], callback)
            wait_until(lambda: len(answers) + worker.admission.inflight >= 40, timeout=5)
            assert worker.admission.inflight  # still in flight when shutdown begins
            shut_down(worker)
            wait_until(lambda: len(answers) == 40, timeout=5)
    finally:
        shm.destroy_shared_memory_region(region)
    assert all(
        isinstance(a, np.ndarray) and np.allclose(a, expected(2, X), rtol=1e-5) for a in answers
    ), [a for a in answers if not isinstance(a, np.ndarray)][:3]
    assert f"/dev/shm{key}" not in Path("/proc/self/maps").read_text()


def test_an_idle_open_stream_does_not_hold_up_shutdown(tmp_path, cache_dir, caplog):
    """A ModelStreamInfer stream left open (idle) is not a call in flight: shutdown
    finishes at once instead of waiting out the grace period, and ends the stream
    UNAVAILABLE, "server is shutting down" (it closed the connection under it: "Stream
    removed (Socket closed ...)", no status of the server's)."""
    export_linear(tmp_path / "repo" / "m", seed=3)
    config = static(tmp_path, cache_dir, ENDPOINTS_SHUTDOWN_GRACE_SECONDS=30)
    answers: list[Any] = []
    with running(config) as worker, connect(worker) as client:
        client.start_stream(callback=lambda result, error: answers.append(error or result))
        client.async_stream_infer("m", [x_input(X)])
        wait_until(lambda: len(answers) == 1, timeout=10)
        assert not isinstance(answers[0], Exception), answers[0]
        assert worker.admission.inflight == 0  # the open stream itself holds no slot
        shut_down(worker)
        wait_until(lambda: len(answers) == 2, timeout=10)
        assert answers[1].status() == "StatusCode.UNAVAILABLE"
        assert answers[1].message() == "server is shutting down", answers[1].message()
        client.stop_stream(cancel_requests=True)
    # not the 30 s grace period: the drain found nothing in flight
    grace = [r.getMessage() for r in caplog.records if "grace period" in r.getMessage()]
    assert not grace, grace
    assert any(r.getMessage().startswith("shutdown: released") for r in caplog.records)


def static(tmp_path: Path, cache_dir: Path, **settings):
    """An in-process worker of ``tmp_path/repo`` in static mode."""
    return worker_config(tmp_path / "repo", cache_dir, MODEL_CONTROL_MODE="static", **settings)


def test_serve_without_a_node_file_says_it_serves_the_checkouts_bundles(tmp_path, cache_dir):
    """From a directory without ./bundles: the checkout's example bundles, and a line
    saying so (it was logged before logging was set up, so it never showed)."""
    checkout = Path(rsrv.__file__).resolve().parents[2] / "bundles"
    if not checkout.is_dir():
        pytest.skip("rsrv is not installed from a source checkout")
    (port,) = free_ports(1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERENCE_SERVER_")}
    env |= {
        "INFERENCE_SERVER_ENDPOINTS_PORT": str(port),
        "INFERENCE_SERVER_CACHE_DIR": str(cache_dir),
    }
    process = subprocess.Popen(
        [*rsrv_command(), "serve"], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True
    )
    lines = []
    try:
        for line in process.stderr:
            lines.append(line)
            if "effective configuration" in line:
                break
    finally:
        process.kill()
        process.wait()
    said = [line for line in lines if "serving the example bundles of the rsrv checkout" in line]
    assert len(said) == 1 and str(checkout) in said[0], lines
    assert f'"model_repo": "{checkout}"' in lines[-1]
