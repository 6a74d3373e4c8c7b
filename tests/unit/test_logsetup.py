"""The JSON log format: one valid object per line, whatever the message holds."""

from __future__ import annotations

import json
import logging
import sys

from rsrv.logsetup import _JsonFormatter


def record(exc_info=None) -> logging.LogRecord:
    return logging.LogRecord("rsrv.x", logging.INFO, __file__, 1, "a\nb %s", ("c\nd",), exc_info)


def test_one_object_per_line_with_the_exception_and_the_stack():
    """(stack_info was dropped, where the text format keeps it.)"""
    formatter = _JsonFormatter("worker0")
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        failed = record(sys.exc_info())
    with_stack = record()
    with_stack.stack_info = "Stack (most recent call last):\n  File x"
    for rec in (record(), failed, with_stack):
        line = formatter.format(rec)
        assert "\n" not in line
        entry = json.loads(line)
        assert (entry["worker"], entry["message"]) == ("worker0", "a\nb c\nd")
    assert "ValueError: bad\nthing" in json.loads(formatter.format(failed))["exception"]
    assert json.loads(formatter.format(with_stack))["stack"].startswith("Stack (most recent")
