"""The gateway file (``rsrv gateway GATEWAY_FILE``): schema, loading, env overrides.

Its keys follow the seed's ``gateway.yml`` so its users recognise the file:
``listen.grpc`` / ``listen.metrics`` as ``"host:port"``, a flat ``endpoints`` list of
worker ``"host:port"``, ``grpc`` and ``worker_client`` limits, a ``scheduling`` block.
``INFERENCE_GATEWAY_<SECTION>_<FIELD>`` variables override scalar keys, as
``INFERENCE_SERVER_*`` do for a worker; ``INFERENCE_GATEWAY_ENDPOINTS``,
``INFERENCE_GATEWAY_ENDPOINTS_DNS`` and ``INFERENCE_GATEWAY_WORKER_NAMES`` take
comma-separated lists. See specs/gateway.md.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from rsrv.transport import metadata_problem

from ._env import is_service_link, parse_env_value
from ._errors import ConfigError, convert, key_segment, reword
from ._load import read_document
from ._resolve import checked_restrictions
from ._schema import LoggingConfig, RestrictedConfig, _doc, _Strict

MAX_FILL_FACTOR = 1000.0  # a run of 1,000 batches: far past any use, and Q stays an int

__all__ = [
    "GATEWAY_ENV_PREFIX",
    "GatewayConfig",
    "ModelPlacementConfig",
    "SchedulingConfig",
    "gateway_config_dict",
    "gateway_json_schema",
    "load_gateway",
    "split_address",
]

GATEWAY_ENV_PREFIX = "INFERENCE_GATEWAY_"
_ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[^:\[\]\s]+):(\d{1,5})")  # (host, port)
Address = Annotated[
    str,
    msgspec.Meta(
        description="host:port, [v6 address]:port",
        # (the schema's, in ECMAScript's syntax; the loader says "'x' is not host:port")
        extra_json_schema={"pattern": f"^{_ADDRESS.pattern}$"},
    ),
]


def split_address(text: str) -> tuple[str, int]:
    """``"host:port"`` (``"[::1]:8001"`` for IPv6) as (host, port); ValueError if not.
    Port 0 (listen on a free port) is allowed here; endpoints must name a port."""
    match = _ADDRESS.fullmatch(text)
    if match is None or not 0 <= int(match[2]) <= 65535:
        raise ValueError(f"{text!r} is not host:port")
    return match[1].strip("[]"), int(match[2])


def join_address(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets (what :func:`split_address` reads)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ListenConfig(_Strict):
    grpc: Annotated[Address, _doc("Where clients connect (gRPC), host:port.")] = "127.0.0.1:8001"
    metrics: Annotated[
        Address | None,
        _doc('Admin HTTP (/healthz, /readyz, /metrics), host:port; null (or "none"): none.'),
    ] = "127.0.0.1:8002"


class GrpcConfig(_Strict):
    """The gateway's own gRPC server (what clients may hold of it)."""

    max_message_bytes: Annotated[
        int, msgspec.Meta(ge=1 << 20, le=(1 << 31) - 1), _doc("Largest message, in bytes.")
    ] = 1 << 28
    max_concurrent_requests_per_worker: Annotated[
        int,
        msgspec.Meta(ge=1),
        _doc("Inbound cap: this times the number of workers; more get RESOURCE_EXHAUSTED."),
    ] = 64
    max_connections: Annotated[int, msgspec.Meta(ge=1), _doc("Open client connections.")] = 1000
    max_streams_per_connection: Annotated[
        int, msgspec.Meta(ge=1), _doc("Calls open at once on one client connection.")
    ] = 128
    max_requests_per_stream: Annotated[
        int, msgspec.Meta(ge=1), _doc("Requests of one ModelStreamInfer stream in flight at once.")
    ] = 16
    receive_timeout_seconds: Annotated[
        float, msgspec.Meta(gt=0), _doc("A request must arrive whole within this.")
    ] = 60.0
    idle_connection_seconds: Annotated[
        float, msgspec.Meta(ge=0), _doc("A client connection idle this long is closed; 0: never.")
    ] = 600.0
    shutdown_grace_seconds: Annotated[
        float, msgspec.Meta(ge=0), _doc("How long calls in flight may finish after a stop signal.")
    ] = 30.0
    tls_cert_file: Annotated[str | None, _doc("PEM certificate chain: serve TLS.")] = None
    tls_key_file: Annotated[str | None, _doc("PEM private key of tls_cert_file.")] = None
    tls_client_ca_file: Annotated[str | None, _doc("PEM CA: require client certificates.")] = None
    restricted: Annotated[
        list[RestrictedConfig],
        _doc(
            "Protocols that need a header at the gateway (as a worker's "
            "endpoints.restricted; gateway-control is its own control service)."
        ),
    ] = []


class WorkerClientConfig(_Strict):
    """How the gateway talks to its workers."""

    request_timeout_seconds: Annotated[
        float,
        msgspec.Meta(gt=0),
        _doc(
            "Longest a call to a worker may take: the client's deadline up to this (this "
            "when it gave none)."
        ),
    ] = 60.0
    max_concurrent_streams: Annotated[
        int,
        msgspec.Meta(ge=1),
        _doc("Calls in flight to one worker at once; more wait (probes apart)."),
    ] = 64
    tls_ca_file: Annotated[
        str | None, _doc("PEM CA: connect to workers over TLS, verifying them with it.")
    ] = None
    tls_cert_file: Annotated[
        str | None, _doc("PEM client certificate for workers that require one.")
    ] = None
    tls_key_file: Annotated[str | None, _doc("PEM private key of tls_cert_file.")] = None
    headers: Annotated[
        dict[str, str],
        _doc(
            "Headers sent with the gateway's own calls (probes, fan-outs), e.g. the header "
            "of a restricted protocol; clients' headers are forwarded with their calls."
        ),
    ] = {}


class DiscoveryConfig(_Strict):
    """How the gateway finds out which worker is up and what it serves."""

    interval_seconds: Annotated[
        float, msgspec.Meta(gt=0), _doc("Time between probe rounds (ServerReady, index).")
    ] = 2.0
    probe_timeout_seconds: Annotated[
        float, msgspec.Meta(gt=0), _doc("A probe unanswered this long counts as a failure.")
    ] = 2.0
    refresh_min_seconds: Annotated[
        float,
        msgspec.Meta(ge=0),
        _doc("An unknown model triggers a refresh at most this often before NOT_FOUND."),
    ] = 1.0
    startup_wait_seconds: Annotated[
        float,
        msgspec.Meta(ge=0),
        _doc(
            "lpt_packing: how long the first placement waits for every configured worker "
            "to report; 0: none (a worker that comes up later is placed at a fleet repack)."
        ),
    ] = 0.0


class ModelPlacementConfig(_Strict):
    """Per-model scheduling overrides (``scheduling.models.<name>``)."""

    replicas: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | Literal["all"] | None,
        _doc("Workers holding the model under lpt_packing; null: default_replicas."),
    ] = None
    fill_mode: Annotated[
        Literal["run", "spread", "inflight"] | None, _doc("null: routing_fill_mode.")
    ] = None
    fill_factor: Annotated[
        Annotated[float, msgspec.Meta(gt=0, le=MAX_FILL_FACTOR)] | None,
        _doc("null: routing_fill_factor."),
    ] = None


class SchedulingConfig(_Strict):
    """Which worker answers a request (specs/gateway.md, Scheduling)."""

    mode: Annotated[
        Literal["round_robin", "least_outstanding", "lpt_packing"],
        _doc("round_robin, least_outstanding or lpt_packing (placement that fills batches)."),
    ] = "round_robin"
    work_basis: Annotated[
        Literal["requests", "items", "compute"],
        _doc(
            "What a request weighs for least_outstanding and fill_least: 1 (lpt_packing: "
            "the model's cost per request), rows, or seconds."
        ),
    ] = "requests"
    rebalance_compute_seconds: Annotated[
        float, msgspec.Meta(gt=0), _doc("Repack after the fleet computes this many seconds.")
    ] = 300.0
    first_rebalance_compute_seconds: Annotated[
        float, msgspec.Meta(gt=0), _doc("The same, until the first traffic-driven repack.")
    ] = 60.0
    hysteresis: Annotated[
        float,
        msgspec.Meta(ge=0, lt=1),
        _doc("A model keeps its home unless another is better by more than this fraction."),
    ] = 0.0
    ema_halflife_compute_seconds: Annotated[
        float,
        msgspec.Meta(ge=0),
        _doc("Half-life of the arrival and cost averages; 0: rebalance_compute_seconds."),
    ] = 0.0
    forbid_memory_oversubscription: Annotated[
        bool, _doc("Place a model only where its weights fit the budget, when any worker can.")
    ] = True
    default_replicas: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | Literal["all"],
        _doc("Workers holding each model under lpt_packing."),
    ] = 1
    routing_policy: Annotated[
        Literal["fill_least", "fill_rr"],
        _doc("fill_least: open a run on the least loaded replica; fill_rr: rotate."),
    ] = "fill_least"
    routing_fill_mode: Annotated[
        Literal["run", "spread", "inflight"], _doc("How requests fill a replica's batches.")
    ] = "run"
    routing_fill_factor: Annotated[
        float,
        msgspec.Meta(gt=0, le=MAX_FILL_FACTOR),
        _doc("Rows per run: this times the largest compiled batch."),
    ] = 1.0
    routing_fill_hold_seconds: Annotated[
        float,
        msgspec.Meta(ge=0, le=1),
        _doc(
            "Run mode: hold a run's requests at the gateway until it is full, at most this "
            "long after it opened, when the model has a run's worth in flight; 0: never."
        ),
    ] = 0.002
    compaction_mode: Annotated[
        Literal["eager", "off", "scheduled"],
        _doc("After a repack that moved models: CompactMemory on the workers it changed."),
    ] = "eager"
    compaction_interval: Annotated[
        int,
        msgspec.Meta(ge=1),
        _doc(
            "Compact at the first repack that moves something once N repacks (moving or "
            "not) have run since the last compaction."
        ),
    ] = 1
    models: Annotated[
        dict[str, ModelPlacementConfig], _doc("Per-model overrides (file only).")
    ] = {}


class GatewayConfig(_Strict):
    """The gateway file."""

    listen: ListenConfig = msgspec.field(default_factory=ListenConfig)
    endpoints: Annotated[
        list[Address], _doc("Workers, as host:port (any hosts), in a fixed order.")
    ] = []
    endpoints_dns: Annotated[
        list[Address],
        _doc(
            "host:port whose host name resolves to every worker (e.g. a Kubernetes headless "
            "Service); re-resolved each discovery round, so workers come and go."
        ),
    ] = []
    worker_names: Annotated[
        list[str], _doc("Names of the endpoints, index-aligned (metric labels); default host:port.")
    ] = []
    grpc: GrpcConfig = msgspec.field(default_factory=GrpcConfig)
    worker_client: WorkerClientConfig = msgspec.field(default_factory=WorkerClientConfig)
    discovery: DiscoveryConfig = msgspec.field(default_factory=DiscoveryConfig)
    scheduling: SchedulingConfig = msgspec.field(default_factory=SchedulingConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)

    @property
    def names(self) -> list[str]:
        """Each endpoint's name: ``worker_names[i]``, else the address."""
        return list(self.worker_names) or list(self.endpoints)

    def tls_files(self) -> dict[str, str | None]:
        """The TLS settings (serving clients, calling workers), by their names in the
        gateway file."""
        server = ("tls_cert_file", "tls_key_file", "tls_client_ca_file")
        client = ("tls_ca_file", "tls_cert_file", "tls_key_file")
        return {
            **{f"grpc.{key}": getattr(self.grpc, key) for key in server},
            **{f"worker_client.{key}": getattr(self.worker_client, key) for key in client},
        }


_SECTIONS = {
    "listen": ListenConfig,
    "grpc": GrpcConfig,
    "worker_client": WorkerClientConfig,
    "discovery": DiscoveryConfig,
    "scheduling": SchedulingConfig,
    "logging": LoggingConfig,
}
_LISTS = ("endpoints", "endpoints_dns", "worker_names")


def _variables() -> dict[str, tuple[tuple[str, ...], Any]]:
    table: dict[str, tuple[tuple[str, ...], Any]] = {}
    for name in _LISTS:
        table[GATEWAY_ENV_PREFIX + name.upper()] = ((name,), list)
    for section, cls in _SECTIONS.items():
        for f in msgspec.structs.fields(cls):
            if f.name != "models":
                table[f"{GATEWAY_ENV_PREFIX}{section.upper()}_{f.name.upper()}"] = (
                    (section, f.name),
                    f.type,
                )
    return table


def _headers_of(variable: str, text: str) -> dict[str, str]:
    """A JSON object of strings, or ``name=value[,name=value...]`` (a comma before
    ``name=`` separates; any other belongs to the value), as headers. Raises
    ConfigError naming the variable, never showing the text (it holds keys)."""
    if text.lstrip().startswith("{"):
        try:
            headers = msgspec.json.decode(text, type=dict[str, str])
        except msgspec.DecodeError:  # (ValidationError is one)
            raise ConfigError(f"{variable}: expected a JSON object of strings") from None
        items = list(headers.items())
    else:
        items = [item.partition("=")[::2] for item in re.split(r",(?=\s*[0-9a-z_.-]+=)", text)]
        items = [(name.strip(), value) for name, value in items]
    for i, (name, value) in enumerate(items):
        if metadata_problem(name, value) is not None or not value:
            raise ConfigError(
                f"{variable}: item {i + 1} is not a header a call may carry "
                "(name=value: a lower-case metadata key, a printable ASCII value)"
            )
    return dict(items)


def _restricted_of(variable: str, text: str) -> list:
    """A JSON list of ``grpc.restricted`` tables (checked as the file's are, after).
    Raises ConfigError naming the variable, never showing the text."""
    try:
        value = msgspec.json.decode(text)
    except msgspec.DecodeError:
        raise ConfigError(f"{variable}: expected a JSON list of tables") from None
    if not isinstance(value, list):
        raise ConfigError(f"{variable}: expected a JSON list of tables")
    return value


def _apply_env(raw: dict[str, Any], env: Mapping[str, str]) -> None:
    table = _variables()
    for variable in sorted(k for k in env if k.startswith(GATEWAY_ENV_PREFIX)):
        text = env[variable]
        if is_service_link(variable, text, env):
            continue
        if variable not in table:
            close = difflib.get_close_matches(variable, table, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"{variable}: unknown gateway variable{hint}")
        path, tp = table[variable]
        if tp is list:
            value: Any = [item.strip() for item in text.split(",") if item.strip()]
        elif path == ("worker_client", "headers"):  # (a key kept out of the file)
            value = _headers_of(variable, text)
        elif path == ("grpc", "restricted"):  # (as the file's: a JSON list of tables)
            value = _restricted_of(variable, text)
        else:
            try:
                value = parse_env_value(text, tp)
                # the field's own range (Meta constraints), named by the variable
                value = msgspec.convert(value, type=tp, strict=True)
            except ValueError as exc:  # (msgspec.ValidationError is one)
                message = reword(str(exc).removesuffix(" - at `$`"))
                raise ConfigError(f"{variable}={text!r}: {message}") from None
            if path[-1].endswith("_file") and isinstance(value, str):
                # relative to the working directory, as a node's variables are (the
                # file's own paths are relative to the file)
                value = os.path.abspath(os.path.expanduser(value))
        target = raw
        for key in path[:-1]:
            target = target.setdefault(key, {})
            if not isinstance(target, dict):
                raise ConfigError(f"{variable}: the file's {key} is not a table")
        target[path[-1]] = value


def gateway_file_sets(
    path: str | os.PathLike[str] | None, key: str, data: bytes | None = None
) -> bool:
    """Whether the gateway file at ``path`` (None: none; ``data``: its bytes, read
    already) sets the dotted ``key`` (``"grpc.max_message_bytes"``). Raises ConfigError
    when it cannot be read."""
    if path is None:
        return False
    value: Any = read_document(Path(path), data)
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return False
        value = value[part]
    return True


def load_gateway(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] = os.environ,
    data: bytes | None = None,
) -> GatewayConfig:
    """Read and check a gateway file (None: defaults only; ``data``: its bytes, read
    already, see :func:`read_document`), with ``INFERENCE_GATEWAY_*`` overrides from
    ``env`` applied over it. Checks: at least one endpoint, no endpoint
    twice, ``worker_names`` (when given) one per endpoint and unique, a per-model
    ``fill_mode`` or ``replicas`` well formed, TLS settings that go together. Raises
    ConfigError naming the file, the key or the variable."""
    where = "<gateway defaults>" if path is None else os.fspath(path)
    raw: dict[str, Any] = {} if path is None else read_document(Path(where), data)
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a table at the top level")
    listen = raw.get("listen")
    if isinstance(listen, dict) and listen.get("metrics") == "none":
        listen["metrics"] = None  # (TOML has no null)
    _apply_env(raw, env)
    config = convert(raw, GatewayConfig, where)
    if not config.endpoints and not config.endpoints_dns:
        raise ConfigError(
            f"{where}: no endpoints: list the workers as host:port in endpoints, or a name "
            f"resolving to all of them in endpoints_dns (or set {GATEWAY_ENV_PREFIX}ENDPOINTS)"
        )
    addresses = [(f"endpoints[{i}]", a) for i, a in enumerate(config.endpoints)]
    addresses += [(f"endpoints_dns[{i}]", a) for i, a in enumerate(config.endpoints_dns)]
    addresses.append(("listen.grpc", config.listen.grpc))
    if config.listen.metrics is not None:
        addresses.append(("listen.metrics", config.listen.metrics))
    for key, address in addresses:
        try:
            _, port = split_address(address)
        except ValueError as exc:
            raise ConfigError(f"{where}: $.{key}: {exc}") from None
        if port == 0 and key.startswith("endpoints"):
            raise ConfigError(f"{where}: $.{key}: {address!r} has no port")
    if len(set(config.endpoints)) != len(config.endpoints):
        raise ConfigError(f"{where}: an endpoint is listed twice in {config.endpoints}")
    names = config.worker_names
    if names and (len(names) != len(config.endpoints) or len(set(names)) != len(names)):
        raise ConfigError(
            f"{where}: worker_names must name each of the {len(config.endpoints)} endpoints "
            f"once; got {names}"
        )
    base = Path.cwd() if path is None else Path(where).absolute().parent
    config = _absolute_files(config, base)
    restricted = checked_restrictions(config.grpc.restricted, where, "grpc.restricted", base)
    config = msgspec.structs.replace(
        config, grpc=msgspec.structs.replace(config.grpc, restricted=restricted)
    )
    grpc = config.grpc
    if (grpc.tls_cert_file is None) != (grpc.tls_key_file is None):
        raise ConfigError(f"{where}: grpc.tls_cert_file and tls_key_file go together")
    if grpc.tls_client_ca_file is not None and grpc.tls_cert_file is None:
        raise ConfigError(f"{where}: grpc.tls_client_ca_file needs tls_cert_file and tls_key_file")
    client = config.worker_client
    if (client.tls_cert_file is None) != (client.tls_key_file is None):
        raise ConfigError(f"{where}: worker_client.tls_cert_file and tls_key_file go together")
    if client.tls_cert_file is not None and client.tls_ca_file is None:
        raise ConfigError(f"{where}: worker_client.tls_cert_file needs tls_ca_file")
    for name, value in client.headers.items():
        # (what a gRPC call may carry as metadata: every probe would fail otherwise)
        problem = metadata_problem(name, value)
        if problem is not None:
            raise ConfigError(f"{where}: $.worker_client.headers{key_segment(name)}: {problem}")
    return config


def _absolute_files(config: GatewayConfig, base: Path) -> GatewayConfig:
    """TLS file paths relative to the gateway file's directory made absolute."""

    def fix(section: msgspec.Struct) -> msgspec.Struct:
        changes = {
            f.name: os.path.normpath(base / os.path.expanduser(value))
            for f in msgspec.structs.fields(section)
            if f.name.endswith("_file") and (value := getattr(section, f.name)) is not None
        }
        return msgspec.structs.replace(section, **changes)

    return msgspec.structs.replace(
        config, grpc=fix(config.grpc), worker_client=fix(config.worker_client)
    )


def gateway_config_dict(config: GatewayConfig) -> dict[str, Any]:
    """``config`` as plain JSON data, for the startup log: the values of
    ``worker_client.headers`` and of ``grpc.restricted`` (a restricted protocol's key)
    are shown as ``"***"``."""
    data = msgspec.json.decode(msgspec.json.encode(config))
    headers = data["worker_client"]["headers"]
    data["worker_client"]["headers"] = dict.fromkeys(headers, "***")
    for block in data["grpc"]["restricted"]:
        if block["value"] is not None:
            block["value"] = "***"
    return data


def gateway_json_schema() -> dict[str, Any]:
    """JSON Schema of the gateway file, constraints and descriptions included."""
    return msgspec.json.schema(GatewayConfig)
