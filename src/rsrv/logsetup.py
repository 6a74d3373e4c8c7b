"""Process log set-up shared by every rsrv process: one line per record on stderr,
as text naming the process (``[worker0]``) or as one JSON object with a ``worker``
field, so a supervisor can forward and tag lines without reformatting them."""

from __future__ import annotations

import json
import logging
import sys
from typing import TextIO

__all__ = ["configure_logging"]


def configure_logging(
    name: str, level: str, format: str, *, tag: bool = True, stream: TextIO | None = None
) -> None:
    """Send every log record to stderr (or ``stream``), as ``format`` (``text`` or
    ``json``) says. ``tag=False`` leaves ``[name]`` out of text lines, for a process
    whose supervisor puts it at the start of each line."""
    handler = logging.StreamHandler(stream or sys.stderr)
    if format == "json":
        handler.setFormatter(_JsonFormatter(name))
    else:
        named = f"[{name}] " if tag else ""
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s {named}%(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class _JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, worker, logger, message[, exception][,
    stack]."""

    def __init__(self, worker: str):
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "worker": self.worker,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry)
