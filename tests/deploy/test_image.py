"""The container image and the one-machine compose file, checked without a container.

The Dockerfile is parsed (``dockerfile-parse``) and its stages resolved: the variants,
the non-root user, the volume, the exec-form entry point. Then the image's exact command
line (ENTRYPOINT + CMD) runs here, in the environment the image's CPU variant sets, on
the node file the image ships with only its paths and port numbers changed: two workers
and a gateway come up, answer health probes and inference on the public port, pass the
compose file's health check, and on SIGTERM answer what they accepted and exit 0.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tc
import yaml
from dockerfile_parse import DockerfileParser
from support import ROOT
from support.bundles import X, export_linear, matches, x_input
from support.health import check
from support.metrics import Scrape
from support.serving import free_base_port, free_ports
from support.waiting import wait_until

from rsrv.config import load_node, plan_node

DOCKER = ROOT / "deploy" / "docker"
IMAGE_NODE_FILE = "/etc/rsrv/node.toml"


def stages() -> dict[str, list[dict]]:
    """Stage name -> its instructions (FROM first), in file order."""
    parsed = DockerfileParser(path=str(DOCKER / "Dockerfile"))
    found: dict[str, list[dict]] = {}
    current = None
    for instruction in parsed.structure:
        if instruction["instruction"] == "FROM":
            current = instruction["value"].split()[-1]
            found[current] = []
        if current is not None and instruction["instruction"] != "COMMENT":
            found[current].append(instruction)
    return found


def chain(all_stages: dict, name: str) -> list[dict]:
    """The instructions that make stage ``name``: its bases' first (``FROM <stage>``)."""
    base = all_stages[name][0]["value"].split()[0]
    inherited = chain(all_stages, base) if base in all_stages else []
    return inherited + all_stages[name]


def last(instructions: list[dict], kind: str) -> str | None:
    values = [i["value"] for i in instructions if i["instruction"] == kind]
    return values[-1] if values else None


def image_env(variant: str) -> dict[str, str]:
    """The environment the ``variant`` image sets (ENV instructions, in order)."""
    env: dict[str, str] = {}
    for instruction in chain(stages(), variant):
        if instruction["instruction"] == "ENV":
            for pair in shlex.split(instruction["value"]):
                key, value = pair.split("=", 1)
                env[key] = value
    return env


def test_the_dockerfile_builds_a_cpu_and_a_cuda_variant():
    found = stages()
    assert list(found) == ["build", "runtime", "cpu", "cuda", "image"]
    text = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"^ARG VARIANT=cpu$", text, re.MULTILINE)
    assert found["image"][0]["value"] == "${VARIANT} AS image"  # the last stage: the variant
    build = " ".join(i["value"] for i in found["build"] if i["instruction"] == "RUN")
    assert 'cpu) extra=""' in build and 'cuda) extra="[cuda]"' in build
    assert "exit 1" in build  # any other variant fails the build
    assert image_env("cpu")["INFERENCE_SERVER_RUNTIME_BACKEND"] == "cpu"
    cuda = image_env("cuda")
    assert cuda["INFERENCE_SERVER_RUNTIME_BACKEND"] == "cuda"
    assert cuda["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"  # nvidia-smi finds GPUs
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "cuda" in extras["optional-dependencies"]


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_the_image_runs_rsrv_node_as_a_user_with_a_cache_volume(variant):
    made = chain(stages(), variant)
    assert last(made, "USER") == "10001:10001"  # numeric: runAsNonRoot can check it
    assert json.loads(last(made, "ENTRYPOINT")) == ["rsrv", "node"]  # exec form: PID 1
    assert json.loads(last(made, "CMD")) == [IMAGE_NODE_FILE]
    assert last(made, "STOPSIGNAL") == "SIGTERM"
    node = tomllib.loads((DOCKER / "node.toml").read_text())
    assert json.loads(last(made, "VOLUME")) == [node["global"]["cache_dir"]]
    assert node["model_repo"] == "/mnt/models"
    copies = [i["value"].split() for i in made if i["instruction"] == "COPY"]
    assert ["deploy/docker/node.toml", IMAGE_NODE_FILE] in copies
    # A multi-stage build: the runtime stage copies the built environment, no compiler.
    assert ["--from=build", "/opt/rsrv", "/opt/rsrv"] in copies
    assert not any("pip install" in i["value"] for i in made if i["instruction"] == "RUN")


def test_the_build_context_holds_what_the_dockerfile_copies():
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copied = set()
    for instructions in stages().values():
        for i in instructions:
            if i["instruction"] == "COPY" and not i["value"].startswith("--from"):
                copied.update(i["value"].split()[:-1])
    assert copied == kept
    assert all((ROOT / path).exists() for path in copied)


def test_the_cuda_image_plans_one_worker_per_gpu_behind_a_gateway():
    path = DOCKER / "node.toml"
    env = {**image_env("cuda"), "INFERENCE_SERVER_GPUS": "4"}
    env = {k: v for k, v in env.items() if k.startswith("INFERENCE_SERVER_")}
    plan = plan_node(load_node(path), env, source=path)
    assert [w.gpu for w in plan.workers] == ["0", "1", "2", "3"]
    assert [w.endpoints.port for w in plan.workers] == [8101, 8102, 8103, 8104]
    assert [w.endpoints.metrics_port for w in plan.workers] == [8201, 8202, 8203, 8204]
    assert (plan.port, plan.metrics_port, plan.gateway_metrics_port) == (8001, 8002, 8003)
    one = plan_node(load_node(path), {**env, "INFERENCE_SERVER_GPUS": "1"}, source=path)
    assert [w.endpoints.port for w in one.workers] == [8001]  # no gateway: the worker's


def test_the_compose_file_runs_the_image_on_every_gpu():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    [(name, service)] = compose["services"].items()
    build = service["build"]
    assert (DOCKER / build["context"] / build["dockerfile"]).resolve() == DOCKER / "Dockerfile"
    assert build["args"]["VARIANT"] == "cuda"
    [gpus] = service["deploy"]["resources"]["reservations"]["devices"]
    assert gpus["driver"] == "nvidia" and gpus["count"] == "all" and "gpu" in gpus["capabilities"]
    node = tomllib.loads((DOCKER / "node.toml").read_text())
    volumes = {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]}
    assert volumes[node["model_repo"]] == "./models"
    assert volumes[node["global"]["cache_dir"]] in compose["volumes"]  # a named volume
    published = {int(p.split(":")[0].split("-")[0]) for p in service["ports"]}
    ports = {node["port"], node["metrics_port"], node["gateway"]["metrics_port"]}
    assert ports | {node["metrics_base_port"]} <= published
    assert service["stop_signal"] == "SIGTERM" and service["init"] is False
    grace = node["global"]["endpoints"]["shutdown_grace_seconds"]
    assert int(service["stop_grace_period"].rstrip("s")) > grace + 5  # + kill_after_seconds
    assert service["healthcheck"]["test"] == ["CMD", "rsrv", "node", "status", IMAGE_NODE_FILE]


# -- the entry point, run here ---------------------------------------------------------------


def local_node_file(workdir: Path, repo: Path, cache: Path) -> tuple[Path, dict[str, int]]:
    """The image's node file with its paths pointing here and free ports for its own."""
    text = (DOCKER / "node.toml").read_text()
    keys = ("port", "metrics_port", "metrics_base_port")
    ports = dict(zip((*keys, "gateway_metrics"), free_ports(4), strict=True))
    # (the workers' ports follow a base: 8001 + 100 + i for gRPC, 8201 + i for metrics)
    ports["port"] = free_base_port((0, 100, 101))
    ports["metrics_base_port"] = free_base_port((0, 1))
    for key in keys:
        # the first one: the top-level key ([gateway] has a metrics_port of its own)
        text, n = re.subn(rf"(?m)^{key} = \d+", f"{key} = {ports[key]}", text, count=1)
        assert n == 1, key
    text = re.sub(
        r"(?m)^(\[gateway\]\nmetrics_port) = \d+", rf"\1 = {ports['gateway_metrics']}", text
    )
    text = text.replace('"/mnt/models"', json.dumps(str(repo)))
    text = text.replace('"/var/cache/rsrv"', json.dumps(str(cache)))
    path = workdir / "node.toml"
    path.write_text(text)
    return path, ports


@pytest.mark.skipif(sys.platform != "linux", reason="POSIX signals")
def test_the_entry_point_serves_and_drains_on_sigterm(tmp_path, cache_dir):
    export_linear(tmp_path / "repo" / "lin", seed=5)
    export_linear(tmp_path / "repo" / "slow", seed=6, work=3000)
    node_file, ports = local_node_file(tmp_path, tmp_path / "repo", cache_dir)
    made = chain(stages(), "cpu")
    argv = json.loads(last(made, "ENTRYPOINT")) + json.loads(last(made, "CMD"))
    argv = [a.replace(IMAGE_NODE_FILE, str(node_file)) for a in argv]
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERENCE_SERVER_")}
    for key, value in image_env("cpu").items():  # PATH=/opt/rsrv/bin:$PATH: this venv
        env[key] = value.replace("/opt/rsrv/bin", str(Path(sys.executable).parent))
        env[key] = env[key].replace("$PATH", os.environ["PATH"])
    env["INFERENCE_SERVER_CPU_WORKERS"] = "2"  # as a two-GPU machine: a gateway in front
    process = subprocess.Popen(
        argv, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True)
    reader.start()
    public = f"127.0.0.1:{ports['port']}"
    try:

        def serving():
            assert process.poll() is None, "".join(lines[-30:])
            return check(public, "ready", timeout=1) == "SERVING"

        wait_until(serving, 120, "the node's gateway to be ready", interval=0.2)
        assert check(public, "") == "SERVING"
        status = [*argv[:-1], "status", str(node_file)]  # the compose health check
        # (the node is ready once a worker behind the gateway says so on its link too)
        wait_until(
            lambda: subprocess.run(status, env=env, capture_output=True).returncode == 0,
            30,
            "the node's health check to pass",
            interval=0.2,
        )
        answers: list = []
        with tc.InferenceServerClient(public) as client:
            assert matches(client.infer("lin", [x_input(X)]).as_numpy("y"), 5, X)
            for _ in range(6):
                client.async_infer(
                    "slow", [x_input(X)], lambda result, error: answers.append(error or result)
                )
            in_flight = lambda: Scrape(ports["gateway_metrics"]).value(  # noqa: E731
                "rsrv_gateway_inflight_requests"
            )
            wait_until(lambda: in_flight() + len(answers) == 6, 20, "the requests in flight")
            process.send_signal(signal.SIGTERM)  # what `docker stop` sends PID 1
            assert process.wait(60) == 0, "".join(lines[-30:])
            wait_until(lambda: len(answers) == 6, 10, "every accepted request's answer")
        for answer in answers:
            assert matches(answer.as_numpy("y"), 6, X), answer
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    reader.join(5)
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert {r.get("worker") for r in records} >= {"node", "gateway", "worker0", "worker1"}
    assert np.all([r["level"] != "ERROR" for r in records if "level" in r]), lines
