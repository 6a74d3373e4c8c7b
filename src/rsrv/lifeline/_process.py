"""Running a serving process (a worker, a gateway) from start to exit status.

Signals, the supervisor link and the exit status are the same for every rsrv server
process: SIGINT and SIGTERM start its graceful shutdown; under ``rsrv node`` its status
goes up the link; a port that cannot be bound is one line and exit status 1.
"""

from __future__ import annotations

import gc
import logging
import resource
import signal
import sys
from collections.abc import Callable
from typing import Protocol

import trio

from rsrv.lifeline._lifeline import ChildStatus, SupervisorLink
from rsrv.transport import is_listen_error

__all__ = ["Server", "first_error", "serve_process"]

log = logging.getLogger("rsrv.lifeline")


class Server(Protocol):
    """A server process's root: ``run`` starts its task tree (``started()`` once it
    serves); ``shutdown`` stops it gracefully, at any time after ``run`` was called
    (during its start-up too)."""

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None: ...

    async def shutdown(self) -> None: ...


def serve_process(name: str, server: Server, status: Callable[[], ChildStatus]) -> int:
    """Run ``server`` until a signal has stopped it. Returns the exit status: 0 after
    a graceful stop, 1 (after one line on stderr) when a port cannot be bound or its
    host name does not resolve."""
    _raise_descriptor_limit()
    unbound = None
    try:
        trio.run(_serve_until_signal, server, status)
    except* OSError as group:
        unbound, rest = group.split(is_listen_error)
        if rest is not None:
            raise
    if unbound is not None:
        # One line, and an exit status a supervisor restarts after (the port may free up).
        print(f"rsrv: {name}: cannot listen: {first_error(unbound)}", file=sys.stderr)
        return 1
    return 0


async def _serve_until_signal(server: Server, status: Callable[[], ChildStatus]) -> None:
    """Serve until SIGINT / SIGTERM (which the supervisor link also sends when the
    supervisor is gone). Both are watched from the start: a signal stops the server
    gracefully (``shutdown``: what it accepted is answered), during start-up too (a
    worker listens while its models load), and the start-up is then cancelled."""
    stopping = False
    serving = False

    def reported() -> ChildStatus:  # (ready only once it serves, until it stops)
        current = status()
        return ChildStatus(ready=current.ready and serving and not stopping, port=current.port)

    async def start() -> None:
        nonlocal serving
        await nursery.start(server.run)
        # What start-up built (modules, bundles, compiled models) lives as long as the
        # process: out of the cyclic collector's passes, which then cost less per
        # request (figure 1: +10% req/s at c = 32 under h2load, paired).
        gc.collect()
        gc.freeze()
        serving = True

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(SupervisorLink(reported).run)
            nursery.start_soon(start)
            async for signum in signals:
                name = signal.Signals(signum).name
                stopping = True
                during = "" if serving else " (while starting)"
                log.info("received %s%s: shutting down gracefully", name, during)
                await server.shutdown()
                nursery.cancel_scope.cancel()
                return


def first_error(error: BaseException) -> BaseException:
    """The first exception inside ``error``'s (nested) groups; ``error`` if none."""
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def _raise_descriptor_limit() -> None:
    """Raise the soft limit on open descriptors to the hard one: every connection
    holds one, and 1024 is a common soft default."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            return
        log.info("open descriptor limit raised from %d to %d", soft, hard)
