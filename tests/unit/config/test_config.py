"""Node configuration: schema, file formats, worker resolution, env overrides."""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

import msgspec
import pytest
from support import ROOT

import rsrv.config
from rsrv.config import (
    ConfigError,
    NodeConfig,
    WorkerConfig,
    effective_config_dict,
    gateway_config_dict,
    load_gateway,
    load_node,
    load_worker,
    node_json_schema,
    plan_node,
    resolve_worker,
)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def worker_of(tmp_path: Path, yaml: str, name: str | None = None, env=None) -> WorkerConfig:
    path = write(tmp_path, "node.yaml", yaml)
    return resolve_worker(load_node(path), name, env or {}, source=path)


TWO_WORKERS = """
    base_port: 9000
    workers:
      - name: a
      - name: b
"""


# --- defaults ---


def test_embedded_default_is_the_schema_default(tmp_path, monkeypatch):
    node = load_node(None)
    assert node == NodeConfig()
    assert node.model_repo == "bundles"
    assert node.port == 8001 and node.base_port is None
    assert node.global_.runtime.backend == "cpu"
    assert node.global_.endpoints.host == "127.0.0.1"

    monkeypatch.chdir(tmp_path)
    worker = resolve_worker(node, env={})
    assert worker.name == "worker0" and worker.index == 0
    assert worker.model_repo == str(tmp_path / "bundles")
    assert worker.cache_dir == os.path.expanduser("~/.cache/rsrv")
    assert worker.endpoints.port == 8001
    assert worker.endpoints.metrics_port is None
    assert worker.gpu is None
    assert worker.overrides == ()


def test_the_embedded_default_shows_every_key(tmp_path):
    """default.toml says it lists every default: each key of the schema's tables is
    set there, or shown commented out (null defaults)."""
    text = (Path(rsrv.config.__file__).parent / "default.toml").read_text()
    shown = set(re.findall(r"^#? *(\w+) = ", text, re.M))

    def keys(struct) -> set[str]:
        out = set()
        for field in msgspec.structs.fields(struct):
            tp = field.type
            if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
                out |= keys(tp)  # a table: [name]
            else:
                out.add(field.encode_name)
        return out

    assert keys(NodeConfig) <= shown


def test_empty_yaml_file_is_all_defaults(tmp_path):
    assert load_node(write(tmp_path, "node.yaml", "")) == NodeConfig()


# --- formats ---


YAML_NODE = """
    model_repo: models
    base_port: 9000
    metrics_base_port: 9100
    gpus: [0, "cuda:1"]
    global:
      cache_dir: cache
      model_control_mode: explicit
      runtime:
        backend: cuda
        mem_fraction: 0.5
        weight_cache_bytes: 1048576
      scheduler:
        discipline: edf
        models:
          resnet: {weight: 2.0, latency_budget_seconds: 0.05}
      endpoints:
        host: 0.0.0.0
        max_message_bytes: 4194304
      logging: {level: debug, format: json}
    workers:
      - name: a
        runtime: {mem_fraction: 0.7}
      - name: b
        gpu: 1
        scheduler:
          models:
            resnet: {weight: 3.0}
    models:
      resnet: [a]
"""

TOML_NODE = """
    model_repo = "models"
    base_port = 9000
    metrics_base_port = 9100
    gpus = [0, "cuda:1"]

    [global]
    cache_dir = "cache"
    model_control_mode = "explicit"

    [global.runtime]
    backend = "cuda"
    mem_fraction = 0.5
    weight_cache_bytes = 1048576

    [global.scheduler]
    discipline = "edf"
    models.resnet = { weight = 2.0, latency_budget_seconds = 0.05 }

    [global.endpoints]
    host = "0.0.0.0"
    max_message_bytes = 4194304

    [global.logging]
    level = "debug"
    format = "json"

    [[workers]]
    name = "a"
    runtime = { mem_fraction = 0.7 }

    [[workers]]
    name = "b"
    gpu = 1
    [workers.scheduler.models.resnet]
    weight = 3.0

    [models]
    resnet = ["a"]
"""


def test_yaml_and_toml_load_to_the_same_config(tmp_path):
    from_yaml = load_node(write(tmp_path, "node.yaml", YAML_NODE))
    from_toml = load_node(write(tmp_path, "node.toml", TOML_NODE))
    assert from_yaml == from_toml
    assert from_yaml.global_.runtime.mem_fraction == 0.5
    assert from_yaml.workers[1].gpu == 1


def test_yml_extension_and_unsupported_extension(tmp_path):
    assert load_node(write(tmp_path, "node.yml", "base_port: 9000")).base_port == 9000
    with pytest.raises(ConfigError, match=r"node\.json: unsupported extension"):
        load_node(write(tmp_path, "node.json", "{}"))
    (tmp_path / "conf.yaml").mkdir()
    for directory in (tmp_path, tmp_path / "conf.yaml"):
        with pytest.raises(ConfigError, match=r": is a directory; give a \.yaml"):
            load_node(directory)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"absent\.yaml: cannot read"):
        load_node(tmp_path / "absent.yaml")


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("bad.yaml", "global:\n  runtime: [1,\n  x: 2\n"),
        ("bad.toml", "[global\nmodel_repo = 1\n"),
        ("dup.toml", "base_port = 1\nbase_port = 2\n"),
        ("dup.yaml", "base_port: 1\nbase_port: 2\n"),  # (as TOML: not the last one silently)
        ("dup2.yaml", "global:\n  port: 1\nglobal:\n  model_repo: x\n"),
        ("latin1.toml", "# caf\xe9\nport = 1\n"),
        ("latin1.yaml", "# caf\xe9\nport: 1\n"),
    ],
)
def test_syntax_errors_name_the_file(tmp_path, name, text):
    path = tmp_path / name
    path.write_bytes(text.encode("latin-1"))
    kind = "YAML" if name.endswith(".yaml") else "TOML"
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: invalid {kind}"):
        load_node(path)


def test_yaml_numbers_read_as_yaml_1_2_does(tmp_path):
    """PyYAML reads YAML 1.1: `010` was 8, `1:30` 90 (base 60), and `1e3` a string."""
    text = "global:\n  scheduler: {max_queue_depth: 010}\n  model_poll_seconds: 1e3\n"
    worker = worker_of(tmp_path, text)
    assert worker.scheduler.max_queue_depth == 10 and worker.model_poll_seconds == 1000.0
    worker = worker_of(tmp_path, "global:\n  scheduler: {max_queue_depth: 0o10}\n")
    assert worker.scheduler.max_queue_depth == 8
    worker = worker_of(tmp_path, "global:\n  scheduler: {max_queue_depth: 1_000}\n")
    assert worker.scheduler.max_queue_depth == 1000  # (as 1.1 allowed)
    assert load_node(write(tmp_path, "node.yaml", "port: !!int 0b1111101000001\n")).port == 8001
    with pytest.raises(ConfigError, match="'1:30' is not an integer"):  # (no traceback)
        load_node(write(tmp_path, "node.yaml", "port: !!int 1:30\n"))
    with pytest.raises(ConfigError, match="model_poll_seconds: Expected `float`, got `str`"):
        load_node(write(tmp_path, "node.yaml", "global: {model_poll_seconds: 1:30}\n"))
    with pytest.raises(ConfigError, match="'1:30' is not a number"):
        load_node(write(tmp_path, "node.yaml", "global: {model_poll_seconds: !!float 1:30}\n"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("port: !!bool maybe\n", "'maybe' cannot be read as !!bool"),  # (was KeyError)
        ("port: !!timestamp foo\n", "'foo' cannot be read as !!timestamp"),  # (AttributeError)
        ("port: !!float abc\n", "'abc' is not a number"),  # (ValueError, no file named)
        ("endpoints: !!map x\n", "expected a mapping, found scalar"),  # (ValueError)
        ("scheduler: !!map [1]\n", "expected a mapping, found sequence"),  # (TypeError)
    ],
)
def test_explicit_yaml_tags_that_cannot_be_read_are_errors_naming_the_file(tmp_path, text, message):
    path = write(tmp_path, "node.yaml", text)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: invalid YAML: {message}"):
        load_node(path)


@pytest.mark.parametrize(
    "text", ["a = " + "[" * 2000 + "]" * 2000, "a = " + "{b = " * 2000 + "}" * 2000]
)
def test_a_toml_file_nested_too_deeply_is_an_error_naming_the_file(tmp_path, text):
    """(It was a RecursionError traceback.)"""
    path = write(tmp_path, "node.toml", text)
    with pytest.raises(
        ConfigError, match=rf"^{re.escape(str(path))}: invalid TOML: nested too deeply$"
    ):
        load_node(path)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("node.yaml", "global: {model_poll_seconds: .inf}\n", "expected a finite number"),
        ("node.toml", "[global]\nmodel_poll_seconds = inf\n", "expected a finite number"),
        ("node.toml", "[supervisor]\nbackoff_seconds = nan\n", "Expected `float` > 0.0"),
    ],
)
def test_numbers_that_are_not_finite_are_refused_as_the_environment_does(
    tmp_path, name, text, message
):
    """(A file's .inf was accepted where INFERENCE_SERVER_MODEL_POLL_SECONDS=inf is not;
    a range the value breaks is said first.)"""
    with pytest.raises(ConfigError, match=rf": \$\.\w+\.\w+: {re.escape(message)}$"):
        load_node(write(tmp_path, name, text))


def test_a_utf8_bom_is_skipped_in_either_format(tmp_path):
    """(Editors on Windows write one; TOML refused the file: "Invalid statement".)"""
    for name in ("node.toml", "node.yaml"):
        path = tmp_path / name
        path.write_bytes(
            b"\xef\xbb\xbf" + (b"port = 9001\n" if name.endswith("toml") else b"port: 9001\n")
        )
        assert load_node(path).port == 9001


def test_naming_the_key_of_an_error_among_thousands_takes_a_few_trials(tmp_path, monkeypatch):
    """One bad weight among 2,000 models: the key is found by bisection (a trial per
    key before it took 4.4 s to report)."""
    models = "".join(f"      m{i}: {{weight: {-1 if i == 1500 else 1}}}\n" for i in range(2000))
    path = write(tmp_path, "node.yaml", f"global:\n  scheduler:\n    models:\n{models}")
    calls = []
    real = msgspec.convert
    monkeypatch.setattr(msgspec, "convert", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    with pytest.raises(ConfigError, match=r"\$\.global\.scheduler\.models\.m1500\.weight: "):
        load_node(path)
    assert len(calls) < 20


@pytest.mark.parametrize("key", ["123", "on", "2024-01-01", "1.5"])
def test_a_yaml_key_that_is_not_a_string_is_named_where_it_is(tmp_path, key):
    """(Its message said `$:` and msgspec's words, "- at `key` in ...".)"""
    path = write(tmp_path, "node.yaml", f"global:\n  scheduler:\n    models:\n      {key}: {{}}\n")
    with pytest.raises(
        ConfigError,
        match=r"\$\.global\.scheduler\.models: a key: Expected `str`, got `\w+` \(quote the key\)$",
    ):
        load_node(path)


def test_yaml_merge_keys_may_be_overridden(tmp_path):
    path = write(tmp_path, "merge.yaml", "workers:\n  - &w {name: a}\n  - {<<: *w, name: b}\n")
    assert [w.name for w in load_node(path).workers] == ["a", "b"]


# --- schema validation ---


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ("bogus: 1", r"$.bogus"),
        ("global:\n  runtime:\n    bogus: 1", r"$.global.runtime.bogus"),
        (
            "global:\n  scheduler:\n    models:\n      m: {bogus: 1}",
            r"$.global.scheduler.models.m.bogus",
        ),
        (
            "workers:\n  - name: a\n  - name: b\n    runtime:\n      bogus: 1",
            r"$.workers[1].runtime.bogus",
        ),
        (
            "workers:\n  - name: a\n    scheduler:\n      models:\n        m: {bogus: 1}",
            r"$.workers[0].scheduler.models.m.bogus",
        ),
    ],
)
def test_unknown_field_rejected_with_its_path(tmp_path, text, path):
    node = write(tmp_path, "node.yaml", text)
    with pytest.raises(ConfigError) as info:
        load_node(node)
    assert str(info.value) == f"{node}: {path}: unknown field"


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ("global:\n  runtime: {mem_fraction: 1.5}", "$.global.runtime.mem_fraction"),
        ("global:\n  runtime: {mem_fraction: 0}", "$.global.runtime.mem_fraction"),
        (
            "global:\n  runtime: {weight_cache_wiggle_fraction: 1.0}",
            "$.global.runtime.weight_cache_wiggle_fraction",
        ),
        (
            "global:\n  scheduler:\n    models:\n      m: {weight: 0}",
            "$.global.scheduler.models.m.weight",
        ),
        (
            "global:\n  scheduler:\n    models:\n      m: {max_batch_size: 0}",
            "$.global.scheduler.models.m.max_batch_size",
        ),
        ("base_port: 99999", "$.base_port"),
        ("global:\n  endpoints: {port: 99999}", "$.global.endpoints.port"),
        ("global:\n  endpoints: {max_message_bytes: 1000}", "$.global.endpoints.max_message_bytes"),
        ("global:\n  runtime: {backend: tpu}", "$.global.runtime.backend"),
        ("global:\n  runtime: {weight_staging: zero_copy}", "$.global.runtime.weight_staging"),
        ("global:\n  model_poll_seconds: 0", "$.global.model_poll_seconds"),
        ("base_port: '8001'", "$.base_port"),
        (
            "global:\n  scheduler:\n    models:\n      a: {weight: 1}\n      b: {weight: -1}",
            "$.global.scheduler.models.b.weight",
        ),
        (
            "global:\n  scheduler:\n    models:\n      'resnet 50': {weight: 0}",
            '$.global.scheduler.models["resnet 50"].weight',
        ),
        (
            "workers:\n  - name: a\n    runtime: {weight_cache_wiggle_fraction: 1.0}",
            "$.workers[0].runtime.weight_cache_wiggle_fraction",
        ),
        ("workers:\n  - {port: 9000}", "$.workers[0]"),
    ],
)
def test_invalid_values_rejected_with_their_path(tmp_path, text, path):
    node = write(tmp_path, "node.yaml", text)
    with pytest.raises(ConfigError) as info:
        load_node(node)
    assert str(info.value).startswith(f"{node}: {path}: ")


def test_json_schema_carries_names_and_ranges():
    schema = node_json_schema()
    defs = schema["$defs"]
    assert "global" in defs["NodeConfig"]["properties"]
    assert defs["NodeConfig"]["additionalProperties"] is False
    mem_fraction = defs["RuntimeConfig"]["properties"]["mem_fraction"]
    assert mem_fraction["exclusiveMinimum"] == 0 and mem_fraction["maximum"] == 1
    assert "RuntimeOverride" in defs


# --- environment overrides ---


def test_env_overrides_apply(tmp_path):
    env = {
        "INFERENCE_SERVER_ENDPOINTS_PORT": "9100",
        "INFERENCE_SERVER_RUNTIME_BACKEND": "cpu",
        "INFERENCE_SERVER_RUNTIME_WEIGHT_CACHE_BYTES": "1048576",
        "INFERENCE_SERVER_RUNTIME_PREALLOCATE": "Off",
        "INFERENCE_SERVER_ENDPOINTS_SYSTEM_SHARED_MEMORY": "no",
        "INFERENCE_SERVER_RUNTIME_ALLOW_CPU_FALLBACK": "YES",
        "INFERENCE_SERVER_LOGGING_LEVEL": "WARNING",
        "INFERENCE_SERVER_MODEL_POLL_SECONDS": "2.5",
        "INFERENCE_SERVER_RUNTIME_WEIGHT_STAGING": "pinned",
        "INFERENCE_SERVER_CACHE_MAX_BYTES": "5000000000",
        "UNRELATED": "ignored",
    }
    worker = worker_of(tmp_path, "global:\n  runtime: {backend: cuda}", env=env)
    assert worker.endpoints.port == 9100
    assert worker.runtime.backend == "cpu"
    assert worker.gpu is None
    assert worker.runtime.weight_cache_bytes == 1048576
    assert worker.runtime.preallocate is False
    assert worker.runtime.allow_cpu_fallback is True
    assert worker.endpoints.system_shared_memory is False
    assert worker.logging.level == "warning"
    assert worker.model_poll_seconds == 2.5
    assert worker.runtime.weight_staging == "pinned"
    assert worker.cache_max_bytes == 5_000_000_000
    assert "INFERENCE_SERVER_ENDPOINTS_PORT=9100" in worker.overrides
    assert len(worker.overrides) == 10


@pytest.mark.parametrize("text", ["none", "None", ""])
def test_env_none_for_optional_fields(tmp_path, text):
    yaml = "global:\n  runtime: {weight_cache_bytes: 5}\n  endpoints: {port: 9000}"
    worker = worker_of(
        tmp_path,
        yaml,
        env={
            "INFERENCE_SERVER_RUNTIME_WEIGHT_CACHE_BYTES": text,
            "INFERENCE_SERVER_ENDPOINTS_PORT": text,
        },
    )
    assert worker.runtime.weight_cache_bytes is None
    assert worker.endpoints.port == 8001  # back to base_port + index


def test_env_overrides_beat_worker_overrides(tmp_path):
    yaml = "workers:\n  - name: a\n    runtime: {mem_fraction: 0.3}"
    worker = worker_of(tmp_path, yaml, env={"INFERENCE_SERVER_RUNTIME_MEM_FRACTION": "0.6"})
    assert worker.runtime.mem_fraction == 0.6


def test_env_unknown_variable_named(tmp_path):
    with pytest.raises(
        ConfigError, match=r"^INFERENCE_SERVER_RUNTIME_BAKEND: unknown.*RUNTIME_BACKEND"
    ):
        worker_of(tmp_path, "", env={"INFERENCE_SERVER_RUNTIME_BAKEND": "cpu"})
    # Sections and dict fields have no single-string spelling.
    with pytest.raises(ConfigError, match=r"^INFERENCE_SERVER_SCHEDULER_MODELS: unknown"):
        worker_of(tmp_path, "", env={"INFERENCE_SERVER_SCHEDULER_MODELS": "x"})
    # Nor lists of tables: empty, it used to drop every restricted protocol.
    with pytest.raises(ConfigError, match=r"^INFERENCE_SERVER_ENDPOINTS_RESTRICTED: unknown"):
        worker_of(tmp_path, "", env={"INFERENCE_SERVER_ENDPOINTS_RESTRICTED": ""})


# What Kubernetes sets in every container for a Service of its namespace named
# "inference-server-predictor" (a KServe InferenceService "inference-server") or
# "inference-gateway": no settings (they stopped the server as unknown variables).
SERVICE_LINKS = {
    "{}_PORT": "tcp://10.96.0.12:80",
    "{}_PORT_80_TCP": "tcp://10.96.0.12:80",
    "{}_PORT_80_TCP_PROTO": "tcp",
    "{}_PORT_80_TCP_PORT": "80",
    "{}_PORT_80_TCP_ADDR": "10.96.0.12",
    "{}_SERVICE_HOST": "10.96.0.12",
    "{}_SERVICE_PORT": "80",
    "{}_SERVICE_PORT_HTTP": "80",
}


def test_kubernetes_service_variables_are_no_settings(tmp_path):
    env = {k.format("INFERENCE_SERVER_PREDICTOR"): v for k, v in SERVICE_LINKS.items()}
    assert worker_of(tmp_path, "", env=env) == worker_of(tmp_path, "", env={})
    env = {k.format("INFERENCE_GATEWAY"): v for k, v in SERVICE_LINKS.items()}
    endpoints = {"INFERENCE_GATEWAY_ENDPOINTS": "127.0.0.1:8101"}
    assert load_gateway(None, {**env, **endpoints}) == load_gateway(None, endpoints)
    with pytest.raises(ConfigError, match="INFERENCE_SERVER_METRIC_PORT: unknown"):
        worker_of(tmp_path, "", env={"INFERENCE_SERVER_METRIC_PORT": "8002"})  # (a typo)
    with pytest.raises(ConfigError, match="INFERENCE_GATEWAY_LISTEN_PORT: unknown"):
        load_gateway(None, {**endpoints, "INFERENCE_GATEWAY_LISTEN_PORT": "tcp://0.0.0.0:9"})
    # A Service named "inference-server-endpoints" gives a real variable's name: its
    # address is no setting, a port set in the pod's spec is
    env = {k.format("INFERENCE_SERVER_ENDPOINTS"): v for k, v in SERVICE_LINKS.items()}
    assert worker_of(tmp_path, "", env=env) == worker_of(tmp_path, "", env={})
    env["INFERENCE_SERVER_ENDPOINTS_PORT"] = "9100"
    assert worker_of(tmp_path, "", env=env).endpoints.port == 9100


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("INFERENCE_SERVER_ENDPOINTS_PORT", "99999"),
        ("INFERENCE_SERVER_ENDPOINTS_PORT", "http"),
        ("INFERENCE_SERVER_RUNTIME_MEM_FRACTION", "1.5"),
        ("INFERENCE_SERVER_RUNTIME_MEM_FRACTION", "nan"),
        ("INFERENCE_SERVER_RUNTIME_PREALLOCATE", "maybe"),
        ("INFERENCE_SERVER_RUNTIME_BACKEND", "tpu"),
        ("INFERENCE_SERVER_SCHEDULER_MAX_QUEUE_DEPTH", ""),
        ("INFERENCE_SERVER_SCHEDULER_MAX_QUEUE_DEPTH", "none"),
        ("INFERENCE_SERVER_ENDPOINTS_HOST", ""),  # (it used to reach bind as "any")
        ("INFERENCE_SERVER_ENDPOINTS_HOST", " 127.0.0.1"),
        ("INFERENCE_SERVER_MODEL_REPO", ""),  # (it used to mean the working directory)
        ("INFERENCE_SERVER_CACHE_DIR", ""),
    ],
)
def test_env_invalid_value_named(tmp_path, var, value):
    with pytest.raises(ConfigError, match=rf"^{var}="):
        worker_of(tmp_path, "", env={var: value})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("global: {endpoints: {host: 'a b'}}", "$.global.endpoints.host: expected a host name"),
        ("workers: [{name: a, host: ''}]", "$.workers[0].host: Expected `str` of length >= 1"),
        ("model_repo: ''", "$.model_repo: Expected `str` of length >= 1"),
    ],
)
def test_empty_or_spaced_hosts_and_paths_are_refused(tmp_path, text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_node(write(tmp_path, "node.yaml", text))


def test_env_model_repo_is_relative_to_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "conf").mkdir()
    path = write(tmp_path, "conf/node.yaml", "model_repo: repo")
    monkeypatch.chdir(tmp_path)
    worker = load_worker(path, env={"INFERENCE_SERVER_MODEL_REPO": "elsewhere"})
    assert worker.model_repo == str(tmp_path / "elsewhere")
    assert load_worker(path, env={}).model_repo == str(tmp_path / "conf" / "repo")


# --- workers ---


def test_two_workers_get_consecutive_ports(tmp_path):
    path = write(tmp_path, "node.yaml", TWO_WORKERS)
    node = load_node(path)
    a = resolve_worker(node, "a", {}, source=path)
    b = resolve_worker(node, "b", {}, source=path)
    assert (a.index, a.endpoints.port) == (0, 9000)
    assert (b.index, b.endpoints.port) == (1, 9001)
    assert a.endpoints.metrics_port is None and b.endpoints.metrics_port is None


def test_worker_name_required_and_checked(tmp_path):
    path = write(tmp_path, "node.yaml", TWO_WORKERS)
    node = load_node(path)
    with pytest.raises(ConfigError, match=r"several workers \(a, b\)"):
        resolve_worker(node, None, {}, source=path)
    with pytest.raises(ConfigError, match=r"no worker named 'c'; workers: a, b"):
        resolve_worker(node, "c", {}, source=path)
    # A single worker, named or implicit, need not be named.
    assert worker_of(tmp_path, "workers: [{name: only}]").name == "only"
    assert worker_of(tmp_path, "", name="worker0").name == "worker0"


def test_duplicate_worker_names_rejected(tmp_path):
    with pytest.raises(ConfigError, match=r"\$\.workers\[1\]\.name: duplicate worker name 'a'"):
        load_node(write(tmp_path, "node.yaml", "workers: [{name: a}, {name: a}]"))


def test_worker_override_of_one_field_keeps_the_rest(tmp_path):
    yaml = """
        global:
          runtime: {backend: cpu, mem_fraction: 0.5, preallocate: false}
          scheduler:
            models:
              m: {weight: 2.0, max_batch_size: 8}
        workers:
          - name: a
            runtime: {mem_fraction: 0.8}
            scheduler:
              models:
                m: {weight: 4.0}
          - name: b
    """
    a = worker_of(tmp_path, yaml, "a")
    b = worker_of(tmp_path, yaml, "b")
    assert a.runtime.mem_fraction == 0.8
    assert a.runtime.preallocate is False and a.runtime.backend == "cpu"
    assert a.scheduler.models["m"].weight == 4.0
    assert a.scheduler.models["m"].max_batch_size == 8
    assert b.runtime.mem_fraction == 0.5
    assert b.scheduler.models["m"].weight == 2.0


def test_worker_shorthands(tmp_path):
    yaml = """
        workers:
          - {name: a, host: 0.0.0.0, port: 7000}
          - {name: b}
    """
    a = worker_of(tmp_path, yaml, "a")
    assert (a.endpoints.host, a.endpoints.port) == ("0.0.0.0", 7000)
    # With base_port unset, worker i of a node of two listens on port + 100 + i.
    assert worker_of(tmp_path, yaml, "b").endpoints.port == 8102
    with pytest.raises(ConfigError, match=r"both port and endpoints.port"):
        worker_of(tmp_path, "workers: [{name: a, port: 7000, endpoints: {port: 7001}}]")


# --- pin map ---


PINNED = """
    global:
      scheduler:
        models:
          explicit: {weight: 3.0, residency: system}
          weighted: {weight: 2.0}
    workers:
      - name: a
      - name: b
    models:
      explicit: [a]
      weighted: [a]
      plain: [a, b]
"""


def test_pin_map_sets_device_residency_on_listed_workers(tmp_path):
    a = worker_of(tmp_path, PINNED, "a").scheduler.models
    b = worker_of(tmp_path, PINNED, "b").scheduler.models
    assert a["weighted"].residency == "device" and a["weighted"].weight == 2.0
    assert b["weighted"].residency is None and b["weighted"].weight == 2.0
    assert a["plain"].residency == "device" and b["plain"].residency == "device"
    # An explicit residency wins over the pin map, and keeps its weight.
    assert a["explicit"].residency == "system" and a["explicit"].weight == 3.0


def test_pin_map_without_workers_targets_worker0(tmp_path):
    worker = worker_of(tmp_path, "models: {m: [worker0]}")
    assert worker.scheduler.models["m"].residency == "device"


@pytest.mark.parametrize(
    ("yaml", "names"),
    [
        ("workers: [{name: a}]\nmodels: {m: [a, ghost]}", "a"),
        ("models: {m: [a]}", "worker0"),
    ],
)
def test_pin_map_naming_undefined_worker_rejected(tmp_path, yaml, names):
    path = write(tmp_path, "node.yaml", yaml)
    with pytest.raises(
        ConfigError, match=rf"^{re.escape(str(path))}: \$\.models\.m: .*unknown worker.*{names}$"
    ):
        load_node(path)


def test_a_pin_on_a_worker_the_machine_decides_is_checked_on_the_machine(tmp_path):
    """Workers named by number, as many as the machine's GPUs or
    INFERENCE_SERVER_CPU_WORKERS say: a pin on worker1 loads (it was refused, the file
    read as one worker), and is checked when the node is planned there."""
    cuda = write(
        tmp_path, "cuda.yaml", "global: {runtime: {backend: cuda}}\nmodels: {m: [worker0, worker1]}"
    )
    load_node(cuda)
    path = write(tmp_path, "cpu.yaml", "models: {m: [worker1]}")
    node = load_node(path)
    plan = plan_node(node, {"INFERENCE_SERVER_CPU_WORKERS": "2"}, source=path)
    assert [w.name for w in plan.workers] == ["worker0", "worker1"]
    assert plan.workers[1].scheduler.models["m"].residency == "device"
    with pytest.raises(ConfigError, match=r"pinned on unknown worker 'worker1'; workers: worker0$"):
        plan_node(node, {}, source=path)


# --- ports ---


@pytest.mark.parametrize(
    ("yaml", "message"),
    [
        # b's explicit port is a's derived one.
        ("workers: [{name: a}, {name: b, port: 8101}]", "both use gRPC port 8101"),
        # A global port is shared by every worker.
        (
            "global: {endpoints: {port: 7000}}\nworkers: [{name: a}, {name: b}]",
            "both use gRPC port 7000",
        ),
        # a's metrics port is b's gRPC port.
        (
            "workers:\n  - {name: a, endpoints: {metrics_port: 8102}}\n  - {name: b}",
            "gRPC port 8102 of worker 'b' is the metrics port of worker 'a'",
        ),
        ("metrics_base_port: 8001", "metrics port and gRPC port are both 8001"),
        ("global: {endpoints: {metrics_port: 8001}}", "metrics port and gRPC port are both 8001"),
        (
            "global: {endpoints: {metrics_port: 9000}}\nworkers: [{name: a}, {name: b}]",
            "both use metrics port 9000",
        ),
        ("base_port: 65535\nworkers: [{name: a}, {name: b}]", "base_port 65535 + worker index 1"),
        (  # (base_port unset: the message named a base_port 65600 the file never set)
            "port: 65500\ncpu_workers: 2",
            "port 65500 + 100 (base_port unset) + worker index 0 exceeds 65535",
        ),
        # Refused before any worker is resolved (a few ms each: it took minutes).
        (
            "cpu_workers: 60000",
            "worker 'worker57435': port 8001 + 100 (base_port unset) + worker index 57435 "
            "exceeds 65535",
        ),
        ("cpu_workers: 60000\nmetrics_base_port: 65000", "worker 'worker536': metrics_base_port"),
        ("cpu_workers: 99999999", "99999999 workers: more than there are ports for them"),
    ],
)
def test_port_collisions_rejected(tmp_path, yaml, message):
    path = write(tmp_path, "node.yaml", yaml)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: .*{re.escape(message)}"):
        load_node(path)


def test_env_port_collision_rejected(tmp_path):
    # The environment applies to every worker of the node, so one port
    # for all of them is a collision.
    path = write(tmp_path, "node.yaml", TWO_WORKERS)
    with pytest.raises(ConfigError, match=r"both use gRPC port 7000"):
        load_worker(path, "a", env={"INFERENCE_SERVER_ENDPOINTS_PORT": "7000"})


def test_metrics_ports_derived_from_metrics_base_port(tmp_path):
    yaml = "metrics_base_port: 9100\nworkers: [{name: a}, {name: b}, {name: c}]"
    ports = [worker_of(tmp_path, yaml, n).endpoints for n in "abc"]
    assert [(e.port, e.metrics_port) for e in ports] == [(8101, 9100), (8102, 9101), (8103, 9102)]


# --- paths, devices, output ---


def test_paths_resolved_relative_to_the_node_file(tmp_path, monkeypatch):
    (tmp_path / "conf").mkdir()
    path = write(
        tmp_path, "conf/node.toml", 'model_repo = "../models"\n[global]\ncache_dir = "c"\n'
    )
    monkeypatch.chdir("/")
    worker = load_worker(path, env={})
    assert worker.model_repo == str(tmp_path / "models")
    assert worker.cache_dir == str(tmp_path / "conf" / "c")
    absolute = write(tmp_path, "abs.yaml", f"model_repo: {tmp_path / 'x'}")
    assert load_worker(absolute, env={}).model_repo == str(tmp_path / "x")


def test_effective_config_dict_round_trips(tmp_path):
    worker = worker_of(tmp_path, PINNED, "a", env={"INFERENCE_SERVER_LOGGING_FORMAT": "json"})
    data = effective_config_dict(worker)
    assert data["endpoints"]["port"] == 8101
    assert data["overrides"] == ["INFERENCE_SERVER_LOGGING_FORMAT=json"]
    assert msgspec.convert(data, WorkerConfig) == worker


def test_the_gateway_logs_its_configuration_without_the_workers_key(tmp_path):
    path = write(
        tmp_path,
        "gateway.toml",
        """
        endpoints = ["127.0.0.1:8101"]
        [worker_client.headers]
        rsrv-control-key = "s3cret"
        """,
    )
    data = gateway_config_dict(load_gateway(path, env={}))
    assert data["worker_client"]["headers"] == {"rsrv-control-key": "***"}
    assert data["endpoints"] == ["127.0.0.1:8101"]
    assert "s3cret" not in str(data)


def test_the_gateway_takes_its_workers_headers_from_the_environment(tmp_path):
    """A worker's key from a Kubernetes Secret, not the file (the variable was refused:
    "cannot be set from the environment")."""
    path = write(tmp_path, "gateway.toml", 'endpoints = ["127.0.0.1:8101"]\n')
    variable = "INFERENCE_GATEWAY_WORKER_CLIENT_HEADERS"
    env = {variable: "admin-key=s3c,ret, repo-key=k=v"}
    config = load_gateway(path, env=env)
    assert config.worker_client.headers == {"admin-key": "s3c,ret", "repo-key": "k=v"}
    for text in ("s3cret", "S3cretKeyBase64==", "Bad=1", "admin-key=s3c,te=Q7"):
        with pytest.raises(ConfigError, match=rf"^{variable}: item \d is not a header") as info:
            load_gateway(path, env={variable: text})
        assert "s3c" not in str(info.value) and "S3c" not in str(info.value)
    # JSON, which holds any value unambiguously (what rsrv node hands its gateway)
    config = load_gateway(path, env={variable: '{"admin-key": "s3c,te=Q7"}'})
    assert config.worker_client.headers == {"admin-key": "s3c,te=Q7"}
    restricted = '[{"protocols": ["gateway-control"], "header": "k", "value": "s3c"}]'
    config = load_gateway(path, env={"INFERENCE_GATEWAY_GRPC_RESTRICTED": restricted})
    assert [(b.protocols, b.header, b.value) for b in config.grpc.restricted] == [
        (["gateway-control"], "k", "s3c")
    ]


def test_the_gateway_restricts_protocols_as_a_worker_does(tmp_path):
    """grpc.restricted: the worker's blocks, a value_file relative to the gateway file,
    the value kept out of the log; the same checks."""
    (tmp_path / "conf").mkdir()
    path = write(
        tmp_path,
        "conf/gateway.toml",
        """
        endpoints = ["127.0.0.1:8101"]
        [[grpc.restricted]]
        protocols = ["gateway-control"]
        header = "admin-key"
        value = "s3cret"
        [[grpc.restricted]]
        protocols = ["model-repository"]
        header = "repo-key"
        value_file = "key.txt"
        """,
    )
    config = load_gateway(path, env={})
    blocks = config.grpc.restricted
    assert [b.protocols for b in blocks] == [["gateway-control"], ["model-repository"]]
    assert blocks[1].value_file == str(tmp_path / "conf" / "key.txt")
    assert "s3cret" not in str(gateway_config_dict(config))
    twice = path.read_text().replace('["model-repository"]', '["gateway-control"]')
    with pytest.raises(ConfigError, match=r"grpc.restricted\[1\]: protocol 'gateway-control'"):
        load_gateway(write(tmp_path, "twice.toml", twice), env={})
    none = path.read_text().replace('value = "s3cret"', "")
    with pytest.raises(ConfigError, match=r"grpc.restricted\[0\]: give exactly one of value"):
        load_gateway(write(tmp_path, "none.toml", none), env={})


@pytest.mark.parametrize(
    ("tls", "needle"),
    [
        ('[grpc]\ntls_client_ca_file = "ca.pem"', "grpc.tls_client_ca_file needs tls_cert_file"),
        (
            '[worker_client]\ntls_cert_file = "c.pem"\ntls_key_file = "k.pem"',
            "worker_client.tls_cert_file needs tls_ca_file",
        ),
    ],
)
def test_gateway_tls_settings_that_would_be_ignored_are_refused(tmp_path, tls, needle):
    path = write(tmp_path, "gateway.toml", f'endpoints = ["127.0.0.1:8101"]\n{tls}\n')
    with pytest.raises(ConfigError, match=needle):
        load_gateway(path, env={})


@pytest.mark.parametrize(
    ("header", "needle"),
    [
        ('rsrv-key = "k\u20acy"', "headers.rsrv-key: the value must be printable ASCII"),
        ('Rsrv-Key = "k"', "headers.Rsrv-Key: not a metadata key a call may carry"),
        ('te = "k"', "headers.te: not a metadata key"),
        ('grpc-timeout = "1S"', "headers.grpc-timeout: not a metadata key"),
        ('connection = "close"', "headers.connection: not a metadata key"),  # (reset)
        ('"x.y" = "caf\u00e9"', 'headers\\["x.y"\\]: the value must be printable ASCII'),
    ],
)
def test_gateway_headers_no_call_could_carry_are_refused(tmp_path, header, needle):
    """(Accepted, they failed the first probe with a traceback: exit 1.)"""
    text = f'endpoints = ["127.0.0.1:8101"]\n[worker_client.headers]\n{header}\n'
    path = write(tmp_path, "gateway.toml", text)
    with pytest.raises(ConfigError, match=needle):
        load_gateway(path, env={})


def test_a_gateway_tls_file_from_the_environment_is_relative_to_the_working_directory(
    tmp_path, monkeypatch
):
    """As a node's variables are (it was resolved against the gateway file's directory)."""
    (tmp_path / "sub").mkdir()
    path = write(tmp_path / "sub", "gw.toml", 'endpoints = ["127.0.0.1:8101"]\n')
    monkeypatch.chdir(tmp_path)
    env = {"INFERENCE_GATEWAY_WORKER_CLIENT_TLS_CA_FILE": "ca.pem"}
    config = load_gateway(path, env=env)
    assert config.worker_client.tls_ca_file == str(tmp_path / "ca.pem")
    written = write(
        tmp_path / "sub",
        "gw.toml",
        'endpoints = ["127.0.0.1:8101"]\n[worker_client]\ntls_ca_file = "ca.pem"\n',
    )
    assert load_gateway(written, env={}).worker_client.tls_ca_file == str(
        tmp_path / "sub" / "ca.pem"
    )


def test_a_gateway_file_turns_admin_http_off_with_none(tmp_path):
    path = write(
        tmp_path, "gateway.toml", 'endpoints = ["127.0.0.1:8101"]\n[listen]\nmetrics = "none"\n'
    )
    assert load_gateway(path, env={}).listen.metrics is None  # TOML has no null


@pytest.mark.parametrize(
    ("variable", "value", "problem"),
    [
        ("INFERENCE_GATEWAY_GRPC_MAX_MESSAGE_BYTES", "5", "Expected `int` >= 1048576"),
        ("INFERENCE_GATEWAY_SCHEDULING_ROUTING_FILL_FACTOR", "1e9", "Expected `float` <= 1000"),
    ],
)
def test_a_gateway_variable_out_of_range_is_named(variable, value, problem):
    env = {"INFERENCE_GATEWAY_ENDPOINTS": "127.0.0.1:8101", variable: value}
    with pytest.raises(ConfigError, match=rf"^{variable}='{value}': {re.escape(problem)}"):
        load_gateway(None, env)


def test_configs_are_immutable(tmp_path):
    worker = worker_of(tmp_path, "")
    with pytest.raises(AttributeError):
        worker.runtime.backend = "cuda"  # type: ignore[misc]


def test_spec_examples_agree_with_each_other_and_the_code(tmp_path):
    spec = (ROOT / "specs" / "config.md").read_text()
    blocks = dict(re.findall(r"```(yaml|toml)\n(.*?)```", spec, re.S)[-2:])
    from_yaml = write(tmp_path, "node.yaml", blocks["yaml"])
    from_toml = write(tmp_path, "node.toml", blocks["toml"])
    assert load_node(from_yaml) == load_node(from_toml)
    gpu1 = load_worker(from_toml, "gpu1", env={})
    assert (gpu1.index, gpu1.gpu) == (1, "1")
    assert (gpu1.endpoints.port, gpu1.endpoints.metrics_port) == (8102, 9002)
    assert gpu1.runtime.mem_fraction == 0.8 and gpu1.runtime.backend == "cuda"
    resnet = gpu1.scheduler.models["resnet50"]
    assert (resnet.weight, resnet.residency, resnet.max_batch_size) == (4.0, "device", 32)
    assert gpu1.scheduler.models["bert"].residency == "system"
