"""Assertion helpers shared by test modules."""

from __future__ import annotations

import gc
import types
from contextlib import contextmanager

import pytest


@contextmanager
def raises(exc_type, *needles: str):
    """``pytest.raises`` that also checks that every needle is in the message."""
    with pytest.raises(exc_type) as info:
        yield info
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


def frames_holding(obj) -> int:
    """How many frame objects alive hold ``obj`` in a local (coroutine frames, which
    the collector does not list, excepted): a finished call's frames kept alive by a
    reference cycle show here until a collection (run with ``gc`` disabled)."""
    return sum(
        1
        for o in gc.get_objects()
        if isinstance(o, types.FrameType) and any(v is obj for v in o.f_locals.values())
    )
