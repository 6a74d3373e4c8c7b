"""The supervisor's output: children's lines, tagged with the child's name, and its own
log lines, written to its stdout and stderr without ever holding the supervisor up."""

from __future__ import annotations

import json
import logging
import os
import select
import threading

import trio

__all__ = ["OutputSink", "SinkStream", "forward_lines", "standard_output", "tag_line"]

log = logging.getLogger("rsrv.node")

#: A line longer than this is forwarded in pieces rather than held whole.
MAX_LINE_BYTES = 64 * 1024
#: Output queued for a descriptor that is not read as fast as it comes; past it, lines
#: are dropped (and counted) instead of held.
QUEUE_LIMIT_BYTES = 4 << 20


def tag_line(name: str, line: bytes) -> bytes:
    """``line`` (without its newline) as the supervisor prints it: a JSON object keeps
    its form and gains a ``worker`` field if it has none; anything else is prefixed
    with ``[name] ``. Returns the line with a newline."""
    if line.startswith(b"{"):
        try:
            entry = json.loads(line)
        except ValueError:
            entry = None
        if isinstance(entry, dict):
            entry.setdefault("worker", name)
            return json.dumps(entry).encode() + b"\n"
    return b"[" + name.encode() + b"] " + line + b"\n"


def _write_all(fd: int, data: bytes) -> bool:
    """Write ``data`` whole, blocking; False when ``fd`` no longer takes output (a
    closed pipe: ``rsrv node ... | head``, a log shipper that went away)."""
    view = memoryview(data)
    try:
        while view:
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:  # a non-blocking descriptor that is full: wait
                select.select([], [fd], [])
    except OSError:  # EPIPE, EIO...: nothing more can be written there
        return False
    return True


class OutputSink:
    """One of the supervisor's output descriptors (``fd``), written whole lines at a
    time so that lines never interleave.

    While :meth:`run` runs, :meth:`write` only queues, and the writer task writes in a
    worker thread: a reader that is slow, or stopped (a paused terminal, a stalled log
    shipper), never holds up the supervisor's task, nor its children, whose pipes are
    still read. Past ``limit`` bytes queued (besides the batch being written), lines
    are dropped; once that batch has been written, a warning says how many. Before
    :meth:`run` starts and after it ends, :meth:`write` writes at once. Once ``fd``
    takes no more output (a closed pipe), what is written is dropped. Call
    :meth:`write` from the trio thread, or while the writer is not running. Sinks whose
    descriptors are one file (``2>&1``, a journal's stream) share a ``lock``, so that
    one's batch never lands inside the other's line (a pipe keeps only writes of up to
    4 KiB whole).
    """

    def __init__(
        self,
        fd: int,
        name: str,
        limit: int = QUEUE_LIMIT_BYTES,
        lock: threading.Lock | None = None,
    ):
        self.fd = fd
        self.lock = lock or threading.Lock()
        self.name = name  # "stdout", "stderr": for the warning about dropped lines
        self.limit = limit
        self.open = True  # fd still takes output
        self.dropped = 0  # lines dropped so far
        self._queue: list[bytes] = []
        self._queued = 0
        self._unreported = 0  # lines dropped since the last warning
        self._running = False
        self._wake = trio.Event()
        self._idle = trio.Event()  # nothing queued nor being written

    def write(self, data: bytes) -> None:
        """Queue ``data`` (whole lines) to be written; never waits while the writer
        runs."""
        if not self.open:
            return
        if not self._running:
            self.open = self._write(data)
            return
        if self._queued + len(data) > self.limit:
            lines = data.count(b"\n") or 1
            self.dropped += lines
            self._unreported += lines
            return
        self._queue.append(data)
        self._queued += len(data)
        if self._idle.is_set():
            self._idle = trio.Event()
        self._wake.set()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Write what is queued, as it comes, until cancelled (then :meth:`write` writes
        at once again). A write blocked on a reader that never reads is abandoned on
        cancel."""
        self._running = True
        task_status.started()
        try:
            while True:
                if not self._queue:
                    self._idle.set()
                    self._wake = trio.Event()
                    await self._wake.wait()
                    continue
                data = b"".join(self._queue)
                self._queue.clear()
                self._queued = 0
                if self.open:
                    self.open = await trio.to_thread.run_sync(
                        self._write, data, abandon_on_cancel=True
                    )
                if self._unreported:  # the reader took a whole batch: it is catching up
                    dropped, self._unreported = self._unreported, 0
                    log.warning(
                        "%d lines of output to %s were dropped: it was not read as fast as "
                        "they came",
                        dropped,
                        self.name,
                    )  # (queued, through the log handler, when that writes to a sink)
        finally:
            self._running = False

    def _write(self, data: bytes) -> bool:
        with self.lock:
            return _write_all(self.fd, data)

    async def flushed(self) -> None:
        """Return once everything queued has been written (or dropped)."""
        if self._running:
            await self._idle.wait()


def standard_output(stdout: int = 1, stderr: int = 2) -> tuple[OutputSink, OutputSink]:
    """Sinks for this process's stdout and stderr (one lock when they are one file)."""
    out = OutputSink(stdout, "stdout")
    try:
        same = os.path.samestat(os.fstat(stdout), os.fstat(stderr))
    except OSError:  # (one of them closed)
        same = False
    return out, OutputSink(stderr, "stderr", lock=out.lock if same else None)


class SinkStream:
    """A text stream over an :class:`OutputSink`, for a ``logging.StreamHandler``."""

    def __init__(self, sink: OutputSink):
        self.sink = sink

    def write(self, text: str) -> None:
        self.sink.write(text.encode("utf-8", "replace"))

    def flush(self) -> None:
        pass


async def forward_lines(name: str, stream: trio.abc.ReceiveStream, sink: OutputSink) -> None:
    """Copy ``stream`` to ``sink`` one whole tagged line at a time, until end of file
    (a last line without a newline is forwarded too). The stream is read to its end
    whatever becomes of the lines, so the child never blocks on a full pipe."""
    pending = b""
    while True:
        chunk = await stream.receive_some(MAX_LINE_BYTES)
        if not chunk:
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        if len(pending) >= MAX_LINE_BYTES:
            lines.append(pending)
            pending = b""
        if lines:
            sink.write(b"".join(tag_line(name, line) for line in lines))
    if pending:
        sink.write(tag_line(name, pending))
