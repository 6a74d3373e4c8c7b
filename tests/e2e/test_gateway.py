"""``rsrv gateway`` in front of real ``rsrv serve`` processes, driven by tritonclient.

Clients see one server: unary, async, streaming and shared-memory inference, metadata,
the repository index and statistics summed over the workers; a worker's status reaches
the client unchanged; a worker killed under load loses no request (those it held fail
over); under lpt_packing a model is placed on its replicas, requests are routed in runs
that fill batches more than round robin does (asserted with a margin; the ratio itself is
`just bench` figure 9b), and the placement is steered live; merged answers keep identity
fields; shared memory and explicit-mode loads catch up on a worker that was away.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import trio
import tritonclient.grpc as tc
import tritonclient.utils.shared_memory as shm
from purerpc.grpclib.status import StatusCode
from support.bundles import X, export_linear, make_repo, matches, x_input
from support.clients import connect, control, index, model_status, raises_status
from support.metrics import Scrape, get
from support.serving import ServerProcess, run_rsrv
from support.waiting import wait_until

from rsrv.client import ControlClient, InferenceClient, RetryPolicy
from rsrv.client._rpc import call_unary
from rsrv.client._tensors import build_request
from rsrv.config import load_gateway
from rsrv.gateway import Gateway
from rsrv.gateway._forward import INFERENCE
from rsrv.protocol import PUSHBACK
from rsrv.transport import open_channel

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="POSIX signals, /dev/shm")

WORKER = """
model_repo = "{repo}"
base_port = {{port}}

[global]
cache_dir = "{cache}"
model_control_mode = "{mode}"

[global.scheduler]
discipline = "{discipline}"
max_queue_delay_seconds = {delay}

[global.endpoints]
max_concurrent_requests = 0
"""

GATEWAY = """
endpoints = [{endpoints}]
worker_names = [{names}]

[listen]
grpc = "127.0.0.1:{{port}}"
metrics = "127.0.0.1:{{metrics_port}}"

[discovery]
interval_seconds = 0.5

[scheduling]
{scheduling}
"""


def start_workers(
    root: Path,
    cache: Path,
    count: int,
    discipline: str = "fair",
    delay: float = 0.0,
    mode: str = "static",
    repos: list[Path] | None = None,
) -> list:
    """``count`` workers serving ``root / "repo"`` (worker i: ``repos[i]`` when given)."""
    workers = []
    for i in range(count):
        workdir = root / f"w{i}"
        workdir.mkdir()
        repo = repos[i] if repos is not None else root / "repo"
        text = WORKER.format(repo=repo, cache=cache, discipline=discipline, delay=delay, mode=mode)
        workers.append(ServerProcess(workdir, text))
    try:
        for worker in workers:
            with connect(worker) as client:
                worker.wait_ready(client)
    except BaseException:  # (not yet the test's to kill: none may outlive it)
        for worker in workers:
            worker.kill()
        raise
    return workers


def start_gateway(root: Path, workers: list, scheduling: str = "") -> ServerProcess:
    workdir = root / f"gateway-{len(list(root.glob('gateway-*')))}"
    workdir.mkdir()
    text = GATEWAY.format(
        endpoints=", ".join(f'"127.0.0.1:{w.port}"' for w in workers),
        names=", ".join(f'"w{i}"' for i in range(len(workers))),
        scheduling=scheduling,
    )
    gateway = ServerProcess(workdir, text, command="gateway", file_name="gateway.toml")
    names = {f"w{i}" for i in range(len(workers))}

    def every_worker_ready():
        assert gateway.process.poll() is None, "\n".join(gateway.stderr[-30:])
        try:
            return ready_workers(gateway) == names
        except OSError:
            return False

    try:
        wait_until(every_worker_ready, 60, "the gateway to see every worker", interval=0.1)
    except BaseException:
        gateway.kill()
        raise
    return gateway


def ready_workers(gateway: ServerProcess) -> set[str]:
    """The workers the gateway's last probe found ready (its /healthz)."""
    status, _, body = get(gateway.metrics_port, "/healthz")
    if status != 200:
        return set()
    return {w["name"] for w in json.loads(body)["workers"] if w["ready"]}


@pytest.fixture
def processes():
    started: list[ServerProcess] = []
    yield started
    for process in started:
        process.kill()


def test_clients_see_one_server(tmp_path, cache_dir, processes):
    export_linear(tmp_path / "repo" / "lin", seed=11)
    workers = start_workers(tmp_path, cache_dir, 3)
    processes.extend(workers)
    gateway = start_gateway(tmp_path, workers)
    processes.append(gateway)

    with connect(gateway) as client:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("lin")
        assert client.get_model_metadata("lin").inputs[0].name == "x"
        assert client.get_model_config("lin").config.name == "lin"
        # unary, spread over the workers
        for _ in range(6):
            assert matches(client.infer("lin", [x_input(X)]).as_numpy("y"), 11, X)
        # async
        done = threading.Event()
        answers = []

        def callback(result, error):
            answers.append(error or result.as_numpy("y"))
            if len(answers) == 4:
                done.set()

        for _ in range(4):
            client.async_infer("lin", [x_input(X)], callback)
        assert done.wait(30)
        assert all(matches(a, 11, X) for a in answers)
        # streaming: answers matched by id, a bad request answered in-band
        streamed: list = []
        client.start_stream(lambda result, error: streamed.append((result, error)))
        for i in range(5):
            client.async_stream_infer("lin", [x_input(X)], request_id=str(i))
        bad = tc.InferInput("x", [2, 4], "FP32")
        bad.set_data_from_numpy(np.zeros((2, 4), np.float32))
        client.async_stream_infer("lin", [bad], request_id="bad")
        wait_until(lambda: len(streamed) == 6, 30, "every stream answer")
        client.stop_stream()
        ok = {r.get_response().id: r.as_numpy("y") for r, e in streamed if e is None}
        assert sorted(ok) == ["0", "1", "2", "3", "4"]
        assert all(matches(y, 11, X) for y in ok.values())
        (error,) = [e for _, e in streamed if e is not None]
        assert "expects 3" in str(error) or "axis 1" in str(error)

        # statuses pass through unchanged
        with raises_status("INVALID_ARGUMENT", "axis 1"):
            client.infer("lin", [bad])
        with raises_status("NOT_FOUND", "unknown model: 'nope'"):
            client.infer("nope", [x_input(X)])

        # the index is the union; statistics are summed over the workers
        (row,) = [m for m in client.get_model_repository_index().models if m.name == "lin"]
        assert row.state == "READY" and row.reason == "ready on w0, w1, w2"
        stats = client.get_inference_statistics("lin").model_stats[0]
        assert stats.inference_stats.success.count == 6 + 4 + 5
        per_worker = []
        for worker in workers:
            with connect(worker) as direct:
                per_worker.append(
                    direct.get_inference_statistics("lin").model_stats[0].inference_count
                )
        assert sum(per_worker) == stats.inference_count == 15 * len(X)  # rows
        assert sum(1 for n in per_worker if n) == 3  # round robin reached every worker

        # system shared memory: registered on every worker, used through the gateway
        key = f"/rsrv_gw_{os.getpid()}"
        region = shm.create_shared_memory_region("gw_x", key, X.nbytes)
        try:
            shm.set_shared_memory_region(region, [X])
            client.register_system_shared_memory("gw_x", key, X.nbytes)
            for worker in workers:
                with connect(worker) as direct:
                    assert "gw_x" in direct.get_system_shared_memory_status(as_json=True)["regions"]
            for _ in range(3):  # whichever worker answers, it reads the same region
                x = tc.InferInput("x", list(X.shape), "FP32")
                x.set_shared_memory("gw_x", X.nbytes)
                assert matches(client.infer("lin", [x]).as_numpy("y"), 11, X)
            client.unregister_system_shared_memory("gw_x")
            for worker in workers:
                with connect(worker) as direct:
                    assert not direct.get_system_shared_memory_status(as_json=True).get("regions")
        finally:
            shm.destroy_shared_memory_region(region)

    metrics = Scrape(gateway.metrics_port)
    assert metrics.value("rsrv_gateway_worker_up", worker="w1") == 1
    assert metrics.total("rsrv_gateway_routed_requests", worker="w0", status="OK") >= 1


def raw_unary(server: ServerProcess, path: str, body: bytes) -> tuple[str, str]:
    """(status name, message) of one call carrying ``body`` as it is."""

    async def call():
        async with open_channel("127.0.0.1", server.port) as channel:
            result = await channel.unary(path, body, timeout=30)
        return result.status.name, result.message

    return trio.run(call)


def control_status(server: ServerProcess):
    async def call():
        async with ControlClient("127.0.0.1", server.port) as control:
            return await control.status()

    return trio.run(call)


def test_what_the_gateway_merges_and_fans_out(tmp_path, cache_dir, processes):
    """Statistics and control status summed as counters, identity fields kept (batch
    sizes, residency); a trace-setting update made on every worker; unknown-model
    requests refresh discovery at most once per refresh_min_seconds; malformed control
    bodies are INVALID_ARGUMENT."""
    export_linear(tmp_path / "repo" / "lin", seed=11)
    export_linear(tmp_path / "repo0" / "lin", seed=11)
    export_linear(tmp_path / "repo0" / "bad", seed=13)
    (tmp_path / "repo0" / "bad" / "weights.safetensors").write_bytes(b"garbage")
    workers = start_workers(tmp_path, cache_dir, 2, repos=[tmp_path / "repo0", tmp_path / "repo"])
    processes.extend(workers)
    gateway = start_gateway(tmp_path, workers)
    processes.append(gateway)
    with connect(gateway) as client:
        for _ in range(4):
            client.infer("lin", [x_input(X)])
        # a model no worker serves, which w0 failed to load: w0's answer, whatever the
        # rotation (the other worker's NOT_FOUND came back every other call)
        for _ in range(4):
            with raises_status("UNAVAILABLE", "weights.safetensors"):
                client.infer("bad", [x_input(X)])
            with raises_status("UNAVAILABLE", "weights.safetensors"):
                client.get_model_metadata("bad")

        def failovers() -> float:
            scrape = Scrape(gateway.metrics_port)
            return sum(s.value for s in scrape.samples("rsrv_gateway_failovers", "_total"))

        before = failovers()
        for _ in range(3):  # one worker's answer: no failover across the fleet
            with raises_status("NOT_FOUND", "unknown model: 'nope'"):
                client.get_model_config("nope")
        assert failovers() == before
        executions: dict[int, int] = {}
        for worker in workers:
            with connect(worker) as direct:
                for b in direct.get_inference_statistics("lin").model_stats[0].batch_stats:
                    executions[b.batch_size] = executions.get(b.batch_size, 0) + (
                        b.compute_infer.count
                    )
        merged = client.get_inference_statistics("lin").model_stats[0].batch_stats
        assert {b.batch_size: b.compute_infer.count for b in merged} == executions

        (direct_row,) = [m for m in control_status(workers[0]).models if m.name == "lin"]
        (merged_row,) = [m for m in control_status(gateway).models if m.name == "lin"]
        assert merged_row.residency == direct_row.residency
        assert merged_row.rows_served == 4 * len(X)

        client.update_trace_settings(settings={"trace_rate": "5"})
        for worker in workers:
            with connect(worker) as direct:
                assert direct.get_trace_settings().settings["trace_rate"].value == ["5"]

        rounds = Scrape(gateway.metrics_port).total("rsrv_gateway_discovery_rounds")
        for _ in range(30):
            with raises_status("NOT_FOUND", "unknown model: 'nope'"):
                client.infer("nope", [x_input(X)])
        more = Scrape(gateway.metrics_port).total("rsrv_gateway_discovery_rounds") - rounds
        assert more <= 10, more  # one per request before the limit

    for path in (
        "/rsrv.control.v1.ControlService/SetModelPolicy",
        "/rsrv.gateway.v1.GatewayControl/SetSchedulingPolicy",
    ):
        code, message = raw_unary(gateway, path, b"\xff\xff\xff")
        assert code == "INVALID_ARGUMENT", (path, code, message)


def test_a_meta_models_sub_models_are_served_through_the_gateway(tmp_path, cache_dir, processes):
    """A meta's sub-models are out of every worker's RepositoryIndex (specs/meta.md §5) but
    callable by name: through the gateway they are routed over every worker that has them,
    and the control RPCs reach them."""
    make_repo(tmp_path / "repo", "region_pipeline", "region_scorer", "patch_classifier")
    workers = start_workers(tmp_path, cache_dir, 2)
    processes.extend(workers)
    gateway = start_gateway(tmp_path, workers)
    processes.append(gateway)
    image = np.random.default_rng(5).random((1, 64, 64), dtype=np.float32)
    with connect(gateway) as client:
        listed = index(client)
        assert "region_pipeline" in listed and "region_scorer" not in listed
        assert client.is_model_ready("region_scorer")
        scores = tc.InferInput("image", list(image.shape), "FP32")
        scores.set_data_from_numpy(image)
        for _ in range(4):
            assert client.infer("region_scorer", [scores]).as_numpy("scores").shape == (1, 16)
    served = [model_status(w, "region_scorer").requests_served for w in workers]
    assert served == [2, 2], served  # round robin over both, not one fallback worker
    assert control(gateway, "set_policy", "region_scorer", weight=3.0) == 3.0
    assert [model_status(w, "region_scorer").weight for w in workers] == [3.0, 3.0]


def test_shared_memory_changes_reach_a_worker_that_was_away(tmp_path, cache_dir, processes):
    """A region unregistered through the gateway while a worker was unresponsive
    (SIGSTOP) is unregistered there too once it is back; one registered meanwhile is
    registered there. Meanwhile an unknown model is NOT_FOUND at once: the refresh it
    wakes waits for the ready workers' answers, not out the wedged one's probe timeout
    (a 1 s deadline ran out before)."""
    export_linear(tmp_path / "repo" / "lin", seed=11)
    workers = start_workers(tmp_path, cache_dir, 2)
    processes.extend(workers)
    gateway = start_gateway(tmp_path, workers)
    processes.append(gateway)
    key = f"/rsrv_gw_away_{os.getpid()}"
    region = shm.create_shared_memory_region("away", key, 64)

    def regions_of(worker) -> set[str]:
        with connect(worker) as direct:
            return set(direct.get_system_shared_memory_status(as_json=True).get("regions", {}))

    try:
        with connect(gateway) as client:
            client.register_system_shared_memory("old", key, 64)
            os.kill(workers[1].process.pid, signal.SIGSTOP)
            try:
                wait_until(lambda: ready_workers(gateway) == {"w0"}, 30, "w1 to be found away")
                for _ in range(2):
                    time.sleep(1.1)  # (discovery.refresh_min_seconds: a refresh each time)
                    with raises_status("NOT_FOUND", "unknown model: 'nope'"):
                        client.infer("nope", [x_input(X)], client_timeout=1.0)
                client.unregister_system_shared_memory("old")
                client.register_system_shared_memory("new", key, 32)
            finally:
                os.kill(workers[1].process.pid, signal.SIGCONT)
            wait_until(lambda: ready_workers(gateway) == {"w0", "w1"}, 30, "w1 to be back")
            wait_until(lambda: regions_of(workers[1]) == {"new"}, 30, "w1's regions replayed")
            assert regions_of(workers[0]) == {"new"}
            client.unregister_system_shared_memory()
    finally:
        shm.destroy_shared_memory_region(region)


def test_loads_made_through_the_gateway_reach_a_worker_that_was_away(
    tmp_path, cache_dir, processes
):
    """Explicit mode: a restarted worker comes back with nothing loaded, and gets the
    loads made through the gateway, and the residency and policy set through it (set
    right after the load: the gateway's routes catch up first); a model unloaded
    through the gateway while a worker was unresponsive (SIGSTOP) is unloaded there
    once it is back."""
    export_linear(tmp_path / "repo" / "lin", seed=11)
    export_linear(tmp_path / "repo" / "lin2", seed=12)
    workers = start_workers(tmp_path, cache_dir, 2, mode="explicit")
    processes.extend(workers)
    gateway = start_gateway(tmp_path, workers)
    processes.append(gateway)

    def ready_on(worker) -> set[str]:
        try:
            with connect(worker) as direct:
                return {name for name, (state, _) in index(direct).items() if state == "READY"}
        except Exception:
            return set()

    def settings_on(worker) -> tuple[int, float]:
        status = model_status(worker, "lin")
        return status.residency, status.weight

    with connect(gateway) as client:
        client.load_model("lin")
        assert control(gateway, "set_residency", "lin", "system") == "system"
        assert control(gateway, "set_policy", "lin", weight=4.0) == 4.0
        client.load_model("lin2")
        assert ready_on(workers[1]) == {"lin", "lin2"}
        pinned = settings_on(workers[0])
        assert settings_on(workers[1]) == pinned and pinned[1] == 4.0
        before = control_status(workers[1]).instance
        workers[1].restart()
        wait_until(lambda: ready_on(workers[1]) == {"lin", "lin2"}, 60, "w1's loads replayed")
        wait_until(lambda: settings_on(workers[1]) == pinned, 30, "w1's settings replayed")
        assert before and control_status(workers[1]).instance not in ("", before)

        os.kill(workers[0].process.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: ready_workers(gateway) == {"w1"}, 30, "w0 to be found away")
            client.unload_model("lin2")
        finally:
            os.kill(workers[0].process.pid, signal.SIGCONT)
        wait_until(lambda: ready_on(workers[0]) == {"lin"}, 30, "w0's unload replayed")
        assert ready_on(workers[1]) == {"lin"}
        assert matches(client.infer("lin", [x_input(X)]).as_numpy("y"), 11, X)


def test_workers_holding_different_versions_answer_as_one_server(tmp_path, cache_dir, processes):
    """A rolling upgrade: w0 holds m/1, w1 m/2. One Triton server holding both answers a
    request without a version, and ModelMetadata, with the newest (2): they alternated
    between versions; one for version 2 goes straight to w1 (half failed over from
    w0, NOT_FOUND there)."""
    export_linear(tmp_path / "repo0" / "m" / "1", seed=1)
    export_linear(tmp_path / "repo1" / "m" / "2", seed=2)
    repos = [tmp_path / "repo0", tmp_path / "repo1"]
    processes += start_workers(tmp_path, cache_dir, 2, repos=repos)
    gateway = start_gateway(tmp_path, processes[:2])
    processes.append(gateway)
    with connect(gateway) as client:
        rows = [(m.version, m.state) for m in client.get_model_repository_index().models]
        assert rows == [("1", "READY"), ("2", "READY")]
        for _ in range(6):
            answer = client.infer("m", [x_input(X)])
            assert answer.get_response().model_version == "2"
            assert matches(answer.as_numpy("y"), 2, X)
        for version in ("1", "2") * 3:
            answer = client.infer("m", [x_input(X)], model_version=version)
            assert matches(answer.as_numpy("y"), int(version), X)
        failovers = Scrape(gateway.metrics_port).samples("rsrv_gateway_failovers", "_total")
        assert sum(s.value for s in failovers) == 0
        metadata = client.get_model_metadata("m")
        assert list(metadata.versions) == ["1", "2"]


def test_a_worker_busy_with_all_the_gateway_sends_it_stays_ready(tmp_path, cache_dir, processes):
    """Discovery's probes do not queue behind the clients' calls: with every one of the
    worker client's 2 call slots held by requests a preprocess hook keeps 1 s each, for
    3 s and more (longer than a probe may wait, 2 s), the worker stays ready and
    answers them all (a probe waiting for a slot took it out of the routes)."""
    export_linear(tmp_path / "repo" / "slow", seed=3, hook_seconds=1.0)
    workers = start_workers(tmp_path, cache_dir, 1)
    processes.extend(workers)
    gateway = start_gateway(tmp_path, workers, "[worker_client]\nmax_concurrent_streams = 2")
    processes.append(gateway)
    answers = []
    with connect(gateway) as client:
        for _ in range(6):
            client.async_infer(
                "slow", [x_input(X)], lambda result, error: answers.append(error or result)
            )
        wait_until(lambda: len(answers) == 6, 60, "every answer")
    assert all(matches(a.as_numpy("y"), 3, X) for a in answers), answers
    assert not [line for line in gateway.stderr if "is not ready" in line]


def test_a_worker_killed_under_load_loses_no_request(tmp_path, cache_dir, processes):
    """Requests held 50 ms in a preprocess hook, 30 at a time, through the gateway; one
    worker is killed with SIGKILL while it holds some: every request is answered
    correctly (those it held fail over to the others), and the gateway stops sending it
    traffic."""
    export_linear(tmp_path / "repo" / "slow", seed=2, hook_seconds=0.05)
    workers = start_workers(tmp_path, cache_dir, 3)
    processes.extend(workers)
    gateway = start_gateway(tmp_path, workers)
    processes.append(gateway)

    answers: dict[int, object] = {}
    lock = threading.Lock()
    with connect(gateway) as client:

        def send(i: int) -> None:
            def callback(result, error):
                with lock:
                    answers[i] = error if error else result.as_numpy("y")

            client.async_infer("slow", [x_input(X)], callback)

        for i in range(30):
            send(i)
        wait_until(lambda: len(answers) >= 5, 30, "the first answers")
        os.kill(workers[1].process.pid, signal.SIGKILL)
        for i in range(30, 90):
            send(i)
        wait_until(lambda: len(answers) == 90, 60, "every answer")
    failed = {i: a for i, a in answers.items() if not isinstance(a, np.ndarray)}
    assert not failed, failed
    assert all(matches(a, 2, X) for a in answers.values())
    metrics = Scrape(gateway.metrics_port)
    wait_until(
        lambda: Scrape(gateway.metrics_port).value("rsrv_gateway_worker_up", worker="w1") == 0, 10
    )
    assert (
        sum(s.value for s in metrics.samples("rsrv_gateway_failovers", "_total", worker="w1")) >= 1
    )


def test_a_request_no_worker_processed_is_retried_by_rsrv_client(tmp_path, cache_dir, processes):
    """With its one worker down, the gateway answers UNAVAILABLE "no worker is ready" with
    a retry pushback of its discovery interval (the request reached no worker):
    tritonclient sees that status and text, and rsrv.client retries the request, pausing
    as asked, until it succeeds on the restarted worker."""
    export_linear(tmp_path / "repo" / "lin", seed=1)
    workers = start_workers(tmp_path, cache_dir, 1)
    processes.extend(workers)
    gateway = start_gateway(tmp_path, workers)
    processes.append(gateway)
    workers[0].kill()
    wait_until(lambda: not ready_workers(gateway), 10, "the gateway to see its worker down")
    with connect(gateway) as triton, raises_status("UNAVAILABLE", "no worker is ready"):
        triton.infer("lin", [x_input(X)])
    body = build_request("lin", {"x": X}).SerializeToString()
    retried_at: list[float] = []

    class Recorded(RetryPolicy):
        def backoff(self, attempt: int) -> float:
            retried_at.append(trio.current_time())
            return super().backoff(attempt)

    async def main():
        async with InferenceClient("127.0.0.1", gateway.port) as client:
            once = await call_unary(client.channel, INFERENCE + "ModelInfer", body)
            assert (once.status, once.reached_server) == (StatusCode.UNAVAILABLE, True)
            assert dict(once.trailers)[PUSHBACK] == "500"  # discovery.interval_seconds
        policy = Recorded(attempts=200, initial_backoff=0.01, max_backoff=0.05)
        async with InferenceClient("127.0.0.1", gateway.port, retry=policy) as client:
            async with trio.open_nursery() as nursery:
                answer = []

                async def infer():
                    answer.append(await client.infer("lin", {"x": X}, timeout=90))

                nursery.start_soon(infer)
                with trio.fail_after(30):
                    while len(retried_at) < 3:
                        await trio.sleep(0.01)
                await trio.to_thread.run_sync(workers[0].restart)
            assert matches(answer[0]["y"], 1, X)
        # each retry waited the pushback (0.5 s), not its own 10-50 ms backoff
        gaps = [b - a for a, b in zip(retried_at, retried_at[1:], strict=False)]
        assert gaps and min(gaps) >= 0.5, gaps

    trio.run(main)


def closed_loop(gateway: ServerProcess, model: str, clients: int, requests: int) -> None:
    """``clients`` threads, each sending ``requests`` one-row requests one after the
    other through the gateway; every answer checked."""
    x = X[:1]
    errors: list = []

    def loop() -> None:
        with connect(gateway) as client:
            for _ in range(requests):
                try:
                    assert matches(client.infer(model, [x_input(x)]).as_numpy("y"), 5, x)
                except Exception as e:  # recorded, asserted below
                    errors.append(e)

    threads = [threading.Thread(target=loop) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]


def test_lpt_packing_places_replicas_and_fills_runs(tmp_path, cache_dir, processes):
    """Two fifo workers with a queue delay, a model compiled at batch sizes 1 and 8,
    lpt_packing with two replicas: the startup repack places it on both workers with
    weight 1/2 each and a fill quantum of 8 rows; 16 closed-loop clients are all answered
    correctly, both replicas take requests, and the control service and the CLI report
    it."""
    export_linear(tmp_path / "repo" / "m", seed=5, batch_sizes=(1, 8), work=300)
    workers = start_workers(tmp_path, cache_dir, 2, discipline="fifo", delay=0.002)
    processes.extend(workers)
    gateway = start_gateway(tmp_path, workers, 'mode = "lpt_packing"\ndefault_replicas = "all"')
    processes.append(gateway)
    closed_loop(gateway, "m", clients=16, requests=25)

    status = run_rsrv("gateway", "status", "--address", gateway.url)
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["mode"] == "lpt_packing" and not report.get("warnings")
    (model,) = [m for m in report["models"] if m["name"] == "m"]
    assert model["placed"] and model["effective_replicas"] == 2
    assert model["fill_mode"] == "run" and model["fill_quantum"] == 8
    replicas = {r["worker"]: r for r in model["replicas"]}
    assert set(replicas) == {"w0", "w1"}
    assert all(r["weight"] == 0.5 and int(r.get("routed", 0)) > 0 for r in replicas.values())
    assert sum(int(r.get("routed", 0)) for r in replicas.values()) == 16 * 25
    executions = 0
    for worker in workers:
        with connect(worker) as client:
            executions += client.get_inference_statistics("m").model_stats[0].execution_count
    assert executions < 16 * 25  # requests were coalesced

    # A repack on request, and a replica count set live, through the CLI.
    repack = run_rsrv("gateway", "repack", "--wait", "10", "--address", gateway.url)
    assert repack.returncode == 0 and json.loads(repack.stdout)["completed"], repack.stderr
    one = run_rsrv("gateway", "set-replicas", "m", "1", "--address", gateway.url)
    assert one.returncode == 0, one.stderr
    assert json.loads(one.stdout)["configured_replicas"] == 1
    bad = run_rsrv("gateway", "set-policy", "mode=round_robin", "--address", gateway.url)
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr


def test_the_gateway_restricts_its_own_control_service(tmp_path, cache_dir, processes, caplog):
    """grpc.restricted covers the gateway's GatewayControl (gateway-control): it was open
    to every client, whose repacks the gateway backed with worker_client.headers; left
    open beside worker_client.headers, the gateway warns."""
    export_linear(tmp_path / "repo" / "m", seed=5)
    workers = start_workers(tmp_path, cache_dir, 1)
    processes.extend(workers)
    restricted = (
        '[[grpc.restricted]]\nprotocols = ["gateway-control"]\nheader = "admin-key"\n'
        'value = "sekrit"'
    )
    gateway = start_gateway(tmp_path, workers, restricted)
    processes.append(gateway)
    refused = run_rsrv("gateway", "status", "--address", gateway.url)
    assert refused.returncode == 1
    assert "This protocol is restricted, expecting header 'admin-key'" in refused.stderr
    header = ["--header", "admin-key=sekrit"]
    status = run_rsrv("gateway", "status", "--address", gateway.url, *header)
    assert status.returncode == 0 and json.loads(status.stdout)["mode"] == "round_robin"
    with connect(gateway) as client:  # (other protocols stay open)
        assert matches(client.infer("m", [x_input(X)]).as_numpy("y"), 5, X)

    open_control = tmp_path / "open.toml"
    open_control.write_text('endpoints = ["127.0.0.1:1"]\n[worker_client.headers]\nkey = "k"\n')
    with caplog.at_level(logging.WARNING, "rsrv.gateway"):
        Gateway(load_gateway(open_control, env={}))
    assert "grpc.restricted leaves gateway-control open" in caplog.text


def row_totals(workers: list, model: str) -> tuple[int, int]:
    """(rows, executions) of ``model`` summed over the workers: ModelStatistics
    inference_count and execution_count."""
    rows = executions = 0
    for worker in workers:
        with connect(worker) as client:
            stats = client.get_inference_statistics(model).model_stats[0]
            rows += stats.inference_count
            executions += stats.execution_count
    return rows, executions


def test_fill_routing_coalesces_more_rows_than_round_robin(tmp_path, cache_dir, processes):
    """The same two fifo workers (2 ms queue delay, a model compiled at [1, 8]) behind a
    round-robin gateway, then lpt_packing ones (two replicas) without and with a run
    hold, 16 closed-loop clients each: fill routing sends a replica runs of 8 rows, so
    its executions hold more rows than when every other request goes elsewhere; held at
    the gateway until full, a run's requests reach the worker together and are one
    batch. Margins below what this machine gives (fill 1.15-1.4x round robin, 1.25 in the
    middle, over 14 runs of the code before and after 2e373cd..HEAD interleaved: the low
    ones under the whole suite's load; held 2.0-2.1x round robin, 1.5-1.6x fill); a fill
    router degraded to alternation gives about 1x, and a hold that never holds, held =
    fill."""
    export_linear(tmp_path / "repo" / "m", seed=5, batch_sizes=(1, 8), work=300)
    workers = start_workers(tmp_path, cache_dir, 2, discipline="fifo", delay=0.002)
    processes.extend(workers)
    measured = {}
    packing = 'mode = "lpt_packing"\ndefault_replicas = "all"\nrouting_fill_hold_seconds = '
    for mode, scheduling in (
        ("round_robin", 'mode = "round_robin"'),
        ("fill", packing + "0"),
        ("held", packing + "0.004"),
    ):
        gateway = start_gateway(tmp_path, workers, scheduling)
        processes.append(gateway)
        closed_loop(gateway, "m", clients=16, requests=5)  # warm-up, not measured
        rows, executions = row_totals(workers, "m")
        closed_loop(gateway, "m", clients=16, requests=60)
        rows_after, executions_after = row_totals(workers, "m")
        measured[mode] = (rows_after - rows) / (executions_after - executions)
        gateway.kill()
    assert measured["fill"] >= 1.1 * measured["round_robin"], measured
    assert measured["held"] >= 1.5 * measured["round_robin"], measured
    assert measured["held"] >= 1.15 * measured["fill"], measured


@pytest.mark.parametrize(
    "variables",
    [
        {"INFERENCE_GATEWAY_WORKER_CLIENT_TLS_CA_FILE": "/nonexistent/ca.pem"},
        {
            "INFERENCE_GATEWAY_GRPC_TLS_CERT_FILE": "/nonexistent/cert.pem",
            "INFERENCE_GATEWAY_GRPC_TLS_KEY_FILE": "/nonexistent/key.pem",
        },
    ],
)
def test_a_tls_file_that_cannot_be_used_is_a_configuration_error(tmp_path, variables):
    """Exit 2 with one line, as for any invalid setting (a supervisor does not restart
    it: exit 1 would read as a port that may free up)."""
    result = run_rsrv(
        "gateway",
        cwd=tmp_path,
        env={
            "INFERENCE_GATEWAY_ENDPOINTS": "127.0.0.1:1",
            "INFERENCE_GATEWAY_LISTEN_GRPC": "127.0.0.1:0",
            "INFERENCE_GATEWAY_LISTEN_METRICS": "none",
            **variables,
        },
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("rsrv: a TLS file cannot be used") and "/nonexistent/" in line
