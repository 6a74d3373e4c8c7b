"""model.py hooks that misbehave, against a running worker through tritonclient: what
they raise fails their request only, what they make is checked, and one model's slow
hooks leave the others' alone."""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from support.bundles import X, make_repo, x_input
from support.clients import connect, infer_input
from support.serving import hook_globals, running, worker_config
from support.waiting import wait_until
from tritonclient.utils import InferenceServerException

PRE = """
import threading

import rsrv

mode = {"v": "ok"}
gate = threading.Event()


@rsrv.preprocess(inputs=["x"], outputs=["x"])
def pre(x):
    if mode["v"] == "zero":
        return x[:0]
    if mode["v"] == "interrupt":
        raise KeyboardInterrupt()
    if mode["v"] == "exit":
        raise SystemExit(3)
    if mode["v"] == "own":  # (a class of the user's deriving from BaseException)
        raise type("Own", (BaseException,), {})("mine")
    if mode["v"] == "cancelled":
        import asyncio

        raise asyncio.CancelledError()
    if mode["v"] == "block":
        gate.wait(60)
    return x
"""

POST = """
import time

import rsrv

mode = {"v": "ok"}


@rsrv.postprocess(inputs=["y"], outputs=["y"])
def post(y):
    if mode["v"] == "one_row":
        return y[:1].copy()
    if mode["v"] == "slow":
        time.sleep(1.0)
    return y
"""


@pytest.fixture
def repo(tmp_path, tiny_template) -> Path:
    repo = tmp_path / "repo"
    for name, model_py in (("pre", PRE), ("post", POST), ("plain", None)):
        path = Path(shutil.copytree(tiny_template, repo / name))
        if model_py is not None:
            (path / "model.py").write_text(model_py)
    return repo


def status(client, model: str, timeout: float = 10) -> tuple[str, str]:
    try:
        client.infer(model, [x_input(X)], client_timeout=timeout)
    except InferenceServerException as e:
        return e.status(), e.message()
    return "OK", ""


@pytest.mark.parametrize(
    ("mode", "raised"),
    [
        ("interrupt", "KeyboardInterrupt: "),
        ("exit", "SystemExit: 3"),
        ("own", "Own: mine"),
        ("cancelled", "CancelledError: "),
    ],
)
def test_a_hook_raising_what_ends_a_process_fails_its_request_only(repo, cache_dir, mode, raised):
    """KeyboardInterrupt or SystemExit in user code ended the worker's trio run: every
    model of the worker went down with the one request (and still did with any other
    BaseException of its own, asyncio's CancelledError included)."""
    with running(worker_config(repo, cache_dir)) as worker, connect(worker) as client:
        hook_globals(worker, "pre")["mode"]["v"] = mode
        assert status(client, "pre") == (
            "StatusCode.INTERNAL",
            f"model 'pre': preprocess hook 'pre' failed: {raised}",
        )
        assert status(client, "plain") == ("OK", "")


def test_a_hook_still_running_at_the_calls_deadline_does_not_answer_ok(repo, cache_dir):
    """(Its thread finished past the deadline, and the call was answered OK, counted a
    success.) It ends DEADLINE_EXCEEDED, counted a failure."""
    with running(worker_config(repo, cache_dir)) as worker, connect(worker) as client:
        hook_globals(worker, "post")["mode"]["v"] = "slow"
        assert status(client, "post", timeout=0.3)[0] == "StatusCode.DEADLINE_EXCEEDED"

        def stats():
            return client.get_inference_statistics("post").model_stats[0].inference_stats

        wait_until(lambda: stats().fail.count == 1)
        assert stats().success.count == 0


def test_a_preprocess_that_makes_no_rows_is_internal(repo, cache_dir):
    """It ran a padded batch on the device and answered OK with no rows, counted as one."""
    with running(worker_config(repo, cache_dir)) as worker, connect(worker) as client:
        hook_globals(worker, "pre")["mode"]["v"] = "zero"
        code, message = status(client, "pre")
        assert code == "StatusCode.INTERNAL"
        assert (
            message == "model 'pre': preprocess produced 'x' with no rows (batch axis of extent 0)"
        )


def test_a_postprocess_that_answers_other_rows_than_the_request_is_internal(repo, cache_dir):
    """One row for a request of two was served as the answer (OK)."""
    with running(worker_config(repo, cache_dir)) as worker, connect(worker) as client:
        hook_globals(worker, "post")["mode"]["v"] = "one_row"
        assert status(client, "post") == (
            "StatusCode.INTERNAL",
            "model 'post': client output 'y' has 1 rows along its batch axis after the "
            "postprocess; the request has 2",
        )


def test_a_preprocess_whose_inputs_disagree_on_rows_is_internal(tmp_path, cache_dir):
    """One input made with 3 rows beside another passed through with 1: the hook's error,
    not the client's (INVALID_ARGUMENT "disagree on the batch size" before)."""
    repo = make_repo(tmp_path / "repo", "simple")
    (repo / "simple" / "model.py").write_text(
        "import numpy as np\nimport rsrv\n\n\n"
        '@rsrv.preprocess(inputs=["INPUT0"], outputs=["INPUT0"])\n'
        "def pre(a):\n    return np.repeat(a, 3, axis=0)\n"
    )
    a = np.ones((1, 16), np.int32)
    with running(worker_config(repo, cache_dir)) as worker, connect(worker) as client:
        with pytest.raises(InferenceServerException) as info:
            client.infer("simple", [infer_input("INPUT0", a), infer_input("INPUT1", a)])
    assert (info.value.status(), info.value.message()) == (
        "StatusCode.INTERNAL",
        "model 'simple': preprocess made executable inputs of [1, 3] rows; they must agree",
    )


def test_slow_hooks_of_one_model_leave_another_models_hooks_their_threads(repo, cache_dir):
    """40 requests parked in one model's preprocess took every thread of trio's default
    limiter: another model's 10 µs postprocess then waited for them (its client's
    deadline passed)."""
    with running(worker_config(repo, cache_dir)) as worker, connect(worker) as client:
        parked = hook_globals(worker, "pre")
        parked["mode"]["v"] = "block"
        try:
            with ThreadPoolExecutor(40) as pool:
                waiting = [pool.submit(status, connect(worker), "pre", 60) for _ in range(40)]
                time.sleep(1.0)
                start = time.monotonic()
                assert status(client, "post", timeout=3) == ("OK", "")
                assert time.monotonic() - start < 2.0
                parked["gate"].set()
                assert all(f.result() == ("OK", "") for f in waiting)
        finally:
            parked["gate"].set()


def test_a_retired_load_of_model_py_leaves_sys_modules(repo, cache_dir):
    """Each load of a model.py is a module of its own; a reload, or a load that fails
    after the import, kept the old one in sys.modules for good, with its globals (a
    model.py holding an 80 MB table grew the worker by 76 MiB a reload)."""
    import gc
    import sys

    config = worker_config(repo, cache_dir, MODEL_CONTROL_MODE="explicit")

    def loaded() -> list[str]:
        gc.collect()
        return [m for m in sys.modules if m.startswith("rsrv_bundle_post_")]

    with running(config) as worker, connect(worker) as client:
        client.load_model("post")
        (first,) = [sys.modules[name] for name in loaded()]
        for _ in range(3):
            client.load_model("post")  # (a reload: the same files, loaded again)
        assert status(client, "post") == ("OK", "")
        wait_until(lambda: len(loaded()) == 1)  # (a version retires once it is idle)
        assert vars(first) == {}  # its globals dropped at once, not at a full collection
        twice = POST + POST.replace("def post(", "def post_again(")  # (two postprocess)
        (repo / "post" / "model.py").write_text(twice)
        with pytest.raises(InferenceServerException, match="more than one @rsrv.postprocess"):
            client.load_model("post")
        wait_until(lambda: len(loaded()) == 1)
        (repo / "post" / "model.py").write_text(POST.replace('outputs=["y"])', 'outputs=["z"])'))
        with pytest.raises(InferenceServerException):  # fails after the import (z: no output)
            client.load_model("post")
        wait_until(lambda: len(loaded()) == 1)  # the serving load's alone
        client.unload_model("post")
        wait_until(lambda: loaded() == [])
