"""The supervisor link: one socket pair between ``rsrv node`` and each child.

The child writes its status on it as JSON lines (``{"ready": true, "port": 8101}``),
one whenever the state changes, so the supervisor knows a child serves without speaking
its protocol (TLS, restricted protocols and all). The supervisor never writes: the
child reads end-of-file when the supervisor is gone, however it died (SIGKILL
included), and stops gracefully as if it had received SIGTERM, within the grace the
supervisor would have given it (``RSRV_SUPERVISOR_GRACE`` seconds): past that the
kernel ends it (SIGALRM, whose default action needs nothing of the process, so a stop
stuck in a model's import or a compile ends too). (Linux's parent-death signal cannot
do this: it fires when the *thread* that started the child exits, and trio starts
processes from worker threads that come and go.)
"""

from __future__ import annotations

import errno
import logging
import math
import os
import signal
import socket
import stat
from collections.abc import AsyncIterator, Callable
from contextlib import suppress

import msgspec
import trio

__all__ = [
    "LINK_FD_VARIABLE",
    "LINK_GRACE_VARIABLE",
    "ChildStatus",
    "SupervisorLink",
    "read_status",
    "supervised",
]

LINK_FD_VARIABLE = "RSRV_SUPERVISOR_FD"
LINK_GRACE_VARIABLE = "RSRV_SUPERVISOR_GRACE"  # seconds from SIGTERM to SIGKILL
DEFAULT_GRACE = 60.0  # (a supervisor that did not say)
MAX_ALARM = 2**31 - 1  # seconds signal.alarm takes

log = logging.getLogger("rsrv.lifeline")


def _is_number(text: str) -> bool:
    return text.isascii() and text.isdigit()


def supervised() -> bool:
    """Whether ``rsrv node`` started this process (its link is in the environment): the
    supervisor then tags each of its output lines with its name."""
    return _is_number(os.environ.get(LINK_FD_VARIABLE, ""))


class ChildStatus(msgspec.Struct, frozen=True):
    """What a child reports: serving (``ready``) and the gRPC port it listens on."""

    ready: bool = False
    port: int | None = None


class SupervisorLink:
    """The child's end: reports ``current()`` (polled every ``interval`` seconds)
    whenever it changes, and when the supervisor goes sends this process SIGTERM and
    arms an alarm that ends it once its grace has passed.

    Outside a supervisor (no ``RSRV_SUPERVISOR_FD``) :meth:`run` returns at once.
    """

    def __init__(self, current: Callable[[], ChildStatus], interval: float = 0.2):
        self.current = current
        self.interval = interval
        text = os.environ.get(LINK_FD_VARIABLE)
        self.fd = int(text) if text is not None and _is_number(text) else None
        try:
            self.grace = float(os.environ.get(LINK_GRACE_VARIABLE, DEFAULT_GRACE))
        except ValueError:
            self.grace = DEFAULT_GRACE

    async def run(self) -> None:
        if self.fd is None:
            return
        try:  # (a variable inherited from elsewhere: no socket of ours, or none at all)
            if not stat.S_ISSOCK(os.fstat(self.fd).st_mode):
                raise OSError(errno.ENOTSOCK, "not a socket")
        except OSError as e:
            log.warning("%s=%d is no supervisor link (%s): ignored", LINK_FD_VARIABLE, self.fd, e)
            return
        sock = trio.socket.from_stdlib_socket(socket.socket(fileno=self.fd))
        async with trio.SocketStream(sock) as stream, trio.open_nursery() as nursery:
            nursery.start_soon(self._report, stream)
            with suppress(trio.BrokenResourceError, OSError):
                while await stream.receive_some():
                    pass  # the supervisor writes nothing; end of file means it is gone
            if math.isfinite(self.grace) and self.grace < MAX_ALARM:
                seconds = max(1, math.ceil(self.grace))
                log.warning("the supervisor is gone: stopping (ended in %d s at most)", seconds)
                signal.alarm(seconds)  # (SIGALRM's default action: the kernel ends us)
            else:  # a grace without end
                log.warning("the supervisor is gone: stopping")
            os.kill(os.getpid(), signal.SIGTERM)
            nursery.cancel_scope.cancel()

    async def _report(self, stream: trio.SocketStream) -> None:
        last = None
        while True:
            status = self.current()
            if status != last:
                try:
                    await stream.send_all(msgspec.json.encode(status) + b"\n")
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    return
                last = status
            await trio.sleep(self.interval)


async def read_status(stream: trio.abc.ReceiveStream) -> AsyncIterator[ChildStatus]:
    """The supervisor's end: every status a child writes on ``stream``, until it
    closes (the child exited). A malformed line is skipped."""
    pending = b""
    while chunk := await stream.receive_some():
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            with suppress(msgspec.ValidationError, msgspec.DecodeError):
                yield msgspec.json.decode(line, type=ChildStatus)
