"""``rsrv node``: one process per worker of the node, kept running, stopped in order.

The process tree::

    rsrv node                      the supervisor: this module, admin HTTP on metrics_port
    ├── rsrv serve --worker worker0   one per worker, CUDA_VISIBLE_DEVICES = its device
    ├── rsrv serve --worker worker1
    ├── ...
    └── rsrv gateway                  two or more workers: on the node's public port

A one-worker node's worker listens on the node's public port itself, no gateway. Stopping
(SIGTERM or SIGINT): the front door first, then every worker drains and exits, each
within its grace period, after which it is killed. Exit status: 0 when every child
stopped by itself, 1 when the node gave up on a child or had to kill one, 2 for an
invalid configuration.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path

import msgspec
import trio

from rsrv.config import (
    DEFAULT_NODE_NAME,
    GATEWAY_ENV_PREFIX,
    GPUS_VARIABLE,
    ConfigError,
    GatewayConfig,
    NodePlan,
    WorkerConfig,
    gateway_file_sets,
    join_address,
    load_gateway,
    load_node,
    plan_node,
    read_config_bytes,
    unusable_tls,
)
from rsrv.lifeline import ConfigCopy, first_error, stop_signals
from rsrv.logsetup import configure_logging
from rsrv.node._admin import serve_node_admin
from rsrv.node._children import Child, ChildSpec
from rsrv.node._output import OutputSink, SinkStream, standard_output
from rsrv.protocol import Restriction, restrictions_of
from rsrv.transport import TLS_ERRORS, client_tls, server_tls

__all__ = ["Supervisor", "node_main"]

log = logging.getLogger("rsrv.node")
#: A stop signal repeated within this long is the same stop (see _watch_signals).
SAME_STOP_SECONDS = 0.1


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


def check_node_ports(plan: NodePlan, where: str) -> None:
    """The node's admin port (and, with two or more workers, its public port) must
    not be a port of any worker (gRPC, metrics, REST). Raises ConfigError naming
    ``where`` (the node file)."""
    taken: dict[int, str] = {}
    for worker in plan.workers:
        assert worker.endpoints.port is not None
        taken[worker.endpoints.port] = f"the gRPC port of worker {worker.name!r}"
        if worker.endpoints.metrics_port is not None:
            taken[worker.endpoints.metrics_port] = f"the metrics port of worker {worker.name!r}"
        if worker.endpoints.http_port is not None:
            taken[worker.endpoints.http_port] = f"the REST port of worker {worker.name!r}"
    if plan.metrics_port in taken:
        raise ConfigError(
            f"{where}: metrics_port {plan.metrics_port} is {taken[plan.metrics_port]}"
        )
    if plan.gateway:
        taken[plan.metrics_port] = "the node's metrics_port"
        if plan.port in taken:
            raise ConfigError(f"{where}: port {plan.port} (the gateway's) is {taken[plan.port]}")
        taken[plan.port] = "the gateway's port"
        if plan.gateway_metrics_port in taken:
            raise ConfigError(
                f"{where}: gateway.metrics_port {plan.gateway_metrics_port} is "
                f"{taken[plan.gateway_metrics_port]}"
            )


class Supervisor:
    """Runs the children of one node; see the module docstring."""

    def __init__(
        self,
        plan: NodePlan,
        specs: list[ChildSpec],
        output: tuple[OutputSink, OutputSink] | None = None,
    ):
        self.plan = plan
        self.output = output or standard_output()
        self.children = [Child(spec, plan.supervisor, self._give_up, self.output) for spec in specs]
        self.stopping = False
        self.failure: str | None = None
        self.forced = False  # a second stop signal killed the children
        self.started_at = 0.0
        self._stop_requested = trio.Event()

    @property
    def front_door(self) -> list[Child]:
        """The children clients connect to: the gateway when there is one, else the
        workers (with one worker, the node's public port is its own)."""
        gateways = [c for c in self.children if c.spec.kind == "gateway"]
        return gateways or self.children

    @property
    def ready(self) -> bool:
        """The front door serves: the gateway, with at least one worker ready behind it
        by the worker's own report (the gateway also routes to a worker still loading
        models, which serves what it has); a one-worker node, its worker."""
        if self.stopping or not all(c.ready for c in self.front_door):
            return False
        return any(c.ready for c in self.children if c.spec.kind == "worker")

    def _give_up(self, reason: str) -> None:
        self.failure = self.failure or reason
        self._stop_requested.set()

    async def run(self) -> int:
        """Supervise until a signal or a failure; returns the exit status. Output is
        written by its own tasks meanwhile (``OutputSink``), and flushed at the end (for
        at most 2 s)."""
        async with trio.open_nursery() as writers:
            for sink in self.output:
                await writers.start(sink.run)
            try:
                return await self._supervise()
            finally:
                with trio.move_on_after(2.0) as flushing:
                    flushing.shield = True
                    for sink in self.output:
                        await sink.flushed()
                writers.cancel_scope.cancel()

    async def _supervise(self) -> int:
        self.started_at = trio.current_time()
        with trio.open_signal_receiver(*stop_signals()) as signals:  # (SIGHUP: a closed terminal)
            async with trio.open_nursery() as nursery:
                admin = join_address(self.plan.host, self.plan.metrics_port)
                unbound: BaseException | None = None
                try:
                    await nursery.start(
                        serve_node_admin, self, self.plan.host, self.plan.metrics_port
                    )
                except* OSError as group:  # nothing started yet: one line, a failed start
                    unbound = first_error(group)
                if unbound is not None:
                    log.error("node admin HTTP: cannot listen on %s: %s", admin, unbound)
                    return 1
                log.info("node admin HTTP on %s", admin)
                for child in self.children:
                    nursery.start_soon(child.run)
                nursery.start_soon(self._watch_signals, signals)
                await self._stop_requested.wait()
                await self._stop_children()
                nursery.cancel_scope.cancel()
        if self.failure is not None:
            log.error("node stopped: %s", self.failure)
            return 1
        killed = [c.name for c in self.children if c.killed]
        if self.forced and not killed:
            log.error("node stopped on a second signal")
            return 1
        if killed:
            log.error(
                "node stopped; killed (past their grace period, or on a second signal): %s",
                ", ".join(killed),
            )
            return 1
        broke_off = [f"{c.name} ({c.broke_off})" for c in self.children if c.broke_off]
        if broke_off:
            log.error("node stopped; did not drain and exit by itself: %s", ", ".join(broke_off))
            return 1
        log.info("node stopped: every child drained and exited")
        return 0

    async def _watch_signals(self, signals) -> None:
        """The first SIGTERM / SIGINT / SIGHUP stops the node gracefully; a second one
        kills every child at once (an impatient Ctrl-C). Another stop signal within
        SAME_STOP_SECONDS of the first is the same stop delivered twice (GNU ``timeout``
        signals the node and then its process group; a closing session sends SIGHUP and
        SIGTERM), not a second one."""
        first: float | None = None
        async for signum in signals:
            name = signal.Signals(signum).name
            if first is None:
                first = trio.current_time()
                log.info("received %s: stopping the node", name)
                self._stop_requested.set()
                continue
            if trio.current_time() - first < SAME_STOP_SECONDS:
                log.info("received %s at once after the first: the same stop", name)
                continue
            log.warning("received %s, a second stop signal: killing every child now", name)
            self.forced = True
            for child in self.children:
                child.kill()

    async def _stop_children(self) -> None:
        """The front door stops first (it stops accepting); then the rest, together. No
        child is restarted meanwhile."""
        self.stopping = True
        for child in self.children:
            child.keep_down()
        front = [c for c in self.children if c.spec.kind == "gateway"]
        for group in (front, [c for c in self.children if c not in front]):
            async with trio.open_nursery() as nursery:
                for child in group:
                    nursery.start_soon(child.stop)


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


def node_main(node_file: str | None) -> int:
    """Entry point of ``rsrv node``: plan the node, then supervise it under trio."""
    try:
        data = None if node_file is None else read_config_bytes(node_file)
        node = load_node(node_file, data)
        plan = plan_node(node, os.environ, source=None if node_file is None else Path(node_file))
        check_node_ports(plan, DEFAULT_NODE_NAME if node_file is None else node_file)
        env = dict(os.environ)
        specs = [worker_spec(plan, worker, node_file, env, data) for worker in plan.workers]
        gateway_config = None
        if plan.gateway:
            gateway, gateway_config = gateway_spec(plan, env)
            specs.append(gateway)
        check_tls(plan, gateway_config)
    except ConfigError as e:
        print(f"rsrv: {e}", file=sys.stderr)
        return 2
    output = standard_output()
    # (as resolved, environment included, as the gateway's: the first worker's)
    logging_config = plan.workers[0].logging if plan.workers else node.global_.logging
    configure_logging(
        "node", logging_config.level, logging_config.format, stream=SinkStream(output[1])
    )
    for warning in [] if gateway_config is None else gateway_warnings(plan, gateway_config):
        log.warning("%s", warning)
    if plan.device_source:
        log.info("devices: %s (from %s)", ", ".join(plan.devices) or "none", plan.device_source)
    for spec in specs:
        log.info(
            "%s %s: port %d%s",
            spec.kind,
            spec.name,
            spec.port,
            f", device {spec.device or 'none'}" if spec.kind == "worker" else "",
        )
    return trio.run(Supervisor(plan, specs, output).run)
