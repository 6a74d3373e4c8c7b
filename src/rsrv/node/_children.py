"""One supervised child process: started, watched, restarted with backoff, stopped.

A :class:`Child` runs as one trio task (:meth:`Child.run`) for the life of the node.
Each incarnation is a process in its own session (a terminal's Ctrl-C reaches the
supervisor alone, which stops the children in order) whose stdout and stderr are
forwarded line by line and whose supervisor link (``rsrv.lifeline``) says when it
serves, and tells it when the supervisor is gone. The process is never left behind:
a task cancelled for any reason kills what it started.
"""

from __future__ import annotations

import enum
import logging
import signal
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from rsrv.config import SupervisorConfig
from rsrv.lifeline import (
    LINK_FD_VARIABLE,
    LINK_GRACE_VARIABLE,
    ConfigCopy,
    HandedDownConfig,
    read_status,
)
from rsrv.node._output import OutputSink, forward_lines

__all__ = ["FATAL_EXIT", "Child", "ChildSpec", "ChildState", "restart_delay"]

log = logging.getLogger("rsrv.node")

#: The exit status of a child whose configuration or device is unusable: restarting
#: cannot help, so the node stops (``rsrv serve`` exits 2 for these).
FATAL_EXIT = 2


@dataclass(frozen=True)
class ChildSpec:
    """How to run one child. ``grace``: seconds from SIGTERM to SIGKILL. ``config``: the
    configuration file named in ``argv``, as the node read it at start; every process of
    the child reads these bytes (see rsrv.lifeline.HandedDownConfig)."""

    name: str
    kind: str  # "worker" or "gateway"
    argv: list[str]
    env: dict[str, str]
    grace: float
    port: int
    device: str | None = None
    config: ConfigCopy | None = None


class ChildState(enum.Enum):
    STARTING = "starting"  # started, not serving yet
    SERVING = "serving"  # ready
    NOT_READY = "not_ready"  # has served, not ready now (loading in explicit mode, draining)
    BACKOFF = "backoff"  # exited; waiting to be restarted
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"  # will not be restarted


def restart_delay(restarts: int, policy: SupervisorConfig) -> float:
    """Seconds before restart number ``restarts`` (1, 2, ...) of a run of crashes:
    backoff_seconds doubled each time, at most max_backoff_seconds."""
    doublings = min(restarts - 1, 64)  # (2.0 ** 1024 overflows; any cap is reached by then)
    return min(policy.backoff_seconds * 2.0**doublings, policy.max_backoff_seconds)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


@dataclass
class Child:
    """The live state of one child; :meth:`run` supervises it until :meth:`stop`.

    ``on_give_up(reason)`` is called once when the child will not be restarted (the
    restart limit, or a fatal exit); the supervisor then stops the node. ``output``:
    where the child's stdout and stderr lines go.
    """

    spec: ChildSpec
    policy: SupervisorConfig
    on_give_up: Callable[[str], None]
    output: tuple[OutputSink, OutputSink]
    state: ChildState = ChildState.STARTING
    pid: int | None = None
    ready: bool = False
    restarts: int = 0  # in the current run of crashes
    restarts_total: int = 0
    last_exit: str | None = None
    killed: bool = False  # SIGKILLed: it outlived its grace period, or a second signal
    # how it ended while the node stopped it, when not by itself (exit 0) nor by the
    # node's own signals: a signal from elsewhere (the OOM killer), a failed drain; or
    # how it had ended before, when the stop found it waiting to be restarted
    broke_off: str | None = None
    timed_out: bool = False  # its last start did not serve within startup_timeout_seconds
    served: bool = False  # its last start reported ready at some point
    started_at: float = 0.0
    _stop: trio.Event = field(default_factory=trio.Event)
    _down: bool = False  # not restarted when it exits (the node is stopping)
    _process: trio.Process | None = None
    _incarnation: trio.Event | None = None  # set once the process being started has exited
    _halt: trio.Event | None = None  # the running process's: set, it is stopped

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def alive(self) -> bool:
        """A process of this child is running."""
        return self._process is not None

    async def run(self) -> None:
        """Start the child and keep it running until :meth:`stop` (or giving up, or
        exiting after :meth:`keep_down`)."""
        while not self._stop.is_set():
            code = await self._run_once()
            if self._stop.is_set() or self._down:
                break
            uptime = trio.current_time() - self.started_at
            if code == FATAL_EXIT:
                self._give_up(
                    f"{self.name} cannot start ({self.last_exit}: its configuration or device "
                    "is unusable; see its last lines above); not restarting"
                )
                return
            if uptime >= self.policy.stable_seconds and self.served and not self.timed_out:
                self.restarts = 0  # (one that never served has not been stable)
            self.restarts += 1
            if self.restarts > self.policy.max_restarts:
                how = (
                    f"stopped {self.restarts} time(s) in a row, the last one not serving "
                    f"{self.policy.startup_timeout_seconds:g} s after starting "
                    "(supervisor.startup_timeout_seconds)"
                    if self.timed_out
                    else f"exited {self.restarts} time(s) in a row, each within "
                    f"{self.policy.stable_seconds:g} s of starting or before serving; "
                    f"last: {self.last_exit}"
                )
                self._give_up(
                    f"{self.name} {how} (limit supervisor.max_restarts = "
                    f"{self.policy.max_restarts}); giving up"
                )
                return
            delay = restart_delay(self.restarts, self.policy)
            log.warning("restarting %s in %.1f s (restart %d)", self.name, delay, self.restarts)
            self.state = ChildState.BACKOFF
            with trio.move_on_after(delay):
                await self._stop.wait()
            if self._stop.is_set():  # stopped while down after a crash: it never drained
                self.broke_off = f"{self.last_exit}, then waiting to be restarted"
            else:
                self.restarts_total += 1
        self.state = ChildState.STOPPED

    def keep_down(self) -> None:
        """Do not restart it when it exits from now on (the node is stopping); one
        waiting to be restarted stops waiting."""
        self._down = True
        if self.state is ChildState.BACKOFF:  # (no process: nothing to stop but the wait)
            self._stop.set()

    def kill(self) -> None:
        """SIGKILL the running process now, if there is one (a second stop signal)."""
        if self._process is not None and self._process.returncode is None:
            self.killed = True
            self._process.kill()

    def _give_up(self, reason: str) -> None:
        log.error("%s", reason)
        self.state = ChildState.FAILED
        self.on_give_up(reason)

    async def _run_once(self) -> int | None:
        """One incarnation: start, forward output and status, wait for the exit; stop it
        (SIGTERM, then SIGKILL after the grace period) once :meth:`stop` is called.
        Returns the exit status, or None when no process could be started."""
        self._incarnation = exited = trio.Event()
        try:
            return await self._start_and_wait()
        finally:
            self._incarnation = None
            exited.set()

    async def _start_and_wait(self) -> int | None:
        """One process's life: its exit status, or None when it could not be started
        (no descriptors or memory left, say): a failed start, restarted like a crash."""
        try:
            link, child_end = socket.socketpair()
        except OSError as e:
            return self._not_started(e)
        env = {
            **self.spec.env,
            LINK_FD_VARIABLE: str(child_end.fileno()),
            LINK_GRACE_VARIABLE: str(self.spec.grace),
        }
        fds = [child_end.fileno()]
        config = None
        try:
            if self.spec.config is not None:  # (the process inherits its own descriptor)
                config = HandedDownConfig(self.spec.config)
                env.update(config.variables)
                fds.append(config.fd)
            process = await trio.lowlevel.open_process(
                self.spec.argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                pass_fds=fds,
                start_new_session=True,
            )
        except OSError as e:
            link.close()
            return self._not_started(e)
        except BaseException:
            link.close()
            raise
        finally:
            child_end.close()
            if config is not None:
                config.close()
        self._process, self.pid = process, process.pid
        self.state, self.ready = ChildState.STARTING, False
        self.timed_out = self.served = False
        self._halt = halt = trio.Event()  # stop this process (see _terminate_when_told)
        if self._stop.is_set():
            halt.set()
        self.started_at = trio.current_time()
        log.info("started %s %s (pid %d)", self.spec.kind, self.name, process.pid)
        try:
            async with trio.open_nursery() as nursery:
                assert process.stdout is not None and process.stderr is not None
                stdout, stderr = self.output
                nursery.start_soon(forward_lines, self.name, process.stdout, stdout)
                nursery.start_soon(forward_lines, self.name, process.stderr, stderr)
                nursery.start_soon(self._follow_status, link)
                async with trio.open_nursery() as waiting:
                    waiting.start_soon(self._terminate_when_told, process, halt)
                    # (a worker: a gateway serves only once a worker does)
                    if self.policy.startup_timeout_seconds and self.spec.kind == "worker":
                        waiting.start_soon(self._halt_unless_serving, halt)
                    await process.wait()
                    waiting.cancel_scope.cancel()
                # Output still in the pipes is forwarded; a descendant holding them
                # open does not hold the supervisor up for long.
                nursery.cancel_scope.deadline = trio.current_time() + 2.0
        finally:
            if process.returncode is None:  # cancelled: never leave the process behind
                process.kill()
                with trio.CancelScope(shield=True):
                    await process.wait()
            self._process, self._halt, self.ready = None, None, False
        uptime = trio.current_time() - self.started_at
        self.last_exit = describe_exit(process.returncode)
        # (kept down: the node is stopping, and waits for the gateway's drain first)
        stopping = (self._stop.is_set() or self._down) and not self.killed
        # (ended by the node's SIGTERM itself: a child still starting, before its handler)
        if stopping and process.returncode not in (0, -signal.SIGTERM):
            self.broke_off = self.last_exit
        log_exit = log.info if stopping and not self.broke_off else log.warning
        log_exit("%s exited (%s) after %.1f s", self.name, self.last_exit, uptime)
        return process.returncode

    def _not_started(self, error: OSError) -> None:
        self.started_at = trio.current_time()
        self.timed_out = self.served = False  # (not the last process's)
        self.last_exit = f"not started: {error}"
        log.warning("%s could not be started: %s", self.name, error)

    async def _terminate_when_told(self, process: trio.Process, halt: trio.Event) -> None:
        """Once ``halt`` is set (the node's stop, or the start-up timeout: one path, one
        SIGTERM): SIGTERM, its graceful stop, then SIGKILL once ``spec.grace`` has
        passed (``killed`` when the node's stop had to)."""
        await halt.wait()
        self.state = ChildState.STOPPING
        process.send_signal(signal.SIGTERM)
        with trio.move_on_after(self.spec.grace):
            await process.wait()
            return
        log.warning("%s still running %.1f s after SIGTERM: killing it", self.name, self.spec.grace)
        if self._stop.is_set():
            self.killed = True
        process.kill()

    async def _halt_unless_serving(self, halt: trio.Event) -> None:
        """Set ``halt`` if the child has not served within startup_timeout_seconds."""
        timeout = self.policy.startup_timeout_seconds
        await trio.sleep(timeout)
        if self.state is ChildState.STARTING and not halt.is_set():
            log.error(
                "%s is not serving %g s after it started (supervisor.startup_timeout_seconds): "
                "stopping it",
                self.name,
                timeout,
            )
            self.timed_out = True
            halt.set()

    async def _follow_status(self, link: socket.socket) -> None:
        async with trio.SocketStream(trio.socket.from_stdlib_socket(link)) as stream:
            async for status in read_status(stream):
                self.ready = status.ready
                self.served |= status.ready
                if self.state is ChildState.STOPPING:
                    continue
                if status.ready:
                    if self.state is ChildState.STARTING:
                        log.info("%s is serving on port %s", self.name, status.port)
                    self.state = ChildState.SERVING
                elif self.state is ChildState.SERVING:
                    self.state = ChildState.NOT_READY

    async def stop(self) -> None:
        """Stop for good: SIGTERM (the child's graceful shutdown), then SIGKILL once
        ``spec.grace`` has passed. Returns when the process is gone, a process that was
        being started when this was called included; a child waiting to be restarted is
        not restarted."""
        self._stop.set()
        if self._halt is not None:
            self._halt.set()
        if self._incarnation is not None:
            await self._incarnation.wait()
