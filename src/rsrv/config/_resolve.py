"""Resolving a node into its workers, and one worker's configuration.

:func:`plan_node` decides the node's workers (the file's ``workers``, or one per device,
or ``cpu_workers`` on a cpu node), their devices (``_devices``) and ports, and resolves
each: ``global``, deep-merged with the worker's override blocks, then the
``host``/``port`` shorthands, then ``INFERENCE_SERVER_*`` variables, then the pin map;
the result is validated once more and flattened into a frozen :class:`WorkerConfig`,
with its ports derived, its device assigned and its paths made absolute. Every worker of
the node is resolved together, so that collisions between workers are caught whichever
starts first; :func:`resolve_worker` picks one.

Merging dicts rather than structs is what lets a worker override a single field: a
struct would have filled every other field with its default.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import msgspec.json

from ._devices import assign_devices, detect_devices, file_devices
from ._env import CPU_WORKERS_VARIABLE, ENV_PREFIX, apply_env, env_variables, parse_env_value
from ._errors import ConfigError, convert, key_segment
from ._schema import (
    SECTIONS,
    EndpointsConfig,
    GlobalConfig,
    NodeConfig,
    RestrictedConfig,
    SupervisorConfig,
    WorkerConfig,
    WorkerEntry,
)

__all__ = ["NodePlan", "effective_config_dict", "plan_node", "resolve_worker"]

#: With base_port unset, worker i of a node of two or more listens on port + 100 + i.
_WORKER_PORT_OFFSET = 100

#: How errors name the embedded default node file (no ``source``).
DEFAULT_NODE_NAME = "<embedded default.toml>"


@dataclass(frozen=True)
class NodePlan:
    """A node resolved: its workers, devices and public ports.

    ``port`` is the node's public gRPC port: the only worker's, or the gateway's;
    ``metrics_port`` the node's admin port (served by ``rsrv node``);
    ``devices`` the devices found and ``device_source`` where they were found (empty on
    a cpu node, or when ``detect`` was off and ``gpus`` is auto).
    """

    workers: list[WorkerConfig]
    port: int
    metrics_port: int
    devices: list[str]
    device_source: str
    supervisor: SupervisorConfig
    host: str = "127.0.0.1"  # where the node's own servers listen (global endpoints.host)
    gateway: bool = True  # a gateway in front of two or more workers
    gateway_file: str | None = None  # absolute
    gateway_metrics_port: int | None = None


def _deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> None:
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)


def _backend(node: NodeConfig, env: Mapping[str, str]) -> str:
    """The node's backend: global.runtime.backend, or its environment override (a
    malformed override is reported later by apply_env, naming the variable)."""
    variable = f"{ENV_PREFIX}RUNTIME_BACKEND"
    if variable in env:
        _, tp = env_variables()[variable]
        try:
            return parse_env_value(env[variable], tp)
        except ValueError:
            pass
    return node.global_.runtime.backend


def _entries(
    node: NodeConfig, backend: str, devices: list[str] | None, env: Mapping[str, str], where: str
) -> list[WorkerEntry]:
    """The file's workers, else worker0..N-1: one per device, or ``cpu_workers``.
    Raises ConfigError for an ``INFERENCE_SERVER_CPU_WORKERS`` that does not parse, or
    that cannot apply (the file lists its workers; a cuda node has one per device)."""
    text = env.get(CPU_WORKERS_VARIABLE)
    if text is not None:
        if not (text.strip().isascii() and text.strip().isdigit()) or int(text) < 1:
            raise ConfigError(f"{CPU_WORKERS_VARIABLE}={text!r}: expected an integer >= 1")
        why = "the node file lists its workers" if node.workers else ""
        if not why and backend != "cpu":
            why = f"a {backend} node runs one worker per device"
        if why:
            raise ConfigError(f"{CPU_WORKERS_VARIABLE}={text!r} cannot apply: {why}")
    if node.workers:
        return list(node.workers)
    if backend == "cpu":
        count = node.cpu_workers if text is None else int(text)
    else:
        count = max(1, len(devices or ()))
    _check_port_room(node, count, env, where)
    return [WorkerEntry(name=f"worker{i}") for i in range(count)]


def _check_port_room(node: NodeConfig, count: int, env: Mapping[str, str], where: str) -> None:
    """Raise, before any of them is resolved, the error :func:`_resolve_one` would give
    the first of ``count`` numbered workers whose derived port passes 65535 (each worker
    takes milliseconds to resolve: minutes, for a count in the millions)."""
    if count > 65535:
        raise ConfigError(f"{where}: {count} workers: more than there are ports for them")
    grpc = _grpc_base(node, count)
    first = []
    for key, base, base_what in (
        ("port", grpc, _grpc_base_text(node, grpc)),
        ("metrics_port", node.metrics_base_port, f"metrics_base_port {node.metrics_base_port}"),
        ("http_port", node.http_base_port, f"http_base_port {node.http_base_port}"),
    ):
        explicit = getattr(node.global_.endpoints, key) is not None
        if base is None or explicit or f"{ENV_PREFIX}ENDPOINTS_{key.upper()}" in env:
            continue  # (not derived: every worker has the same one)
        if base + count - 1 > 65535:
            first.append((max(65536 - base, 0), base_what))
    if first:
        index, what = min(first, key=lambda item: item[0])
        raise ConfigError(
            f"{where}: worker 'worker{index}': {what} + worker index {index} exceeds 65535"
        )


_NUMBERED = re.compile(r"worker[0-9]+")


def _check_node(
    node: NodeConfig, entries: list[WorkerEntry], where: str, count_known: bool = True
) -> None:
    """Cross-field rules of the node's workers that do not depend on their settings.
    Not ``count_known`` (the workers are named by number, and how many there are
    depends on the machine: its devices, INFERENCE_SERVER_CPU_WORKERS), a pin on
    ``workerN`` is left to the plan made on the machine."""
    if isinstance(node.gpus, list):
        file_devices(node, where)  # well formed, whatever the backend
    names = [entry.name for entry in entries]
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            raise ConfigError(f"{where}: $.workers[{i}].name: duplicate worker name {name!r}")
        seen.add(name)
    for model, targets in node.models.items():
        for target in targets:
            if target not in seen and (count_known or not _NUMBERED.fullmatch(target)):
                raise ConfigError(
                    f"{where}: $.models{key_segment(model)}: pinned on unknown worker {target!r}; "
                    f"workers: {', '.join(names)}"
                )
    for i, entry in enumerate(node.workers):
        if entry.endpoints is None:
            continue
        for short in ("host", "port"):
            if getattr(entry, short) is not None and (
                getattr(entry.endpoints, short) is not msgspec.UNSET
            ):
                raise ConfigError(
                    f"{where}: $.workers[{i}]: both {short} and endpoints.{short} are set"
                )


def _absolute(path: str, base: Path) -> str:
    return os.path.normpath(os.path.join(base, os.path.expanduser(path)))


def _grpc_base(node: NodeConfig, count: int) -> int:
    """The gRPC port of worker 0 of ``count``: base_port, else the node's port (one
    worker) or port + _WORKER_PORT_OFFSET."""
    if node.base_port is not None:
        return node.base_port
    return node.port if count == 1 else node.port + _WORKER_PORT_OFFSET


def _grpc_base_text(node: NodeConfig, base: int) -> str:
    """How errors name ``base`` (:func:`_grpc_base`): as the file says it."""
    if node.base_port is not None:
        return f"base_port {base}"
    return f"port {node.port} + {base - node.port} (base_port unset)"


def _derived_port(
    explicit: int | None, base: int | None, index: int, what: str, where: str
) -> int | None:
    if explicit is not None:
        return explicit
    if base is None:
        return None
    port = base + index
    if port > 65535:
        raise ConfigError(f"{where}: {what} + worker index {index} exceeds 65535")
    return port


def _resolve_one(
    node: NodeConfig,
    entry: WorkerEntry,
    index: int,
    env: Mapping[str, str],
    base: Path,
    where: str,
    *,
    base_port: int,
    workers: int,
) -> WorkerConfig:
    """One worker, resolved; its device (``gpu``) is assigned by :func:`plan_node`."""
    settings: dict[str, Any] = msgspec.to_builtins(node.global_)
    settings["model_repo"] = node.model_repo
    for section in SECTIONS:
        override = getattr(entry, section)
        if override is not None:
            # to_builtins drops UNSET fields: exactly the keys the file set.
            _deep_merge(settings[section], msgspec.to_builtins(override))
    for short in ("host", "port"):
        if getattr(entry, short) is not None:
            settings["endpoints"][short] = getattr(entry, short)
    overrides = apply_env(settings, env)
    for model, targets in node.models.items():
        if entry.name in targets:
            policy = settings["scheduler"]["models"].setdefault(model, {})
            # An explicit residency is a deliberate choice; the pin map
            # only fills in where none was made.
            if policy.get("residency") is None:
                policy["residency"] = "device"

    here = f"{where}: worker {entry.name!r}"
    from_env = {item.partition("=")[0] for item in overrides}
    model_repo = settings.pop("model_repo")
    merged = convert(settings, GlobalConfig, here)

    endpoints = merged.endpoints
    derived = _grpc_base_text(node, base_port)
    port = _derived_port(endpoints.port, base_port, index, derived, here)
    metrics_port = _derived_port(
        endpoints.metrics_port,
        node.metrics_base_port,
        index,
        f"metrics_base_port {node.metrics_base_port}",
        here,
    )
    if metrics_port == port:
        raise ConfigError(f"{here}: metrics port and gRPC port are both {port}")
    http_port = _derived_port(
        endpoints.http_port,
        node.http_base_port,
        index,
        f"http_base_port {node.http_base_port}",
        here,
    )
    if http_port is not None and http_port in (port, metrics_port):
        other = "gRPC" if http_port == port else "metrics"
        raise ConfigError(f"{here}: REST (http) port and {other} port are both {http_port}")

    # Paths from the file are relative to the file; from the environment,
    # relative to where the server was started.
    cwd = Path.cwd()
    endpoints = _resolve_security(endpoints, here, base, cwd, from_env)
    return WorkerConfig(
        name=entry.name,
        index=index,
        model_repo=_absolute(model_repo, cwd if f"{ENV_PREFIX}MODEL_REPO" in from_env else base),
        cache_dir=_absolute(
            merged.cache_dir, cwd if f"{ENV_PREFIX}CACHE_DIR" in from_env else base
        ),
        cache_max_bytes=merged.cache_max_bytes,
        model_control_mode=merged.model_control_mode,
        model_poll_seconds=merged.model_poll_seconds,
        runtime=merged.runtime,
        scheduler=merged.scheduler,
        endpoints=msgspec.structs.replace(
            endpoints, port=port, metrics_port=metrics_port, http_port=http_port
        ),
        logging=merged.logging,
        gpu=None,
        workers=workers,
        overrides=overrides,
    )


def _resolve_security(
    endpoints: EndpointsConfig, here: str, base: Path, cwd: Path, from_env: set[str]
) -> EndpointsConfig:
    """Check the TLS and restricted-protocol settings; make their paths absolute."""
    tls = {}
    for key in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
        value = getattr(endpoints, key)
        if value is not None:
            variable = f"{ENV_PREFIX}ENDPOINTS_{key.upper()}"
            tls[key] = _absolute(value, cwd if variable in from_env else base)
    if ("tls_cert_file" in tls) != ("tls_key_file" in tls):
        raise ConfigError(f"{here}: endpoints.tls_cert_file and tls_key_file go together")
    if "tls_client_ca_file" in tls and "tls_cert_file" not in tls:
        raise ConfigError(
            f"{here}: endpoints.tls_client_ca_file needs tls_cert_file and tls_key_file"
        )
    restricted = checked_restrictions(endpoints.restricted, here, "endpoints.restricted", base)
    for i, block in enumerate(restricted):
        if "gateway-control" in block.protocols:  # (it would guard nothing here)
            raise ConfigError(
                f"{here}: endpoints.restricted[{i}]: gateway-control is a gateway's own "
                "protocol: restrict it in the gateway file's grpc.restricted"
            )
    return msgspec.structs.replace(endpoints, restricted=restricted, **tls)


def checked_restrictions(
    blocks: Sequence[RestrictedConfig], where: str, key: str, base: Path
) -> list[RestrictedConfig]:
    """``blocks`` (setting ``key`` of ``where``, for messages) once each gives one value
    and restricts protocols no other block does, a ``value_file`` made absolute
    (relative to ``base``). Raises ConfigError."""
    restricted = []
    owner: dict[str, int] = {}
    for i, block in enumerate(blocks):
        at = f"{where}: {key}[{i}]"
        sources = [k for k in ("value", "value_env", "value_file") if getattr(block, k) is not None]
        if len(sources) != 1:
            raise ConfigError(f"{at}: give exactly one of value, value_env, value_file")
        for protocol in block.protocols:
            if protocol in owner:
                raise ConfigError(
                    f"{at}: protocol {protocol!r} is already restricted by {key}[{owner[protocol]}]"
                )
            owner[protocol] = i
        if block.value_file is not None:
            block = msgspec.structs.replace(block, value_file=_absolute(block.value_file, base))
        restricted.append(block)
    return restricted


def _check_ports(workers: list[WorkerConfig], where: str) -> None:
    grpc: dict[int, str] = {}
    metrics: dict[int, str] = {}
    for worker in workers:
        port, metrics_port = worker.endpoints.port, worker.endpoints.metrics_port
        assert port is not None  # resolved by _resolve_one
        if port in grpc:
            raise ConfigError(
                f"{where}: workers {grpc[port]!r} and {worker.name!r} both use gRPC port {port}"
            )
        grpc[port] = worker.name
        if metrics_port is not None:
            if metrics_port in metrics:
                raise ConfigError(
                    f"{where}: workers {metrics[metrics_port]!r} and {worker.name!r} "
                    f"both use metrics port {metrics_port}"
                )
            metrics[metrics_port] = worker.name
    for port, name in grpc.items():
        if port in metrics:
            raise ConfigError(
                f"{where}: gRPC port {port} of worker {name!r} is the metrics port "
                f"of worker {metrics[port]!r}"
            )
    http: dict[int, str] = {}
    for worker in workers:
        http_port = worker.endpoints.http_port
        if http_port is None:
            continue
        for ports, kind in ((http, "REST (http)"), (grpc, "gRPC"), (metrics, "metrics")):
            if http_port in ports and ports[http_port] != worker.name:
                raise ConfigError(
                    f"{where}: REST (http) port {http_port} of worker {worker.name!r} is "
                    f"the {kind} port of worker {ports[http_port]!r}"
                )
        http[http_port] = worker.name


def plan_node(
    node: NodeConfig,
    env: Mapping[str, str] = os.environ,
    *,
    source: Path | None = None,
    detect: bool = True,
) -> NodePlan:
    """Every worker of ``node``, resolved with ``env`` (see the module docstring).

    ``detect`` False leaves ``gpus: auto`` undetected (a file checked away from the
    machine it is for): workers then get no device, and a count is not matched against
    this process's own ``CUDA_VISIBLE_DEVICES``. Raises ConfigError naming the file and
    the worker at fault.
    """
    where = os.fspath(source) if source is not None else DEFAULT_NODE_NAME
    base = Path(where).absolute().parent if source is not None else Path.cwd()
    backend = _backend(node, env)
    may_detect = detect or node.gpus != "auto"
    device_env = env if detect else {k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"}
    devices, found = [], ""
    if backend != "cpu" and may_detect:  # (the number of workers may follow)
        devices, found = detect_devices(node, device_env, where)
    entries = _entries(node, backend, devices if found else None, env, where)
    _check_node(node, entries, where, count_known=detect or bool(node.workers))
    base_port = _grpc_base(node, len(entries))
    workers = [
        _resolve_one(
            node, entry, index, env, base, where, base_port=base_port, workers=len(entries)
        )
        for index, entry in enumerate(entries)
    ]
    # Devices go to the workers whose own backend uses one (a worker may override the
    # node's). None found: each gets none to see (""), and fails at start with one line,
    # or falls back to the CPU where allow_cpu_fallback says so (the worker's call).
    on_device = [i for i, w in enumerate(workers) if w.runtime.backend != "cpu"]
    if on_device and not found and may_detect:
        devices, found = detect_devices(node, device_env, where)
    if on_device and found:
        names = [workers[i].name for i in on_device]
        gpus = [entries[i].gpu for i in on_device]
        assigned = assign_devices(names, gpus, devices, where) if devices else [""] * len(names)
        for i, device in zip(on_device, assigned, strict=True):
            workers[i] = msgspec.structs.replace(workers[i], gpu=device)
    _check_ports(workers, where)
    public = workers[0].endpoints.port if len(workers) == 1 else node.port
    assert public is not None  # resolved by _resolve_one
    gateway_file = node.gateway.file
    if gateway_file is not None:
        gateway_file = _absolute(gateway_file, base)
    return NodePlan(
        workers,
        public,
        node.metrics_port,
        devices,
        found,
        node.supervisor,
        # the host every worker listens on (the environment included), else the file's
        host=_shared_host(workers) or node.global_.endpoints.host,
        gateway=node.gateway.enabled and len(workers) > 1,
        gateway_file=gateway_file,
        gateway_metrics_port=node.gateway.metrics_port,
    )


def _shared_host(workers: Sequence[WorkerConfig]) -> str | None:
    hosts = {w.endpoints.host for w in workers}
    return hosts.pop() if len(hosts) == 1 else None


def resolve_worker(
    node: NodeConfig,
    name: str | None = None,
    env: Mapping[str, str] = os.environ,
    *,
    source: Path | None = None,
) -> WorkerConfig:
    """The fully resolved configuration of worker `name` of `node`.

    `name` may be omitted when the node has one worker; a node without
    `workers` has worker0, worker1, ... (see :func:`plan_node`). `env` supplies the
    ``INFERENCE_SERVER_*`` overrides. `source` is the node file `node` was
    loaded from: errors name it, and relative paths in the node resolve
    against its directory (against the working directory when None, as
    for the embedded default).

    Every worker of the node is resolved, with the same environment, so
    that port collisions between workers are caught whichever worker
    starts first. Raises ConfigError.
    """
    where = os.fspath(source) if source is not None else DEFAULT_NODE_NAME
    workers = plan_node(node, env, source=source).workers
    names = ", ".join(w.name for w in workers)
    if name is None:
        if len(workers) > 1:
            raise ConfigError(f"{where}: the node has several workers ({names}); name one")
        return workers[0]
    for worker in workers:
        if worker.name == name:
            return worker
    raise ConfigError(f"{where}: no worker named {name!r}; workers: {names}")


def effective_config_dict(worker: WorkerConfig) -> dict[str, Any]:
    """`worker` as plain JSON data (dicts, lists, str, numbers, None), for the startup log.
    Restricted-protocol values written in the file are shown as ``"***"``."""
    # Through JSON rather than to_builtins: tuples come back as lists.
    data = msgspec.json.decode(msgspec.json.encode(worker))
    for block in data["endpoints"]["restricted"]:
        if block.get("value") is not None:
            block["value"] = "***"
    return data
