"""The admin HTTP endpoint of a running worker: /healthz, /readyz, and /metrics parsed
with prometheus_client's own parser, its counters checked against the traffic sent.
Names and labels: specs/metrics.md.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from support.bundles import WEIGHT_BYTES, ImportGate, X, export_linear, infer_y, matches, x_input
from support.clients import connect, failure, infer_input
from support.metrics import Scrape, get, get_absolute
from support.procfs import listening_ports
from support.serving import LOOP_THREAD, free_port, running, threads_calling, worker_config
from support.waiting import wait_until


@pytest.fixture
def repo(tmp_path):
    path = tmp_path / "repo"
    path.mkdir()
    export_linear(path / "a", seed=0)
    export_linear(path / "b", seed=1)
    return path


def with_metrics(repo, cache_dir, **settings):
    """(port, config): a worker config whose admin endpoint listens on a free port; the
    repository is polled every minute unless ``settings`` say otherwise."""
    port = free_port()
    settings = {"MODEL_POLL_SECONDS": 60, **settings}
    return port, worker_config(repo, cache_dir, ENDPOINTS_METRICS_PORT=port, **settings)


def test_health_endpoints(repo, cache_dir):
    port, config = with_metrics(repo, cache_dir)
    assert config.endpoints.metrics_port == port
    with running(config):
        assert get(port, "/healthz")[0::2] == (200, "ok\n")
        assert get(port, "/readyz")[0::2] == (200, "ready\n")
        assert get(port, "/healthz", "HEAD")[0] == 200
        assert get(port, "/nope")[0] == 404
        assert get_absolute(port, "/healthz") == (200, b"ok\n")  # (RFC 9112 §3.2.2: was 404)
        assert get(port, "/metrics", "POST")[0] == 405
        request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=5)
        assert refused.value.headers["allow"] == "GET, HEAD"  # (RFC 9110: a 405 says which)
    with pytest.raises(OSError):  # the admin server stops with the worker
        get(port, "/healthz")


def test_no_admin_server_without_a_metrics_port(repo, cache_dir):
    config = worker_config(repo, cache_dir, MODEL_POLL_SECONDS=60)
    assert config.endpoints.metrics_port is None
    before = listening_ports()
    with running(config) as worker:
        opened = listening_ports() - before
    assert opened == {worker.port}  # gRPC only: no admin HTTP listener


def test_readyz_is_503_while_a_model_is_loading(repo, cache_dir, tmp_path, monkeypatch):
    port, config = with_metrics(repo, cache_dir, MODEL_POLL_SECONDS=0.1)
    slow = export_linear(tmp_path / "staging" / "slow", seed=2, import_gate=True)
    gate = ImportGate(monkeypatch, tmp_path / "gate")
    with running(config) as worker, connect(worker) as client:
        assert get(port, "/readyz")[0] == 200
        slow.rename(repo / "slow")  # it loads until the gate opens
        assert wait_until(lambda: get(port, "/readyz")[0] == 503, timeout=5)
        assert not client.is_server_ready()
        assert get(port, "/healthz")[0] == 200  # live all along
        assert matches(infer_y(client, "a", X), 0, X)  # the others keep serving
        gate.open()
        wait_until(lambda: get(port, "/readyz")[0] == 200, timeout=10)
        assert client.is_server_ready()
        assert matches(infer_y(client, "slow", X), 2, X)


def test_a_scrape_renders_its_text_off_the_event_loop(repo, cache_dir, monkeypatch):
    """(A scrape held the loop about 0.2 ms per model: 1,000 models stalled every call
    for 200 ms. The loop now only copies the values.)"""
    from rsrv.worker import _metrics

    threads = threads_calling(monkeypatch, _metrics, "generate_latest")
    port, config = with_metrics(repo, cache_dir)
    with running(config) as worker, connect(worker) as client:
        infer_y(client, "a", X)
        assert Scrape(port).total("rsrv_requests", model="a", status="OK") == 1
    assert threads and LOOP_THREAD not in threads


def test_a_call_its_client_timed_out_counts_as_deadline_exceeded(tmp_path, cache_dir):
    """The client's timer starts before its request is sent, so its reset at the
    deadline reached the worker before the worker's own deadline: 7 of 8 such calls
    were counted CANCELLED."""
    repo = tmp_path / "repo"
    export_linear(repo / "slow", seed=0, work=3000)
    port, config = with_metrics(repo, cache_dir, SCHEDULER_MAX_QUEUE_DELAY_SECONDS=0.005)
    statuses, done = [], threading.Semaphore(0)

    def answered(result, error):
        statuses.append("OK" if error is None else error.status())
        done.release()

    with running(config) as worker, connect(worker) as client:
        infer_y(client, "slow", X[:1])
        for i in range(60):  # a queue, so that the timed-out calls wait past their deadline
            timeout = {"client_timeout": 0.05} if i % 2 == 0 else {}
            client.async_infer("slow", [x_input(X[:1])], answered, **timeout)
        for _ in range(60):
            assert done.acquire(timeout=60)
        timed_out = statuses.count("StatusCode.DEADLINE_EXCEEDED")
        assert timed_out > 0 and set(statuses) <= {"OK", "StatusCode.DEADLINE_EXCEEDED"}
        scrape = Scrape(port)
        assert not scrape.samples("rsrv_requests", "_total", model="slow", status="CANCELLED")
        # (a call answered just before its client gave up is the worker's OK)
        assert 0 < scrape.total("rsrv_requests", model="slow", status="DEADLINE_EXCEEDED")
        assert scrape.total("rsrv_requests", model="slow", status="DEADLINE_EXCEEDED") <= timed_out


def test_metrics_count_what_was_sent(repo, cache_dir):
    """Sequential requests (one dispatch each) with known rows and statuses, and a
    weight budget that holds one model, so switching models loads and evicts."""
    port, config = with_metrics(repo, cache_dir, RUNTIME_WEIGHT_CACHE_BYTES=WEIGHT_BYTES + 8)
    rng = np.random.default_rng(0)
    with running(config) as worker, connect(worker) as client:
        # (metrics.md: a served model's request series are there from its load, at zero)
        assert Scrape(port).total("rsrv_requests", model="b", status="OK") == 0
        infer_y(client, "a", X[:1])  # a is now the resident model
        before = Scrape(port)

        ok_rows = [2, 2, 4, 3, 1]
        for rows in ok_rows:
            x = rng.standard_normal((rows, 3)).astype(np.float32)
            assert matches(infer_y(client, "a", x), 0, x)
        failures = {"INVALID_ARGUMENT": 0, "DEADLINE_EXCEEDED": 0}

        def fail(status, call):
            assert failure(call)[0] == f"StatusCode.{status}"
            failures[status] += 1

        fail("INVALID_ARGUMENT", lambda: infer_y(client, "a", np.ones((2, 4), np.float32)))
        fail("INVALID_ARGUMENT", lambda: infer_y(client, "a", np.ones((5, 3), np.float32)))
        f64 = infer_input("x", np.ones((2, 3), np.float64))
        fail("INVALID_ARGUMENT", lambda: client.infer("a", [f64]))
        fail("DEADLINE_EXCEEDED", lambda: client.infer("a", [x_input(X)], timeout=1))
        for name in ("b", "a", "b"):  # each switch evicts one model and loads the other
            assert matches(infer_y(client, name, X), "ab".index(name), X)
        triton = client.get_inference_statistics("a").model_stats[0]
        after = Scrape(port)

    ok_rows = [1, *ok_rows, 2]  # with the first request and the one in the switching
    n_ok, n_failed = len(ok_rows), sum(failures.values())

    assert after.type("rsrv_worker_info") == "gauge"
    info = after.samples("rsrv_worker_info")[0]
    assert info.labels == {
        "worker": "worker0",
        "platform": "cpu",
        "device": "cpu device 0, cpu",
        "discipline": "fair",
        "control_mode": "dynamic",
    }
    assert info.value == 1
    assert after.samples("rsrv_device_fallback")[0].value == 0

    assert after.type("rsrv_requests") == "counter"
    assert after.total("rsrv_requests", model="a", status="OK") == n_ok
    for status, n in failures.items():
        assert after.total("rsrv_requests", model="a", status=status) == n
    assert {s.labels["status"] for s in after.samples("rsrv_requests", "_total", model="a")} == {
        "OK",
        *failures,
    }
    assert after.total("rsrv_requests", model="b", status="OK") == 2
    assert triton.inference_stats.success.count == n_ok  # agrees with Triton's statistics
    assert triton.inference_stats.fail.count == n_failed

    assert after.type("rsrv_request_latency_seconds") == "histogram"
    assert after.value("rsrv_request_latency_seconds", "_count", model="a") == n_ok + n_failed
    assert after.value("rsrv_request_latency_seconds", "_sum", model="a") > 0
    buckets = [
        (float(s.labels["le"]), s.value)
        for s in after.samples("rsrv_request_latency_seconds", "_bucket", model="a")
    ]
    assert buckets == sorted(buckets)  # cumulative, bounds ascending
    assert buckets[-1] == (float("inf"), n_ok + n_failed)
    assert buckets[0][0] == 0.001 and len(buckets) == 15

    # one dispatch per successful request: they were sent one at a time
    assert after.type("rsrv_executions") == "counter"
    assert after.total("rsrv_executions", model="a") == n_ok
    assert after.total("rsrv_inferences", model="a") == sum(ok_rows)
    by_size = {
        s.labels["batch_size"]: s.value
        for s in after.samples("rsrv_batch_executions", "_total", model="a")
    }
    assert by_size == {"1": 2, "2": 3, "4": 2}  # 3 rows run at compiled size 4
    assert after.total("rsrv_compute_seconds", model="a") > 0
    assert after.total("rsrv_executions", model="b") == 2
    assert after.value("rsrv_queue_depth", model="a") == 0
    waits = {
        s.labels["quantile"]: s.value for s in after.samples("rsrv_queue_wait_seconds", model="a")
    }
    assert set(waits) == {"0.5", "0.99"} and 0 <= waits["0.5"] <= waits["0.99"]

    assert after.value("rsrv_model_weight_bytes", model="a") == WEIGHT_BYTES
    assert after.value("rsrv_model_device_resident", model="b") == 1  # used last
    assert after.value("rsrv_model_device_resident", model="a") == 0  # evicted for it
    assert after.value("rsrv_model_host_resident", model="a") == 1  # the "system" floor

    assert after.value("rsrv_weight_cache_budget_bytes") == WEIGHT_BYTES + 8
    assert after.value("rsrv_weight_cache_resident_bytes") == WEIGHT_BYTES
    assert after.value("rsrv_weight_cache_pinned_bytes") == 0
    for family, delta in (
        ("rsrv_weight_cache_loads", 3),
        ("rsrv_weight_cache_evictions", 3),
        ("rsrv_weight_cache_transferred_bytes", 3 * WEIGHT_BYTES),
    ):
        assert after.type(family) == "counter"
        assert after.total(family) - before.total(family) == delta, family
    assert after.total("rsrv_weight_cache_load_seconds") > before.total(
        "rsrv_weight_cache_load_seconds"
    )

    assert after.value("rsrv_inflight_requests") == 0
    assert after.total("rsrv_requests_shed") == 0


def test_requests_refused_at_the_inflight_cap_are_counted(repo, cache_dir, tmp_path):
    export_linear(repo / "slow", seed=3, hook_seconds=0.3)
    port, config = with_metrics(repo, cache_dir, ENDPOINTS_MAX_CONCURRENT_REQUESTS=2)
    with running(config) as worker, connect(worker) as client:
        statuses: list[str] = []
        lock = threading.Lock()

        def callback(result, error):
            with lock:
                statuses.append(error.status() if error else "OK")

        for _ in range(6):
            client.async_infer("slow", [x_input(X)], callback)
        wait_until(lambda: Scrape(port).value("rsrv_inflight_requests") == 2, timeout=5)
        wait_until(lambda: len(statuses) == 6, timeout=10)
        time.sleep(0.05)
        scrape = Scrape(port)
    assert statuses.count("OK") == 2
    assert statuses.count("StatusCode.RESOURCE_EXHAUSTED") == 4
    assert scrape.total("rsrv_requests_shed") == 4
    assert scrape.total("rsrv_requests", model="slow", status="OK") == 2
