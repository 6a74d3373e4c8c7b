"""benchmarks/gpu.py, the GPU measurement script, where there is no GPU: it says so and
exits 0, and ``--cpu-smoke`` runs its steps on the CPU device (the pinned staging route)
so the script is known to work before it first meets a GPU. It writes to results/."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from support import ROOT

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("jax_cuda12_plugin") is not None,
    reason="a CUDA plugin is installed: the script would measure the GPU",
)


def gpu_bench(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_without_an_accelerator_it_says_so_and_exits_0():
    done = gpu_bench(timeout=120)
    assert done.returncode == 0, done.stderr
    assert "no accelerator" in done.stdout and "Nothing was measured" in done.stdout


def test_cpu_smoke_of_the_cold_load_figure():
    done = gpu_bench("--cpu-smoke", "--only", "1", timeout=300)
    assert done.returncode == 0, done.stderr + done.stdout
    out = done.stdout
    assert "| G1 cold load" in out and "| G1 bandwidth" in out
    assert "Floors in pinned_host memory; every lease copied into device memory." in out
    assert "CPU smoke run" in out and "paired and interleaved" in out


@pytest.mark.slow
def test_cpu_smoke_of_the_many_models_figure():
    done = gpu_bench("--cpu-smoke", "--only", "2", timeout=600)
    assert done.returncode == 0, done.stderr + done.stdout
    out = done.stdout
    assert "| G2 many models | weight cache (8x over budget) / all resident" in out
    assert "posix_fadvise(POSIX_FADV_DONTNEED)" in out and "interleaved" in out
