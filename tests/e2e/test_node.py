"""``rsrv node``: the real supervisor, its real ``rsrv serve`` children, tritonclient.

Two CPU workers start on their own ports and answer; a worker killed with SIGKILL is
restarted; the restart limit stops the node non-zero; SIGTERM under load answers every
accepted request and leaves no process behind; so does SIGKILL of the supervisor
itself. Device errors (two workers on one device; a cuda node on this machine without
GPUs) fail with one clear line.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tc
from support.bundles import SLOW_HOOK_PY, X, export_linear, infer_y, matches, x_input
from support.metrics import Scrape, get
from support.serving import ServerProcess, free_port, free_ports, rsrv_command
from support.waiting import wait_until

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="POSIX signals, /proc")

TWO_WORKERS = """
model_repo = "repo"
port = {node_port}
metrics_port = {metrics_port}
workers = [{name = "worker0", port = {port}}, {name = "worker1", port = {port_b}}]

[global]
cache_dir = "CACHE"
model_control_mode = "static"

[global.endpoints]
max_concurrent_requests = 0
shutdown_grace_seconds = 20

[gateway]
metrics_port = {gateway_metrics_port}

[supervisor]
backoff_seconds = 0.2
SUPERVISOR
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited: only its parent has not reaped it yet.
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"


class Node(ServerProcess):
    """``rsrv node`` with helpers for its admin endpoint."""

    def health(self) -> dict:
        status, _, body = get(self.metrics_port, "/healthz")
        assert status == 200
        return json.loads(body)

    def children(self) -> dict[str, dict]:
        return {c["name"]: c for c in self.health()["children"]}

    def wait_serving(self, timeout: float = 60) -> dict[str, dict]:
        def serving():
            assert self.process.poll() is None, "\n".join(self.stderr[-30:])
            try:
                children = self.children()
            except OSError:
                return None
            return children if all(c["ready"] for c in children.values()) else None

        return wait_until(serving, timeout, "every worker to serve", interval=0.1)


@pytest.fixture
def node(tmp_path, cache_dir):
    started: list[Node] = []

    def start(text: str = TWO_WORKERS, supervisor: str = "", env=None) -> Node:
        (tmp_path / "repo").mkdir(exist_ok=True)
        text = text.replace("CACHE", str(cache_dir)).replace("SUPERVISOR", supervisor)
        started.append(Node(tmp_path, text, env=env, command="node"))
        return started[-1]

    yield start
    for n in started:
        pids = (
            [c["pid"] for c in n.children().values() if c["pid"]]
            if n.process.poll() is None
            else []
        )
        n.kill()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_two_cpu_workers_each_answer_on_their_own_port(tmp_path, node):
    export_linear(tmp_path / "repo" / "lin", seed=3)
    n = node()
    children = n.wait_serving()
    assert sorted(children) == ["gateway", "worker0", "worker1"]
    ports = [children[w]["port"] for w in ("worker0", "worker1")]
    assert ports == [n.port, n.ports["port_b"]]
    pids = {c["pid"] for c in children.values()}
    assert len(pids) == 3 and os.getpid() not in pids
    # Each worker answers on its own port, and the gateway on the node's.
    assert children["gateway"]["port"] == n.ports["node_port"]
    for port in [*ports, n.ports["node_port"]]:
        with tc.InferenceServerClient(f"127.0.0.1:{port}") as client:
            assert client.is_server_ready()
            assert matches(infer_y(client, "lin", X), 3, X)
    # The gateway finds worker1 up at its next discovery round (the node saw it serve
    # on its own link, which can come first).
    wait_until(
        lambda: (
            Scrape(n.ports["gateway_metrics_port"]).value(
                "rsrv_gateway_worker_up", worker="worker1"
            )
            == 1
        ),
        what="the gateway to see worker1 up",
    )
    # The node says it is ready, per child and as a whole.
    assert get(n.metrics_port, "/readyz")[0] == 200
    scrape = Scrape(n.metrics_port)
    assert scrape.value("rsrv_node_ready") == 1
    assert scrape.value("rsrv_node_child_ready", child="worker1", kind="worker") == 1
    status = subprocess.run(
        [*rsrv_command(), "node", "status", str(n.path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert status.returncode == 0, status.stderr
    assert "ready" in status.stdout.splitlines()[0]
    rows = {line.split()[0]: line.split() for line in status.stdout.splitlines()[2:]}
    assert rows["worker1"][2:6] == [
        "serving",
        "yes",
        str(children["worker1"]["pid"]),
        str(ports[1]),
    ]
    # Every worker's lines reach the node's stderr, tagged with its name, once (one
    # "listening" line per start of the worker: restarts, should one happen, counted).
    restarts = Scrape(n.metrics_port).total("rsrv_node_child_restarts", child="worker1")
    listening = [
        line for line in n.stderr if line.startswith("[worker1] ") and "gRPC listening" in line
    ]
    assert len(listening) == 1 + restarts, (restarts, listening)
    assert all(line.count("[worker1]") == 1 for line in listening), listening


def test_a_killed_worker_is_restarted_and_serves_again(tmp_path, node):
    """As the node planned it at start: an edit of the node file meanwhile (here one
    that no longer parses) reaches no restart."""
    export_linear(tmp_path / "repo" / "lin", seed=4)
    n = node()
    before = n.wait_serving()["worker1"]
    n.path.write_text(n.path.read_text().replace("port = ", "port = = "))
    os.kill(before["pid"], signal.SIGKILL)
    wait_until(lambda: not n.children()["worker1"]["ready"], 20, "the node to notice")

    after = n.wait_serving()["worker1"]
    assert after["pid"] != before["pid"] and after["restarts"] == 1
    assert after["port"] == before["port"]
    assert after["last_exit"] == "signal SIGKILL"
    with tc.InferenceServerClient(f"127.0.0.1:{after['port']}") as client:
        assert matches(infer_y(client, "lin", X), 4, X)
    assert n.children()["worker0"]["restarts"] == 0
    assert Scrape(n.metrics_port).total("rsrv_node_child_restarts", child="worker1") == 1
    assert any("worker1 exited (signal SIGKILL)" in line for line in n.stderr)


def test_the_restart_limit_stops_the_node_non_zero(tmp_path, node):
    # worker1's port is taken: it fails at every start (exit 1, one line, no traceback).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        text = TWO_WORKERS.replace(
            '"worker0", port = {port}}, {name = "worker1", port = {port_b}',
            f'"a", port = {{port}}}}, {{name = "b", port = {taken.getsockname()[1]}',
        )
        n = node(text, "max_restarts = 2")
        status = n.wait_exit(120)
    assert status == 1
    log = "\n".join(n.stderr)
    assert log.count("[b] rsrv: worker b: cannot listen") == 3  # the start and 2 restarts
    assert "b exited 3 time(s) in a row" in log and "giving up" in log
    assert "Traceback" not in log
    assert "a exited (code 0)" in log  # the healthy worker was stopped gracefully
    assert "gateway exited (code 0)" in log


def test_sigterm_under_load_answers_every_accepted_request(tmp_path, node):
    """Requests held 100 ms in a preprocess hook on both workers when the node gets
    SIGTERM: every one is answered correctly, the node exits 0, no child is left; a
    second SIGTERM once it has stopped changes nothing (it ended the node by that signal
    while its output was flushed: exit -15)."""
    export_linear(tmp_path / "repo" / "slow", seed=0, work=3000, hook_seconds=0.1)
    n = node()
    children = n.wait_serving()
    answers: dict[int, object] = {}
    lock = threading.Lock()
    # Through the front door (the gateway) and straight to each worker.
    clients = [tc.InferenceServerClient(f"127.0.0.1:{c['port']}") for c in children.values()]
    try:

        def send(i: int) -> None:
            def callback(result, error):
                with lock:
                    answers[i] = error if error else result.as_numpy("y")

            clients[i % len(clients)].async_infer("slow", [x_input(X)], callback)

        for i in range(40):
            send(i)
        wait_until(lambda: len(answers) >= 2, 30, "the first answers")
        n.process.send_signal(signal.SIGTERM)
        stopped = "node stopped: every child drained and exited"
        wait_until(
            lambda: any(stopped in line for line in n.stderr), 60, "the stop", interval=0.002
        )
        n.process.send_signal(signal.SIGTERM)  # (a no-op once it has exited)
        status = n.wait_exit(60)
        wait_until(lambda: len(answers) == 40, 10, "every answer")
    finally:
        for client in clients:
            client.close()
    assert status == 0, "\n".join(n.stderr[-30:])
    failed = {i: a for i, a in answers.items() if not isinstance(a, np.ndarray)}
    assert not failed
    assert all(matches(a, 0, X) for a in answers.values())
    for child in children.values():
        assert not alive(child["pid"])
    log = "\n".join(n.stderr)
    assert "received SIGTERM: stopping the node" in log
    assert "node stopped: every child drained and exited" in log


def test_a_child_killed_from_elsewhere_while_the_node_stops_fails_the_stop(tmp_path, node):
    """Its drain was cut short (what it held is lost): exit 1 naming it, not 0."""
    export_linear(tmp_path / "repo" / "lin", seed=5)
    n = node()
    worker0 = n.wait_serving()["worker0"]["pid"]
    os.kill(worker0, signal.SIGSTOP)  # (it cannot drain on its own before the kill)
    n.process.send_signal(signal.SIGTERM)
    wait_until(lambda: n.children()["worker0"]["state"] == "stopping", 30, "the stop")
    os.kill(worker0, signal.SIGKILL)  # the OOM killer, say
    assert n.wait_exit(60) == 1
    assert n.stderr[-1].endswith(
        "node stopped; did not drain and exit by itself: worker0 (signal SIGKILL)"
    )


def test_children_stop_when_the_supervisor_is_killed(tmp_path, node):
    export_linear(tmp_path / "repo" / "lin", seed=5)
    n = node()
    pids = [c["pid"] for c in n.wait_serving().values()]
    n.process.kill()
    n.process.wait()
    wait_until(lambda: not any(alive(pid) for pid in pids), 30, "the workers to exit")


def test_children_whose_stop_hangs_end_within_their_grace_when_the_supervisor_dies(tmp_path, node):
    """A model whose import hangs holds each worker's start-up (and so its graceful
    stop) for 10 minutes; SIGKILL of the supervisor still ends both within the grace it
    would have given them (1 s to drain + 1 s), not when the import returns."""
    bundle = export_linear(tmp_path / "repo" / "lin", seed=5, import_seconds=0.01)
    hang = SLOW_HOOK_PY.format(
        seconds=0, import_seconds=600, import_gate=False
    )  # (exported, it would run)
    (bundle / "model.py").write_text(hang)
    n = node(
        TWO_WORKERS.replace("shutdown_grace_seconds = 20", "shutdown_grace_seconds = 1"),
        supervisor="kill_after_seconds = 1",
    )

    def starting() -> list[int]:
        try:
            children = n.children()
        except OSError:  # (its admin endpoint is not up yet)
            return []
        pids = [c["pid"] for name, c in children.items() if name != "gateway" and c["pid"]]
        return pids if len(pids) == 2 else []

    pids = wait_until(starting, 60, "both workers to start", interval=0.1)

    def loading() -> bool:  # (they listen, then load their models: the import hangs)
        lines = [x for x in n.stderr if "gRPC listening" in x]
        return all(any(f"[{w}]" in x for x in lines) for w in ("worker0", "worker1"))

    wait_until(loading, 60, "both workers to listen")
    time.sleep(0.5)  # (into the import)
    n.process.kill()
    n.process.wait()
    wait_until(lambda: not any(alive(pid) for pid in pids), 30, "the workers to end")


@pytest.mark.parametrize("where", ["file", "environment"])
def test_json_logs_stay_json_with_the_child_named(tmp_path, node, where):
    """Every line, the node's own included, whether the file or the environment asks."""
    export_linear(tmp_path / "repo" / "lin", seed=6)
    if where == "file":
        n = node(TWO_WORKERS + '\n[global.logging]\nformat = "json"\n')
    else:
        n = node(env={"INFERENCE_SERVER_LOGGING_FORMAT": "json"})
    n.wait_serving()
    n.process.send_signal(signal.SIGTERM)
    assert n.wait_exit(60) == 0
    entries = [json.loads(line) for line in n.stderr if line.strip()]
    workers = {e["worker"] for e in entries}
    assert {"node", "gateway", "worker0", "worker1"} <= workers
    assert any(e["worker"] == "worker1" and "gRPC listening" in e["message"] for e in entries)


def run_node(tmp_path: Path, text: str, *args: str, env=None) -> subprocess.CompletedProcess:
    (tmp_path / "node.toml").write_text(text)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("INFERENCE_SERVER_")}
    return subprocess.run(
        [*rsrv_command(), *args, str(tmp_path / "node.toml")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**environ, "PATH": "/usr/bin:/bin", **(env or {})},
    )


def test_an_invalid_gateway_file_stops_the_node_before_it_starts(tmp_path):
    (tmp_path / "gateway.toml").write_text('[scheduling]\nmode = "lpt_packin"\n')
    text = 'cpu_workers = 2\n[gateway]\nfile = "gateway.toml"\n'
    result = run_node(tmp_path, text, "node")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()  # nothing started, nothing else logged
    assert line.startswith("rsrv: ") and "lpt_packin" in line, line


@pytest.mark.parametrize("child", ["worker", "gateway"])
def test_a_tls_file_that_cannot_be_used_stops_the_node_before_it_starts(tmp_path, child):
    (tmp_path / "repo").mkdir()
    tls = 'tls_cert_file = "missing.pem"\ntls_key_file = "missing.key"\n'
    if child == "worker":
        text = f'model_repo = "repo"\ncpu_workers = 2\n[global.endpoints]\n{tls}'
    else:
        (tmp_path / "gateway.toml").write_text(f"[grpc]\n{tls}")
        text = 'model_repo = "repo"\ncpu_workers = 2\n[gateway]\nfile = "gateway.toml"\n'
    result = run_node(tmp_path, text, "node")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()  # nothing started, nothing else logged
    who = "worker worker0" if child == "worker" else "gateway"
    assert line.startswith(f"rsrv: {who}: a TLS file cannot be used ("), line
    assert "missing.pem" in line


def test_a_taken_admin_port_is_one_line_and_a_failed_start(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        (tmp_path / "repo").mkdir()
        text = f'model_repo = "repo"\nport = {free_port()}\nmetrics_port = {port}\n'
        result = run_node(tmp_path, text, "node")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr


def test_two_workers_on_one_device_is_an_error_naming_them(tmp_path):
    text = """
gpus = 2
[global.runtime]
backend = "cuda"
[[workers]]
name = "left"
gpu = 1
[[workers]]
name = "right"
gpu = 1
"""
    result = run_node(tmp_path, text, "node")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"rsrv: {tmp_path / 'node.toml'}: workers 'left' and 'right' are both on device 1: "
        "one worker per device"
    ]


def test_a_cuda_node_without_gpus_fails_clearly(tmp_path, cache_dir):
    """gpus = 2 with backend cuda on a machine without GPUs: a worker says in one line
    what to do and exits 2; the node does not restart it and exits non-zero."""
    port, metrics_port = free_ports(2)
    text = f"""
model_repo = "repo"
gpus = 2
base_port = {port}
metrics_port = {metrics_port}
[global]
cache_dir = "{cache_dir}"
[global.runtime]
backend = "cuda"
"""
    (tmp_path / "repo").mkdir()
    result = run_node(tmp_path, text, "node")
    assert result.returncode == 1, result.stderr
    assert "worker worker0: port" in result.stderr and "device 0" in result.stderr
    errors = [line for line in result.stderr.splitlines() if "has no usable device" in line]
    assert errors, result.stderr
    for line in errors:
        assert line.startswith(
            ("[worker0] rsrv: worker worker0: ", "[worker1] rsrv: worker worker1: ")
        )
        assert "install the CUDA build (pip install -e '.[cuda]' in a checkout" in line
        assert "runtime.allow_cpu_fallback" in line
    assert "configuration or device is unusable" in result.stderr
    assert "not restarting" in result.stderr
    assert "Traceback" not in result.stderr


def test_cuda_with_cpu_fallback_warns_and_says_so_in_metrics(tmp_path, cache_dir):
    export_linear(tmp_path / "repo" / "lin", seed=7)
    server = ServerProcess(
        tmp_path,
        f"""
model_repo = "repo"
base_port = {{port}}
metrics_base_port = {{metrics_port}}
[global]
cache_dir = "{cache_dir}"
[global.runtime]
backend = "cuda"
allow_cpu_fallback = true
""",
    )
    try:
        with tc.InferenceServerClient(server.url) as client:
            server.wait_ready(client)
            assert matches(infer_y(client, "lin", X), 7, X)
        assert any(
            "WARNING" in line and "found no usable GPU: running on the CPU" in line
            for line in server.stderr
        )
        scrape = Scrape(server.metrics_port)
        assert scrape.value("rsrv_device_fallback") == 1
        assert scrape.samples("rsrv_worker_info")[0].labels["device"] == "cpu device 0, cpu"
    finally:
        server.kill()
