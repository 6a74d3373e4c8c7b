"""Model versions and Triton's model configuration, through tritonclient against a real
worker: versions served side by side and addressed by version, version strings with
Triton's messages, version policies (node file and manifest), dynamic mode adding and
retiring versions, a request in its preprocess hook across a reload, explicit mode's
index, RepositoryModelLoad's config override and file overrides.
"""

from __future__ import annotations

import errno
import gc
import json
import logging
import pathlib
import queue
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from support.bundles import X, export_linear, infer_y, matches, x_input
from support.clients import connect, raises_status, stats_of
from support.serving import LOOP_THREAD, held_device, node_config, running, sched_stats
from support.waiting import wait_until
from tritonclient.grpc import service_pb2

from rsrv.errors import InvalidArgument
from rsrv.protocol import _infer_flow, _tensors
from rsrv.runtime import FileReplaced
from rsrv.worker import _loading

POLL = 0.1
WRONG = "failed to get model version from specified version string 'wrong_specification'"


def node(repo, cache_dir, mode: str = "dynamic", models: str = "") -> str:
    """A node file serving ``repo``; ``models``: TOML tables of per-model settings."""
    return f"""
model_repo = "{repo}"

[global]
cache_dir = "{cache_dir}"
model_control_mode = "{mode}"
model_poll_seconds = {POLL}
{models}
"""


def versions(client, name: str) -> list[tuple[str, str, str]]:
    """RepositoryIndex entries of ``name``: (version, state, reason)."""
    return [
        (m.version, m.state, m.reason)
        for m in client.get_model_repository_index().models
        if m.name == name
    ]


def infer_v(client, name: str, version: str, x: np.ndarray):
    return client.infer(name, [x_input(x)], model_version=version)


#: A preprocess hook that notes each request's arrival in ``started`` and holds it until
#: the file ``go`` exists.
GATED_HOOK_PY = """
import os
import time

import rsrv


@rsrv.preprocess(inputs=["x"], outputs=["x"])
def gate(x):
    open({started!r}, "a").write("x")
    while not os.path.exists({go!r}):
        time.sleep(0.01)
    return x
"""


def export_gated(path, seed: int, gate) -> None:
    """The linear bundle of ``seed`` with the gated hook, its files in directory ``gate``."""
    export_linear(path, seed, hook_seconds=0.001)
    hook = GATED_HOOK_PY.format(started=str(gate / "started"), go=str(gate / "go"))
    (path / "model.py").write_text(hook)


# -- two versions side by side -----------------------------------------------------------------


def test_two_versions_served_side_by_side_and_addressed_by_version(tmp_path, cache_dir):
    repo = tmp_path / "repo"
    export_linear(repo / "m" / "1", seed=1)
    export_linear(repo / "m" / "2", seed=2)
    policy = "[global.scheduler.models.m]\nversion_policy = { all = true }"
    with (
        running(node_config(tmp_path, node(repo, cache_dir, models=policy))) as worker,
        connect(worker) as client,
    ):
        assert versions(client, "m") == [("1", "READY", ""), ("2", "READY", "")]
        for version, seed in (("1", 1), ("2", 2), ("", 2)):  # "": the newest ready one
            result = infer_v(client, "m", version, X)
            assert matches(result.as_numpy("y"), seed, X)
            assert result.get_response().model_version == (version or "2")
        infer_v(client, "m", "1", X[:1])

        assert list(client.get_model_metadata("m").versions) == ["1", "2"]
        assert list(client.get_model_metadata("m", "1").versions) == ["1"]
        assert client.is_model_ready("m", "1") and client.is_model_ready("m", "2")
        assert client.is_model_ready("m") and not client.is_model_ready("m", "3")
        config = client.get_model_config("m", "1").config
        assert config.version_policy.WhichOneof("policy_choice") == "all"

        stats = client.get_inference_statistics("m").model_stats
        counts = [(s.version, s.inference_stats.success.count, s.inference_count) for s in stats]
        assert counts == [("1", 2, 3), ("2", 2, 4)]  # per version, rows counted
        assert [s.execution_count for s in stats] == [2, 2]
        (one,) = client.get_inference_statistics("m", "1").model_stats
        assert (one.version, one.inference_count) == ("1", 3)
        everything = client.get_inference_statistics().model_stats
        assert [(s.name, s.version) for s in everything] == [("m", "1"), ("m", "2")]

        # a version that is not served: Triton's words, then rsrv's detail
        for call in (
            lambda: infer_v(client, "m", "3", X),
            lambda: client.get_model_metadata("m", "3"),
            lambda: client.get_model_config("m", "3"),
            lambda: client.get_inference_statistics("m", "3"),
        ):
            with raises_status(
                "NOT_FOUND", "Request for unknown model: 'm' version 3 is not found", "1, 2"
            ):
                call()


def test_a_wrong_version_string_gets_tritons_message(tmp_path, cache_dir):
    repo = tmp_path / "repo"
    export_linear(repo / "m", seed=0)  # a bundle directly in the model directory: version 1
    with (
        running(node_config(tmp_path, node(repo, cache_dir))) as worker,
        connect(worker) as client,
    ):
        assert matches(infer_v(client, "m", "1", X).as_numpy("y"), 0, X)
        for call in (
            lambda: infer_v(client, "m", "wrong_specification", X),
            lambda: client.get_model_metadata("m", "wrong_specification"),
            lambda: client.get_model_config("m", "wrong_specification"),
            lambda: client.is_model_ready("m", "wrong_specification"),
            lambda: client.get_inference_statistics("m", "wrong_specification"),
        ):
            with raises_status("INVALID_ARGUMENT", WRONG, "version should be an integral value"):
                call()
        with raises_status("INVALID_ARGUMENT", "invalid model version specified '-1'"):
            infer_v(client, "m", "-1", X)
        with raises_status("NOT_FOUND", "Request for unknown model: 'nope' is not found"):
            infer_v(client, "nope", "1", X)
        assert stats_of(client, "m").inference_stats.fail.count == 0  # never reached it


# -- version policies --------------------------------------------------------------------------


def test_version_policies_from_manifest_and_node_file(tmp_path, cache_dir):
    """The newest version's manifest may carry a policy; the node file's wins. A layout
    mixing both forms, and a policy selecting nothing, make the model unavailable."""
    repo = tmp_path / "repo"
    for name in ("a", "b"):
        for n in (1, 2, 3):
            export_linear(repo / name / str(n), seed=n)
            manifest = repo / name / str(n) / "manifest.yaml"
            manifest.write_text(manifest.read_text() + "version_policy: {latest: 2}\n")
    export_linear(repo / "mixed", seed=0)
    export_linear(repo / "mixed" / "2", seed=2)
    export_linear(repo / "none" / "1", seed=1)
    export_linear(repo / "c" / "2", seed=2)
    export_linear(repo / "c" / "3", seed=3)
    (repo / "c" / "3" / "model.b1.mlir").write_text("not StableHLO")
    models = """
[global.scheduler.models.b]
version_policy = { specific = [1] }

[global.scheduler.models.none]
version_policy = { specific = [4] }
"""
    with (
        running(node_config(tmp_path, node(repo, cache_dir, "static", models))) as worker,
        connect(worker) as client,
    ):
        assert [v for v, _, _ in versions(client, "a")] == ["2", "3"]
        assert [v for v, _, _ in versions(client, "b")] == ["1"]
        assert matches(infer_y(client, "b", X), 1, X)
        assert client.get_model_config("a").config.version_policy.latest.num_versions == 2

        ((version, state, reason),) = versions(client, "mixed")
        assert (version, state) == ("", "UNAVAILABLE")
        assert "it also holds version directories (2); keep one layout" in reason
        ((version, state, reason),) = versions(client, "none")
        assert (version, state) == ("", "UNAVAILABLE")
        assert reason.startswith(
            "at least one version must be available under the version policy of model 'none'"
        )
        with raises_status("UNAVAILABLE", "model 'none' is unavailable", "specific [4]"):
            infer_y(client, "none", X)

        # the version latest 1 selects is broken, and none served before it: unavailable
        ((version, state, reason),) = versions(client, "c")
        assert (version, state) == ("3", "UNAVAILABLE") and "model.b1.mlir" in reason
        with raises_status("UNAVAILABLE", "model 'c' is unavailable", "model.b1.mlir"):
            infer_y(client, "c", X)
        with raises_status(
            "UNAVAILABLE", "Request for unknown model: 'c' version 3 is not at ready state"
        ):
            infer_v(client, "c", "3", X)
        with raises_status("NOT_FOUND", "Request for unknown model: 'c' version 2 is not found"):
            infer_v(client, "c", "2", X)


# -- dynamic mode --------------------------------------------------------------------------------


def test_dynamic_mode_adds_a_version_beside_and_retires_a_removed_one(tmp_path, cache_dir, caplog):
    """latest 2: version 3 appears and loads beside 2; version 2's directory goes and it
    retires, after the requests queued for it have finished on it; versions 4 and 5
    appear broken, and version 3, which they would replace, keeps serving."""
    caplog.set_level(logging.INFO, logger="rsrv")
    repo = tmp_path / "repo"
    export_linear(repo / "m" / "2", seed=2)
    policy = "[global.scheduler.models.m]\nversion_policy = { latest = 2 }"
    with (
        running(node_config(tmp_path, node(repo, cache_dir, models=policy))) as worker,
        connect(worker) as client,
    ):
        assert versions(client, "m") == [("2", "READY", "")]
        export_linear(repo / "m" / "3", seed=3)
        wait_until(lambda: versions(client, "m") == [("2", "READY", ""), ("3", "READY", "")])
        assert matches(infer_y(client, "m", X), 3, X)
        assert matches(infer_v(client, "m", "2", X).as_numpy("y"), 2, X)

        answers: queue.Queue = queue.Queue()

        def send():
            client.async_infer(
                "m",
                [x_input(X)],
                lambda result, error: answers.put(error or result),
                model_version="2",
            )

        dispatched = sched_stats(worker, "m").dispatches
        with held_device(worker) as gate:
            send()  # executing (held), then three queued behind it
            wait_until(lambda: sched_stats(worker, "m").dispatches == dispatched + 1)
            for _ in range(3):
                send()
            wait_until(lambda: sched_stats(worker, "m").queue_depth == 3, what="3 queued")
            shutil.rmtree(repo / "m" / "2")
            wait_until(lambda: versions(client, "m") == [("3", "READY", "")])
            with raises_status("NOT_FOUND", "'m' version 2 is not found"):
                infer_v(client, "m", "2", X)
            gate.set()
            results = [answers.get(timeout=30) for _ in range(4)]
        for result in results:  # every queued request answered, by version 2
            assert not isinstance(result, Exception), result
            assert result.get_response().model_version == "2"
            assert matches(result.as_numpy("y"), 2, X)
        assert matches(infer_y(client, "m", X), 3, X)

        # the versions latest 2 now selects are broken: version 3 keeps serving
        for n in (4, 5):
            staged = export_linear(tmp_path / "staging" / str(n), seed=n)
            (staged / "model.b1.mlir").write_text("not StableHLO")
            staged.rename(repo / "m" / str(n))
        three, four, five = wait_until(
            lambda: (found := versions(client, "m"))[0][2].startswith("kept serving") and found
        )
        assert three[:2] == ("3", "READY")
        assert three[2] == "kept serving: none of the versions latest 2 selects (4, 5) is ready"
        for entry, n in ((four, "4"), (five, "5")):
            assert entry[:2] == (n, "UNAVAILABLE") and "model.b1.mlir" in entry[2]
        assert matches(infer_y(client, "m", X), 3, X)
        with raises_status("UNAVAILABLE", "'m' version 5 is not at ready state"):
            infer_v(client, "m", "5", X)

    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("model m version 3 ready (load ") for m in messages)
    assert any(m.startswith("model m version 2 retired (its directory is gone)") for m in messages)


def test_a_gone_version_retires_and_a_kept_one_loses_its_reason(tmp_path, cache_dir):
    """Dynamic mode. Under `specific [2]`, version 2's directory goes: it retires though
    the policy now selects nothing (it used to keep serving). Under latest 1, a broken
    version 2 leaves version 1 "kept serving"; once version 2 is gone, version 1 is
    selected again and its reason is cleared."""
    repo = tmp_path / "repo"
    export_linear(repo / "s" / "1", seed=1)
    export_linear(repo / "s" / "2", seed=2)
    export_linear(repo / "m" / "1", seed=1)
    policy = "[global.scheduler.models.s]\nversion_policy = { specific = [2] }"
    with (
        running(node_config(tmp_path, node(repo, cache_dir, models=policy))) as worker,
        connect(worker) as client,
    ):
        assert versions(client, "s") == [("2", "READY", "")]
        shutil.rmtree(repo / "s" / "2")
        (entry,) = wait_until(lambda: (found := versions(client, "s"))[0][1] != "READY" and found)
        assert entry[:2] == ("", "UNAVAILABLE") and entry[2].startswith(
            "at least one version must be available under the version policy of model 's'"
        )
        with raises_status("UNAVAILABLE"):
            infer_y(client, "s", X)

        staged = export_linear(tmp_path / "staging" / "2", seed=2)
        (staged / "model.b1.mlir").write_text("not StableHLO")
        staged.rename(repo / "m" / "2")
        one, _ = wait_until(lambda: (found := versions(client, "m"))[0][2] and found)
        assert one == (
            "1",
            "READY",
            "kept serving: none of the versions latest 1 selects (2) is ready",
        )
        shutil.rmtree(repo / "m" / "2")
        wait_until(lambda: versions(client, "m") == [("1", "READY", "")])
        assert matches(infer_y(client, "m", X), 1, X)


def test_a_version_directory_that_cannot_be_read_keeps_its_version_serving(
    tmp_path, cache_dir, monkeypatch
):
    """Dynamic mode: version 2's directory can no longer be read (EACCES, as after
    chmod 000 for a user other than root; simulated, since the tests may run as root):
    the model says why, and both versions keep serving (version 2 used to retire as
    gone); readable again, the reason clears."""
    repo = tmp_path / "repo"
    export_linear(repo / "m" / "1", seed=1)
    export_linear(repo / "m" / "2", seed=2)
    locked = repo / "m" / "2"
    denied = threading.Event()
    iterdir, stat = pathlib.Path.iterdir, pathlib.Path.stat

    def refuse(path) -> None:
        if denied.is_set() and path.is_relative_to(locked):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))

    def denying_iterdir(path):
        refuse(path)
        return iterdir(path)

    def denying_stat(path, **kwargs):
        if path != locked:  # (its own entry is in m, which can be read)
            refuse(path)
        return stat(path, **kwargs)

    monkeypatch.setattr(pathlib.Path, "iterdir", denying_iterdir)
    monkeypatch.setattr(pathlib.Path, "stat", denying_stat)
    policy = "[global.scheduler.models.m]\nversion_policy = { all = true }"
    with (
        running(node_config(tmp_path, node(repo, cache_dir, models=policy))) as worker,
        connect(worker) as client,
    ):
        both = [("1", "READY", ""), ("2", "READY", "")]
        assert versions(client, "m") == both
        denied.set()
        reasons = wait_until(
            lambda: {e.reason for e in client.get_model_repository_index().models} - {""}
        )
        assert any("m/2: cannot be read: Permission denied" in r for r in reasons), reasons
        assert [v[:2] for v in versions(client, "m")] == [("1", "READY"), ("2", "READY")]
        assert matches(infer_v(client, "m", "2", X).as_numpy("y"), 2, X)
        denied.clear()
        wait_until(lambda: versions(client, "m") == both)


def test_a_request_in_its_preprocess_runs_on_the_load_it_was_accepted_for(tmp_path, cache_dir):
    """Explicit mode. A request naming no version is held in version 1's preprocess hook
    while a load retires version 1 for version 2; another is held in version 2's while
    version 2 is reloaded from another bundle. Each is answered by the load it was
    accepted for (they used to fail NOT_FOUND, or run on the new load's executable)."""
    repo, gate = tmp_path / "repo", tmp_path / "gate"
    gate.mkdir()
    export_gated(repo / "m" / "1", 1, gate)
    with (
        running(node_config(tmp_path, node(repo, cache_dir, mode="explicit"))) as worker,
        connect(worker) as client,
    ):
        client.load_model("m")
        answers: queue.Queue = queue.Queue()

        def held(n: int) -> None:
            """Send a request and wait until it is the n-th in a hook."""
            (gate / "go").unlink(missing_ok=True)
            client.async_infer(
                "m", [x_input(X)], lambda result, error: answers.put(error or result)
            )
            started = gate / "started"
            wait_until(lambda: started.exists() and len(started.read_text()) == n, what="in hook")

        try:
            held(1)
            export_gated(repo / "m" / "2", 2, gate)
            client.load_model("m")  # latest 1: version 2 loads, version 1 retires
            assert versions(client, "m") == [("2", "READY", "")]
            (gate / "go").touch()
            first = answers.get(timeout=30)
            held(2)
            export_gated(repo / "m" / "2", 3, gate)
            client.load_model("m")  # version 2 reloaded, from the bundle of seed 3
            (gate / "go").touch()
            second = answers.get(timeout=30)
        finally:
            (gate / "go").touch()
        for result, version, seed in ((first, "1", 1), (second, "2", 2)):
            assert not isinstance(result, Exception), result
            assert result.get_response().model_version == version
            assert matches(result.as_numpy("y"), seed, X)
        assert matches(infer_y(client, "m", X), 3, X)


def test_a_request_decoding_in_a_thread_runs_on_the_load_it_was_accepted_for(
    tmp_path, cache_dir, monkeypatch
):
    """As above, with the gap in the decoding a worker thread does for a large request
    (made long here: it waits for a signal; and every request counts as large): a load
    retiring version 1, then a reload of version 2, overtake it there."""
    repo = tmp_path / "repo"
    export_linear(repo / "m" / "1", seed=1)
    entered, go = threading.Event(), threading.Event()
    materialize = _tensors.Decoding.materialize

    def held_materialize(self):
        if threading.current_thread().name != LOOP_THREAD:  # (a worker thread)
            entered.set()
            assert go.wait(30)
        return materialize(self)

    monkeypatch.setattr(_tensors.Decoding, "materialize", held_materialize)
    monkeypatch.setattr(_infer_flow, "OFFLOAD_SECONDS", -1.0)
    with (
        running(node_config(tmp_path, node(repo, cache_dir, mode="explicit"))) as worker,
        connect(worker) as client,
    ):
        client.load_model("m")
        answers: queue.Queue = queue.Queue()
        for version, new_seed, expected in (("1", 2, 1), ("2", 3, 2)):
            entered.clear()
            go.clear()
            client.async_infer(
                "m", [x_input(X)], lambda result, error: answers.put(error or result)
            )
            try:
                assert entered.wait(30)
                export_linear(repo / "m" / "2", seed=new_seed)
                client.load_model("m")  # version 2 loads (1 retires), then is reloaded
            finally:
                go.set()
            result = answers.get(timeout=30)
            assert not isinstance(result, Exception), result
            assert result.get_response().model_version == version
            assert matches(result.as_numpy("y"), expected, X)


# -- explicit mode: the index, config overrides, file overrides -----------------------------------


def test_explicit_mode_index_lists_unloaded_models_and_loads_versions(tmp_path, cache_dir):
    repo = tmp_path / "repo"
    export_linear(repo / "a", seed=0)
    export_linear(repo / "v" / "1", seed=1)
    export_linear(repo / "v" / "2", seed=2)
    with (
        running(node_config(tmp_path, node(repo, cache_dir, "explicit"))) as worker,
        connect(worker) as client,
    ):
        index = client.get_model_repository_index().models
        assert [(m.name, m.version, m.state, m.reason) for m in index] == [
            ("a", "", "UNAVAILABLE", "unloaded"),
            ("v", "", "UNAVAILABLE", "unloaded"),
        ]
        ready = client._client_stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(ready=True))
        assert list(ready.models) == []
        with raises_status(
            "NOT_FOUND", "failed to load 'nope', failed to poll from model repository"
        ):
            client.load_model("nope")

        client.load_model("v", config=json.dumps({"version_policy": {"all": {}}}))
        assert versions(client, "v") == [("1", "READY", ""), ("2", "READY", "")]
        client.load_model("v")  # without the override: the repository's policy, latest 1
        assert versions(client, "v") == [("2", "READY", "")]
        client.unload_model("v")
        assert versions(client, "v") == [("", "UNAVAILABLE", "unloaded")]


def test_config_override_sets_max_batch_size_for_model_config_and_scheduler(tmp_path, cache_dir):
    repo = tmp_path / "repo"
    export_linear(repo / "a", seed=0)  # compiled at 1, 2, 4
    x1, x3 = X[:1], np.concatenate([X, X[:1]])
    with (
        running(node_config(tmp_path, node(repo, cache_dir, "explicit"))) as worker,
        connect(worker) as client,
    ):
        client.load_model("a", config=json.dumps({"max_batch_size": 2}))
        config = client.get_model_config("a").config
        assert config.max_batch_size == 2
        assert list(config.dynamic_batching.preferred_batch_size) == [1, 2]
        assert sched_stats(worker, "a").max_batch_size == 2

        # the scheduler obeys: 3 rows are refused, queued rows run two at a time
        with raises_status("INVALID_ARGUMENT", "a request of 3 rows exceeds max_batch_size 2"):
            infer_y(client, "a", x3)
        before = stats_of(client, "a")
        answers: queue.Queue = queue.Queue()
        with held_device(worker) as gate:
            client.async_infer("a", [x_input(x1)], lambda result, error: answers.put(error))
            wait_until(lambda: sched_stats(worker, "a").dispatches == before.execution_count + 1)
            for _ in range(4):
                client.async_infer("a", [x_input(x1)], lambda result, error: answers.put(error))
            wait_until(lambda: sched_stats(worker, "a").queue_depth == 4, what="4 queued")
            gate.set()
            assert [answers.get(timeout=30) for _ in range(5)] == [None] * 5
        after = stats_of(client, "a")
        assert after.execution_count - before.execution_count == 1 + 2
        assert {b.batch_size for b in after.batch_stats} <= {1, 2}

        # a round trip of what ModelConfig reports, with another cap
        reported = client.get_model_config("a", as_json=True)["config"]
        reported["max_batch_size"] = 4
        client.load_model("a", config=json.dumps(reported))
        assert client.get_model_config("a").config.max_batch_size == 4
        assert matches(infer_y(client, "a", x3), 0, x3)

        # what rsrv cannot do is refused, naming the field; the model serves on unchanged
        for config, fragment in (
            ({"instance_group": [{"count": 2}]}, "field 'instance_group' is not supported"),
            ({"max_batch_size": 8}, "max_batch_size 8 is not between 1 and the largest"),
            ({"platform": "onnxruntime_onnx"}, "field 'platform' differs from what rsrv derives"),
        ):
            with raises_status("INVALID_ARGUMENT", fragment):
                client.load_model("a", config=json.dumps(config))
        assert client.get_model_config("a").config.max_batch_size == 4

        client.load_model("a", config=json.dumps({"max_batch_size": 1}))
        assert client.get_model_config("a").config.max_batch_size == 1
        client.load_model("a")  # a load without the override: the repository's settings
        assert client.get_model_config("a").config.max_batch_size == 4


def test_a_refused_load_is_freed_at_once(tmp_path, cache_dir):
    """Its error held the load's request (files and all) in a reference cycle through
    its traceback until a garbage collection."""
    repo = tmp_path / "repo"
    export_linear(repo / "m", seed=1)

    def errors() -> int:
        return sum(isinstance(o, InvalidArgument) for o in gc.get_objects())

    with (
        running(node_config(tmp_path, node(repo, cache_dir, "explicit"))) as worker,
        connect(worker) as client,
    ):
        gc.collect()
        gc.disable()
        try:
            before = errors()
            for _ in range(3):
                with raises_status("INVALID_ARGUMENT", "max_batch_size 100 is not between"):
                    client.load_model("m", config=json.dumps({"max_batch_size": 100}))
            assert errors() == before
        finally:
            gc.enable()
        assert worker.models.entries.get("m") is None


def test_a_version_replaced_while_it_loads_is_loaded_again_and_checked_again(
    tmp_path, cache_dir, monkeypatch
):
    """Version 2's files renamed in during its load (its weights file found replaced):
    it is built again from the new files, whose batch sizes the load's config override
    does not allow. It fails alone (version 1 serves), and nothing of its first build
    stays registered (a retry of the whole load left version 1 registered under a
    model it removed, and another skipped the check)."""
    repo = tmp_path / "repo"
    export_linear(repo / "m" / "1", seed=1)
    export_linear(repo / "m" / "2", seed=2)
    build, builds = _loading.build_model, []

    async def replaced_once(path, *args, **kwargs):
        builds.append(path.name)
        if builds == ["1", "2"]:
            export_linear(path, seed=3, batch_sizes=(1, 2))
            raise FileReplaced(f"{path} was replaced since it loaded")
        return await build(path, *args, **kwargs)

    monkeypatch.setattr(_loading, "build_model", replaced_once)
    with (
        running(node_config(tmp_path, node(repo, cache_dir, "explicit"))) as worker,
        connect(worker) as client,
    ):
        config = {"max_batch_size": 4, "version_policy": {"all": {}}}
        with raises_status("FAILED_PRECONDITION", "version 2: config override for 'm'"):
            client.load_model("m", config=json.dumps(config))
        assert builds == ["1", "2"]  # (checked before it was built again)
        ((v1, state1, _), (v2, state2, reason2)) = versions(client, "m")
        assert (v1, state1, v2, state2) == ("1", "READY", "2", "UNAVAILABLE")
        assert "max_batch_size 4 is not between 1 and the largest" in reason2
        assert sorted(worker.executor.versions) == sorted(worker.weights.placements) == ["m@1"]
        assert matches(infer_v(client, "m", "1", X).as_numpy("y"), 1, X)


def test_file_overrides_only_where_allowed_and_only_inside_the_model(tmp_path, cache_dir):
    repo = tmp_path / "repo"
    export_linear(repo / "a", seed=0)
    outside = tmp_path / "outside"
    outside.mkdir()
    (repo / "g").symlink_to(outside, target_is_directory=True)
    source = export_linear(tmp_path / "source" / "f", seed=5)
    files = {f"file:1/{p.name}": p.read_bytes() for p in sorted(source.iterdir())}
    models = """
[global.scheduler.models.f]
allow_file_overrides = true

[global.scheduler.models.g]
allow_file_overrides = true
"""
    with (
        running(node_config(tmp_path, node(repo, cache_dir, "explicit", models))) as worker,
        connect(worker) as client,
    ):
        with raises_status(
            "FAILED_PRECONDITION",
            "failed to load 'a': the request carries file overrides (file:1/manifest.yaml",
            "scheduler.models.a.allow_file_overrides = true",
        ):
            client.load_model("a", files=files)
        assert not (repo / "a" / "1").exists()

        client.load_model("f", files=files)  # a new model, from the request's files
        assert sorted(p.name for p in (repo / "f" / "1").iterdir()) == sorted(
            p.name for p in source.iterdir()
        )
        assert versions(client, "f") == [("1", "READY", "")]
        assert matches(infer_y(client, "f", X), 5, X)

        for path in ("../escape", "1/../../escape", "v1/manifest.yaml", "1/.hidden", "1/a/b"):
            with raises_status("INVALID_ARGUMENT", f"file:{path} is not a path inside"):
                client.load_model("f", files={f"file:{path}": b"x"})
        with raises_status("INVALID_ARGUMENT", "g in the repository is not a plain directory"):
            client.load_model("g", files=files)
        assert not (tmp_path / "escape").exists() and not (repo / "escape").exists()
        assert list(outside.iterdir()) == []

        # Loads writing the same file at once each write their own temporary file (one
        # name per process: all but one failed INTERNAL, FileExistsError naming the
        # repository's path); a file that cannot be written is named as the client did.
        big = {"file:1/extra.bin": bytes(64 << 20), **files}
        with ThreadPoolExecutor(3) as pool:
            loads = [pool.submit(client.load_model, "f", files=big) for _ in range(3)]
            assert [load.result() for load in loads] == [None] * 3
        assert not [p for p in (repo / "f" / "1").iterdir() if p.name.startswith(".")]
        (repo / "f" / "1" / "sub").mkdir()
        with raises_status("INVALID_ARGUMENT", "cannot write file:1/sub: Is a directory") as e:
            client.load_model("f", files={"file:1/sub": b"x"})
        assert str(repo) not in e.value.message()
        long = "m" * 250  # (a name the check accepts: its temporary file's too, now)
        client.load_model("f", files={f"file:1/{long}": b"x"})
        assert (repo / "f" / "1" / long).read_bytes() == b"x"
