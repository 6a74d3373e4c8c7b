"""Model lifecycle against a running worker: the repository watcher of dynamic mode
(add / change / remove, two-poll debounce), reloads that never drop service (a broken
update keeps the old version, queued requests finish on their version), and static mode.

Every check goes through tritonclient over real gRPC, as a client would see it.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import trio
from support.bundles import ImportGate, X, export_linear, infer_y, matches, x_input
from support.clients import connect, index, model_status, status_of
from support.serving import free_port, run_rsrv, running, worker_config
from support.waiting import wait_until
from tritonclient.utils import InferenceServerException

POLL = 0.1


@pytest.fixture
def repo(tmp_path) -> Path:
    path = tmp_path / "repo"
    path.mkdir()
    return path


# -- dynamic mode: the repository watcher ----------------------------------------------------


async def poll_once(watcher) -> None:
    """One poll of ``watcher``, the changes it starts run to their end."""
    async with trio.open_nursery() as changes:
        await watcher.poll(changes.start_soon)


def test_dynamic_mode_follows_the_repository(repo, cache_dir):
    """Add -> LOADING/READY and answering; new weights -> new outputs; removed ->
    NOT_FOUND and gone from the index. The other model answers throughout."""
    export_linear(repo / "a", seed=0)
    config = worker_config(repo, cache_dir, MODEL_POLL_SECONDS=POLL)
    assert config.model_control_mode == "dynamic"  # the default
    with running(config) as worker, connect(worker) as client:
        assert index(client) == {"a": ("READY", "")}

        added = time.monotonic()  # before the bundle appears: a poll may follow at once
        export_linear(repo / "b", seed=1)
        states = wait_until(lambda: index(client).get("b"), timeout=5)
        assert states[0] in ("LOADING", "READY")
        # acted on only once seen unchanged by two polls
        assert time.monotonic() - added >= POLL
        wait_until(lambda: index(client)["b"] == ("READY", ""))
        assert client.is_model_ready("b")
        assert matches(infer_y(client, "b", X), 1, X)

        export_linear(repo / "b", seed=2)  # same modules, other weights
        wait_until(lambda: matches(infer_y(client, "b", X), 2, X), timeout=5)
        assert index(client) == {"a": ("READY", ""), "b": ("READY", "")}

        shutil.rmtree(repo / "b")
        wait_until(lambda: "b" not in index(client), timeout=5)
        assert status_of(lambda: infer_y(client, "b", X)) == "StatusCode.NOT_FOUND"
        assert not client.is_model_ready("b")
        assert matches(infer_y(client, "a", X), 0, X)
        assert index(client) == {"a": ("READY", "")}


def test_what_the_repository_may_hold_in_dynamic_mode(repo, cache_dir):
    """A manifest that is not UTF-8 is that model's error (it ended the worker); a
    directory whose name is not UTF-8 is no model (RepositoryIndex failed for every
    model); a bundle replaced by one with the same sizes and mtimes (a reproducible
    build) is reloaded (it was never seen)."""
    epoch = 315532800  # 1980-01-01, as reproducible archives pin it

    def pin(bundle: Path) -> Path:
        for file in bundle.iterdir():
            os.utime(file, (epoch, epoch))
        return bundle

    pin(export_linear(repo / "a", seed=0))
    export_linear(repo / os.fsdecode(b"caf\xe9"), seed=1)
    with running(worker_config(repo, cache_dir, MODEL_POLL_SECONDS=POLL)) as worker:
        with connect(worker) as client:
            assert index(client) == {"a": ("READY", "")}
            (repo / "bad").mkdir()
            (repo / "bad" / "manifest.toml").write_bytes(b"\xff\xfe format_version = '2.0'\n")
            bad = wait_until(
                lambda: (found := index(client).get("bad")) and found[0] == "UNAVAILABLE" and found,
                timeout=5,
            )
            assert "manifest.toml: cannot parse" in bad[1]

            staged = pin(export_linear(repo.parent / "staged" / "a", seed=2))
            shutil.rmtree(repo / "a")
            os.rename(staged, repo / "a")
            wait_until(lambda: matches(infer_y(client, "a", X), 2, X), timeout=10)
            assert client.get_inference_statistics().model_stats


def test_a_change_during_the_startup_load_is_picked_up(repo, cache_dir, monkeypatch):
    """The bundle changes on disk once the startup load has read it (weights on the
    device, warming up): the watcher, which fingerprinted the repository before that
    load, reloads it."""
    from rsrv.worker._executor import DeviceExecutor

    export_linear(repo / "a", seed=0)
    export_linear(repo.parent / "unused", seed=1)  # exported now, copied in below
    warm_up, changed = DeviceExecutor.warm_up, []

    async def warm_up_then_change(self, served):
        costs = await warm_up(self, served)
        if not changed:
            changed.append(served.name)
            export_linear(repo / "a", seed=1)
        return costs

    monkeypatch.setattr(DeviceExecutor, "warm_up", warm_up_then_change)
    config = worker_config(repo, cache_dir, MODEL_POLL_SECONDS=POLL)
    with running(config) as worker, connect(worker) as client:
        assert changed == ["a"]
        assert matches(infer_y(client, "a", X), 0, X)  # what the startup load read
        wait_until(lambda: matches(infer_y(client, "a", X), 1, X), timeout=5)


def test_a_bundle_being_written_is_not_loaded_until_stable(repo, cache_dir, tmp_path):
    """The manifest lands first; the rest follows within one poll interval: the watcher
    never tries the incomplete bundle (no UNAVAILABLE entry), it loads the whole one."""
    source = export_linear(tmp_path / "staging" / "c", seed=3)
    # A generous poll: the rest of the bundle must land within one interval of the
    # manifest even on a loaded machine (the debounce itself is tested poll by poll below).
    config = worker_config(repo, cache_dir, MODEL_POLL_SECONDS=2.0)
    with running(config) as worker, connect(worker) as client:
        (repo / "c").mkdir()
        shutil.copy2(source / "manifest.yaml", repo / "c")
        seen = set()
        end = time.monotonic() + 0.15  # well within one poll: at most one poll saw it
        while time.monotonic() < end:
            seen.add(index(client).get("c"))
        for f in sorted(source.iterdir()):
            if f.name != "manifest.yaml":
                shutil.copy2(f, repo / "c")
        while (state := index(client).get("c")) != ("READY", ""):
            seen.add(state)
            time.sleep(0.01)
        assert seen <= {None, ("LOADING", "")}, seen
        assert matches(infer_y(client, "c", X), 3, X)


def test_a_slow_load_delays_no_other_models_change(repo, cache_dir, tmp_path, monkeypatch):
    """A model whose load takes a while (its model.py's import waits at a gate) is
    LOADING while a model added after it is loaded, and one removed after it is
    unloaded."""
    export_linear(repo / "gone", seed=0)
    slow = export_linear(tmp_path / "staging" / "slow", seed=1, import_gate=True)
    gate = ImportGate(monkeypatch, tmp_path / "gate")
    config = worker_config(repo, cache_dir, MODEL_POLL_SECONDS=POLL)
    with running(config) as worker, connect(worker) as client:
        slow.rename(repo / "slow")
        wait_until(lambda: index(client).get("slow") == ("LOADING", ""), timeout=5)
        export_linear(repo / "fast", seed=2)
        shutil.rmtree(repo / "gone")
        wait_until(lambda: index(client).get("fast") == ("READY", ""), timeout=10)
        wait_until(lambda: "gone" not in index(client), timeout=5)
        assert index(client)["slow"] == ("LOADING", "")
        assert matches(infer_y(client, "fast", X), 2, X)
        gate.open()
        wait_until(lambda: index(client)["slow"] == ("READY", ""), timeout=10)


def test_a_failed_model_loaded_again_is_loading_meanwhile(repo, cache_dir, tmp_path, monkeypatch):
    """As Triton says (the last load's UNAVAILABLE and reason were shown meanwhile)."""
    good = export_linear(tmp_path / "staging" / "a", seed=0, import_gate=True)
    (repo / "a").mkdir()
    (repo / "a" / "manifest.yaml").write_text("format_version: '9.9'\n")
    gate = ImportGate(monkeypatch, tmp_path / "gate")
    config = worker_config(repo, cache_dir, MODEL_CONTROL_MODE="explicit")
    with running(config) as worker, connect(worker) as client:
        assert status_of(lambda: client.load_model("a")) == "StatusCode.FAILED_PRECONDITION"
        assert index(client)["a"][0] == "UNAVAILABLE"
        shutil.rmtree(repo / "a")
        shutil.copytree(good, repo / "a")
        loading = threading.Thread(target=client.load_model, args=("a",))
        loading.start()
        wait_until(lambda: index(client)["a"] == ("LOADING", ""), timeout=10)
        gate.open()
        loading.join(30)
        assert index(client)["a"] == ("READY", "")


def test_a_fingerprint_sees_a_file_of_the_same_size_and_mtime(tmp_path):
    """Replaced by a rename (another inode) or rewritten in place (``cp -p``: the same
    inode, its ctime new): either was missed by size and mtime alone."""
    from rsrv.worker._watcher import fingerprint

    bundle = export_linear(tmp_path / "m", seed=0)
    weights = bundle / "weights.safetensors"
    stat = weights.stat()
    for rewrite in ("rename", "in place"):
        before = fingerprint(bundle)
        if rewrite == "rename":
            copy = tmp_path / "copy"
            copy.write_bytes(weights.read_bytes())
            os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns))
            os.rename(copy, weights)
        else:
            time.sleep(0.01)  # (a ctime the clock can tell apart)
            weights.write_bytes(weights.read_bytes())
            os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert fingerprint(bundle) != before, rewrite


async def test_watcher_acts_only_on_a_fingerprint_seen_on_two_polls(tmp_path):
    """The debounce rule itself, poll by poll, over real files."""
    from rsrv.worker._watcher import RepositoryWatcher

    repo = tmp_path / "repo"
    repo.mkdir()
    source = export_linear(tmp_path / "src" / "m", seed=0)
    calls = []

    async def load(path):
        calls.append(("load", path.name))

    async def unload(name):
        calls.append(("unload", name))

    watcher = RepositoryWatcher(repo, 1.0, load, unload)
    watcher.seed()
    await poll_once(watcher)
    assert calls == []

    (repo / "m").mkdir()
    (repo / "m" / "notes.txt").write_text("no manifest: not a bundle yet")
    await poll_once(watcher)
    await poll_once(watcher)
    assert calls == []

    shutil.copy2(source / "manifest.yaml", repo / "m")
    await poll_once(watcher)  # first sighting
    assert calls == []
    for f in source.iterdir():  # still being written when the next poll comes
        shutil.copy2(f, repo / "m")
    await poll_once(watcher)
    assert calls == []
    await poll_once(watcher)  # unchanged since the last poll: act
    assert calls == [("load", "m")]
    await poll_once(watcher)
    assert calls == [("load", "m")]

    (repo / "m" / "weights.safetensors").write_bytes(b"half")
    await poll_once(watcher)
    (repo / "m" / "weights.safetensors").write_bytes(b"half a file")
    await poll_once(watcher)
    assert calls == [("load", "m")]
    await poll_once(watcher)
    assert calls == [("load", "m"), ("load", "m")]

    shutil.rmtree(repo / "m")
    await poll_once(watcher)
    assert calls[-1] == ("load", "m")
    await poll_once(watcher)
    assert calls[-1] == ("unload", "m")

    (repo / "m").mkdir()  # vanished for a single poll only: nothing happens
    shutil.copy2(source / "manifest.yaml", repo / "m")
    await poll_once(watcher)
    shutil.rmtree(repo / "m")
    await poll_once(watcher)
    await poll_once(watcher)
    assert calls[-1] == ("unload", "m") and len(calls) == 3


async def test_watcher_leaves_what_it_cannot_read_as_it_is(tmp_path, monkeypatch, caplog):
    """A version directory that is a symbolic link loop (a change: loaded, it is no
    version), a model directory that cannot be listed and a repository that cannot be
    listed (left as they are) no longer end the worker; the latter two are logged once,
    and their return once."""
    from rsrv.bundle import discover
    from rsrv.errors import BundleError
    from rsrv.worker import _watcher

    caplog.set_level(logging.INFO, logger="rsrv")
    repo = tmp_path / "repo"
    export_linear(repo / "m" / "1", seed=0)
    export_linear(repo / "n" / "1", seed=1)
    calls = []

    async def load(path):
        calls.append(("load", path.name))

    async def unload(name):
        calls.append(("unload", name))

    watcher = _watcher.RepositoryWatcher(repo, 1.0, load, unload)
    watcher.seed()
    (repo / "m" / "7").symlink_to("7")
    for _ in range(3):
        await poll_once(watcher)
    # a change to m: loading it finds no version 7 there (a loop is no directory)
    assert calls == [("load", "m")] and [p.name for p in discover(repo)] == ["m", "n"]
    calls.clear()

    listed = _watcher.model_fingerprint

    def unlistable(model):
        if model.name == "n":
            raise PermissionError(13, "Permission denied")
        return listed(model)

    monkeypatch.setattr(_watcher, "model_fingerprint", unlistable)
    for _ in range(3):
        await poll_once(watcher)
    monkeypatch.undo()

    moved = tmp_path / "away"
    repo.rename(moved)
    repo.symlink_to(repo.name)  # a loop: listing it fails ELOOP
    for _ in range(3):
        await poll_once(watcher)
    with pytest.raises(BundleError, match="repo: model repository is not a directory"):
        discover(repo)
    repo.unlink()
    moved.rename(repo)
    for _ in range(3):
        await poll_once(watcher)
    assert calls == []
    warnings = [r.getMessage() for r in caplog.records if "cannot be read" in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith(f"model directory {repo / 'n'} cannot be read ([Errno 13]")
    assert warnings[1].startswith(f"model repository {repo} cannot be read ([Errno 40]")
    assert sum("no longer unreadable" in r.getMessage() for r in caplog.records) == 2


def test_a_broken_update_keeps_the_old_version_answering(repo, cache_dir):
    export_linear(repo / "a", seed=0)
    config = worker_config(repo, cache_dir, MODEL_POLL_SECONDS=POLL)
    with running(config) as worker, connect(worker) as client:
        assert matches(infer_y(client, "a", X), 0, X)

        (repo / "a" / "model.b1.mlir").write_bytes(b"\x00garbage, not a StableHLO module")
        state, reason = wait_until(lambda: index(client)["a"][1] and index(client)["a"])
        assert state == "READY"
        assert "model.b1.mlir" in reason
        assert client.is_model_ready("a")
        assert matches(infer_y(client, "a", X), 0, X)

        (repo / "a" / "manifest.yaml").write_text("format_version: [this is not a manifest\n")
        wait_until(lambda: "manifest" in index(client)["a"][1])
        assert index(client)["a"][0] == "READY"
        assert matches(infer_y(client, "a", X), 0, X)
        assert matches(infer_y(client, "a", X[:1]), 0, X[:1])

        export_linear(repo / "a", seed=4)  # fixed: the new version takes over
        wait_until(lambda: matches(infer_y(client, "a", X), 4, X), timeout=5)
        assert index(client)["a"] == ("READY", "")


def test_requests_queued_before_a_reload_finish_on_their_version(repo, cache_dir):
    """Explicit reload while ~100 requests are queued on a slow model: every request
    sent before the reload answers with the old weights, every one after with the new,
    and some old ones were still queued when the new version took over."""
    export_linear(repo / "slow", seed=0, work=3000)
    config = worker_config(
        repo, cache_dir, MODEL_CONTROL_MODE="explicit", ENDPOINTS_MAX_CONCURRENT_REQUESTS=0
    )
    with running(config) as worker, connect(worker) as client:
        client.load_model("slow")
        assert matches(infer_y(client, "slow", X), 0, X)
        export_linear(repo / "slow", seed=1, work=3000)  # on disk; not yet loaded

        answers: dict[int, tuple[float, object]] = {}
        done = threading.Event()
        n_before, n_after = 96, 16
        xs = [
            np.random.default_rng(i).standard_normal((1 + i % 2, 3)).astype(np.float32)
            for i in range(n_before + n_after)
        ]

        def send(i):
            def callback(result, error):
                answers[i] = (time.monotonic(), error if error else result.as_numpy("y"))
                if len(answers) == len(xs):
                    done.set()

            client.async_infer("slow", [x_input(xs[i])], callback)

        for i in range(n_before):
            send(i)
        wait_until(lambda: model_status(worker, "slow").queue_depth >= 32, timeout=5)
        client.load_model("slow")  # returns once the new version serves
        swapped = time.monotonic()
        for i in range(n_before, len(xs)):
            send(i)
        assert done.wait(30)

    failures = [a for _, a in answers.values() if isinstance(a, Exception)]
    assert not failures, failures[:3]
    for i, (_, y) in answers.items():
        assert matches(y, 0 if i < n_before else 1, xs[i]), i
    late = [t for i, (t, _) in answers.items() if i < n_before and t > swapped]
    assert late, "no old request was still queued at the swap"


def test_continuous_traffic_across_dynamic_reloads(repo, cache_dir):
    """Requests keep flowing while the watcher reloads twice: none fails, and each
    answer is entirely one version's."""
    for seed in (2, 1, 0):  # export every version now; copy them in under traffic
        export_linear(repo / "m", seed=seed, work=300)
    config = worker_config(
        repo, cache_dir, MODEL_POLL_SECONDS=POLL, ENDPOINTS_MAX_CONCURRENT_REQUESTS=0
    )
    results: list[tuple[np.ndarray, object]] = []
    stop = threading.Event()
    with running(config) as worker:

        def client_loop(k):
            with connect(worker) as client:
                rng = np.random.default_rng(k)
                while not stop.is_set():
                    x = rng.standard_normal((1 + k % 3, 3)).astype(np.float32)
                    try:
                        results.append((x, infer_y(client, "m", x)))
                    except InferenceServerException as e:
                        results.append((x, e))

        threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        try:
            with connect(worker) as client:
                for seed in (1, 2):
                    time.sleep(0.1)
                    export_linear(repo / "m", seed=seed, work=300)
                    wait_until(lambda s=seed: matches(infer_y(client, "m", X), s, X), timeout=5)

            def answered_by_2() -> bool:  # (the traffic's, not the probe's)
                done = list(results)
                return any(not isinstance(y, Exception) and matches(y, 2, x) for x, y in done)

            wait_until(answered_by_2, timeout=10)
        finally:
            stop.set()
            for t in threads:
                t.join(10)

    assert not [r for _, r in results if isinstance(r, Exception)]
    seen = set()
    for x, y in results:
        versions = [s for s in (0, 1, 2) if matches(y, s, x)]
        assert len(versions) == 1, (x, y)
        seen.add(versions[0])
    assert seen == {0, 1, 2}


# -- static mode -----------------------------------------------------------------------------


def test_static_mode_ignores_the_repository(repo, cache_dir):
    export_linear(repo / "a", seed=0)
    config = worker_config(repo, cache_dir, MODEL_CONTROL_MODE="static", MODEL_POLL_SECONDS=0.05)
    with running(config) as worker, connect(worker) as client:
        assert index(client) == {"a": ("READY", "")}
        export_linear(repo / "a", seed=1)
        export_linear(repo / "b", seed=2)
        time.sleep(0.4)  # eight poll intervals
        assert index(client) == {"a": ("READY", "")}
        assert matches(infer_y(client, "a", X), 0, X)
        assert status_of(lambda: infer_y(client, "b", X)) == "StatusCode.NOT_FOUND"
        # the startup set is fixed: no explicit load either
        assert status_of(lambda: client.load_model("b")) == "StatusCode.FAILED_PRECONDITION"
        assert status_of(lambda: client.unload_model("a")) == "StatusCode.FAILED_PRECONDITION"
        assert matches(infer_y(client, "a", X), 0, X)


@pytest.mark.parametrize("missing", ["absent", "a file"])
def test_a_model_repo_that_is_not_a_directory_stops_serve(tmp_path, missing):
    """A mistyped model_repo would otherwise serve nothing and answer ready: exit 2,
    naming the path, before any port is opened."""
    if missing == "a file":
        (tmp_path / "modls").write_text("")
    (tmp_path / "node.toml").write_text(f'model_repo = "modls"\nport = {free_port()}\n')
    result = run_rsrv("serve", str(tmp_path / "node.toml"))
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line == f"rsrv: model_repo {tmp_path / 'modls'}: not a directory"
    assert "listening" not in result.stderr
