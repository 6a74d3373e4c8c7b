"""The standard gRPC health service (``grpc.health.v1.Health``) of a worker and of a
gateway, asked by grpcio's own health client, as Kubernetes' gRPC probes and
``grpc_health_probe`` ask it.

``""`` / ``"live"`` answer liveness, ``"ready"`` / ``"inference.GRPCInferenceService"``
readiness: NOT_SERVING while a model loads for the first time and while the server
drains, SERVING otherwise; Watch streams each change; an unknown name is NOT_FOUND. The
health service is never shed at the in-flight cap and answers while the worker drains.
"""

from __future__ import annotations

import signal
import sys
import threading

import pytest
from support.bundles import ImportGate, X, export_linear, matches, x_input
from support.clients import connect
from support.health import Watch, check
from support.metrics import get
from support.serving import (
    ServerProcess,
    free_port,
    held_device,
    node_config,
    running,
    shut_down,
    url,
    worker_config,
)
from support.waiting import wait_until

READY_NAMES = ("ready", "inference.GRPCInferenceService")
LIVE_NAMES = ("", "live")


@pytest.fixture
def repo(tmp_path):
    path = tmp_path / "repo"
    export_linear(path / "a", seed=0)
    return path


def test_check_answers_each_service_name(repo, cache_dir):
    with running(worker_config(repo, cache_dir, MODEL_POLL_SECONDS=60)) as worker:
        address = url(worker)
        for name in LIVE_NAMES + READY_NAMES:
            assert check(address, name) == "SERVING", name
        assert check(address, "no.such.Service") == "NOT_FOUND"
        with Watch(address, "no.such.Service") as unknown:
            unknown.wait_for("SERVICE_UNKNOWN")
            assert unknown.ended is None  # the gRPC rule: the stream stays open


def test_readiness_follows_a_model_loading(repo, cache_dir, tmp_path, monkeypatch):
    """A bundle added in dynamic mode loads until the test lets it: readiness is
    NOT_SERVING meanwhile (liveness stays SERVING), and Watch sees SERVING ->
    NOT_SERVING -> SERVING."""
    slow = export_linear(tmp_path / "staging" / "slow", seed=2, import_gate=True)
    gate = ImportGate(monkeypatch, tmp_path / "gate")
    config = worker_config(repo, cache_dir, MODEL_POLL_SECONDS=0.1)
    with running(config) as worker, Watch(url(worker), "ready") as watch:
        watch.wait_for("SERVING")
        slow.rename(repo / "slow")
        watch.wait_for("NOT_SERVING", timeout=10)
        assert check(url(worker), "inference.GRPCInferenceService") == "NOT_SERVING"
        assert check(url(worker), "") == "SERVING"
        gate.open()
        watch.wait_for("SERVING", timeout=20)
        assert watch.statuses == ["SERVING", "NOT_SERVING", "SERVING"]
        with connect(worker) as client:
            assert client.is_server_ready() and client.is_model_ready("slow")


def test_graceful_shutdown_is_not_serving_and_health_is_never_shed(repo, cache_dir):
    """One request held on the device fills the in-flight cap (1): health still answers.
    Then the worker drains: readiness NOT_SERVING (and /readyz 503), liveness SERVING,
    while the held request waits; released, it is answered and the Watch stream ends
    with the server."""
    admin = free_port()
    config = worker_config(
        repo,
        cache_dir,
        MODEL_POLL_SECONDS=60,
        ENDPOINTS_MAX_CONCURRENT_REQUESTS=1,
        ENDPOINTS_METRICS_PORT=admin,
    )
    answers: list = []
    with running(config) as worker, connect(worker) as client:
        address = url(worker)
        with held_device(worker) as gate, Watch(address, "ready") as watch:
            client.async_infer(
                "a", [x_input(X)], lambda result, error: answers.append(error or result)
            )
            wait_until(lambda: worker.admission.inflight == 1, 10, "the request to be in flight")
            assert check(address, "ready") == "SERVING"  # not RESOURCE_EXHAUSTED
            watch.wait_for("SERVING")

            stopping = threading.Thread(target=shut_down, args=(worker, 30.0))
            stopping.start()
            watch.wait_for("NOT_SERVING")
            for name in READY_NAMES:
                assert check(address, name) == "NOT_SERVING", name
            for name in LIVE_NAMES:
                assert check(address, name) == "SERVING", name
            assert get(admin, "/readyz")[0] == 503  # as over gRPC (it stayed 200)
            assert not answers  # still held: the drain waits for it
            gate.set()
            stopping.join(30)
            assert not stopping.is_alive()
            assert watch.wait_ended() == "UNAVAILABLE"  # ended by the server's close, last thing
            assert watch.ended_message == "server is shutting down"  # (not "Socket closed")
            assert watch.statuses == ["SERVING", "NOT_SERVING"]
    wait_until(lambda: answers, 10, "the held request's answer")
    assert matches(answers[0].as_numpy("y"), 0, X)


def test_a_restricted_health_protocol_covers_the_health_service(repo, tmp_path, cache_dir):
    node = f"""
model_repo = "{repo}"
[global]
cache_dir = "{cache_dir}"
model_control_mode = "static"
[[global.endpoints.restricted]]
protocols = ["health"]
header = "probe-key"
value = "s3cret"
"""
    with running(node_config(tmp_path, node)) as worker:
        assert check(url(worker), "ready") == "UNAVAILABLE"
        assert check(url(worker), "ready", metadata=[("probe-key", "s3cret")]) == "SERVING"


# -- the gateway -----------------------------------------------------------------------------

WORKER = """
model_repo = "{repo}"
base_port = {port}

[global]
cache_dir = "{cache}"
model_control_mode = "static"
"""

GATEWAY = """
endpoints = ["127.0.0.1:{worker_port}"]

[listen]
grpc = "127.0.0.1:{{port}}"
metrics = "127.0.0.1:{{metrics_port}}"

[discovery]
interval_seconds = 0.2
probe_timeout_seconds = 1.0
"""


@pytest.mark.skipif(sys.platform != "linux", reason="POSIX signals")
def test_gateway_readiness_follows_its_workers(tmp_path, cache_dir, repo):
    """The gateway is ready while a worker behind it is: Watch sees NOT_SERVING when the
    only worker is killed and SERVING again when a new one takes its port; liveness
    stays SERVING throughout; SIGTERM ends with the gateway exiting 0."""

    def start_worker(n: int, port: str = "{port}") -> ServerProcess:
        """A worker on a free port, or on ``port`` (the first one's, once it is gone)."""
        workdir = tmp_path / f"w{n}"
        workdir.mkdir()
        worker = ServerProcess(workdir, WORKER.format(repo=repo, port=port, cache=cache_dir))
        worker.url = f"127.0.0.1:{port if n else worker.port}"
        wait_until(lambda: check(worker.url, "ready", timeout=1) == "SERVING", 60, "worker")
        return worker

    workdir = tmp_path / "gateway"
    workdir.mkdir()
    processes: list[ServerProcess] = []
    try:
        processes.append(start_worker(0))
        worker_port = processes[0].port
        gateway = ServerProcess(
            workdir,
            GATEWAY.format(worker_port=worker_port),
            command="gateway",
            file_name="gateway.toml",
        )
        processes.append(gateway)
        wait_until(lambda: check(gateway.url, "ready", timeout=1) == "SERVING", 60, "gateway ready")
        with Watch(gateway.url, "inference.GRPCInferenceService") as watch:
            watch.wait_for("SERVING")
            processes[0].kill()
            watch.wait_for("NOT_SERVING")
            assert check(gateway.url, "ready") == "NOT_SERVING"
            assert check(gateway.url) == "SERVING"
            processes.append(start_worker(1, str(worker_port)))
            watch.wait_for("SERVING", timeout=60)
            assert watch.statuses == ["SERVING", "NOT_SERVING", "SERVING"]
            assert check(gateway.url, "nope") == "NOT_FOUND"
            with connect(gateway) as client:
                assert client.is_server_ready()
                y = client.infer("a", [x_input(X)]).as_numpy("y")
                assert matches(y, 0, X)
            gateway.process.send_signal(signal.SIGTERM)
            assert gateway.wait_exit(30) == 0
            assert watch.wait_ended() == "UNAVAILABLE"
    finally:
        for process in processes:
            process.kill()
