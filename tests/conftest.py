"""Fixtures for every test: the repository paths, the session's one compilation cache, a
tiny exported bundle to copy and break, and a worker serving a module's ``repo`` (with a
tritonclient client of it). Helpers live in the support package."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from support import BUNDLES, ROOT
from support.bundles import tiny
from support.clients import connect
from support.rest import with_http
from support.serving import running, worker_config


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def examples_dir() -> Path:
    """The committed example model repository, bundles/."""
    return BUNDLES


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """The session's one compilation cache: every worker and ``rsrv serve`` process of
    the session shares it, so identical modules compile once."""
    return tmp_path_factory.getbasetemp() / "rsrv-cache"


@pytest.fixture(scope="session")
def tiny_template() -> Path:
    """Exported once per session: y = x @ w + b, x f32[n,3] -> y f32[n,2], batch sizes 1
    and 2, weights argument_order (by tree path) b, w. Compiles in milliseconds."""
    return tiny()


@pytest.fixture
def tiny_bundle(tiny_template, tmp_path) -> Path:
    """A fresh, valid copy of the tiny bundle at ``tmp_path/repo/tiny``, to break."""
    return Path(shutil.copytree(tiny_template, tmp_path / "repo" / "tiny"))


# -- a worker serving the test module's ``repo`` -------------------------------------------------


@pytest.fixture(scope="module")
def worker_settings() -> dict:
    """INFERENCE_SERVER_* style overrides of ``worker`` (a module may override this)."""
    return {}


@pytest.fixture(scope="module")
def worker_http() -> bool:
    """Whether ``worker`` serves the KServe V2 REST endpoint too (a module may override
    this)."""
    return False


@pytest.fixture(scope="module")
def worker(repo, cache_dir, worker_settings, worker_http):
    """A real worker serving the test module's ``repo`` fixture on a loopback port (and
    on a REST port when ``worker_http``)."""
    config = worker_config(repo, cache_dir, **worker_settings)
    with running(with_http(config) if worker_http else config) as w:
        yield w


@pytest.fixture(scope="module")
def triton(worker):
    """A tritonclient.grpc client of ``worker``."""
    with connect(worker) as client:
        yield client
