"""The queue delay through tritonclient against a real worker: ModelConfig reports it as
Triton's dynamic_batching.max_queue_delay_microseconds, RepositoryModelLoad's config
override sets it for a load, closed-loop clients get fuller batches with it, and a
graceful stop does not wait it out.

Rows per execution are measured as Triton users would: ModelStatistics inference_count
(rows) over execution_count, before and after a phase. Only ratios are asserted.
"""

from __future__ import annotations

import json
import queue
import threading

import numpy as np
import pytest
from support.bundles import make_repo
from support.clients import connect, infer_input, raises_status, stats_of
from support.references import classifier_inputs
from support.serving import node_config, running, sched_stats, shut_down
from support.waiting import wait_until

CLIENTS = 8  # closed-loop clients: as many as one execution of the classifier holds
CALLS = 40  # requests per client per phase


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return make_repo(tmp_path_factory.mktemp("delay") / "repo", "classifier", "unbatched")


def node(repo, cache_dir, mode: str = "dynamic", scheduler: str = "") -> str:
    return f"""
model_repo = "{repo}"

[global]
cache_dir = "{cache_dir}"
model_control_mode = "{mode}"

[global.scheduler]
{scheduler}
"""


def delay_us(client, name: str) -> int:
    return client.get_model_config(name).config.dynamic_batching.max_queue_delay_microseconds


def rows_per_execution(server, name: str = "classifier") -> float:
    """CLIENTS closed-loop clients (one tritonclient each, in threads) send CALLS one-row
    requests each; ModelStatistics inference_count / execution_count over the phase."""
    x = classifier_inputs(np.random.default_rng(0), 1)
    errors: list[BaseException] = []
    start = threading.Barrier(CLIENTS)

    def client_loop() -> None:
        try:
            with connect(server) as client:
                start.wait(30)
                for _ in range(CALLS):
                    client.infer(name, [infer_input("x", x)])
        except BaseException as e:  # reported below
            errors.append(e)

    with connect(server) as client:
        before = stats_of(client, name)
        threads = [threading.Thread(target=client_loop) for _ in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        after = stats_of(client, name)
    assert not errors, errors[0]
    inferences = after.inference_count - before.inference_count
    assert inferences == CLIENTS * CALLS
    return inferences / (after.execution_count - before.execution_count)


def test_model_config_reports_the_queue_delay(tmp_path, repo, cache_dir):
    scheduler = """max_queue_delay_seconds = 0.002
[global.scheduler.models.classifier]
max_queue_delay_seconds = 0.0005
"""
    with (
        running(node_config(tmp_path, node(repo, cache_dir, scheduler=scheduler))) as worker,
        connect(worker) as client,
    ):
        assert delay_us(client, "classifier") == 500
        as_json = client.get_model_config("classifier", as_json=True)["config"]
        assert as_json["dynamic_batching"]["max_queue_delay_microseconds"] == "500"
        assert not client.get_model_config("unbatched").config.HasField("dynamic_batching")


def test_an_override_sets_the_delay_and_batches_fill_up(tmp_path, repo, cache_dir):
    """Explicit mode: the classifier loaded as the node file says (no delay), then with
    a config override of 100 ms, then without again. 8 closed-loop clients: without a
    delay an execution takes whatever arrived while the last one ran; with one it waits
    for the 8 rows it can hold (each client has one request in flight), so nearly every
    execution is full, and fuller than without."""
    config = node_config(tmp_path, node(repo, cache_dir, mode="explicit"))
    override = json.dumps({"dynamic_batching": {"max_queue_delay_microseconds": 100000}})
    with running(config) as worker, connect(worker) as client:
        client.load_model("classifier")
        assert delay_us(client, "classifier") == 0
        eager = rows_per_execution(worker)

        # all or nothing: a refused override leaves the served load as it was
        with raises_status("INVALID_ARGUMENT", "must be at most 1000000"):
            client.load_model(
                "classifier",
                config=json.dumps({"dynamic_batching": {"max_queue_delay_microseconds": 2**21}}),
            )
        with raises_status("INVALID_ARGUMENT", "max_queue_delay_microseconds must be 0"):
            client.load_model("unbatched", config=override)
        assert delay_us(client, "classifier") == 0

        client.load_model("classifier", config=override)
        assert delay_us(client, "classifier") == 100000
        patient = rows_per_execution(worker)

        client.load_model("classifier")  # the override applied to that load only
        assert delay_us(client, "classifier") == 0
    assert patient >= 7.5 and patient > eager, (eager, patient)


def test_a_graceful_stop_does_not_wait_out_the_delay(tmp_path, repo, cache_dir):
    """A request held for company (delay 1 s, the most there is) is dispatched as soon as
    the worker begins to stop: its queue time is below the delay."""
    scheduler = "[global.scheduler.models.classifier]\nmax_queue_delay_seconds = 1.0\n"
    answers: queue.Queue = queue.Queue()
    with running(node_config(tmp_path, node(repo, cache_dir, scheduler=scheduler))) as worker:
        with connect(worker) as client:
            x = classifier_inputs(np.random.default_rng(1), 1)
            client.async_infer(
                "classifier", [infer_input("x", x)], lambda result, error: answers.put(error)
            )
            wait_until(
                lambda: sched_stats(worker, "classifier").queue_depth == 1,
                what="the request to be held",
            )
            shut_down(worker)
            assert answers.get(timeout=30) is None
    (waited,) = worker.scheduler._models["classifier"].stats.waits
    assert waited < 1.0
