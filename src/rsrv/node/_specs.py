"""How ``rsrv node`` runs each child: a worker's or the gateway's command line,
environment and configuration, and the checks that stop the node before it starts
anything when a child could not serve.

The gateway in front of the workers gets, from the node and unless its own file or the
environment says otherwise, what makes it serve as they do: their message limit and
logging, their TLS on the node's port, the keys of their restricted protocols for its
own calls, and their restrictions at its front door (specs/node.md).
"""

from __future__ import annotations

import json
import os
import sys

import msgspec

from rsrv.config import (
    GATEWAY_ENV_PREFIX,
    GPUS_VARIABLE,
    ConfigError,
    GatewayConfig,
    NodePlan,
    WorkerConfig,
    gateway_file_sets,
    join_address,
    load_gateway,
    read_config_bytes,
    unusable_tls,
)
from rsrv.lifeline import ConfigCopy
from rsrv.node._children import ChildSpec
from rsrv.protocol import Restriction, restrictions_of
from rsrv.transport import TLS_ERRORS, client_tls, server_tls

__all__ = ["check_tls", "dialled", "gateway_spec", "gateway_warnings", "worker_spec"]


def worker_spec(
    plan: NodePlan,
    worker: WorkerConfig,
    node_file: str | None,
    base_env: dict[str, str],
    node_data: bytes | None = None,
) -> ChildSpec:
    """How to run ``worker`` of ``plan``: ``rsrv serve`` with the node's own file (read
    from ``node_data``, its bytes as the node read them, when given) and environment,
    plus the device it may see."""
    argv = [sys.executable, "-m", "rsrv.cli", "serve"]
    if node_file is not None:
        argv.append(os.path.abspath(node_file))
    argv += ["--worker", worker.name]
    env = {**base_env, "PYTHONUNBUFFERED": "1"}
    if plan.device_source:
        # The child plans the node again: it must find the same devices (its own
        # CUDA_VISIBLE_DEVICES would show it one) and so the same workers. Ordinals go
        # as cuda:N: a lone "3" would read as a count of three devices.
        env[GPUS_VARIABLE] = ",".join(cuda_names(plan.devices)) or "0"
    if worker.gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = worker.gpu
    assert worker.endpoints.port is not None
    return ChildSpec(
        name=worker.name,
        kind="worker",
        argv=argv,
        env=env,
        grace=worker.endpoints.shutdown_grace_seconds + plan.supervisor.kill_after_seconds,
        port=worker.endpoints.port,
        device=worker.gpu,
        config=None
        if node_file is None or node_data is None
        else ConfigCopy(os.path.abspath(node_file), node_data),
    )


def dialled(host: str) -> str:
    """Where to reach a server listening on ``host`` from this machine (loopback for a
    wildcard address)."""
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)


def cuda_names(devices: list[str]) -> list[str]:
    """``devices`` as INFERENCE_SERVER_GPUS lists them unambiguously (ordinals as cuda:N)."""
    return [f"cuda:{d}" if d.isdigit() else d for d in devices]


#: The protocols of the gateway's own calls to its workers: probes (ServerReady,
#: RepositoryIndex, ModelControlStatus), catch-up (loads, shared memory, settings), the
#: CompactMemory after a repack.
_GATEWAY_CALLS = frozenset(
    {"health", "model-repository", "control", "shared-memory", "logging", "trace"}
)


#: Those without which the gateway cannot see a worker at all (ServerReady, RepositoryIndex).
_GATEWAY_SIGHT = frozenset({"health", "model-repository"})


def _worker_keys(by_worker: dict[str, list[Restriction]]) -> dict[str, str]:
    """The headers the gateway's own calls must carry, with their values: those of the
    workers' restrictions of a protocol it calls itself (a key only clients hold, say
    inference's, is not the gateway's). A header needing two values is left out, but
    for the one of the protocols it sees the workers by (their key wins), which two
    values stop the node (ConfigError): it would never see them ready. Calls left
    without their key are warned about (:func:`gateway_warnings`)."""
    keys: dict[str, dict[str, set[str]]] = {}  # header -> value -> "worker: protocols"
    sight: dict[str, set[str]] = {}  # header -> values of _GATEWAY_SIGHT protocols
    for name, restrictions in by_worker.items():
        for r in restrictions:
            if r.protocols & _GATEWAY_CALLS:
                where = f"{name}: {', '.join(sorted(r.protocols))}"
                keys.setdefault(r.header, {}).setdefault(r.value, set()).add(where)
            if r.protocols & _GATEWAY_SIGHT:
                sight.setdefault(r.header, set()).add(r.value)
    chosen = {}
    for header, values in keys.items():
        seen = sight.get(header, set())
        if len(seen) > 1:
            places = "; ".join(sorted(w for v in seen for w in values[v]))
            raise ConfigError(
                f"the workers restrict the protocols their gateway sees them by (health, "
                f"model-repository) under header {header!r} with different values ({places}): "
                "it would never see them all ready; give them one key (or the gateway its "
                "own worker_client.headers in its file, for the workers it should see)"
            )
        if seen or len(values) == 1:
            (chosen[header],) = seen or values
    return chosen


def _gateway_restrictions(by_worker: dict[str, list[Restriction]]) -> list[dict]:
    """The gateway's ``grpc.restricted``: the workers' blocks when every worker has the
    same (it answers ServerLive and ServerReady itself, which they may restrict), its own
    control service under their control key; else that control key alone. Holding their
    control key, the gateway must not leave its own control service open: a client's
    repack would send the workers a CompactMemory under that key. Raises ConfigError when
    the workers restrict control under different keys (no one key for gateway-control)."""
    lists = {frozenset((r.protocols, r.header, r.value) for r in rs) for rs in by_worker.values()}
    blocks = []
    if len(lists) == 1:
        (same,) = lists
        for protocols, header, value in sorted(same, key=lambda block: sorted(block[0])):
            named = sorted(protocols) + (["gateway-control"] if "control" in protocols else [])
            blocks.append({"protocols": named, "header": header, "value": value})
        return blocks
    every = [r for rs in by_worker.values() for r in rs]
    control = {(r.header, r.value) for r in every if "control" in r.protocols}
    if len(control) > 1:
        raise ConfigError(
            "the workers restrict control under different keys, so the node cannot restrict "
            "its gateway's own control service (gateway-control) as they do: give it one in "
            "the gateway file (grpc.restricted)"
        )
    if control:
        ((header, value),) = control
        blocks.append({"protocols": ["gateway-control"], "header": header, "value": value})
    return blocks


def gateway_warnings(plan: NodePlan, config: GatewayConfig) -> list[str]:
    """What the node says of its gateway's configuration once its logging is set up:
    its own calls a worker will refuse for their key, mutual TLS it drops."""
    warnings = []
    headers = config.worker_client.headers
    for worker in plan.workers:
        key = f"worker {worker.name!r}: endpoints.restricted"
        for r in restrictions_of(worker.endpoints.restricted, key):
            called = r.protocols & _GATEWAY_CALLS
            if called and headers.get(r.header) != r.value:
                warnings.append(
                    f"worker {worker.name} will refuse its gateway's own "
                    f"{', '.join(sorted(called))} calls (header {r.header!r}: "
                    f"{'another value' if r.header in headers else 'not sent'}); set "
                    "worker_client.headers in the gateway file to give it the key"
                )
    if config.grpc.tls_client_ca_file is None and any(
        w.endpoints.tls_client_ca_file is not None for w in plan.workers
    ):
        warnings.append(
            "the workers ask clients for certificates, the gateway (TLS settings of its own) "
            "does not: set grpc.tls_client_ca_file in the gateway file for the node's port"
        )
    return warnings


_TLS_KEYS = ("tls_cert_file", "tls_key_file", "tls_client_ca_file")


def _inherited_tls(plan: NodePlan, base_env: dict[str, str], data: bytes | None) -> dict:
    """The gateway's ``grpc.tls_*``, as its workers serve TLS: the node's port is the
    gateway's, and TLS set for the node must not leave it in the clear. Empty when
    its file or the environment gives it TLS settings of its own. Raises ConfigError when
    the workers serve TLS differently."""
    for key in _TLS_KEYS:
        if _given(plan, base_env, data, f"grpc.{key}", f"{GATEWAY_ENV_PREFIX}GRPC_{key.upper()}"):
            return {}
    served = {tuple(getattr(w.endpoints, key) for key in _TLS_KEYS) for w in plan.workers}
    if len(served) > 1:
        raise ConfigError(
            "the workers serve TLS differently, so their gateway cannot serve it as they "
            "do: give it its own (grpc.tls_cert_file and tls_key_file in the gateway file)"
        )
    (values,) = served
    return {
        f"grpc.{key}": value
        for key, value in zip(_TLS_KEYS, values, strict=True)
        if value is not None
    }


def gateway_spec(plan: NodePlan, base_env: dict[str, str]) -> tuple[ChildSpec, GatewayConfig]:
    """How to run the gateway in front of ``plan``'s workers: ``rsrv gateway`` with the
    node's gateway file (if any: read here once, and its bytes handed down), listening on
    the node's public port, the workers as its endpoints (each at its own host and
    port); and the configuration it will read (loaded here, so its errors stop the node
    before anything starts: ConfigError)."""
    argv = [sys.executable, "-m", "rsrv.cli", "gateway"]
    data = None
    if plan.gateway_file is not None:
        argv.append(plan.gateway_file)
        data = read_config_bytes(plan.gateway_file)
    endpoints = [join_address(dialled(w.endpoints.host), w.endpoints.port) for w in plan.workers]
    env = {
        **base_env,
        "PYTHONUNBUFFERED": "1",
        f"{GATEWAY_ENV_PREFIX}LISTEN_GRPC": join_address(plan.host, plan.port),
        f"{GATEWAY_ENV_PREFIX}LISTEN_METRICS": "none"
        if plan.gateway_metrics_port is None
        else join_address(plan.host, plan.gateway_metrics_port),
        f"{GATEWAY_ENV_PREFIX}ENDPOINTS": ",".join(endpoints),
        f"{GATEWAY_ENV_PREFIX}ENDPOINTS_DNS": "",  # the node's workers, and only they
        f"{GATEWAY_ENV_PREFIX}WORKER_NAMES": ",".join(w.name for w in plan.workers),
    }
    # The gateway accepts what its workers accept, logs as they do, and serves TLS
    # (client certificates too) as they do, unless its file or the environment says
    # otherwise.
    inherited = {
        "grpc.max_message_bytes": max(w.endpoints.max_message_bytes for w in plan.workers),
        "logging.format": plan.workers[0].logging.format,
        "logging.level": plan.workers[0].logging.level,
        **_inherited_tls(plan, base_env, data),
    }
    for key, value in inherited.items():
        if not gateway_file_sets(plan.gateway_file, key, data):
            variable = GATEWAY_ENV_PREFIX + key.replace(".", "_").upper()
            env.setdefault(variable, str(value))
    by_worker = {
        w.name: restrictions_of(w.endpoints.restricted, f"worker {w.name!r}: endpoints.restricted")
        for w in plan.workers
    }
    # Its own calls (probes, catch-up) carry the workers' restricted-protocol keys:
    # RepositoryIndex, say, is model-repository's, and without the key no worker looked
    # ready. (JSON: a key may hold any character.)
    headers = f"{GATEWAY_ENV_PREFIX}WORKER_CLIENT_HEADERS"
    if not _given(plan, base_env, data, "worker_client.headers", headers):
        keys = _worker_keys(by_worker)
        if keys:
            env[headers] = json.dumps(keys)
    own = f"{GATEWAY_ENV_PREFIX}GRPC_RESTRICTED"
    if not _given(plan, base_env, data, "grpc.restricted", own):
        blocks = _gateway_restrictions(by_worker)
        if blocks:
            env[own] = json.dumps(blocks)
    # It drains at least as long as its workers may (its own longer grace stands; so
    # does one set in the environment), and is given that long before SIGKILL.
    drain = f"{GATEWAY_ENV_PREFIX}GRPC_SHUTDOWN_GRACE_SECONDS"
    config = load_gateway(plan.gateway_file, env, data)
    grace = config.grpc.shutdown_grace_seconds
    workers = max(w.endpoints.shutdown_grace_seconds for w in plan.workers)
    if drain not in base_env and grace < workers:
        env[drain], grace = str(workers), workers
        grpc = msgspec.structs.replace(config.grpc, shutdown_grace_seconds=workers)
        config = msgspec.structs.replace(config, grpc=grpc)
    spec = ChildSpec(
        name="gateway",
        kind="gateway",
        argv=argv,
        env=env,
        grace=grace + plan.supervisor.kill_after_seconds,
        port=plan.port,
        config=None if data is None else ConfigCopy(plan.gateway_file, data),
    )
    return spec, config


def _given(plan: NodePlan, env: dict[str, str], data: bytes | None, key: str, variable: str):
    """Whether the gateway's file (its bytes ``data``) or the environment sets ``key``."""
    return variable in env or gateway_file_sets(plan.gateway_file, key, data)


def check_tls(plan: NodePlan, gateway: GatewayConfig | None) -> None:
    """Build the TLS contexts the children will build, so that a file that cannot be
    read or used stops the node before it starts anything. Raises ConfigError."""
    for worker in plan.workers:
        try:
            server_tls(worker.endpoints)
        except TLS_ERRORS as e:
            raise unusable_tls(worker.endpoints.tls_files(), e, f"worker {worker.name}") from None
    if gateway is not None:
        try:
            server_tls(gateway.grpc)
            client_tls(gateway.worker_client)
        except TLS_ERRORS as e:
            raise unusable_tls(gateway.tls_files(), e, "gateway") from None
        _check_gateway_dials(plan, gateway)


def _check_gateway_dials(plan: NodePlan, gateway: GatewayConfig) -> None:
    """ConfigError when the gateway could not call a worker that serves TLS (no
    ``worker_client.tls_ca_file``) or asks for client certificates (no
    ``tls_cert_file``): no worker would ever look ready to it, each probe failing in
    its handshake."""
    client = gateway.worker_client
    for worker in plan.workers:
        endpoints = worker.endpoints
        needs, key = None, None
        if endpoints.tls_cert_file is not None and client.tls_ca_file is None:
            needs, key = "serves TLS", "worker_client.tls_ca_file (the CA that signed it)"
        elif endpoints.tls_client_ca_file is not None and client.tls_cert_file is None:
            needs, key = (
                "asks for client certificates",
                "worker_client.tls_cert_file and tls_key_file (signed by its client CA)",
            )
        if needs is not None:
            raise ConfigError(
                f"worker {worker.name!r} {needs}, which its gateway cannot call: set {key} "
                "in the gateway file (gateway.file in the node file)"
            )
