"""Shared fixtures: the repository paths and a tiny exported bundle to copy and break."""

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
