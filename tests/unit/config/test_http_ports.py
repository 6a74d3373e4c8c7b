"""endpoints.http_port (the KServe V2 REST endpoint): off by default, set per worker or
derived from the node's http_base_port like metrics ports, never shared with another
port of the node, and overridable from the environment."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rsrv.config import ConfigError, load_node, resolve_worker


def worker_of(tmp_path: Path, yaml: str, name: str | None = None, env=None):
    path = tmp_path / "node.yaml"
    path.write_text(yaml)
    return resolve_worker(load_node(path), name, env or {}, source=path)


def test_off_unless_configured(tmp_path):
    assert worker_of(tmp_path, "model_repo: m").endpoints.http_port is None


def test_set_for_the_worker_or_from_the_environment(tmp_path):
    yaml = "global: {endpoints: {http_port: 8000}}"
    assert worker_of(tmp_path, yaml).endpoints.http_port == 8000
    env = {"INFERENCE_SERVER_ENDPOINTS_HTTP_PORT": "8500"}
    assert worker_of(tmp_path, "model_repo: m", env=env).endpoints.http_port == 8500


def test_derived_from_http_base_port(tmp_path):
    yaml = (
        "http_base_port: 8300\n"
        "workers: [{name: a}, {name: b}, {name: c, endpoints: {http_port: 9999}}]"
    )
    ports = [worker_of(tmp_path, yaml, n).endpoints.http_port for n in "abc"]
    assert ports == [8300, 8301, 9999]


@pytest.mark.parametrize(
    ("yaml", "message"),
    [
        ("http_base_port: 8001", "REST (http) port and gRPC port are both 8001"),
        (
            "metrics_base_port: 8400\nhttp_base_port: 8400",
            "REST (http) port and metrics port are both 8400",
        ),
        (
            "global: {endpoints: {http_port: 8000}}\nworkers: [{name: a}, {name: b}]",
            "REST (http) port 8000 of worker 'b' is the REST (http) port of worker 'a'",
        ),
        (
            "http_base_port: 8100\nworkers: [{name: a}, {name: b}]",
            "REST (http) port 8101 of worker 'b' is the gRPC port of worker 'a'",
        ),
    ],
)
def test_collisions_rejected(tmp_path, yaml, message):
    path = tmp_path / "node.yaml"
    path.write_text(yaml)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_node(path)
