"""Reading node files, and resolving one worker's configuration from them.

The path from file to worker is:

1. :func:`load_node` decodes the file (YAML or TOML, by extension) and
   validates it against :class:`NodeConfig`. Every error is a
   :class:`ConfigError` naming the file and, when there is one, the
   field's ``$.path``.
2. :func:`resolve_worker` picks a worker and builds its settings as plain
   dicts: ``global``, deep-merged with the worker's override blocks, then
   the ``host``/``port`` shorthands, then ``INFERENCE_SERVER_*``
   variables, then the pin map. The result is validated once more and
   flattened into a frozen :class:`WorkerConfig`.

Merging dicts rather than structs is what lets a worker override a single
field: a struct would have filled every other field with its default.
"""

from __future__ import annotations

import copy
import importlib.resources
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import msgspec.json
import msgspec.toml
import msgspec.yaml

from ._env import ENV_PREFIX, apply_env
from ._errors import ConfigError
from ._schema import (
    SECTIONS,
    EndpointsConfig,
    GlobalConfig,
    NodeConfig,
    WorkerConfig,
    WorkerEntry,
)

__all__ = [
    "DEFAULT_NODE_NAME",
    "effective_config_dict",
    "load_node",
    "load_worker",
    "resolve_worker",
]

#: How errors name the embedded default node file.
DEFAULT_NODE_NAME = "<embedded default.toml>"

#: The name of the implicit worker of a node file without `workers`.
IMPLICIT_WORKER = "worker0"

_FORMATS = {".yaml": "YAML", ".yml": "YAML", ".toml": "TOML"}
_DECODERS = {"YAML": msgspec.yaml.decode, "TOML": msgspec.toml.decode}

_T = TypeVar("_T")


# --- decoding ---


def _key_segment(key: str) -> str:
    """A mapping key as a path segment: `.name`, or `["odd key"]`."""
    return f".{key}" if re.fullmatch(r"[A-Za-z_][\w-]*", key) else f"[{json.dumps(key)}]"


_SEGMENT = re.compile(r"\.([A-Za-z_]\w*)|\[(\d+)\]|\[(\.\.\.)\]")


def _split(message: str) -> tuple[str, str]:
    """msgspec's message as (problem, `$.path`)."""
    match = re.fullmatch(r"(?s)(.*) - at `(\$[^`]*)`", message)
    return (match.group(1), match.group(2)) if match else (message, "$")


def _name_keys(raw: Any, type_: type, message: str) -> str | None:
    """The error's path with msgspec's `[...]` placeholders replaced by the keys.

    msgspec does not say which mapping key an error is under. It reports
    the first error in document order, so the culprit is the first key k
    for which the mapping cut after k reproduces the same error. Returns
    None when the path cannot be followed.
    """
    _, path = _split(message)
    tokens: list[Any] = []
    for match in _SEGMENT.finditer(path):
        name, index, _ = match.groups()
        tokens.append(name if name else int(index) if index else ...)
    for pos, token in enumerate(tokens):
        if token is not ...:
            continue
        if pos == 0:
            return None
        node = raw
        for step in tokens[:pos]:
            node = node[step]
        if not isinstance(node, dict):
            return None
        keys = list(node)
        for cut in range(1, len(keys) + 1):
            trial = copy.deepcopy(raw)
            parent = trial
            for step in tokens[: pos - 1]:
                parent = parent[step]
            parent[tokens[pos - 1]] = {k: node[k] for k in keys[:cut]}
            try:
                msgspec.convert(trial, type=type_, strict=True)
            except msgspec.ValidationError as exc:
                if str(exc) == message:
                    tokens[pos] = keys[cut - 1]
                    break
        else:
            return None
    rendered = "$"
    for token in tokens:
        rendered += f"[{token}]" if isinstance(token, int) else _key_segment(token)
    return rendered


def _describe(exc: msgspec.ValidationError, raw: Any, type_: type) -> str:
    """msgspec's message, reworded as `$.path: problem` with every key named.

    msgspec reports an unknown field at its parent's path; appending the
    field's name gives the operator the exact key to delete.
    """
    problem, path = _split(str(exc))
    if "[...]" in path:
        try:
            path = _name_keys(raw, type_, str(exc)) or path
        except (KeyError, IndexError, TypeError):
            pass  # keep msgspec's own path
    unknown = re.fullmatch(r"Object contains unknown field `(.*)`", problem)
    if unknown:
        return f"{path}{_key_segment(unknown.group(1))}: unknown field"
    return f"{path}: {problem}"


def _convert(raw: Any, type_: type[_T], where: str) -> _T:
    try:
        return msgspec.convert(raw, type=type_, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{where}: {_describe(exc, raw, type_)}") from None


def _decode(data: bytes, fmt: str, where: str) -> Any:
    try:
        raw = _DECODERS[fmt](data)
    except msgspec.DecodeError as exc:
        # PyYAML names the input "<byte string>"; the prefix names it better.
        detail = str(exc).replace('in "<byte string>", ', "")
        raise ConfigError(f"{where}: invalid {fmt}: {detail}") from None
    # An empty YAML file is a node with every default.
    return {} if raw is None else raw


def load_node(path: str | os.PathLike[str] | None = None) -> NodeConfig:
    """Read and validate a node file; None reads the embedded ``default.toml``.

    The format follows the extension: ``.yaml``/``.yml`` or ``.toml``.
    Values are returned as written (paths unresolved, derived ports None);
    use :func:`resolve_worker` with ``source=path`` to get a runnable
    worker. Besides the schema this checks what can be checked without the
    environment: worker names are unique, the pin map names defined
    workers, device lists are well formed and ports do not collide.

    Raises ConfigError, naming the file, for unreadable files, syntax
    errors and invalid contents.
    """
    if path is None:
        where, fmt = DEFAULT_NODE_NAME, "TOML"
        data = importlib.resources.files(__package__).joinpath("default.toml").read_bytes()
    else:
        where = os.fspath(path)
        fmt = _FORMATS.get(Path(where).suffix.lower())
        if fmt is None:
            raise ConfigError(f"{where}: unsupported extension; use .yaml, .yml or .toml")
        try:
            data = Path(where).read_bytes()
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read: {exc.strerror or exc}") from None
    node = _convert(_decode(data, fmt, where), NodeConfig, where)
    # Resolve every worker with no environment: a file that cannot yield a
    # worker is rejected now rather than when its worker starts.
    _resolve_all(node, {}, Path.cwd() if path is None else Path(where).parent, where)
    return node


# --- resolution ---


def _deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> None:
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)


def _entries(node: NodeConfig) -> list[WorkerEntry]:
    return list(node.workers) or [WorkerEntry(name=IMPLICIT_WORKER)]


def _device_ordinals(node: NodeConfig, where: str) -> list[int] | None:
    """`gpus` as device ordinals; None for "auto" (every visible device)."""
    gpus = node.gpus
    if gpus == "auto":
        return None
    if isinstance(gpus, int):
        return list(range(gpus))
    ordinals = []
    for i, item in enumerate(gpus):
        if isinstance(item, str):
            match = re.fullmatch(r"\s*(?:cuda:)?(\d+)\s*", item)
            if match is None:
                raise ConfigError(
                    f"{where}: $.gpus[{i}]: {item!r} is not a device ordinal (N or cuda:N)"
                )
            item = int(match.group(1))
        ordinals.append(item)
    return ordinals


def _check_node(node: NodeConfig, where: str) -> None:
    """Cross-field rules of the node file that do not depend on the environment."""
    names = [entry.name for entry in _entries(node)]
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            raise ConfigError(f"{where}: $.workers[{i}].name: duplicate worker name {name!r}")
        seen.add(name)
    for model, targets in node.models.items():
        for target in targets:
            if target not in seen:
                raise ConfigError(
                    f"{where}: $.models{_key_segment(model)}: pinned on unknown worker {target!r}; "
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
    _device_ordinals(node, where)


def _absolute(path: str, base: Path) -> str:
    return os.path.normpath(os.path.join(base, os.path.expanduser(path)))


def _derived_port(
    explicit: int | None, base: int | None, index: int, what: str, where: str
) -> int | None:
    if explicit is not None:
        return explicit
    if base is None:
        return None
    port = base + index
    if port > 65535:
        raise ConfigError(f"{where}: {what} {base} + worker index {index} exceeds 65535")
    return port


def _resolve_one(
    node: NodeConfig,
    entry: WorkerEntry,
    index: int,
    env: Mapping[str, str],
    base: Path,
    where: str,
) -> WorkerConfig:
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
    merged = _convert(settings, GlobalConfig, here)

    endpoints = merged.endpoints
    port = _derived_port(endpoints.port, node.base_port, index, "base_port", here)
    metrics_port = _derived_port(
        endpoints.metrics_port, node.metrics_base_port, index, "metrics_base_port", here
    )
    if metrics_port == port:
        raise ConfigError(f"{here}: metrics port and gRPC port are both {port}")

    gpu = None
    if merged.runtime.backend != "cpu":
        ordinals = _device_ordinals(node, where)
        if entry.gpu is not None:
            if ordinals is not None and entry.gpu not in ordinals:
                raise ConfigError(f"{here}: gpu {entry.gpu} is not among gpus {ordinals}")
            gpu = entry.gpu
        elif ordinals is None:
            gpu = index
        elif not ordinals:
            raise ConfigError(f"{here}: backend {merged.runtime.backend!r} but gpus is 0")
        else:
            # More workers than devices: they share devices round-robin.
            gpu = ordinals[index % len(ordinals)]

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
        model_control_mode=merged.model_control_mode,
        model_poll_seconds=merged.model_poll_seconds,
        runtime=merged.runtime,
        scheduler=merged.scheduler,
        endpoints=msgspec.structs.replace(endpoints, port=port, metrics_port=metrics_port),
        logging=merged.logging,
        gpu=gpu,
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
    restricted = []
    owner: dict[str, int] = {}
    for i, block in enumerate(endpoints.restricted):
        at = f"{here}: endpoints.restricted[{i}]"
        sources = [k for k in ("value", "value_env", "value_file") if getattr(block, k) is not None]
        if len(sources) != 1:
            raise ConfigError(f"{at}: give exactly one of value, value_env, value_file")
        for protocol in block.protocols:
            if protocol in owner:
                raise ConfigError(
                    f"{at}: protocol {protocol!r} is already restricted by "
                    f"endpoints.restricted[{owner[protocol]}]"
                )
            owner[protocol] = i
        if block.value_file is not None:
            block = msgspec.structs.replace(block, value_file=_absolute(block.value_file, base))
        restricted.append(block)
    return msgspec.structs.replace(endpoints, restricted=restricted, **tls)


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


def _resolve_all(
    node: NodeConfig, env: Mapping[str, str], base: Path, where: str
) -> list[WorkerConfig]:
    _check_node(node, where)
    workers = [
        _resolve_one(node, entry, index, env, base, where)
        for index, entry in enumerate(_entries(node))
    ]
    _check_ports(workers, where)
    return workers


def resolve_worker(
    node: NodeConfig,
    name: str | None = None,
    env: Mapping[str, str] = os.environ,
    *,
    source: Path | None = None,
) -> WorkerConfig:
    """The fully resolved configuration of worker `name` of `node`.

    `name` may be omitted when the node has at most one worker; a node
    without `workers` has one, named ``worker0``. `env` supplies the
    ``INFERENCE_SERVER_*`` overrides. `source` is the node file `node` was
    loaded from: errors name it, and relative paths in the node resolve
    against its directory (against the working directory when None, as
    for the embedded default).

    Every worker of the node is resolved, with the same environment, so
    that port collisions between workers are caught whichever worker
    starts first. Raises ConfigError.
    """
    where = os.fspath(source) if source is not None else "<node config>"
    base = Path(where).absolute().parent if source is not None else Path.cwd()
    workers = _resolve_all(node, env, base, where)
    names = ", ".join(w.name for w in workers)
    if name is None:
        if len(workers) > 1:
            raise ConfigError(f"{where}: the node has several workers ({names}); name one")
        return workers[0]
    for worker in workers:
        if worker.name == name:
            return worker
    raise ConfigError(f"{where}: no worker named {name!r}; workers: {names}")


def load_worker(
    path: str | os.PathLike[str] | None,
    name: str | None = None,
    env: Mapping[str, str] = os.environ,
) -> WorkerConfig:
    """:func:`load_node` then :func:`resolve_worker`, with `source` set to `path`."""
    node = load_node(path)
    return resolve_worker(node, name, env, source=None if path is None else Path(path))


def effective_config_dict(worker: WorkerConfig) -> dict[str, Any]:
    """`worker` as plain JSON data (dicts, lists, str, numbers, None), for the startup log.
    Restricted-protocol values written in the file are shown as ``"***"``."""
    # Through JSON rather than to_builtins: tuples come back as lists.
    data = msgspec.json.decode(msgspec.json.encode(worker))
    for block in data["endpoints"]["restricted"]:
        if block.get("value") is not None:
            block["value"] = "***"
    return data
