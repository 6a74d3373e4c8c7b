"""Which devices a node has, and which one each worker gets (config/_devices.py)."""

from __future__ import annotations

import os
import re
import stat
import textwrap
from pathlib import Path

import pytest

from rsrv.config import ConfigError, NodeConfig, detect_devices, load_node, plan_node

CUDA = "global: {runtime: {backend: cuda}}\n"


def node_file(tmp_path: Path, yaml: str) -> Path:
    path = tmp_path / "node.yaml"
    path.write_text(textwrap.dedent(yaml))
    return path


def plan(tmp_path: Path, yaml: str, env: dict[str, str] | None = None):
    path = node_file(tmp_path, yaml)
    # An empty PATH: no real nvidia-smi is consulted unless a test puts one there.
    return plan_node(load_node(path), {"PATH": "", **(env or {})}, source=path)


@pytest.fixture
def fake_smi(tmp_path):
    """A directory holding an ``nvidia-smi`` that lists ordinals 0..2."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text('#!/bin/sh\n[ "$1" = --query-gpu=index ] && printf "0\\n1\\n2\\n"\n')
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    return str(bin_dir)


@pytest.fixture
def fake_devfs(tmp_path):
    devfs = tmp_path / "dev"
    devfs.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "null"):
        (devfs / name).touch()
    return str(devfs)


def detect(node: NodeConfig, env: dict[str, str], devfs: str = "/nonexistent"):
    return detect_devices(node, env, "node.yaml", devfs=devfs)


def test_detection_precedence(fake_smi, fake_devfs):
    listed = NodeConfig(gpus=["GPU-1c2b", 1])
    everything = {
        "INFERENCE_SERVER_GPUS": "2",
        "CUDA_VISIBLE_DEVICES": "5,6,7",
        "PATH": fake_smi,
    }
    # 1. The environment override beats the file, CUDA_VISIBLE_DEVICES and the tools (a
    # count takes the first of the devices this process was given).
    assert detect(listed, everything, fake_devfs) == (["5", "6"], "INFERENCE_SERVER_GPUS")
    assert detect(listed, {"INFERENCE_SERVER_GPUS": "2"}) == (["0", "1"], "INFERENCE_SERVER_GPUS")
    assert detect(listed, {**everything, "INFERENCE_SERVER_GPUS": "cuda:3, GPU-ab"}) == (
        ["3", "GPU-ab"],
        "INFERENCE_SERVER_GPUS",
    )
    assert detect(listed, {**everything, "INFERENCE_SERVER_GPUS": "0"})[0] == []
    # 2. The node file, when it is not auto.
    rest = {k: v for k, v in everything.items() if k != "INFERENCE_SERVER_GPUS"}
    assert detect(listed, rest, fake_devfs) == (["GPU-1c2b", "1"], "gpus")
    assert detect(NodeConfig(gpus=2), rest) == (["5", "6"], "gpus")
    assert detect(NodeConfig(gpus=2), {}) == (["0", "1"], "gpus")
    # a count of none reads nothing (CUDA_VISIBLE_DEVICES=-1 hides every GPU)
    assert detect(NodeConfig(gpus=0), {"CUDA_VISIBLE_DEVICES": "-1"}) == ([], "gpus")
    assert (
        detect(NodeConfig(), {"INFERENCE_SERVER_GPUS": "0", "CUDA_VISIBLE_DEVICES": "-1"})[0] == []
    )
    # 3. The devices this process was given.
    auto = NodeConfig()
    assert detect(auto, rest, fake_devfs) == (["5", "6", "7"], "CUDA_VISIBLE_DEVICES")
    assert detect(auto, {**rest, "CUDA_VISIBLE_DEVICES": ""})[0] == []
    # as CUDA reads it, the list ends at -1 or NoDevFiles (it was an error)
    for hidden, devices in (("-1", []), ("NoDevFiles", []), ("2,-1,3", ["2"])):
        assert detect(auto, {**rest, "CUDA_VISIBLE_DEVICES": hidden})[0] == devices
    # 4. nvidia-smi on PATH.
    assert detect(auto, {"PATH": fake_smi}, fake_devfs) == (["0", "1", "2"], "nvidia-smi")
    # 5. The device files.
    assert detect(auto, {"PATH": ""}, fake_devfs) == (["0", "1"], f"{fake_devfs}/nvidia*")
    assert detect(auto, {"PATH": ""}) == ([], "/nonexistent/nvidia*")


def test_a_broken_nvidia_smi_falls_through_to_the_device_files(tmp_path, fake_devfs):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    smi.chmod(0o755)
    assert detect(NodeConfig(), {"PATH": str(bin_dir)}, fake_devfs)[0] == ["0", "1"]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"INFERENCE_SERVER_GPUS": "0,x"}, r"INFERENCE_SERVER_GPUS\[1\]: 'x' is not a device"),
        ({"INFERENCE_SERVER_GPUS": "1,1"}, "a device appears twice"),
        ({"INFERENCE_SERVER_GPUS": " "}, "INFERENCE_SERVER_GPUS is empty"),
        ({"CUDA_VISIBLE_DEVICES": "0,gpu"}, r"CUDA_VISIBLE_DEVICES\[1\]"),
        (
            {"INFERENCE_SERVER_GPUS": "3", "CUDA_VISIBLE_DEVICES": "4,5"},
            "INFERENCE_SERVER_GPUS: 3 devices, but CUDA_VISIBLE_DEVICES gives this process 2",
        ),
    ],
)
def test_malformed_device_lists(env, message):
    with pytest.raises(ConfigError, match=message):
        detect(NodeConfig(), env)


def test_a_file_device_list_is_checked_when_loaded(tmp_path):
    with pytest.raises(ConfigError, match=r"\$\.gpus\[0\]: 'GPU' is not a device"):
        load_node(node_file(tmp_path, "gpus: [GPU]\n"))


def test_workers_get_devices_by_index_or_by_gpu(tmp_path):
    three = "workers: [{name: a}, {name: b, gpu: 2}, {name: c, gpu: 1}]\n"
    got = plan(tmp_path, CUDA + three + 'gpus: [3, "cuda:5", GPU-9f]\n')
    assert [w.gpu for w in got.workers] == ["3", "GPU-9f", "5"]
    assert (got.devices, got.device_source) == (["3", "5", "GPU-9f"], "gpus")
    # The cpu backend uses no device, whatever the file says.
    assert [w.gpu for w in plan(tmp_path, three + "gpus: 3\n").workers] == [None] * 3


def test_a_count_takes_the_devices_this_process_was_given(tmp_path):
    """Under a scheduler that handed the supervisor GPUs 4 and 5, `gpus = 2` means
    those (it meant 0 and 1: another job's); not when the plan is made away from the
    machine (`rsrv node status` run from a shell that has a device of its own)."""
    path = node_file(tmp_path, CUDA + "gpus: 2\n")
    env = {"PATH": "", "CUDA_VISIBLE_DEVICES": "4,5"}
    assert [w.gpu for w in plan_node(load_node(path), env, source=path).workers] == ["4", "5"]
    shell = {"PATH": "", "CUDA_VISIBLE_DEVICES": "0"}
    away = plan_node(load_node(path), shell, source=path, detect=False)
    assert [w.gpu for w in away.workers] == ["0", "1"]
    with pytest.raises(ConfigError, match="2 devices, but CUDA_VISIBLE_DEVICES gives"):
        plan_node(load_node(path), shell, source=path)


def test_devices_go_to_the_workers_whose_own_backend_uses_one(tmp_path):
    """A worker may override the node's backend: a cuda one on a cpu node gets a device
    of its own (it used to see them all), a cpu one on a cuda node takes none."""
    mixed = (
        "workers: [{name: a, runtime: {backend: cuda}}, {name: b},"
        " {name: c, runtime: {backend: cuda}}]\n"
    )
    got = plan(tmp_path, mixed, {"INFERENCE_SERVER_GPUS": "2"})
    assert [w.gpu for w in got.workers] == ["0", None, "1"]
    assert (got.devices, got.device_source) == (["0", "1"], "INFERENCE_SERVER_GPUS")
    assert [w.gpu for w in plan(tmp_path, mixed).workers] == ["", None, ""]  # none found
    # The i-th worker on a device gets the i-th device (a cpu worker is not counted).
    cpu_one = "workers: [{name: a, runtime: {backend: cpu}}, {name: b}, {name: c, gpu: 0}]\n"
    with pytest.raises(ConfigError, match="workers 'b' and 'c' are both on device 0"):
        plan(tmp_path, CUDA + cpu_one, {"INFERENCE_SERVER_GPUS": "2"})
    got = plan(tmp_path, CUDA + cpu_one.replace("gpu: 0", "gpu: 1"), {"INFERENCE_SERVER_GPUS": "2"})
    assert [w.gpu for w in got.workers] == [None, "0", "1"]


def test_one_worker_per_detected_device(tmp_path, fake_smi):
    got = plan(tmp_path, CUDA, {"PATH": fake_smi})
    assert [(w.name, w.gpu) for w in got.workers] == [
        ("worker0", "0"),
        ("worker1", "1"),
        ("worker2", "2"),
    ]
    # A larger node: worker i on port + 100 + i, the public port left to the gateway.
    assert [w.endpoints.port for w in got.workers] == [8101, 8102, 8103]
    assert got.port == 8001 and all(w.workers == 3 for w in got.workers)
    # One device: its worker is the node's front door.
    one = plan(tmp_path, CUDA, {"INFERENCE_SERVER_GPUS": "GPU-77"})
    assert [(w.name, w.gpu, w.endpoints.port) for w in one.workers] == [("worker0", "GPU-77", 8001)]
    assert one.port == 8001
    # None found: one worker, shown no device (it fails at start, or falls back to the
    # CPU), and not every device there may be (gpus 0 says none).
    assert [w.gpu for w in plan(tmp_path, CUDA).workers] == [""]
    assert [w.gpu for w in plan(tmp_path, CUDA + "gpus: 0\n", {"PATH": fake_smi}).workers] == [""]


def test_base_port_fixes_every_workers_port_whatever_the_node_size(tmp_path):
    for count in (1, 3):
        got = plan(tmp_path, f"base_port: 9000\ncpu_workers: {count}\n")
        assert [w.endpoints.port for w in got.workers] == list(range(9000, 9000 + count))
    assert plan(tmp_path, "base_port: 9000\n").port == 9000  # a one-worker node's front door


def test_the_gateway_runs_in_front_of_two_or_more_workers_unless_disabled(tmp_path):
    assert not plan(tmp_path, "cpu_workers: 1\n").gateway
    assert plan(tmp_path, "cpu_workers: 2\n").gateway
    assert not plan(tmp_path, "cpu_workers: 2\ngateway:\n  enabled: false\n").gateway


def test_cpu_workers_from_the_file_and_the_environment(tmp_path):
    assert [w.name for w in plan(tmp_path, "cpu_workers: 2\n").workers] == ["worker0", "worker1"]
    got = plan(tmp_path, "", {"INFERENCE_SERVER_CPU_WORKERS": "3"})
    assert len(got.workers) == 3
    for value in ("0", "\u00b2"):  # (a superscript two is a digit to str.isdigit, not to int)
        with pytest.raises(ConfigError, match=f"INFERENCE_SERVER_CPU_WORKERS='{value}': expected"):
            plan(tmp_path, "", {"INFERENCE_SERVER_CPU_WORKERS": value})
    with pytest.raises(ConfigError, match="INFERENCE_SERVER_GPUS\\[0\\]: '\u00b2' is not a device"):
        plan(tmp_path, CUDA, {"INFERENCE_SERVER_GPUS": "\u00b2"})
    # Where it cannot apply it is an error, not ignored (malformed or not).
    for value in ("4", "abc"):
        with pytest.raises(ConfigError, match=f"CPU_WORKERS='{value}'"):
            plan(tmp_path, "workers: [{name: a}]\n", {"INFERENCE_SERVER_CPU_WORKERS": value})
    with pytest.raises(ConfigError, match="cannot apply: a cuda node runs one worker per"):
        plan(tmp_path, CUDA, {"INFERENCE_SERVER_CPU_WORKERS": "2"})
    # The backend override decides between cpu_workers and one per device.
    cuda = plan(tmp_path, "cpu_workers: 4\n", {"INFERENCE_SERVER_RUNTIME_BACKEND": "cuda"})
    assert [w.gpu for w in cuda.workers] == [""]  # (none found)


@pytest.mark.parametrize(
    ("yaml", "env", "message"),
    [
        (
            "workers: [{name: left, gpu: 1}, {name: right, gpu: 1}]\ngpus: 2\n",
            {},
            "workers 'left' and 'right' are both on device 1",
        ),
        (
            "workers: [{name: left}, {name: right, gpu: 0}]\ngpus: 2\n",
            {},
            "workers 'left' and 'right' are both on device 0",
        ),
        (
            "workers: [{name: a}, {name: b, gpu: 4}]\n",
            {"INFERENCE_SERVER_GPUS": "2"},
            "worker 'b': gpu 4 is out of range: the node has 2 device(s) (0, 1)",
        ),
        (
            "workers: [{name: a}, {name: b}, {name: c}]\ngpus: [GPU-x, GPU-y]\n",
            {},
            "3 workers (a, b, c) but 2 device(s) (GPU-x, GPU-y)",
        ),
    ],
)
def test_device_conflicts_name_the_workers(tmp_path, yaml, env, message):
    with pytest.raises(ConfigError, match=rf"node\.yaml: .*{re.escape(message)}"):
        plan(tmp_path, CUDA + yaml, env)


def test_node_variables_are_not_worker_overrides(tmp_path):
    # apply_env leaves the node-level variables to plan_node, and suggests them.
    env = {"INFERENCE_SERVER_GPUS": "1", "INFERENCE_SERVER_CPU_WORKERS": "1"}
    assert plan(tmp_path, "", env).workers[0].overrides == ()
    with pytest.raises(ConfigError, match="did you mean INFERENCE_SERVER_GPUS"):
        plan(tmp_path, "", {"INFERENCE_SERVER_GPU": "1"})


def test_the_real_machine_is_consulted_by_default(tmp_path):
    # Detection with the process environment runs the real probes without failing.
    devices, source = detect_devices(NodeConfig(), os.environ, "node.yaml")
    assert isinstance(devices, list) and source
