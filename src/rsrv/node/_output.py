"""Forwarding a child's output, line by line, tagged with the child's name."""

from __future__ import annotations

import json
import os
import select

import trio

__all__ = ["forward_lines", "tag_line"]

#: A line longer than this is forwarded in pieces rather than held whole.
MAX_LINE_BYTES = 64 * 1024


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
    """Write ``data`` whole; False when ``fd`` no longer takes output (a closed pipe:
    ``rsrv node ... | head``, a log shipper that went away)."""
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


async def forward_lines(name: str, stream: trio.abc.ReceiveStream, fd: int) -> None:
    """Copy ``stream`` to ``fd`` one whole tagged line at a time, until end of file
    (a last line without a newline is forwarded too). Each line is written in one
    piece from this thread, so lines of different children never interleave. Once
    ``fd`` takes no more output, the child's output is still read, and dropped (the
    child must not block on a full pipe, nor the node fail)."""
    pending = b""
    writing = True
    while True:
        chunk = await stream.receive_some(MAX_LINE_BYTES)
        if not chunk:
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        if len(pending) >= MAX_LINE_BYTES:
            lines.append(pending)
            pending = b""
        if lines and writing:
            writing = _write_all(fd, b"".join(tag_line(name, line) for line in lines))
    if pending and writing:
        _write_all(fd, tag_line(name, pending))
