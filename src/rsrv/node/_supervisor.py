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

import logging
import os
import signal
import sys
from pathlib import Path

import trio

from rsrv.config import (
    DEFAULT_NODE_NAME,
    ConfigError,
    NodePlan,
    join_address,
    load_node,
    plan_node,
    read_config_bytes,
)
from rsrv.lifeline import first_error, stop_signals
from rsrv.logsetup import configure_logging
from rsrv.node._admin import serve_node_admin
from rsrv.node._children import Child, ChildSpec
from rsrv.node._output import OutputSink, SinkStream, standard_output
from rsrv.node._specs import check_tls, gateway_spec, gateway_warnings, worker_spec

__all__ = ["Supervisor", "node_main"]

log = logging.getLogger("rsrv.node")
#: A stop signal repeated within this long is the same stop (see _watch_signals).
SAME_STOP_SECONDS = 0.1


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
        at most 2 s). Stop signals are watched until then: one during the flush changes
        nothing (Python's default would end the node by that signal)."""
        with trio.open_signal_receiver(*stop_signals()) as signals:  # (SIGHUP: a closed terminal)
            async with trio.open_nursery() as writers:
                for sink in self.output:
                    await writers.start(sink.run)
                try:
                    return await self._supervise(signals)
                finally:
                    with trio.move_on_after(2.0) as flushing:
                        flushing.shield = True
                        for sink in self.output:
                            await sink.flushed()
                    writers.cancel_scope.cancel()

    async def _supervise(self, signals) -> int:
        self.started_at = trio.current_time()
        async with trio.open_nursery() as nursery:
            admin = join_address(self.plan.host, self.plan.metrics_port)
            unbound: BaseException | None = None
            try:
                await nursery.start(serve_node_admin, self, self.plan.host, self.plan.metrics_port)
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
    try:
        return trio.run(Supervisor(plan, specs, output).run)
    finally:  # stopped: a stop signal as the process exits changes nothing
        for signum in stop_signals():
            signal.signal(signum, signal.SIG_IGN)
