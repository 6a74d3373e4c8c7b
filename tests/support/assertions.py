"""Assertion helpers shared by test modules."""

from __future__ import annotations

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
