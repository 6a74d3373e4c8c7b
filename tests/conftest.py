"""Shared fixtures: the repository paths, one compilation cache, a tiny exported bundle
to copy and break, and a worker serving a module's ``repo``."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def examples_dir() -> Path:
    """The committed example model repository, bundles/."""
    return ROOT / "bundles"


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One compilation cache for the session: identical modules compile once."""
    return tmp_path_factory.getbasetemp() / "rsrv-cache"


@pytest.fixture(scope="module")
def worker(repo):
    """A real worker serving the test module's ``repo`` fixture on a loopback port."""
    from serving import running, worker_config
    from test_kserve_support import cache_dir

    with running(worker_config(repo, cache_dir=cache_dir())) as w:
        yield w


@pytest.fixture(scope="module")
def triton(worker):
    """A tritonclient.grpc client of ``worker``."""
    from test_kserve_support import client

    c = client(worker)
    yield c
    c.close()


@pytest.fixture(scope="session")
def tiny_template(tmp_path_factory) -> Path:
    """Exported once per session: y = x @ w + b, x f32[n,3] -> y f32[n,2], batch sizes 1
    and 2, weights argument_order (by tree path) b, w. Compiles in milliseconds."""
    from rsrv.export import Input, Output, export_jax

    rng = np.random.default_rng(0)
    params = {
        "w": rng.standard_normal((3, 2)).astype(np.float32),
        "b": rng.standard_normal(2).astype(np.float32),
    }
    return export_jax(
        lambda p, x: x @ p["w"] + p["b"],
        params,
        inputs=[Input("x", np.float32, ("n", 3), letters="nf")],
        outputs=[Output("y", letters="nk")],
        batch_sizes=[1, 2],
        out_dir=tmp_path_factory.mktemp("template") / "tiny",
    )


@pytest.fixture
def tiny_bundle(tiny_template, tmp_path) -> Path:
    """A fresh, valid copy of the tiny bundle at ``tmp_path/repo/tiny``, to break."""
    return Path(shutil.copytree(tiny_template, tmp_path / "repo" / "tiny"))
