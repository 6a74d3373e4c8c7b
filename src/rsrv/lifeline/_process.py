"""Running a serving process (a worker, a gateway) from start to exit status.

Signals, the supervisor link and the exit status are the same for every rsrv server
process: SIGINT, SIGTERM and SIGHUP start its graceful shutdown (a stop signal during
that stop, or as the process exits, changes nothing: GNU ``timeout`` sends one twice, a
closing session SIGHUP and SIGTERM; a SIGHUP ignored at start, ``nohup``, stays so);
under ``rsrv node`` its status goes up the link; a port that cannot be bound is one line
and exit status 1. From :func:`hold_stop_signals` on (the entry point calls it before
its slow imports), a stop signal that comes before the server runs is kept for it: the
server then starts and stops gracefully at once; a second one during that start-up ends
the process as the signal would (a start-up that hangs can still be ended).
"""

from __future__ import annotations

import gc
import logging
import os
import resource
import signal
import sys
from collections.abc import Callable
from typing import Protocol

import trio

from rsrv.lifeline._lifeline import ChildStatus, SupervisorLink
from rsrv.transport import is_listen_error

__all__ = [
    "Server",
    "first_error",
    "hold_stop_signals",
    "release_stop_signals",
    "serve_process",
    "stop_signals",
]

log = logging.getLogger("rsrv.lifeline")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def stop_signals() -> tuple[signal.Signals, ...]:
    """The stop signals this process heeds: SIGTERM, and SIGINT and SIGHUP unless it was
    started ignoring them (``nohup`` ignores SIGHUP, a shell's background job SIGINT, and
    Python itself leaves an ignored SIGINT ignored)."""
    return tuple(
        s for s in STOP_SIGNALS if s == signal.SIGTERM or signal.getsignal(s) is not signal.SIG_IGN
    )


class _Stop:
    """The process's stop, as far as the signal handlers outside trio know it."""

    early: int | None = None  # a stop signal received before the server watched them
    stopping = False  # the graceful stop has begun: stop signals change nothing now


def hold_stop_signals() -> None:
    """Keep a stop signal that comes before :func:`serve_process` watches them (see the
    module docstring). Idempotent."""
    for signum in stop_signals():
        signal.signal(signum, _held)


def release_stop_signals() -> None:
    """Python's own handling of the stop signals again (a command that turned out to be
    no server); one held meanwhile is delivered now."""
    early, _Stop.early = _Stop.early, None
    for signum in stop_signals():
        signal.signal(
            signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
        )
    if early is not None:
        os.kill(os.getpid(), early)


def _held(signum: int, frame) -> None:
    if _Stop.stopping:
        return
    if _Stop.early is not None:  # twice before the server ran: as the signal would
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _Stop.early = signum


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
    # Outside trio's watch, before and after it, _held has them (see the module
    # docstring); what held them before comes back on return (the entry point's own
    # hold_stop_signals, in a process: a signal at exit changes nothing either).
    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    hold_stop_signals()
    unbound = None
    try:
        trio.run(_serve_until_signal, server, status)
    except* OSError as group:
        unbound, rest = group.split(is_listen_error)
        if rest is not None:
            raise
    finally:
        for signum, handler in before.items():
            # Held by the entry point, the process ends now: ignored from here (Python's
            # exit gives the default back to a handler it set, and a repeated stop signal
            # then ended the process by that signal, after its graceful stop).
            signal.signal(signum, signal.SIG_IGN if handler is _held else handler)
    if unbound is not None:
        # One line, and an exit status a supervisor restarts after (the port may free up).
        print(f"rsrv: {name}: cannot listen: {first_error(unbound)}", file=sys.stderr)
        return 1
    return 0


async def _serve_until_signal(server: Server, status: Callable[[], ChildStatus]) -> None:
    """Serve until a stop signal (SIGTERM is what the supervisor link also sends when
    the supervisor is gone), or one held from before (:func:`hold_stop_signals`). They
    are watched from the start: a signal stops the server
    gracefully (``shutdown``: what it accepted is answered), during start-up too (a
    worker listens while its models load), and the start-up is then cancelled."""
    serving = False
    _Stop.stopping = False  # (stays True once set: later signals, at exit, change nothing)

    def reported() -> ChildStatus:  # (ready only once it serves, until it stops)
        current = status()
        ready = current.ready and serving and not _Stop.stopping
        return ChildStatus(ready=ready, port=current.port)

    run_called = trio.Event()  # (the server's shutdown is for after its run was called)

    async def start() -> None:
        nonlocal serving
        run_called.set()
        await nursery.start(server.run)
        # What start-up built (modules, bundles, compiled models) lives as long as the
        # process: out of the cyclic collector's passes, which then cost less per
        # request (figure 1: +10% req/s at c = 32 under h2load, paired).
        gc.collect()
        gc.freeze()
        serving = True

    async def stop(signum: int) -> None:
        await run_called.wait()
        during = "" if serving else " (while starting)"
        log.info("received %s%s: shutting down gracefully", signal.Signals(signum).name, during)
        await server.shutdown()
        nursery.cancel_scope.cancel()

    with trio.open_signal_receiver(*stop_signals()) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(SupervisorLink(reported).run)
            nursery.start_soon(start)
            if _Stop.early is not None:  # (consumed: the stop it asked for is this one)
                _Stop.stopping = True
                nursery.start_soon(stop, _Stop.early)
                _Stop.early = None
            async for signum in signals:
                if _Stop.stopping:
                    log.info("received %s: the graceful stop goes on", signal.Signals(signum).name)
                    continue
                _Stop.stopping = True
                nursery.start_soon(stop, signum)


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
